"""The detect bench in the bench's registry: it renders its own report from results.json."""

from privlm_bench.detect.report import render_detect_report
from privlm_bench.harness.registry import SweepEntry, register

register(SweepEntry("detect", (), render=render_detect_report))
