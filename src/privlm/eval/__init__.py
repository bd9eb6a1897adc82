"""Evaluation kit: real labelled text and deterministic splits, probes, attacks and benchmarks.

The data loaders of :mod:`privlm.eval.data` are re-exported here.
"""

from privlm.eval import data
from privlm.eval.data import *  # noqa: F403 - the loaders, by their own __all__

__all__ = list(data.__all__)
