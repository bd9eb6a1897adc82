"""The chat-quality sweep in the bench's registry: it renders its own report from results.json."""

from privlm_bench.chat.quality_report import render_quality_report
from privlm_bench.harness.registry import SweepEntry, register

register(SweepEntry("chat-quality", (), render=render_quality_report))
