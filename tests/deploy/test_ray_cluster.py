"""deploy/ray-cluster.yaml, the Ray cluster launcher config for VMs: accepted by Ray's own config preparation and
schema (what `ray up` checks before it touches the cloud), and its start commands run for real with stand-in
programs: Ray first, then the gateway with flags `das serve` parses, its token from the uploaded file."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer.main
import yaml
from jsonschema import ValidationError
from ray.autoscaler._private.util import prepare_config, validate_config

from das.service.cli import app as cli_app
from tests.deploy.manifests import ROOT
from tests.deploy.shell_stubs import run_with_stubs

CONFIG = ROOT / "deploy" / "ray-cluster.yaml"


def load() -> dict[str, Any]:
    return yaml.safe_load(CONFIG.read_text())


def test_ray_accepts_the_config() -> None:
    validate_config(prepare_config(load()))


def test_ray_would_refuse_a_misspelled_key() -> None:
    config = load()
    config["available_node_types"]["head"]["min_worker"] = 0
    with pytest.raises(ValidationError, match="min_worker"):
        validate_config(prepare_config(config))


def test_node_types_cpu_head_and_8_gpu_workers() -> None:
    config = prepare_config(load())
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"]["GPU"] == 0 and head["max_workers"] == 0
    (gpu_type,) = [name for name, t in types.items() if t["resources"].get("GPU", 0) > 0]
    gpu = types[gpu_type]
    assert gpu["resources"]["GPU"] == 8
    assert 0 <= gpu["min_workers"] <= gpu["max_workers"] <= config["max_workers"]


def _volume_targets(options: list[str]) -> dict[str, str]:
    """Container path -> host path of the `-v HOST:CONTAINER[:mode]` docker options."""
    targets = {}
    for option in options:
        match = re.fullmatch(r"-v (\S+?):(\S+?)(?::(?:ro|rw))?", option)
        if match:
            targets[match.group(2)] = match.group(1)
    return targets


def test_head_starts_ray_then_the_gateway(tmp_path: Path) -> None:
    config = prepare_config(load())
    (tmp_path / "das-token").write_text("t0ken")  # where file_mounts puts it: ~/das-token
    assert config["file_mounts"]["~/das-token"]
    script = "\n".join(config["head_start_ray_commands"])
    status, calls = run_with_stubs(script, ["ray", "das"], tmp_path, wait_for=3)
    assert status == 0
    assert [c.program for c in calls] == ["ray", "ray", "das"]
    assert calls[0].argv == ["stop"]
    ray_start = calls[1].argv
    assert ray_start[:2] == ["start", "--head"] and "--autoscaling-config=~/ray_bootstrap_config.yaml" in ray_start

    das = calls[2]
    assert das.das_token == "t0ken" and "--token" not in das.argv  # from the uploaded file, not the command line
    serve = typer.main.get_command(cli_app).commands["serve"]  # type: ignore[attr-defined]
    params = serve.make_context("serve", das.argv[1:]).params  # raises on any flag das serve lacks
    assert das.argv[0] == "serve" and params["address"] == "auto" and params["host"] == "0.0.0.0"
    docker = config["docker"]
    mounts = _volume_targets(docker["run_options"])
    head_mounts = _volume_targets(docker["head_run_options"])
    assert str(params["weights_root"]) in mounts  # on every node: engines load checkpoints too
    assert str(params["state_dir"]) in head_mounts
    assert str(params["model"]).startswith(str(params["weights_root"]) + "/")


def test_workers_join_the_head(tmp_path: Path) -> None:
    config = prepare_config(load())
    head_port = re.search(r"ray start --head --port=(\d+)", " ".join(config["head_start_ray_commands"]))
    assert head_port
    status, calls = run_with_stubs("\n".join(config["worker_start_ray_commands"]), ["ray"], tmp_path,
                                   env={"RAY_HEAD_IP": "10.0.0.1"})
    assert status == 0
    assert [c.argv for c in calls] == [["stop"], ["start", f"--address=10.0.0.1:{head_port.group(1)}"]]


def test_image_is_this_version() -> None:
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert version and load()["docker"]["image"].endswith(f"/das-rollout:{version.group(1)}")
