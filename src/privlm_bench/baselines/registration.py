"""The baselines sweep in the bench's registry."""

from privlm_bench.baselines.sweep import METHODS
from privlm_bench.harness.registry import SweepEntry, register

register(SweepEntry("baselines", METHODS))
