"""What a traffic capture is searched for: the byte forms a token-id sequence could take on the wire."""

from __future__ import annotations

import itertools

import numpy as np


def id_patterns(ids: list[int]) -> list[bytes]:
    """Each adjacent pair of ids as ints of 2, 4 and 8 bytes, and as decimal text."""
    patterns = []
    for a, b in itertools.pairwise(ids):
        pair = np.array([a, b])
        patterns += [pair.astype("<i8").tobytes(), pair.astype("<i4").tobytes(), pair.astype("<i2").tobytes(),
                     f"{a}, {b}".encode(), f"{a},{b}".encode()]
    return patterns
