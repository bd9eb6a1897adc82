"""Evaluation kit: real labelled text and deterministic splits, probes, attacks and benchmarks."""

from privlm.eval.data import (
    Splits,
    Task,
    TextDataset,
    load_fortunes,
    load_glue,
    load_table,
    load_tweets,
    load_wordnet,
    named_task,
    public_corpus,
    split_dataset,
)

__all__ = [
    "Splits",
    "Task",
    "TextDataset",
    "load_fortunes",
    "load_glue",
    "load_table",
    "load_tweets",
    "load_wordnet",
    "named_task",
    "public_corpus",
    "split_dataset",
]
