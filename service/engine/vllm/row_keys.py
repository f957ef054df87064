"""The row keys of keyed sampling for a whole batch (service/wire/sample_keys.py says what they are): the key of
the token each row samples, as a function of its sample's key and its position only. SplitMix64's finaliser
(`sample_keys.mix64`) on numpy uint64 arrays with wrap-around arithmetic: O(1) vectorised work per row, ~1 us per
call for a batch of a few hundred rows."""

from __future__ import annotations

import numpy as np

from das.service.wire.sample_keys import GOLDEN, M1, M2

_GOLDEN, _M1, _M2 = np.uint64(GOLDEN), np.uint64(M1), np.uint64(M2)


def mix(x: np.ndarray) -> np.ndarray:
    """`sample_keys.mix64` over a uint64 array (a new array)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


def row_keys(sample_keys: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """int64 [rows]: the key of the token each row samples. sample_keys int64 [rows] (`derive(seed, index)`),
    positions int64 [rows] >= 0 (tokens the sample generated before this one)."""
    samples = np.ascontiguousarray(sample_keys, dtype=np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        at = mix(positions.astype(np.uint64) * _GOLDEN + _GOLDEN)
    return mix(samples ^ at).view(np.int64)
