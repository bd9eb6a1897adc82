"""Privacy accounting: a persistent ledger of what each principal has spent."""

from privlm.accounting.ledger import BudgetExhaustedError, Ledger, Receipt, principal_of_key

__all__ = ["BudgetExhaustedError", "Ledger", "Receipt", "principal_of_key"]
