"""The attacks sweep in the bench's registry: it renders its own reports."""

from privlm_bench.attacks.report import render_attacks_report
from privlm_bench.harness.registry import SweepEntry, register

register(SweepEntry("attacks", (), render=render_attacks_report))
