"""The engine core's allocator environment (service/engine/cpu_allocator.py); the engine test checks that a real
engine core maps jemalloc (tests/service/engine/vllm/test_engine.py)."""

from __future__ import annotations

import logging
import os

import pytest

from das.service.engine import cpu_allocator
from das.service.engine.cpu_allocator import (
    JEMALLOC_CONF,
    LARGE_VOCAB,
    cpu_allocator_env,
    jemalloc_library,
    model_vocab_size,
    resolve_allocator,
)


def test_jemalloc_comes_first_in_ld_preload_and_everything_is_restored(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/opt/user/libfoo.so")
    monkeypatch.delenv("MALLOC_CONF", raising=False)
    library = jemalloc_library()
    assert library is not None and library.name == "libjemalloc.so"  # Ray's wheel ships it
    with cpu_allocator_env("jemalloc"):
        assert os.environ["LD_PRELOAD"] == f"{library}:/opt/user/libfoo.so"
        assert os.environ["MALLOC_CONF"] == JEMALLOC_CONF
    assert os.environ["LD_PRELOAD"] == "/opt/user/libfoo.so" and "MALLOC_CONF" not in os.environ


def test_a_users_malloc_conf_wins_and_system_changes_nothing(monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.setenv("MALLOC_CONF", "narenas:2")
    with cpu_allocator_env("jemalloc"):
        assert os.environ["MALLOC_CONF"] == "narenas:2"
    with cpu_allocator_env("system"):
        assert "LD_PRELOAD" not in os.environ and os.environ["MALLOC_CONF"] == "narenas:2"
    assert "LD_PRELOAD" not in os.environ


def test_a_missing_jemalloc_warns_and_keeps_the_systems_malloc(monkeypatch, caplog):
    monkeypatch.setattr(cpu_allocator, "jemalloc_library", lambda: None)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    with caplog.at_level(logging.WARNING), cpu_allocator_env("jemalloc"):
        assert "LD_PRELOAD" not in os.environ
    assert "libjemalloc.so is missing" in caplog.text


def test_auto_picks_jemalloc_for_a_large_vocabulary_only(tmp_path):
    assert resolve_allocator("auto", 151936) == "jemalloc"  # Qwen2.5
    assert resolve_allocator("auto", 49152) == "system"  # SmolLM2
    assert resolve_allocator("auto", LARGE_VOCAB) == "jemalloc" and resolve_allocator("auto", None) == "system"
    assert resolve_allocator("system", 151936) == "system" and resolve_allocator("jemalloc", 32) == "jemalloc"
    (tmp_path / "config.json").write_text('{"vocab_size": 151936}')
    assert model_vocab_size(str(tmp_path)) == 151936
    (tmp_path / "config.json").write_text("{not json")
    assert model_vocab_size(str(tmp_path)) is None
    assert model_vocab_size(str(tmp_path / "missing")) is None


def test_an_unknown_allocator_is_refused_by_the_engine_config():
    from das.service.engine.config import EngineConfig

    with pytest.raises(ValueError, match="cpu_allocator"):
        EngineConfig(cpu_allocator="tcmalloc")
