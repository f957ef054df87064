"""The package a speculation method needs, checked without starting an engine (service/engine/preflight.py): a package
that is found but does not import counts as missing, as vLLM's own check has it."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from das.service.engine.preflight import ARCTIC_INFERENCE, MissingPackage, check_method_packages, package_of


def shadow(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, module: str) -> None:
    """`module` found first on the path, and its import fails (a wheel built against another torch does that)."""
    (tmp_path / module).mkdir()
    (tmp_path / module / "__init__.py").write_text("raise ImportError('undefined symbol: _ZN3c1017RegisterOperators')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == module or m.startswith(f"{module}.")]:
        monkeypatch.delitem(sys.modules, name)
    importlib.invalidate_caches()


def test_suffix_without_an_importable_arctic_inference_is_refused_naming_the_package(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    shadow(monkeypatch, tmp_path, "arctic_inference")
    with pytest.raises(MissingPackage) as refused:
        check_method_packages("suffix")
    message = str(refused.value)
    assert message.startswith("--speculation suffix needs arctic-inference, which cannot be imported here")
    assert "undefined symbol" in message and "requirements/peers.txt" in message
    assert "another --speculation" in message
    check_method_packages("das")  # the other methods need nothing beyond vLLM
    check_method_packages("ngram")


def test_an_import_error_is_matched_to_its_package_by_module_or_by_vllms_wording() -> None:
    assert package_of("Arctic Inference is required for suffix decoding.") is ARCTIC_INFERENCE
    assert package_of("", "arctic_inference.suffix_decoding") is ARCTIC_INFERENCE
    assert package_of("No module named 'flashinfer'", "flashinfer") is None
