"""The KV-cache block size: on the CPU small enough that a group's samples share their prompt's blocks."""

from __future__ import annotations

import pytest

from das.service.engine.vllm.engine import CPU_BLOCK_SIZE, EngineConfig, kv_block_size


def test_the_cpu_gets_the_smallest_block_its_attention_takes_and_a_gpu_vllms_default():
    assert EngineConfig(model="m").block_size is None
    assert kv_block_size(None, cpu=True) == CPU_BLOCK_SIZE == 32
    assert kv_block_size(None, cpu=False) is None


def test_an_explicit_block_size_wins_where_the_platform_takes_it():
    assert kv_block_size(128, cpu=True) == 128
    assert kv_block_size(16, cpu=False) == 16


@pytest.mark.parametrize("size", [16, 48])
def test_a_cpu_block_size_vllm_would_refuse_is_a_clear_error_before_the_engine_starts(size):
    with pytest.raises(ValueError, match=f"block_size {size}: .*multiples of 32"):
        kv_block_size(size, cpu=True)
