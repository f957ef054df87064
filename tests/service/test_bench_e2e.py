"""`das bench e2e` through the CLI on a tiny model: the JSON the issue specifies, with real engines."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from das.service.bench_e2e import E2EConfig
from das.service.cli import app
from das.service.models import prepare_model
from tests.tiny_models import build_tiny_model


def test_config_errors_are_clear():
    with pytest.raises(ValueError, match="arms must be distinct"):
        E2EConfig(model="m", prompts="p", arms=("none", "eagle"))
    with pytest.raises(ValueError, match="samples must be >= 1"):
        E2EConfig(model="m", prompts="p", samples=0)
    bad = CliRunner().invoke(app, ["bench", "e2e", "--prompts", "reasoning-gym:x"])
    assert bad.exit_code == 2 and "reasoning-gym:<count>" in bad.output
    bad = CliRunner().invoke(app, ["bench", "e2e", "--prompts", "reasoning-gym:2", "--budget", "fast"])
    assert bad.exit_code == 2 and "--budget" in bad.output


def test_two_arms_two_epochs_json(tmp_path):
    model = build_tiny_model(tmp_path / "tiny", prepare_model("smollm2", progress=False), vocab_size=64, seed=0,
                             sharpness=12.0)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"problem_id": f"p{i}", "prompt_token_ids": [5, 6, 7 + i]})
                                 for i in range(3)) + "\n")
    out = CliRunner().invoke(app, ["bench", "e2e", "--model", str(model), "--prompts", str(prompts), "--samples", "4",
                                   "--epochs", "2", "--max-tokens", "24", "--arms", "none,das", "--dtype", "float32",
                                   "--max-model-len", "256", "--eager", "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert doc["config"]["arms"] == ["none", "das"] and len(doc["epochs"]) == 2
    for epoch in doc["epochs"]:
        assert set(epoch["arms"]) == {"none", "das"}
        for arm in epoch["arms"].values():
            assert arm["tokens"] > 0 and arm["makespan_s"] > 0 and arm["errors"] == 0
            assert 0 <= arm["tail_share"] < 1
            assert set(arm) >= {"tokens_per_s", "draft_tokens", "accepted_tokens", "acceptance_length"}
        assert epoch["arms"]["none"]["draft_tokens"] == 0
    second = doc["epochs"][1]["arms"]["das"]
    assert second["accepted_tokens"] > 0 and second["acceptance_length"] > 1
    assert doc["identical_outputs"] is True and doc["divergence"] == {"das": 0.0}
    assert doc["proposer"]["steps"] > 0
