"""`dtype="auto"`: bfloat16 only where the hardware computes in it natively."""

from __future__ import annotations

import pytest

from das.service.engine.config import EngineConfig
from das.service.engine.serving_dtype import build_dtype, serving_dtype
from das.service.engine.vllm.engine import engine_dtype


@pytest.mark.parametrize("cpu, flags, expected", [
    (False, frozenset(), "bfloat16"),                             # a GPU
    (True, frozenset({"avx2", "fma"}), "float32"),                # AVX2 only: vLLM would emulate bfloat16
    (True, frozenset({"avx512f", "avx512_bf16"}), "bfloat16"),
    (True, frozenset({"amx_tile", "amx_bf16"}), "bfloat16"),
    (True, frozenset(), "float32"),                               # flags unreadable: the safe choice
])
def test_auto_picks_bfloat16_only_with_native_support(cpu, flags, expected):
    assert serving_dtype("auto", cpu=cpu, cpu_flags=flags) == expected


def test_an_explicit_dtype_wins_and_auto_is_the_default():
    assert serving_dtype("bfloat16", cpu=True, cpu_flags=frozenset()) == "bfloat16"
    assert serving_dtype("float16", cpu=False) == "float16"
    assert EngineConfig(model="m").dtype == "auto"


@pytest.mark.parametrize("requested", ["auto", "float32", "bfloat16"])
def test_the_vllm_free_choice_is_vllms_platforms_choice_on_this_node(requested):
    """`das serve` prepares the model in `build_dtype` (no vLLM import); an engine serves in `engine_dtype` (vLLM's
    platform): on this node they agree."""
    assert build_dtype(requested) == engine_dtype(requested)
