"""The row keys of keyed sampling over a batch (service/engine/vllm/row_keys.py): the wire's scalar mix on numpy arrays."""

from __future__ import annotations

import numpy as np

from das.service.engine.vllm.row_keys import mix, row_keys
from das.service.wire.sample_keys import GOLDEN, MASK64, derive, mix64


def test_row_keys_are_a_function_of_key_and_position_only():
    keys = np.array([derive(7, i) for i in range(4)], dtype=np.int64)
    positions = np.array([0, 5, 5, 1000], dtype=np.int64)
    together = row_keys(keys, positions)
    alone = [int(row_keys(keys[i:i + 1], positions[i:i + 1])[0]) for i in range(4)]
    assert together.dtype == np.int64 and together.tolist() == alone
    grid = row_keys(np.repeat(keys, 64), np.tile(np.arange(64), 4))
    assert len(set(grid.tolist())) == 256  # no two (sample, position) cells share a key


def test_the_vectorised_mix_is_the_wires_scalar_mix():
    rng = np.random.default_rng(5)
    words = np.concatenate([rng.integers(0, 2**63, 500, dtype=np.uint64) * np.uint64(2),
                            np.array([0, MASK64], np.uint64)])
    assert mix(words).tolist() == [mix64(int(w)) for w in words]
    key, position = derive(7, 3), 11
    expected = mix64((key & MASK64) ^ mix64((position * GOLDEN + GOLDEN) & MASK64))
    got = int(row_keys(np.array([key], np.int64), np.array([position], np.int64))[0])
    assert got & MASK64 == expected
