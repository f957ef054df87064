"""The vLLM GPU build against what the service relies on (tests/service/engine/vllm/gpu_contract.py) and what a port to
model runner V2 would rely on (gpu_contract_v2.py): every check passes on the pinned release's GPU wheel, and every
check fails on a copy of that source in which the behaviour it checks was changed (so a check cannot pass
vacuously). The wheel is fetched once (gpu_wheel.py); a failed fetch fails these tests."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from tests.service.engine.vllm import gpu_contract, gpu_contract_v2
from tests.service.engine.vllm.gpu_contract import CONFIG, RUNNER, ContractBroken
from tests.service.engine.vllm.gpu_contract_v2 import (ADAPTIVE, ESTIMATOR, GUMBEL, NGRAM, REJECTION_UTILS, SAMPLER,
                                                  SAMPLING_STATES, SPEC, SPECULATOR, V2_RUNNER)
from tests.service.engine.vllm.gpu_wheel import PINNED, Sources, WheelUnavailable, gpu_wheel

assert not gpu_contract.CHECKS.keys() & gpu_contract_v2.CHECKS.keys()
CHECKS = {**gpu_contract.CHECKS, **gpu_contract_v2.CHECKS}


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
    ("weight transfer", "register_engine renamed", "distributed/weight_transfer/factory.py",
     sub(r"def register_engine\(", "def add_engine(")),
    ("weight transfer", "workers ranked from 0 again", "distributed/weight_transfer/nccl_common.py",
     sub(r"rank = worker_rank \+ init_info\.rank_offset", "rank = worker_rank")),
    ("weight transfer", "the trainer's init info reordered", "distributed/weight_transfer/nccl_engine.py",
     sub(r"    master_address: str\n    master_port: int\n", "    master_port: int\n    master_address: str\n",
         count=1)),
    ("weight transfer", "the worker's update flag renamed", "v1/worker/gpu_worker.py",
     sub(r"_weight_update_active", "_update_in_progress")),
    ("patch targets and signatures", "rejection_sample takes new arguments (0.33's fly_*)",
     "v1/sample/rejection_sampler.py",
     sub(r"(\ndef rejection_sample\((?:.*\n)*?\s+synthetic_conditional_rates: torch\.Tensor \| None = None,\n)",
         r"\1    fly_mask: torch.Tensor | None = None,\n", count=1)),
    ("patch targets and signatures", "a patched method renamed", "v1/sample/ops/topk_topp_sampler.py",
     sub(r"def forward_cpu\(", "def forward_host(")),
    ("keyed CUDA wrappers", "forward_cuda takes another parameter", "v1/sample/ops/topk_topp_sampler.py",
     sub(r"(def forward_cuda\((?:.*\n)*?(\s+)p: torch\.Tensor \| None,\n)", r"\1\2seeds: torch.Tensor | None = None,\n",
         count=1)),
    ("keyed CUDA wrappers", "rejection_sample's default changed", "v1/sample/rejection_sampler.py",
     sub(r"(\ndef rejection_sample\((?:.*\n)*?\s+use_fp64_gumbel: bool = )False", r"\1True", count=1)),
    # model runner V2 (gpu_contract_v2.py)
    ("V2 speculator interface", "propose takes a per-request draft budget", SPECULATOR,
     sub(r"(\n(\s+)num_speculative_tokens: int \| None = None,\n)", r"\1\2draft_budget: torch.Tensor | None = None,\n",
         count=1)),
    ("V2 speculator interface", "the n-gram speculator reads the model runner", NGRAM,
     sub(r"req_states: RequestState,\n", "req_states: RequestState,\n        runner: Any = None,\n", count=1)),
    ("V2 speculator construction and call", "init_speculator builds custom_class", SPEC + "__init__.py",
     lambda text: text.replace(
         '    if speculative_config.method == "extract_hidden_states":',
         '    if speculative_config.method == "custom_class":\n'
         '        return create_custom_speculator(vllm_config, device, req_states)\n'
         '    elif speculative_config.method == "extract_hidden_states":', 1)),
    ("V2 speculator construction and call", "drafts handed to the host", V2_RUNNER,
     sub(r"self\.req_states\.draft_tokens\[input_batch\.idx_mapping\] = draft_tokens\n",
         "self.draft_tokens_cpu = draft_tokens.cpu()\n")),
    ("V2 async scheduling placeholders", "the scheduler gets each request's own draft count",
     "v1/core/sched/async_scheduler.py",
     sub(r"request\.spec_token_ids = self\._spec_token_placeholders",
         "request.spec_token_ids = [-1] * len(spec_decode_tokens.get(req_id, ()))")),
    ("V2 Gumbel hash", "the position mixed before the seed", GUMBEL,
     sub(r"(    h = _murmur3_mix\(h, \(seed & 0xFFFFFFFF\)\.to\(tl\.uint32\)\)\n)((?:.*\n){1})"
         r"(    h = _murmur3_mix\(h, \(pos & 0xFFFFFFFF\)\.to\(tl\.uint32\)\)\n)", r"\3\1\2")),
    ("V2 Gumbel hash", "the fp64 uniform's second domain changed", GUMBEL,
     sub(r"domain=0x9E3779B9", "domain=0x85EBCA6B")),
    ("V2 Gumbel hash", "the fp32 uniform truncated to 24 bits", GUMBEL,
     sub(r"(return \(\n\s+)hi16\.to\(tl\.float32\) \* 1\.52587890625e-05\n\s+\+ \(lo16\.to\(tl\.float32\) \+ 0\.5\)"
         r" \* 2\.3283064365386963e-10\n",
         r"\1(random32 >> 8).to(tl.float32) * 5.960464477539063e-08\n")),
    ("V2 Gumbel draw", "fp64 noise by log1p", GUMBEL,
     sub(r"gumbel_noise = -tl\.log\(-tl\.log\(u\)\)", "gumbel_noise = -tl.log(-_log1p_neg_stable(1.0 - u))")),
    ("V2 Gumbel draw", "one seed per token row", GUMBEL,
     sub(r"seed = tl\.load\(seeds_ptr \+ req_state_idx, ", "seed = tl.load(seeds_ptr + token_idx, ")),
    ("V2 sampler seeding", "seeded requests may take FlashInfer", SAMPLER,
     sub(r"\n\s+or self\.sampling_states\.any_explicit_seed\(idx_mapping_np\)", "")),
    ("V2 sampler seeding", "the draw keyed by output length", SAMPLER,
     sub(r"pos = input_batch\.positions\[input_batch\.logits_indices\]",
         "pos = input_batch.positions[input_batch.logits_indices] - input_batch.seq_lens[0]")),
    ("V2 sampler seeding", "seeds drawn per step", SAMPLING_STATES,
     sub(r"seed = sampling_params\.seed\n", "seed = None\n")),
    ("V2 rejection rule", "verification becomes a Gumbel coupling", REJECTION_UTILS,
     sub(r"accepted = target_logprob > tl\.log\(u\) \+ draft_logprob",
         "accepted = target_logprob >= draft_logprob")),
    ("V2 rejection rule", "corrections drawn with the drafter's salted noise", REJECTION_UTILS,
     sub(r"(def _seeded_resample_argmax\((?:.*\n)*?\s+IS_DRAFTING=)False", r"\1True", count=1)),
    ("V2 adaptive verification", "the budget maximises tokens minus cost", ADAPTIVE,
     sub(r"num_tokens_to_estimated_accepted_tokens / costs", "num_tokens_to_estimated_accepted_tokens - costs")),
    ("V2 adaptive verification", "switched on by the speculative config, not the speculator", V2_RUNNER,
     sub(r'enable_adaptive_verification=getattr\(\n\s+self\.speculator, "enable_adaptive_verification", False\n\s+\),',
         "enable_adaptive_verification=self.speculative_config.enable_adaptive_verification,")),
    ("V2 acceptance estimator", "predict takes the draft tokens", ESTIMATOR,
     sub(r"(def predict\(\n(?:.*\n)*?\s+temperature: torch\.Tensor,\n)", r"\1        draft_tokens: torch.Tensor,\n",
         count=1)),
    ("V2 acceptance estimator", "the bonus token counted as accepted", ESTIMATOR,
     sub(r"num_accepted = tl\.maximum\(num_sampled - 1, 0\)", "num_accepted = num_sampled")),
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


# MurmurHash3_x86_32's published test vectors (data, hash seed, hash): the reference the "V2 Gumbel hash" check runs
# the wheel's murmur3_hash32 against is the standard function, so V2's noise word is MurmurHash3_x86_32 of the 16
# bytes (request seed, position, token id).
MURMUR3_VECTORS = [(b"", 0, 0), (b"", 1, 0x514E28B7), (b"", 0xFFFFFFFF, 0x81F16F39), (b"\0\0\0\0", 0, 0x2362F9DE),
                   (b"aaaa", 0x9747B28C, 0x5A97808A), (b"Hello, world!", 0x9747B28C, 0x24884CBA),
                   (b"The quick brown fox jumps over the lazy dog", 0x9747B28C, 0x2FA826CD),
                   (b"test", 0, 0xBA6BD213), (b"Hello, world!", 1234, 0xFAF6CDB3)]


@pytest.mark.parametrize(("data", "seed", "expected"), MURMUR3_VECTORS)
def test_the_v2_hash_reference_is_murmurhash3(data: bytes, seed: int, expected: int) -> None:
    assert gpu_contract_v2.murmur3_x86_32(data, seed) == expected


def test_a_failed_download_fails_with_what_to_do(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DAS_VLLM_GPU_CACHE", str(tmp_path))
    with pytest.raises(WheelUnavailable, match=r"(?s)could not fetch the vLLM 0\.0\.1 GPU wheel .*\(put the wheel in"):
        gpu_wheel("0.0.1")
