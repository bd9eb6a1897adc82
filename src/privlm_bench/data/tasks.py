"""The bench's labelled tasks by name: the product's corpora with each task's labels and filters."""

from __future__ import annotations

from typing import Any

from privlm.data import TextDataset, load_fortunes, load_tweets, load_wordnet

_NAMED: dict[str, tuple[Any, dict[str, Any]]] = {
    "tweets": (load_tweets, {}),
    "tweets-binary": (load_tweets, {"labels": ("negative", "positive"), "min_confidence": 0.5}),
    "fortunes": (load_fortunes, {}),
    "wordnet-pos": (load_wordnet, {"part": "examples", "label": "pos"}),
    "wordnet-lexname": (load_wordnet, {"part": "examples", "label": "lexname"}),
}
TASK_NAMES = tuple(_NAMED)


def named_task(name: str, **kwargs: Any) -> TextDataset:
    """A built-in task by name; ``kwargs`` (limit, seed, ...) override the task's defaults."""
    if name not in _NAMED:
        raise ValueError(f"name must be one of {TASK_NAMES}, got {name!r}")
    loader, defaults = _NAMED[name]
    return loader(**{**defaults, **kwargs})
