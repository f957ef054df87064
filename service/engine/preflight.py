"""The packages an engine needs beyond vLLM, checked without starting one (issue 59).

vLLM imports a speculation method's package only once the engine is configured, after the model and vLLM itself
have loaded: `--speculation suffix` without ArcticInference failed each engine with "Arctic Inference is required
for suffix decoding", and the service stayed up, never ready. `das serve` checks here, on the gateway's node, before
any engine starts; an engine actor checks again on its own node before it loads anything (a node of a joined
cluster may lack what the gateway's has), and a load failure that is an ImportError names the same remedy
(service/cluster/load_failure.py). No vLLM import: the trial import is the package's own, as vLLM's check does it.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass


@dataclass(frozen=True)
class Package:
    """A package a speculation method loads: its import name, its distribution, the name vLLM's error gives it,
    and how this project installs it."""

    module: str
    distribution: str
    vllm_name: str
    install: str


# vLLM's `suffix` method: ArcticInference's suffix tree. Built from source against the installed torch by setup.sh.
ARCTIC_INFERENCE = Package(
    module="arctic_inference", distribution="arctic-inference", vllm_name="Arctic Inference",
    install="pip install --no-build-isolation --no-deps -r requirements/peers.txt (arctic-inference==0.3.0, "
            "built against the installed torch as setup.sh does)")

METHOD_PACKAGES: dict[str, Package] = {"suffix": ARCTIC_INFERENCE}


class MissingPackage(ImportError):
    """A package the configured speculation method needs cannot be imported on this node."""


def import_error(module: str) -> str | None:
    """Why `module` cannot be imported here (its error, one line), or None if it imports. A trial import, as
    vLLM's `has_arctic_inference` does: a package that is found but fails to import counts as missing."""
    try:
        if importlib.util.find_spec(module) is None:
            return f"no module named {module!r}"
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 -- any failure to import is the answer
        lines = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {lines[0] if lines else ''}"
    return None


def check_method_packages(speculation: str) -> None:
    """Raises MissingPackage naming the distribution to install when `speculation` needs a package that does not
    import here."""
    package = METHOD_PACKAGES.get(speculation)
    if package is None:
        return
    why = import_error(package.module)
    if why is not None:
        raise MissingPackage(f"--speculation {speculation} needs {package.distribution}, which cannot be imported "
                             f"here ({why}): install it with {package.install}, or serve another --speculation (das, "
                             f"ngram, none)")


def package_of(message: str, module: str | None = None) -> Package | None:
    """The known package an ImportError is about, by the module it names or by vLLM's wording of its message."""
    for package in METHOD_PACKAGES.values():
        if module is not None and (module == package.module or module.startswith(f"{package.module}.")):
            return package
        if package.vllm_name in message or package.module in message or package.distribution in message:
            return package
    return None
