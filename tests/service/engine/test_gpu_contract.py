"""The vLLM GPU build against what the service relies on (tests/service/engine/gpu_contract.py): every check
passes on the pinned release's GPU wheel, and every check fails on a copy of that source in which the behaviour it
checks was changed (so a check cannot pass vacuously). The wheel is fetched once (gpu_wheel.py); a failed fetch
fails these tests."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from tests.service.engine.gpu_contract import CHECKS, CONFIG, RUNNER, ContractBroken
from tests.service.engine.gpu_wheel import PINNED, Sources, WheelUnavailable, gpu_wheel


@pytest.fixture(scope="module")
def wheel_sources() -> Sources:
    try:
        wheel = gpu_wheel()
    except WheelUnavailable as exc:
        pytest.fail(str(exc))
    assert wheel.name.startswith(f"vllm-{PINNED}-")
    return Sources(wheel)


def test_the_wheel_is_the_pinned_gpu_build(wheel_sources: Sources) -> None:
    assert f"__version__ = version = '{PINNED}'" in wheel_sources.text("_version.py")
    assert "class CudaPlatformBase" in wheel_sources.text("platforms/cuda.py")


@pytest.mark.parametrize("name", list(CHECKS))
def test_the_gpu_build_does_what_we_rely_on(wheel_sources: Sources, name: str) -> None:
    CHECKS[name](wheel_sources)


def sub(pattern: str, replacement: str, count: int = 0) -> Callable[[str], str]:
    return lambda text: re.sub(pattern, replacement, text, count=count)


# One change of vLLM per check: what a release could plausibly do to what the check reads.
MUTATIONS: list[tuple[str, str, str, Callable[[str], str]]] = [
    ("custom_class proposer", "propose gets renamed keyword", RUNNER,
     sub(r"slot_mappings=slot_mappings", "slot_mapping=slot_mappings")),
    ("custom_class proposer", "propose gets another positional argument", RUNNER,
     sub(r"(self\.input_batch\.token_ids_cpu,\n)(\s+)(slot_mappings=slot_mappings,\n\s+\)\n\s+elif "
         r"spec_config\.use_ngram_gpu)", r"\1\2self.input_batch.num_prompt_tokens,\n\2\3")),
    ("custom_class proposer", "the proposer is built with the runner too", "v1/spec_decode/custom_class_proposer.py",
     sub(r"user_class\(vllm_config\)", "user_class(vllm_config, runner=None)")),
    ("runner choice", "model runner V2 supports custom_class", CONFIG,
     sub(r'\n\s+"custom_class",\n(\s+\):\n\s+unsupported\.append\(f"speculative method)', r"\n\1")),
    ("runner choice", "async scheduling on for custom_class", CONFIG,
     sub(r'and self\.speculative_config\.method != "dflash"\n', 'and self.speculative_config.method != "dflash"\n'
         '                and self.speculative_config.method != "custom_class"\n')),
    ("pause rules", "pausing rejects new requests (0.33)", "v1/engine/core.py",
     sub(r"(\n(\s+)self\.scheduler\.set_pause_state\(pause_state\)\n)",
         r"\1\2self.scheduler.reject_new_requests = mode != 'keep'\n")),
    ("pause rules", "keep mode no longer freezes running requests", "v1/engine/core.py",
     sub(r'PauseState\.PAUSED_ALL if mode == "keep"', 'PauseState.PAUSED_NEW if mode == "keep"')),
    ("RL routes", "a route renamed", "entrypoints/rl/online/api_router.py",
     sub(r'@router\.get\("/is_paused"\)', '@router.get("/paused")')),
    ("RL routes", "pause's default mode changed", "entrypoints/rl/online/api_router.py",
     sub(r'(mode: Annotated\[PauseMode, Query\(\)\] = )"abort"', r'\1"wait"')),
    ("worker calls", "reload_weights' argument renamed", RUNNER,
     sub(r"(def reload_weights\(\n(?:.*\n){2}\s+)weights_path", r"\1checkpoint_path")),
    ("patch targets and signatures", "rejection_sample takes new arguments (0.33's fly_*)",
     "v1/sample/rejection_sampler.py",
     sub(r"(\ndef rejection_sample\((?:.*\n)*?\s+synthetic_conditional_rates: torch\.Tensor \| None = None,\n)",
         r"\1    fly_mask: torch.Tensor | None = None,\n", count=1)),
    ("patch targets and signatures", "a patched method renamed", "v1/sample/ops/topk_topp_sampler.py",
     sub(r"def forward_cpu\(", "def forward_host(")),
]


@pytest.mark.parametrize(("name", "change", "path", "mutate"), MUTATIONS, ids=[m[1] for m in MUTATIONS])
def test_each_check_fails_when_vllm_changes_what_it_checks(wheel_sources: Sources, name: str, change: str,
                                                           path: str, mutate: Callable[[str], str]) -> None:
    changed = wheel_sources.mutated(path, mutate)
    with pytest.raises(ContractBroken) as failure:
        CHECKS[name](changed)
    print(f"{name} / {change}: {failure.value}")


def test_every_check_has_a_mutation_that_breaks_it() -> None:
    assert {m[0] for m in MUTATIONS} == set(CHECKS)


def test_a_failed_download_fails_with_what_to_do(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DAS_VLLM_GPU_CACHE", str(tmp_path))
    with pytest.raises(WheelUnavailable, match=r"(?s)could not fetch the vLLM 0\.0\.1 GPU wheel .*\(put the wheel in"):
        gpu_wheel("0.0.1")
