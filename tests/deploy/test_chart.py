"""The helm chart (helm/das-rollout), rendered by Helm's own engine for the default values, the 8xH100 example
and every optional feature: schema-valid for Kubernetes and the KubeRay / prometheus-operator CRDs, lint-clean,
and wired together (the gateway's command line parses with `das serve` itself, the Service reaches the head,
the ServiceMonitor scrapes it with the token, the dashboard ConfigMap carries deploy/'s dashboard)."""

from __future__ import annotations

import base64
import re
import shlex
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import typer.main
import yaml
from yamllint import linter
from yamllint.config import YamlLintConfig

from das.service.cli import app as cli_app
from das.service.engine.config import EngineConfig
from tests.deploy.manifests import (
    CHART,
    ROOT,
    by_kind,
    example_values,
    objects,
    pod_templates,
    render,
    validation_errors,
)
from tests.deploy.shell_stubs import run_with_stubs

EXAMPLE = "values-8xh100.yaml"
# Every optional feature on (and the alternatives to the defaults: existing claim, no auth), so each template
# branch is rendered and validated at least once.
ALL_OPTIONS: dict[str, Any] = {
    "engine": {"maxModelLen": 4096, "eager": True, "maxGroupDeaths": 2, "weightTransfer": "gloo",
               "budget": "das-lengths", "extraArgs": ["--history-shards", "4"]},
    "gateway": {"otlpTracesEndpoint": "http://otel-collector.monitoring:4318",
                "ingress": {"enabled": True, "className": "nginx",
                            "tls": [{"secretName": "das-tls", "hosts": ["das.example.test"]}],
                            "hosts": [{"host": "das.example.test", "paths": [{"path": "/", "pathType": "Prefix"}]}]}},
    "auth": {"enabled": False},
    "history": {"persistence": {"existingClaim": "das-history"}},
    "weights": {"volume": {"hostPath": {"path": "/mnt/checkpoints", "type": "Directory"}}},
    "workers": {"rayStartParams": {"resources": '"{\\"das_node\\": 1}"'},
                "env": [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}],
                "compileCache": {"volume": {"persistentVolumeClaim": {"claimName": "vllm-cache"}}}},
    "head": {"extraVolumes": [{"name": "scratch", "emptyDir": {}}],
             "extraVolumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]},
    "serviceMonitor": {"enabled": True}, "dashboards": {"enabled": True},
    "autoscaling": {"enabled": True, "targetEngines": 16},
}
CASES = {"defaults": None, "example-8xh100": example_values(EXAMPLE), "all-options": ALL_OPTIONS}


def merged(values: dict[str, Any] | None) -> dict[str, Any]:
    with helm.Chart.load(CHART) as chart:
        return chart.merge_values(values)


def head_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (cluster,) = by_kind(docs, "RayCluster")
    return cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]


def head_script(docs: list[dict[str, Any]]) -> str:
    container = head_container(docs)
    assert container["command"] == ["/bin/bash", "-c", "--"]
    (script,) = container["args"]
    return str(script)


def serve_argv(docs: list[dict[str, Any]]) -> list[str]:
    """The words of the `exec das serve ...` part of the head's command line."""
    words = shlex.split(head_script(docs).split("exec ", 1)[1])
    assert words[:2] == ["das", "serve"]
    return words[2:]


@pytest.mark.parametrize("case", CASES)
def test_every_object_is_schema_valid(case: str) -> None:
    docs = objects(render(CASES[case]))
    assert docs
    errors = [e for doc in docs for e in validation_errors(doc)]
    assert errors == []


def test_which_objects_each_case_makes() -> None:
    kinds = {case: sorted(d["kind"] for d in objects(render(values))) for case, values in CASES.items()}
    assert kinds["defaults"] == ["PersistentVolumeClaim", "RayCluster", "Secret", "Service"]
    # The example brings its own token Secret and turns monitoring on.
    assert kinds["example-8xh100"] == ["ConfigMap", "PersistentVolumeClaim", "RayCluster", "Service",
                                       "ServiceMonitor"]
    assert kinds["all-options"] == ["ConfigMap", "Ingress", "RayCluster", "Service", "ServiceMonitor"]


@pytest.mark.parametrize("case", CASES)
def test_gateway_command_line_is_accepted_by_das_serve(case: str) -> None:
    values = merged(CASES[case])
    docs = objects(render(CASES[case]))
    serve = typer.main.get_command(cli_app).commands["serve"]  # type: ignore[attr-defined]
    params = serve.make_context("serve", serve_argv(docs)).params  # raises on any flag das serve lacks
    assert params["address"] == "auto" and params["host"] == "0.0.0.0"
    assert params["port"] == values["gateway"]["port"]
    assert params["header_timeout"] == values["gateway"]["headerTimeoutSeconds"]
    assert params["body_timeout"] == values["gateway"]["bodyTimeoutSeconds"]
    assert params["otlp_traces_endpoint"] == (values["gateway"]["otlpTracesEndpoint"] or None)
    assert params["model"] == values["engine"]["model"] and params["k"] == values["engine"]["k"]
    assert params["speculation"] == values["engine"]["speculation"]
    if values["engine"]["maxModelLen"]:
        assert params["max_model_len"] == values["engine"]["maxModelLen"]
    assert params["eager"] == values["engine"]["eager"]
    assert params["tensor_parallel_size"] == values["engine"]["tensorParallelSize"]
    assert params["budget"] == values["engine"]["budget"]
    # the engine settings das serve validates before it starts anything (typed budget and drafter settings)
    EngineConfig(model=params["model"], speculation=params["speculation"], num_speculative_tokens=params["k"],
                 tensor_parallel_size=params["tensor_parallel_size"], budget=params["budget"],
                 weight_transfer=params["weight_transfer"])
    assert params["max_restarts"] == values["engine"]["maxRestarts"]
    assert params["restart_window"] == values["engine"]["restartWindowSeconds"]
    assert params["max_group_deaths"] == values["engine"]["maxGroupDeaths"]
    assert params["weight_transfer"] == values["engine"]["weightTransfer"]
    assert params["snapshot_interval"] == values["history"]["snapshotIntervalSeconds"]
    autoscaling = values["autoscaling"]
    assert params["target_engines"] == ((autoscaling["targetEngines"] or None) if autoscaling["enabled"] else None)
    assert params["token"] is None  # never on the command line (visible in the pod spec): DAS_TOKEN from a Secret

    container = head_container(docs)
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts[str(params["state_dir"])] == "history"
    if values["weights"]["volume"]:
        assert str(params["weights_root"]) == values["weights"]["mountPath"]
        (cluster,) = by_kind(docs, "RayCluster")
        for group, template in pod_templates(cluster):
            volume_mounts = template["spec"]["containers"][0]["volumeMounts"]
            assert {"name": "weights", "mountPath": values["weights"]["mountPath"], "readOnly": True} in \
                volume_mounts, group
            assert {"name": "weights", **values["weights"]["volume"]} in template["spec"]["volumes"], group
    else:
        assert params["weights_root"] is None


def test_head_script_starts_ray_without_block_then_execs_the_gateway(tmp_path: Path) -> None:
    """The head's bash glue, run for real with stand-ins for `ray` and `das`: KubeRay's generated `ray start ...
    --block` must come back without --block (else the gateway never starts), and a failed `ray start` must stop
    the container instead of starting a gateway with no Ray."""
    docs = objects(render(ALL_OPTIONS))
    script = head_script(docs)
    # As KubeRay 1.x formats it (pod.go: flags sorted, each with a space either side).
    generated = "ray start --head  --block  --dashboard-host=0.0.0.0  --metrics-export-port=8080 "
    env = {"KUBERAY_GEN_RAY_START_CMD": generated}

    status, calls = run_with_stubs(script, ["ray", "das"], tmp_path, env)
    assert status == 0
    assert [(c.program, c.argv) for c in calls] == [
        ("ray", ["start", "--head", "--dashboard-host=0.0.0.0", "--metrics-export-port=8080"]),
        ("das", ["serve", *serve_argv(docs)])]

    status, calls = run_with_stubs(script, ["ray", "das"], tmp_path, env, fail="ray")
    assert status != 0
    assert [c.program for c in calls] == ["ray"]


@pytest.mark.parametrize("case", CASES)
def test_token_reaches_the_gateway_from_a_secret(case: str) -> None:
    values = merged(CASES[case])
    docs = objects(render(CASES[case]))
    env = {e["name"]: e for e in head_container(docs).get("env", [])}
    if not values["auth"]["enabled"]:
        assert "DAS_TOKEN" not in env and not by_kind(docs, "Secret")
        return
    ref = env["DAS_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref["key"] == values["auth"]["secretKey"]
    if values["auth"]["existingSecret"]:
        assert ref["name"] == values["auth"]["existingSecret"] and not by_kind(docs, "Secret")
    else:
        (secret,) = by_kind(docs, "Secret")
        assert secret["metadata"]["name"] == ref["name"] and ref["key"] in secret["data"]


def test_given_token_is_stored_and_a_generated_one_is_long() -> None:
    (given,) = by_kind(objects(render({"auth": {"token": "s3cret"}})), "Secret")
    assert base64.b64decode(given["data"]["token"]) == b"s3cret"
    (generated,) = by_kind(objects(render()), "Secret")
    assert len(base64.b64decode(generated["data"]["token"])) >= 32


@pytest.mark.parametrize("case", CASES)
def test_probes_give_model_loading_a_long_startup_window(case: str) -> None:
    container = head_container(objects(render(CASES[case])))
    port_names = {p["name"] for p in container["ports"]}
    paths = {}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container[kind]
        assert probe["httpGet"]["port"] in port_names
        paths[kind] = probe["httpGet"]["path"]
    assert paths == {"startupProbe": "/healthz", "readinessProbe": "/readyz", "livenessProbe": "/healthz"}
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60  # seconds allowed to start


def test_gpu_workers_from_the_example() -> None:
    values = merged(example_values(EXAMPLE))
    (cluster,) = by_kind(objects(render(example_values(EXAMPLE))), "RayCluster")
    spec = cluster["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["rayVersion"] == values["rayVersion"]
    (group,) = spec["workerGroupSpecs"]
    w = values["workers"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (4, 1, 8) == \
        (w["replicas"], w["minReplicas"], w["maxReplicas"])
    pod = group["template"]["spec"]
    (container,) = pod["containers"]
    for side in ("requests", "limits"):
        assert container["resources"][side]["nvidia.com/gpu"] == 8
        assert container["resources"][side]["memory"] == w["resources"][side]["memory"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["affinity"]["podAntiAffinity"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["dshm"] == "/dev/shm"
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": w["shmSize"]}
    # The head runs no engine: no GPU asked for there.
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert all("nvidia.com/gpu" not in head["resources"].get(side, {}) for side in ("requests", "limits"))


def test_compile_cache_volume_is_the_workers_vllm_cache_root() -> None:
    def worker(values: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
        (cluster,) = by_kind(objects(render(values)), "RayCluster")
        (group,) = cluster["spec"]["workerGroupSpecs"]
        pod = group["template"]["spec"]
        return pod, pod["containers"][0]

    pod, container = worker(ALL_OPTIONS)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert volumes["vllm-cache"]["persistentVolumeClaim"] == {"claimName": "vllm-cache"}
    assert mounts["vllm-cache"] == "/var/cache/vllm"
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env == {"VLLM_CACHE_ROOT": "/var/cache/vllm", "VLLM_LOGGING_LEVEL": "DEBUG"}  # the user's env kept
    pod, container = worker(None)  # default: no volume, vLLM's own cache location in the container
    assert "vllm-cache" not in {v["name"] for v in pod["volumes"]} and "env" not in container


def test_a_tensor_parallel_size_reaches_das_serve_and_must_divide_the_gpus_per_node() -> None:
    docs = objects(render({"engine": {"tensorParallelSize": 4}, "workers": {"gpusPerNode": 8}}))
    serve = typer.main.get_command(cli_app).commands["serve"]  # type: ignore[attr-defined]
    assert serve.make_context("serve", serve_argv(docs)).params["tensor_parallel_size"] == 4
    with pytest.raises(helm.HelmError, match=r"engine.tensorParallelSize \(3\) must divide workers.gpusPerNode \(8\)"):
        render({"engine": {"tensorParallelSize": 3}, "workers": {"gpusPerNode": 8}})


@pytest.mark.parametrize("engine, message", [({"budget": "fastest"}, r"a budget is one of: das \| das-lengths"),
                                             ({"budget": "uniform:h100-7b"}, "only a das name takes :COST_MODEL"),
                                             ({"k": 99}, "less than or equal to 64")])
def test_a_bad_engine_value_is_refused_by_das_serve_not_by_the_engine(engine: dict[str, Any], message: str) -> None:
    serve = typer.main.get_command(cli_app).commands["serve"]  # type: ignore[attr-defined]
    argv = serve_argv(objects(render({"engine": engine})))
    with pytest.raises(typer.BadParameter, match=message):
        serve.make_context("serve", argv)


def test_engine_budget_takes_the_names_its_values_comment_lists() -> None:
    """values.yaml documents the budget grammar (scheduler/policies.py); every name it lists reaches das serve and
    the engine's settings."""
    text = (CHART / "values.yaml").read_text()
    comment = text[text.index("# -- --budget"):text.index("  budget: ")]
    names = ["das", "das-lengths", "das-token", "uniform", "uniform-8", "classes", "classes-16-8-0", "das:h200-7b"]
    for name in names:
        assert re.sub(r"-8$|-16-8-0$|:h200-7b$", "", name) in comment, name
        serve = typer.main.get_command(cli_app).commands["serve"]  # type: ignore[attr-defined]
        params = serve.make_context("serve", serve_argv(objects(render({"engine": {"budget": name}})))).params
        assert params["budget"] == name
        EngineConfig(model="m", budget=params["budget"])


@pytest.mark.parametrize("replicas,low,high", [(5, 1, 2), (1, 2, 4)])
def test_replicas_outside_their_bounds_are_refused(replicas: int, low: int, high: int) -> None:
    with pytest.raises(helm.HelmError, match="minReplicas"):
        render({"workers": {"replicas": replicas, "minReplicas": low, "maxReplicas": high}})


def test_service_ingress_and_servicemonitor_reach_the_head_gateway() -> None:
    docs = objects(render(ALL_OPTIONS | {"auth": {"enabled": True}}))
    (cluster,) = by_kind(docs, "RayCluster")
    head_labels = cluster["spec"]["headGroupSpec"]["template"]["metadata"]["labels"] | {"ray.io/node-type": "head"}
    worker_labels = [g["template"]["metadata"]["labels"] | {"ray.io/node-type": "worker"}
                     for g in cluster["spec"]["workerGroupSpecs"]]
    (service,) = by_kind(docs, "Service")
    selector = service["spec"]["selector"]
    assert selector.items() <= head_labels.items()  # KubeRay adds ray.io/node-type to the pods it makes
    assert not any(selector.items() <= labels.items() for labels in worker_labels)
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] in {p["name"] for p in head_container(docs)["ports"]}

    (ingress,) = by_kind(docs, "Ingress")
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": service["metadata"]["name"], "port": {"name": port["name"]}}

    (monitor,) = by_kind(docs, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == port["name"] and endpoint["path"] == "/metrics"
    # /metrics is behind the API token: the scrape must send the same Secret's token.
    token_ref = {e["name"]: e for e in head_container(docs)["env"]}["DAS_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert endpoint["authorization"] == {"type": "Bearer", "credentials": token_ref}


def test_dashboard_configmap_carries_the_deploy_dashboard() -> None:
    source = (ROOT / "deploy" / "grafana" / "das-stragglers.json").read_bytes()
    assert (CHART / "dashboards" / "das-stragglers.json").read_bytes() == source
    (config_map,) = by_kind(objects(render({"dashboards": {"enabled": True}})), "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["data"] == {"das-stragglers.json": source.decode()}


def test_packaged_chart_keeps_the_dashboard_and_example(tmp_path: Path) -> None:
    """What `helm package` ships renders the same dashboard (a .helmignore rule or a symlink could drop it)."""
    archive = helm.package(CHART, destination=tmp_path)
    with helm.Chart.load(archive) as chart:
        names = {f["name"] for f in chart.files}
        rendered = chart.render({"dashboards": {"enabled": True}}, name="demo", namespace="rl")
    assert {"dashboards/das-stragglers.json", f"examples/{EXAMPLE}", "README.md"} <= names
    (config_map,) = by_kind(objects(rendered), "ConfigMap")
    assert config_map["data"]["das-stragglers.json"] == (ROOT / "deploy/grafana/das-stragglers.json").read_text()


@pytest.mark.parametrize("case", ["defaults", "example-8xh100"])
def test_helm_lint_strict(case: str) -> None:
    report = helm.lint(CHART, CASES[case], strict=True, namespace="rl")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []  # 2 = warning, 3 = error


SOURCE_LINT = YamlLintConfig("extends: default\nrules:\n  line-length: {max: 120}\n  document-start: disable\n")
# Rendered manifests: toYaml writes sequences unindented inside hand-indented templates, and long command lines
# are single YAML strings; everything else (syntax, duplicate keys, trailing spaces, truthy values) still counts.
RENDERED_LINT = YamlLintConfig("extends: default\nrules:\n  line-length: disable\n  document-start: disable\n"
                               "  indentation: {spaces: consistent, indent-sequences: whatever}\n"
                               "  comments-indentation: disable\n  empty-lines: {max: 1, max-start: 1}\n")


def _lint(text: str, config: YamlLintConfig) -> list[str]:
    return [f"{p.line}:{p.column} {p.rule}: {p.desc}" for p in linter.run(text, config)]


def test_yamllint_sources() -> None:
    files = [CHART / "Chart.yaml", CHART / "values.yaml", *sorted((CHART / "examples").glob("*.yaml")),
             ROOT / "deploy" / "ray-cluster.yaml"]
    problems = {f.name: _lint(f.read_text(), SOURCE_LINT) for f in files}
    assert problems == {f.name: [] for f in files}


@pytest.mark.parametrize("case", CASES)
def test_yamllint_rendered(case: str) -> None:
    problems = {path: _lint(text, RENDERED_LINT) for path, text in render(CASES[case]).items()
                if not path.endswith("NOTES.txt")}
    assert {path: p for path, p in problems.items() if p} == {}


def _values_paths(templates: str) -> set[tuple[str, ...]]:
    """Every values path the templates read: `.Values.a.b`, and the aliases the templates bind
    (`$v := .Values`, `$w := .Values.workers`)."""
    aliases = {r"\.Values": (), r"\$v": (), r"\$w": ("workers",)}
    paths = set()
    for pattern, prefix in aliases.items():
        for match in re.finditer(pattern + r"((?:\.[A-Za-z_][A-Za-z0-9_]*)+)", templates):
            paths.add(prefix + tuple(match.group(1).strip(".").split(".")))
    return paths


def _key_lines(node: yaml.Node, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], int]:
    """Values path -> 0-based line of its key in values.yaml, for every mapping key."""
    lines: dict[tuple[str, ...], int] = {}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            lines[path + (key.value,)] = key.start_mark.line
            lines.update(_key_lines(value, path + (key.value,)))
    return lines


def test_values_are_all_used_and_documented() -> None:
    templates = "\n".join(p.read_text() for p in sorted((CHART / "templates").iterdir()))
    used = _values_paths(templates)
    text = (CHART / "values.yaml").read_text()
    source_lines = text.splitlines()
    key_lines = _key_lines(yaml.compose(text))
    assert used - key_lines.keys() == set(), "templates read values that values.yaml does not define"

    def read(path: tuple[str, ...]) -> bool:
        return any(path[:len(u)] == u for u in used)

    unused = {path for path in key_lines if not read(path) and not any(u[:len(path)] == path for u in used)}
    assert unused == set(), "values.yaml keys no template reads"
    # Every value as the templates see it (a key they read, with nothing below it read on its own: a scalar, or
    # an object passed through whole like resources) has a comment on the line above its key.
    leaves = {path for path in used if not any(len(u) > len(path) and u[:len(path)] == path for u in used)}
    undocumented = [".".join(path) for path in sorted(leaves)
                    if not source_lines[key_lines[path] - 1].strip().startswith("#")]
    assert undocumented == []


def test_chart_version_and_app_version_match_the_package() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = (ROOT / "pyproject.toml").read_text()
    version = re.search(r'^version = "([^"]+)"', project, re.MULTILINE)
    assert version and chart["appVersion"] == version.group(1)
    ray = re.search(r'"ray==([^"]+)"', project)
    assert ray and merged(None)["rayVersion"] == ray.group(1)


def test_click_would_reject_a_flag_das_serve_lacks() -> None:
    """The command-line check above is able to fail: an unknown flag is refused by the same parser."""
    serve = typer.main.get_command(cli_app).commands["serve"]  # type: ignore[attr-defined]
    with pytest.raises(Exception, match="No such option: --adress"):
        serve.make_context("serve", ["--adress", "auto"])
