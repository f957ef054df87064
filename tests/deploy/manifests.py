"""Rendering the chart with Helm's own engine and validating what comes out, for tests/deploy.

Helm: `helm_python` (PyPI helm-python-sdk) binds Helm's Go SDK (v4) built as a C library, so `render` is what
`helm template` produces. Core kinds are validated with kubernetes-validate's schemas of a Kubernetes version in
strict mode (unknown fields are errors, as with `kubectl apply --validate=strict`); RayCluster and
ServiceMonitor with the vendored CRD schemas in schemas/, made strict the same way.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "das-rollout"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
# Oldest and newest Kubernetes the chart is checked against (Chart.yaml kubeVersion >= 1.26; kubernetes-validate
# 1.37 ships schemas up to 1.37).
KUBE_VERSIONS = ("1.26.0", "1.37.0")
CRD_SCHEMAS = {
    ("ray.io/v1", "RayCluster"): "ray.io_rayclusters_v1.schema.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_servicemonitors_v1.schema.json",
}


def example_values(name: str) -> dict[str, Any]:
    """A values file of the chart's examples/ folder, parsed by Helm's own values reader."""
    return helm.values_from_yaml((CHART / "examples" / name).read_text())


def render(values: dict[str, Any] | None = None, *, release: str = "demo",
           namespace: str = "rl") -> dict[str, str]:
    """Template path -> rendered text, as `helm template release CHART -n namespace` would produce."""
    with helm.Chart.load(CHART) as chart:
        return chart.render(values, name=release, namespace=namespace, is_install=True)


def objects(rendered: dict[str, str]) -> list[dict[str, Any]]:
    """Every Kubernetes object in the rendered templates (NOTES.txt and empty documents left out)."""
    found = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            continue
        found.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return found


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def _strict(schema: Any) -> Any:
    """The CRD schema with unknown fields refused: `additionalProperties: false` on every object that lists its
    properties and does not preserve unknown fields (the API server prunes or, with strict field validation,
    refuses such fields; plain JSON Schema would accept them)."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@cache
def _crd_validator(file_name: str) -> jsonschema.Draft7Validator:
    schema = _strict(json.loads((SCHEMAS / file_name).read_text()))
    return jsonschema.Draft7Validator(schema, format_checker=jsonschema.Draft7Validator.FORMAT_CHECKER)


def pod_templates(raycluster: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(group name, pod template) of the head group and of each worker group."""
    spec = raycluster["spec"]
    yield "head", spec["headGroupSpec"]["template"]
    for group in spec.get("workerGroupSpecs", []):
        yield group["groupName"], group["template"]


def validation_errors(doc: dict[str, Any]) -> list[str]:
    """Why `doc` would be refused by the API server (schema level), empty when it validates. A kind with no
    schema here is an error too, so a new template cannot slip past validation."""
    name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in CRD_SCHEMAS:
        errors = [f"{name}: {'.'.join(map(str, e.path))}: {e.message}"
                  for e in _crd_validator(CRD_SCHEMAS[key]).iter_errors(doc)]
        if doc["kind"] == "RayCluster":
            # The CRD embeds the pod template schema loosely (metadata is any object); check each pod template
            # against the core PodTemplate schema as well.
            for group, template in pod_templates(doc):
                wrapped = {"apiVersion": "v1", "kind": "PodTemplate",
                           "metadata": {"name": f"{doc['metadata']['name']}-{group}"},
                           "template": copy.deepcopy(template)}
                errors += [f"{name} pod template {group}: {e}" for e in _core_errors(wrapped)]
        return errors
    return [f"{name}: {e}" for e in _core_errors(doc)]


def _core_errors(doc: dict[str, Any]) -> list[str]:
    errors = []
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"Kubernetes {version}: {'.'.join(map(str, exc.path))}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            errors.append(exc.message)
    return errors
