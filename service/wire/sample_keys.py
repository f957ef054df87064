"""The keys of keyed sampling: which random numbers a sampled token is drawn with, as a pure function of (seed,
sample index, position) instead of a generator's running state (service/engine/keyed_sampler.py draws with them).

A batch's seed names its groups' seeds (`derive(batch seed, group index)`) unless a group gives its own
(`sampling.seed`); a group's seed names its samples' keys (`derive(group seed, sample index)`); a sample's key and
a position (the number of tokens the sample had generated before this one) name the row key the engine hands to
vLLM's keyed Gumbel-max kernel. So the same batch with the same seed draws the same tokens on any engine, in any
batch shape, with or without drafts, before or after a re-dispatch; a different seed draws different ones.

Mixing is SplitMix64's finaliser (a bijection of 64-bit words with full avalanche), on numpy uint64 arrays with
wrap-around arithmetic: O(1) vectorised work per row, ~1 us per call for a batch of a few hundred rows."""

from __future__ import annotations

import secrets

import numpy as np

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # SplitMix64's increment: consecutive indices land far apart
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser over a uint64 array (a new array)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


def derive(parent: int, index: int) -> int:
    """The seed of child `index` (>= 0) of `parent` (an int64): a group's of a batch's, a sample's key of its
    group's seed. An int64; distinct indices give distinct children of one parent (the mix is a bijection)."""
    with np.errstate(over="ignore"):
        word = np.array([parent], dtype=np.int64).view(np.uint64) + _GOLDEN * np.uint64(index + 1)
    return int(_mix(word).view(np.int64)[0])


def row_keys(sample_keys: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """int64 [rows]: the key of the token each row samples. sample_keys int64 [rows] (`derive(seed, index)`),
    positions int64 [rows] >= 0 (tokens the sample generated before this one)."""
    samples = np.ascontiguousarray(sample_keys, dtype=np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        at = _mix(positions.astype(np.uint64) * _GOLDEN + _GOLDEN)
    return _mix(samples ^ at).view(np.int64)


def fresh_seed() -> int:
    """A random int64 seed, for a batch or group that names none."""
    return secrets.randbits(64) + INT64_MIN
