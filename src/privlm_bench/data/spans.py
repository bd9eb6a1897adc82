"""Which tokens carry a marked span of a text (a planted secret, a personal detail): one rule for every bench.

Token i, with character span [a_i, b_i) (a fast tokenizer's ``offset_mapping``), is in the span [start, end) when
the two overlap on at least one character: b_i > a_i, a_i < end and b_i > start. A token with an empty span (a
special token, a zero-width piece) carries none of the span's characters, so it never is.
"""

from __future__ import annotations

from collections.abc import Sequence


def span_token_positions(offsets: Sequence[tuple[int, int]], start: int, end: int) -> list[int]:
    """Positions of the tokens whose character span (``offsets``) overlaps [start, end), in order."""
    return [i for i, (a, b) in enumerate(offsets) if b > a and a < end and b > start]


__all__ = ["span_token_positions"]
