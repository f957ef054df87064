"""The house rules that keep the code readable in one direction: the import layers (import-linter, contracts in
pyproject.toml) and a trainer's client that installs without the server."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _lint_imports(cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert exe, "lint-imports is not installed next to this interpreter (requirements/cpu.txt)"
    env = {**os.environ, "PYTHONPATH": str(pythonpath)} if pythonpath else None
    return subprocess.run([exe, "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


def test_layers_and_client_contracts_hold() -> None:
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 2 kept, 0 broken" in result.stdout, result.stdout


def test_an_upward_import_breaks_the_layers_contract(tmp_path: Path) -> None:
    """The contract can fail: the same contracts over a copy of the tree in which the drafter imports the service.
    The copy is renamed `dascopy` so that the installed `das` cannot shadow it."""
    for folder in ("drafter", "scheduler", "service", "bench"):
        shutil.copytree(ROOT / folder, tmp_path / "dascopy" / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "native", "*.so"))
    records = tmp_path / "dascopy" / "drafter" / "records.py"
    records.write_text(records.read_text() + "\nfrom das.service.wire import api  # upward\n")
    for path in [*tmp_path.rglob("*.py"), tmp_path / "pyproject.toml"]:
        source = (ROOT / "pyproject.toml").read_text() if path.name == "pyproject.toml" else path.read_text()
        path.write_text(re.sub(r"\bdas\.(drafter|scheduler|service|bench)\b", r"dascopy.\1", source))
    result = _lint_imports(tmp_path, pythonpath=tmp_path)
    assert result.returncode != 0, result.stdout + result.stderr
    assert "dascopy.drafter.records -> dascopy.service.wire.api" in result.stdout, result.stdout + result.stderr


def test_the_client_imports_no_server_engine_or_native_code() -> None:
    probe = ("import json, sys; import das.service.client; "
             "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
             "('vllm', 'torch', 'ray', 'fastapi', 'uvicorn', 'transformers') or m == 'das.drafter._suffix_index' "
             "or m.startswith('das.service.engine'))))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []
