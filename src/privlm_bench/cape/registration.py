"""The cape sweep in the bench's registry, with its claims and plots beyond results.md."""

from privlm_bench.cape.claims import write_reports
from privlm_bench.cape.sweep import METHODS, NAME
from privlm_bench.harness.registry import SweepEntry, register

register(SweepEntry(NAME, METHODS, extra_reports=write_reports))
