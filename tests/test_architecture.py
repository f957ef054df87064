"""The house rules that keep the code readable in one direction: the import layers (import-linter, contracts in
pyproject.toml: the packages', and the service's rooms), a trainer's client that loads only the wire contract, and a
gateway and coordinator that load no vLLM, torch or native index."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _lint_imports(cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert exe, "lint-imports is not installed next to this interpreter (requirements/cpu.txt)"
    env = {**os.environ, "PYTHONPATH": str(pythonpath)} if pythonpath else None
    return subprocess.run([exe, "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


def test_layers_and_client_contracts_hold() -> None:
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 7 kept, 0 broken" in result.stdout, result.stdout


@pytest.mark.parametrize("module, line, broken", [
    ("drafter/records.py", "from das.service.wire import api", "dascopy.drafter.records -> dascopy.service.wire.api"),
    ("service/wire/api.py", "from das.service.http import metrics",
     "dascopy.service.wire.api -> dascopy.service.http.metrics"),
    ("service/http/gateway.py", "from das.service.engine.vllm import sampling",
     "dascopy.service.http.gateway -> dascopy.service.engine.vllm.sampling"),
    ("service/cluster/node_engine.py", "from das.service.engine.vllm import engine",
     "dascopy.service.cluster.node_engine -> dascopy.service.engine.vllm.engine"),
    ("service/engine/config.py", "from das.service.engine.vllm import models",
     "dascopy.service.engine.config -> dascopy.service.engine.vllm.models"),
    ("service/engine/stub_engine.py", "import torch", "dascopy.service.engine.stub_engine -> torch"),
    ("service/http/gateway.py", "from opentelemetry import trace", "dascopy.service.http.gateway -> opentelemetry"),
    ("service/client/weights.py", "import vllm", "dascopy.service.client.weights -> vllm"),
    ("service/engine/vllm/gloo_transfer.py", "import ray", "dascopy.service.engine.vllm.gloo_transfer -> ray"),
])
def test_an_upward_or_forbidden_import_breaks_a_contract(tmp_path: Path, module: str, line: str, broken: str) -> None:
    """The contracts can fail: the same contracts over a copy of the tree with one import added (the drafter
    importing the service, the wire types the gateway, the gateway vLLM's sampling glue or OpenTelemetry outside
    service/http/tracing.py, an engine actor the vLLM room past the factory, the engine's vLLM-free room the vLLM
    room or torch, the trainer's weight sender vLLM, or Ray through the gloo data plane it uses). The copy is renamed
    `dascopy` so that the installed `das` cannot shadow it."""
    for folder in ("drafter", "scheduler", "service", "bench"):
        shutil.copytree(ROOT / folder, tmp_path / "dascopy" / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "native", "*.so"))
    target = tmp_path / "dascopy" / module
    target.write_text(target.read_text() + f"\n{line}  # deliberately\n")
    for path in [*tmp_path.rglob("*.py"), tmp_path / "pyproject.toml"]:
        source = (ROOT / "pyproject.toml").read_text() if path.name == "pyproject.toml" else path.read_text()
        path.write_text(re.sub(r"\bdas\.(drafter|scheduler|service|bench)\b", r"dascopy.\1", source))
    result = _lint_imports(tmp_path, pythonpath=tmp_path)
    assert result.returncode != 0, result.stdout + result.stderr
    assert broken in result.stdout, result.stdout + result.stderr


def test_every_module_of_the_engine_room_outside_vllm_and_the_factory_is_held_to_the_vllm_free_contract() -> None:
    """A module added to service/engine/ is either vLLM glue (service/engine/vllm/), the factory, or listed in the
    vLLM-free contract: none escapes it by being new."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (free,) = [c for c in contracts if c["name"].startswith("the engine's vLLM-free room")]
    room = {f"das.service.engine.{p.stem}" for p in (ROOT / "service" / "engine").glob("*.py")
            if p.stem not in ("__init__", "factory")}
    assert room and set(free["source_modules"]) == room


def _loaded_after_import(module: str) -> list[str]:
    """The modules a fresh interpreter holds after importing `module`, of the packages these tests watch."""
    probe = (f"import json, sys; import {module}; "
             "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
             "('vllm', 'torch', 'numpy', 'ray', 'fastapi', 'uvicorn', 'transformers') or m.startswith('das.'))))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_the_client_loads_the_wire_contract_and_nothing_of_the_server_numpy_drafter_or_scheduler() -> None:
    loaded = _loaded_after_import("das.service.client")
    assert "das.service.client.client" in loaded and "das.service.wire.api" in loaded  # the probe sees imports
    heavy = [m for m in loaded if m.split(".")[0] in ("vllm", "torch", "numpy", "ray", "fastapi", "uvicorn",
                                                      "transformers")
             or m.startswith(("das.drafter", "das.scheduler", "das.service.engine", "das.service.cluster",
                              "das.service.http"))]
    assert heavy == []


def test_the_weight_sender_loads_torch_and_the_wire_but_no_vllm_ray_or_server() -> None:
    loaded = _loaded_after_import("das.service.client.weights")
    assert "das.service.client.weights" in loaded and "torch" in loaded  # the probe sees imports
    assert [m for m in loaded if m.split(".")[0] in ("vllm", "ray", "fastapi", "uvicorn", "transformers")
            or m.startswith(("das.drafter", "das.scheduler", "das.service.cluster", "das.service.http",
                             "das.service.engine.vllm.engine",
                             "das.service.engine.vllm.weight_transfer"))] == []


@pytest.mark.parametrize("module", ["das.service.http.gateway", "das.service.cluster.coordinator"])
def test_the_gateway_and_the_coordinator_load_no_vllm_torch_or_native_index(module: str) -> None:
    loaded = _loaded_after_import(module)
    assert module in loaded
    assert [m for m in loaded if m.split(".")[0] in ("vllm", "torch") or m in (
        "das.drafter._suffix_index", "das.drafter.history", "das.service.engine.vllm.engine")] == []


def test_no_import_cycles_among_the_packages_modules() -> None:
    """No module imports, directly or not, one that imports it back (function-level imports count: they once hid
    a bench/e2e <-> bench/e2e_report cycle)."""
    import grimp

    graph = grimp.build_graph("das", include_external_packages=False, exclude_type_checking_imports=True)
    edges = [(a, b) for a in graph.modules for b in graph.find_modules_directly_imported_by(a) if a != b]
    assert len(edges) > 100  # the graph is the package's
    assert [(a, b) for a, b in edges if graph.chain_exists(importer=b, imported=a)] == []


def test_the_readme_stays_a_short_users_document() -> None:
    """README.md is the user's document (at most 250 lines, its results one line a row); the design and the dated
    results live in docs/."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines"
