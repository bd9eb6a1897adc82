"""Privacy accounting: a persistent ledger of what each principal has spent."""

from privlm.accounting.database import DatabaseUnavailableError
from privlm.accounting.ledger import (
           BudgetExhaustedError,
           KeyMigration,
           Ledger,
           LedgerCopy,
           Receipt,
           charge,
           copy_ledger,
)
from privlm.accounting.principals import PrincipalHasher, SecretFileError, joint_principal, principal_members

__all__ = ["BudgetExhaustedError", "DatabaseUnavailableError", "KeyMigration", "Ledger", "LedgerCopy",
           "PrincipalHasher", "Receipt", "SecretFileError", "charge",
           "copy_ledger", "joint_principal", "principal_members"]
