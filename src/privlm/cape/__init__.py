"""Cape: context-aware private prompts (Wu et al. 2025), on the mechanism protocol and the ledger."""
