"""privlm's bench kit, apart from the product: the harness (sweeps, results.json with provenance, reports),
the bench's data (named tasks, table files), one folder of sweeps per system (``snd``, ``cape``, ``baselines``,
``sap``, ``chat``) and the ``privlm bench`` commands. It may import anything of ``privlm``; ``privlm`` never
imports it (an import-linter contract)."""
