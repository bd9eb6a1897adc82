"""Privacy accounting: a persistent ledger of what each principal has spent."""

from privlm.accounting.ledger import BudgetExhaustedError, KeyMigration, Ledger, Receipt, charge
from privlm.accounting.principals import PrincipalHasher, SecretFileError, joint_principal, principal_members

__all__ = ["BudgetExhaustedError", "KeyMigration", "Ledger", "PrincipalHasher", "Receipt", "SecretFileError", "charge",
           "joint_principal", "principal_members"]
