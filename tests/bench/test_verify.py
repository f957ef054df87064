"""`das bench verify`: both rejection samplers and the plain sampler timed on the same step, figures printed as
JSON; bad shapes are refused before anything runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from das.service.cli import program

app = program()

DAS = str(Path(sys.executable).with_name("das"))


def test_verify_bench_prints_every_case():
    # A fresh process: vLLM's CPU kernel registration scans every loaded module and fails on some a test run loads.
    done = subprocess.run([DAS, "bench", "verify", "--requests", "2,4", "--drafts", "1,3", "--vocab", "512",
                           "--repeats", "2", "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["config"]["vocab"] == 512 and result["config"]["repeats"] == 2
    assert [(c["requests"], c["drafts"]) for c in result["cases"]] == [(2, 1), (2, 3), (4, 1), (4, 3)]
    for case in result["cases"]:
        assert case["vllm_ms"] > 0 and case["das_ms"] > 0 and case["plain_ms"] > 0
        assert case["vllm_over_das"] == round(case["vllm_ms"] / case["das_ms"], 2)
        assert case["draw_fused_ms"] > 0 and case["draw_torch_ms"] > 0 and case["draw_identical"] is True


def test_bad_shapes_are_refused():
    for args, message in ((["--requests", "8,x"], "comma-separated integers"), (["--drafts", "0"], ">= 1")):
        result = CliRunner().invoke(app, ["bench", "verify", *args])
        assert result.exit_code == 2 and message in result.output, result.output
