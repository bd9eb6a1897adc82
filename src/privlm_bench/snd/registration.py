"""The snd sweep in the bench's registry, with its claims beyond results.md."""

from pathlib import Path

from privlm_bench.harness.registry import SweepEntry, register
from privlm_bench.snd.claims import write_claims
from privlm_bench.snd.sweep import METHODS


def _claims(out_dir: Path) -> list[Path]:
    return [write_claims(out_dir)]


register(SweepEntry("snd", METHODS, extra_reports=_claims))
