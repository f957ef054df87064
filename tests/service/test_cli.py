"""`das serve --engine-options`: engine settings no flag sets, merged into the flags' settings; a clash with a flag,
bad JSON or a bad value is refused before anything starts. A configuration no engine can load ends `das serve` at
once, its cause on the last line (issue 59)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from das.scheduler.policies import budget_from_config, parse_budget
from das.service.cli import app, merge_engine_options
from das.service.cluster.engine_layout import cpu_node
from tests.service.serve_process import free_port

FLAGS = {"model": "smollm2", "num_speculative_tokens": 8, "budget": {"policy": "das"}}


def test_options_merge_into_nested_settings_and_add_new_ones():
    merged = merge_engine_options(FLAGS, '{"budget": {"per_token": true}, "drafter": {"min_prob": 0.05}}')
    assert merged == {**FLAGS, "budget": {"policy": "das", "per_token": True}, "drafter": {"min_prob": 0.05}}
    assert FLAGS["budget"] == {"policy": "das"}  # the flags' dict is not changed


@pytest.mark.parametrize(("options", "message"), [
    ('{"budget": {"policy": "uniform"}}', "budget.policy is set by a flag"),
    ('{"num_speculative_tokens": 4}', "num_speculative_tokens is set by a flag"),
    ('{"budget": ', "not JSON"),
    ("[1, 2]", "must be a JSON object"),
])
def test_a_clash_with_a_flag_or_bad_json_is_refused(options, message):
    with pytest.raises(ValueError, match=message):
        merge_engine_options(FLAGS, options)


@pytest.mark.parametrize(("args", "message"), [
    (["--engine-options", '{"k": 3'], "not JSON"),
    (["--engine-options", '{"drafter": {"min_prob": 7}}'], "min_prob"),
    (["--engine-options", '{"budget": {"policy": "uniform"}}'], "use the flag"),
    (["--stub-engine", "--engine-options", "{}"], "the stub engine takes none"),
])
def test_das_serve_refuses_bad_engine_options_before_starting(args, message):
    result = CliRunner().invoke(app, ["serve", "--port", "1", *args])
    assert result.exit_code != 0
    assert message in " ".join(result.output.split())


@pytest.mark.parametrize("name", ["das", "uniform", "classes", "das-lengths", "das-token", "uniform-4",
                                  "classes-16-8-0", "das:h100-7b"])
def test_das_serve_budget_takes_a_name_of_the_budget_grammar(name):
    """--budget is a name of scheduler/policies.py's grammar (das, uniform and classes as before); it sets its
    fields, and --engine-options the others."""
    serve = typer.main.get_command(app).commands["serve"]  # type: ignore[attr-defined]
    assert serve.make_context("serve", ["--budget", name]).params["budget"] == name
    merged = merge_engine_options({"budget": parse_budget(name).fields()}, '{"budget": {"acceptance": 0.5}}')
    assert budget_from_config(merged["budget"]) == parse_budget(name).model_copy(update={"acceptance": 0.5})


def test_das_serve_refuses_a_budget_outside_the_grammar_and_options_its_name_sets():
    result = CliRunner().invoke(app, ["serve", "--port", "1", "--budget", "fastest"])
    assert result.exit_code == 2 and "--budget" in result.output
    serve = typer.main.get_command(app).commands["serve"]  # type: ignore[attr-defined]
    with pytest.raises(typer.BadParameter, match=r"unknown budget 'fastest'; a budget is one of: das \| das-lengths"):
        serve.make_context("serve", ["--budget", "fastest"])
    with pytest.raises(ValueError, match="budget.k is set by a flag"):
        merge_engine_options({"budget": parse_budget("uniform-8").fields()}, '{"budget": {"k": 4}}')


# ---- issue 59: a configuration no engine can load ends das serve with its cause ----

DAS = Path(sys.executable).with_name("das")
# `das serve` with the gateway's package check off: the engine actor's own check is what finds the package missing
SERVE_WITHOUT_GATEWAY_CHECK = """
import sys
import das.service.engine.preflight as preflight
preflight.check_method_packages = lambda speculation: None
from das.service.cli import program

app = program()
sys.argv = ["das", *sys.argv[1:]]
app()
"""


@pytest.fixture
def no_arctic_inference(tmp_path: Path) -> dict[str, str]:
    """An environment in which `arctic_inference` is found first in a folder where its import fails (it is installed
    in this venv): what a plain `pip install das-rollout[gpu]` has, for this process and every Ray worker."""
    (tmp_path / "shadow" / "arctic_inference").mkdir(parents=True)
    (tmp_path / "shadow" / "arctic_inference" / "__init__.py").write_text(
        "raise ImportError('arctic_inference is shadowed by the test: not importable')\n")
    path = os.pathsep.join(filter(None, [str(tmp_path / "shadow"), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def serve_until_it_ends(args: list[str], env: dict[str, str] | None = None, limit_s: float = 60
                        ) -> tuple[int, float, list[str]]:
    """A `das serve` process (`args` after the program) run until it exits: its exit status, seconds, output lines.
    Fails if it is still up after `limit_s`."""
    start = time.monotonic()
    proc = subprocess.Popen([*args, "--port", str(free_port())], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"still serving after {limit_s} s:\n{out[-3000:]}") from None
    lines = [line for line in out.splitlines() if line.strip()]
    return proc.returncode, time.monotonic() - start, lines


def test_das_serve_suffix_without_arctic_inference_is_refused_before_any_engine_starts(
        no_arctic_inference: dict[str, str]) -> None:
    status, seconds, lines = serve_until_it_ends([str(DAS), "serve", "--speculation", "suffix"], no_arctic_inference)
    assert status != 0 and seconds < 60
    assert lines[-1].startswith("error: --speculation suffix needs arctic-inference, which cannot be imported here")
    assert "requirements/peers.txt" in lines[-1]
    assert not any("Ray instance" in line for line in lines)  # refused before Ray or any engine started


def test_das_serve_ends_within_seconds_when_its_engine_cannot_load(no_arctic_inference: dict[str, str]) -> None:
    """The gateway's check off: the engine actor fails its load for good (its node lacks arctic-inference), and
    das serve, whose own cluster has no other node, stops with the cause instead of staying up never ready."""
    status, seconds, lines = serve_until_it_ends(
        [sys.executable, "-c", SERVE_WITHOUT_GATEWAY_CHECK, "serve", "--speculation", "suffix"], no_arctic_inference)
    assert status == 2 and seconds < 60, lines[-5:]
    assert lines[-1].startswith("error: no engine can load, so das serve stops: engine "), lines[-5:]
    assert "cannot load: --speculation suffix needs arctic-inference" in lines[-1]


def test_das_serve_with_no_such_model_directory_is_refused_naming_the_flag() -> None:
    status, seconds, lines = serve_until_it_ends([str(DAS), "serve", "--model", "/no/such/dir"])
    assert status != 0 and seconds < 60
    assert lines[-1].startswith("error: unknown model '/no/such/dir': not a directory") and "--model" in lines[-1]


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU node splits its GPUs, not its CPUs")
def test_das_serve_with_more_tensor_parallel_workers_than_the_node_can_bind_is_refused() -> None:
    cpus, numa_nodes = cpu_node()
    if min(cpus, numa_nodes or cpus) >= 3:
        pytest.skip("this node can run 3 CPU workers")
    status, seconds, lines = serve_until_it_ends([str(DAS), "serve", "--tensor-parallel-size", "3", "--eager"])
    assert status != 0 and seconds < 60
    assert lines[-1].startswith("error: this node has no GPU and ") and "--tensor-parallel-size 3" in lines[-1]


def test_the_das_program_takes_its_bench_group_from_the_entry_point_once() -> None:
    """The service assembles `das`; the benchmarks (the layer above) register `das bench` and `das models perturb`
    through the `das.commands` entry point, not by importing the service's app and extending it."""
    from das.service.cli import program

    groups = [group.name for group in program().registered_groups]
    assert "bench" in groups and [group.name for group in program().registered_groups] == groups
    models = next(group.typer_instance for group in program().registered_groups if group.name == "models")
    assert [command.name for command in models.registered_commands].count("perturb") == 1
