"""`das bench gpu-cost` on the CPU with its tiny config, with vLLM made unimportable (as on a GPU machine without
it): the keyed draw agrees with its CPU-tensor run, every grid point is timed, and the cost model it writes is one
the simulator loads; bad grids are refused before anything runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from das.scheduler.cost_model import load_cost_model

WITHOUT_VLLM = "import sys; sys.modules['vllm'] = None\nfrom das.bench.gpu_cost import main\nmain(sys.argv[1:])"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT_VLLM, *args], capture_output=True, text=True, timeout=240)


def test_the_tiny_run_writes_a_surface_and_a_cost_model(tmp_path: Path):
    done = run("--tiny", "--out", str(tmp_path), "--repeats", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout)
    assert summary["keyed_draw"]["identical_to_cpu"] is True and summary["keyed_draw"]["median_ms"] > 0
    surface = json.loads((tmp_path / "tiny-cpu-surface.json").read_text())
    shapes = {(p["batch"], p["tokens_per_request"], p["context"]) for p in surface["points"]}
    assert shapes == {(b, t, c) for b in (1, 4) for t in (1, 3) for c in (16, 64)}
    assert all(p["step_s"] > 0 and p["cuda_graph"] is False for p in surface["points"])
    model = load_cost_model(str(tmp_path / "tiny-cpu.json"))
    assert model.name == "tiny-cpu" and model.c_base_s + model.c_tok_s > 0 and "gpu-cost" in model.source
    assert surface["cost_model"]["c_tok_s"] == model.c_tok_s


def test_bad_grids_are_refused_before_anything_runs(tmp_path: Path):
    done = run("--tiny", "--out", str(tmp_path), "--batches", "0")
    assert done.returncode == 2 and ">= 1" in done.stderr
    done = run("--tiny", "--out", str(tmp_path), "--batches", "2", "--tokens", "1")
    assert done.returncode == 2 and "two distinct" in done.stderr
    assert not any(tmp_path.iterdir())
