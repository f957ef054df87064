"""The keys of keyed sampling: which random numbers a sampled token is drawn with, as a pure function of (seed,
sample index, position) instead of a generator's running state (service/engine/vllm/keyed_sampler.py draws with them).

A batch's seed names its groups' seeds (`derive(batch seed, group index)`) unless a group gives its own
(`sampling.seed`); a group's seed names its samples' keys (`derive(group seed, sample index)`); a sample's key and
a position (the number of tokens the sample had generated before this one) name the row key the engine hands to
vLLM's keyed Gumbel-max kernel. So the same batch with the same seed draws the same tokens on any engine, in any
batch shape, with or without drafts, before or after a re-dispatch; a different seed draws different ones.

Mixing is SplitMix64's finaliser (a bijection of 64-bit words with full avalanche), here on Python ints: the wire
contract, which a trainer imports, loads no numpy. The engine applies the same function to a whole batch of rows
on numpy arrays (service/engine/vllm/row_keys.py)."""

from __future__ import annotations

import secrets

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MASK64 = 2**64 - 1
GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64's increment: consecutive indices land far apart
M1, M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # its finaliser's multipliers


def mix64(x: int) -> int:
    """SplitMix64's finaliser of a 64-bit word (an int in [0, 2**64)), as an int in [0, 2**64)."""
    x = ((x ^ (x >> 30)) * M1) & MASK64
    x = ((x ^ (x >> 27)) * M2) & MASK64
    return x ^ (x >> 31)


def derive(parent: int, index: int) -> int:
    """The seed of child `index` (>= 0) of `parent` (an int64): a group's of a batch's, a sample's key of its
    group's seed. An int64; distinct indices give distinct children of one parent (the mix is a bijection)."""
    word = mix64((parent + GOLDEN * (index + 1)) & MASK64)
    return word - 2**64 if word > INT64_MAX else word


def fresh_seed() -> int:
    """A random int64 seed, for a batch or group that names none."""
    return secrets.randbits(64) + INT64_MIN
