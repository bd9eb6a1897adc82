"""``python -m privlm.cli``: what background processes run."""

from privlm.cli import app

app()
