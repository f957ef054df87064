"""`das bench gpu-cost` on the CPU with its tiny config, with vLLM made unimportable (as on a GPU machine without
it): the keyed draw agrees with its CPU-tensor run, every grid point is timed, and the cost model it writes is one
the simulator loads; bad grids are refused before anything runs (checked in this process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from das.bench.gpu_cost import fit_step_terms, main
from das.scheduler.cost_model import load_cost_model

WITHOUT_VLLM = "import sys; sys.modules['vllm'] = None\nfrom das.bench.gpu_cost import main\nmain(sys.argv[1:])"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT_VLLM, *args], capture_output=True, text=True, timeout=240)


def test_the_tiny_run_writes_a_surface_and_a_cost_model(tmp_path: Path):
    done = run("--tiny", "--out", str(tmp_path), "--repeats", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout)
    assert [d["rows"] for d in summary["keyed_draw"]] == [1, 16]
    for draw in summary["keyed_draw"]:
        assert draw["eager_identical_to_cpu"] is True and draw["compiled_identical_to_cpu"] is True
        assert draw["eager_median_ms"] > 0 and draw["compiled_median_ms"] > 0 and draw["unkeyed_median_ms"] > 0
    surface = json.loads((tmp_path / "tiny-cpu-surface.json").read_text())
    shapes = {(p["batch"], p["tokens_per_request"], p["context"]) for p in surface["points"]}
    assert shapes == {(b, t, c) for b in (1, 4) for t in (1, 3) for c in (16, 64)}
    assert all(p["step_s"] > 0 and p["cuda_graph"] is False for p in surface["points"])
    model = load_cost_model(str(tmp_path / "tiny-cpu.json"))
    assert model.name == "tiny-cpu" and model.c_base_s + model.c_tok_s > 0 and "gpu-cost" in model.source
    assert surface["cost_model"]["c_tok_s"] == model.c_tok_s == surface["fit"]["c_tok_s"]
    assert "per-request term" in model.source
    (host,) = summary["proposer_host"]["per_batch"]  # (c): the draft step at 16 running requests on this CPU
    assert host["requests"] == 16 and host["steps"] > 0 and 0 < host["budget_ms"] < host["step_ms"]
    assert host["step_ms"] == pytest.approx(host["settle_ms"] + host["draft_ms"], rel=0.5)


def test_the_proposers_host_time_is_skipped_with_why_where_our_drafter_does_not_import(tmp_path: Path):
    without_drafter = ("import sys; sys.modules['vllm'] = None; sys.modules['das.drafter.history'] = None\n"
                       "from das.bench.gpu_cost import main\nmain(sys.argv[1:])")
    done = subprocess.run([sys.executable, "-c", without_drafter, "--tiny", "--out", str(tmp_path), "--repeats", "1",
                           "--draw-only", "--draw-rows", "2"], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "our drafter does not import" in json.loads(done.stdout)["proposer_host"]["skipped"]


def test_draw_only_times_the_draw_and_nothing_else(tmp_path: Path):
    done = run("--tiny", "--out", str(tmp_path), "--repeats", "1", "--draw-only", "--draw-rows", "2,5",
               "--proposer-batches", "0")
    assert done.returncode == 0, done.stderr[-2000:]
    assert [d["rows"] for d in json.loads(done.stdout)["keyed_draw"]] == [2, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-cpu-draw.json"]


def test_the_fit_recovers_a_known_step_cost():
    """step = 2 ms + 0.5 ms a request + 30 us a token, over a grid: the three terms come back."""
    points = [{"batch": b, "tokens_per_request": k, "step_s": 2e-3 + 0.5e-3 * b + 30e-6 * b * k}
              for b in (1, 8, 32) for k in (1, 4, 16)]
    fit = fit_step_terms(points)
    assert abs(fit["c_base_s"] - 2e-3) < 1e-9 and abs(fit["per_request_s"] - 0.5e-3) < 1e-9
    assert abs(fit["c_tok_s"] - 30e-6) < 1e-10 and fit["fit_error"] < 1e-9
    with pytest.raises(ValueError, match="two batch sizes"):
        fit_step_terms([p for p in points if p["batch"] == 8])


@pytest.mark.parametrize("grid, message", [(("--batches", "0"), ">= 1"),
                                           (("--batches", "2", "--tokens", "1"), "two batch sizes")])
def test_bad_grids_are_refused_before_anything_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    grid: tuple[str, ...], message: str):
    """In this process, not a child: the refusal comes before anything is timed, so a child's interpreter and torch
    import would only add seconds."""
    with pytest.raises(SystemExit) as refused:
        main(["--tiny", "--out", str(tmp_path), *grid])
    assert refused.value.code == 2 and message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
