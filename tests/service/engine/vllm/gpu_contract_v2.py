"""What a port of DAS to vLLM's model runner V2 (vllm/v1/worker/gpu/) would rely on, checked against the source of
the pinned GPU wheel (gpu_wheel.Sources), the way gpu_contract.py checks what the V1 path relies on today. Nothing
here runs on V2 yet (`custom_class` is on V2's unsupported list: gpu_contract.check_runner_choice); these checks
make a change to the interfaces the plan in docs/design.md ("Model runner V2: how DAS would land there") is built
on fail CI, naming the file and what changed, instead of surfacing when the port is attempted.

- the speculator interface: `BaseSpeculator`'s abstract methods and `propose` parameters, and the GPU n-gram
  speculator (the closest analogue of our host-side drafter) as the template a DAS speculator would follow;
- how the runner builds and drives a speculator: `init_speculator` dispatches on the method name (no
  `custom_class`), `sample_tokens` proposes right after sampling, on the device, and the drafts stay there;
- async scheduling: the scheduler holds only `-1` placeholders for draft tokens, the same count for every request;
- the seeded Gumbel draw: the hash (MurmurHash3_x86_32 of seed, position and token id, executed here against a
  reference), the uniform and noise transforms, the argmax, and the sampler's seeding inputs;
- verification: a probability-ratio test with its own uniform (not a Gumbel coupling), resampling with the Gumbel
  draw;
- adaptive verification and the online acceptance estimator: the per-request draft budget V2 chooses on the device.
"""

from __future__ import annotations

import ast
import copy
from collections.abc import Callable
from typing import Any

from tests.service.engine.vllm.gpu_contract import ContractBroken, calls_in, expect, find_class, find_def, parameters, walk
from tests.service.engine.vllm.gpu_wheel import Sources

V2_RUNNER = "v1/worker/gpu/model_runner.py"
SPEC = "v1/worker/gpu/spec_decode/"
SPECULATOR = SPEC + "speculator.py"
NGRAM = SPEC + "ngram/speculator.py"
GUMBEL = "v1/worker/gpu/sample/gumbel.py"
SAMPLER = "v1/worker/gpu/sample/sampler.py"
SAMPLING_STATES = "v1/worker/gpu/sample/states.py"
REJECTION = SPEC + "rejection_sampler.py"
REJECTION_UTILS = SPEC + "rejection_sampler_utils.py"
ADAPTIVE = SPEC + "adaptive_verification.py"
ESTIMATOR = SPEC + "acceptance_estimator.py"
CONFIG = "config/vllm.py"

Params = list[tuple[str, str, str | None]]


def _pos(*names: str) -> Params:
    return [("pos", n, None) for n in names]


# BaseSpeculator.propose in vLLM 0.32.0: what a DAS speculator would implement (speculator.py types the tensors:
# num_sampled / num_rejected [num_reqs], last_sampled [max_num_reqs], temperature / seeds [max_num_reqs]).
PROPOSE: Params = _pos("self", "input_batch", "attn_metadata", "slot_mappings", "last_hidden_states",
                       "aux_hidden_states", "num_sampled", "num_rejected", "last_sampled", "next_prefill_tokens",
                       "temperature", "seeds") + [
    ("pos", "dp_sync_state", "None"), ("pos", "dummy_run", "False"), ("pos", "skip_attn_for_dummy_run", "False"),
    ("pos", "mm_inputs", "None"), ("pos", "is_profile", "False"), ("pos", "num_speculative_tokens", "None")]
ABSTRACT = {"init_cudagraph_manager": _pos("self", "cudagraph_mode"), "capture": _pos("self"), "propose": PROPOSE}

# sample_tokens' propose call: positional arguments, in the order of PROPOSE[1:12]
PROPOSE_ARGS = ["input_batch", "attn_metadata", "slot_mappings_by_layer", "spec_hidden_states", "aux_hidden_states",
                "num_sampled", "num_rejected", "self.req_states.last_sampled_tokens",
                "self.req_states.next_prefill_tokens", "self.sampler.sampling_states.temperature.gpu",
                "self.sampler.sampling_states.seeds.gpu"]

GUMBEL_SAMPLE: Params = _pos("logits", "expanded_idx_mapping", "temperature", "seed", "pos", "apply_temperature",
                             "is_drafting") + [
    ("pos", "logits_cache", "None"), ("pos", "logits_cache_col", "None"), ("pos", "use_fp64", "False"),
    ("pos", "logits_cache_source", "None")]

REJECTION_SAMPLE: Params = _pos("target_logits", "draft_logits", "draft_sampled", "cu_num_logits", "pos",
                                "idx_mapping", "expanded_idx_mapping", "expanded_local_pos", "temperature", "seed",
                                "num_speculative_steps") + [
    ("pos", "synthetic_conditional_rates", "None"), ("pos", "use_fp64", "False"),
    ("pos", "use_block_verification", "False"), ("pos", "contexts", "None"), ("pos", "watermarking", "None"),
    ("pos", "watermarking_skip_mask", "None"), ("pos", "watermark_key", "None")]

ADAPTIVE_METHODS: dict[str, Params] = {
    "__init__": _pos("self", "req_states", "query_start_loc", "num_bonus_tokens", "max_total_logits"),
    "add_request": _pos("self", "req_idx"),
    "set_cost_curves": _pos("self", "draft_curve", "verify_curve"),
    "record_confidences": _pos("self", "confidence_probs", "input_batch"),
    "get_num_tokens": _pos("self", "num_tokens_per_req", "draft_tokens"),
    "reallocate_drafts": _pos("self", "req_ids", "idx_mapping"),
}
ESTIMATOR_METHODS: dict[str, Params] = {
    "__init__": _pos("self", "max_num_reqs", "num_speculative_steps", "device"),
    "step": _pos("self", "idx_mapping", "num_sampled", "num_rejected"),
    "predict": _pos("self", "logits", "idx_mapping", "draft_step", "confidence_probs", "temperature"),
}


# ---- reading the source ----

def _fn(src: Sources, path: str, qualname: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    found = find_def(src.tree(path), qualname)
    expect(found is not None, f"vllm/{path}: {qualname} is gone")
    assert found is not None
    return found


def _statements(node: ast.AST) -> set[str]:
    """Every statement in node, unparsed (hex constants come back decimal, comments and layout are gone)."""
    return {ast.unparse(s) for s in walk(node, ast.stmt)}


def _has(node: ast.AST, path: str, where: str, statement: str, meaning: str) -> None:
    expect(statement in _statements(node), f"vllm/{path}: {where} no longer does `{statement}` ({meaning})")


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef, path: str, what: str, expected: Params) -> None:
    found = parameters(fn)
    expect(found == expected, f"vllm/{path}: {what}'s parameters changed: {found}, expected {expected}")


# ---- V2's hash, as a port of our keyed draw would compute it ----

MASK32 = 0xFFFFFFFF
DOMAIN_HI = 0x9E3779B9  # murmur3_uniform64's second hash


def murmur3_x86_32(data: bytes, seed: int = 0) -> int:
    """MurmurHash3_x86_32 (Appleby's reference) of `data` under hash seed `seed`."""
    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (32 - r))) & MASK32

    h = seed & MASK32
    blocks = len(data) // 4
    for i in range(blocks):
        k = int.from_bytes(data[4 * i:4 * i + 4], "little")
        k = rotl(k * 0xCC9E2D51 & MASK32, 15) * 0x1B873593 & MASK32
        h = (rotl(h ^ k, 13) * 5 + 0xE6546B64) & MASK32
    tail = data[4 * blocks:]
    if tail:
        k = int.from_bytes(tail, "little")
        h ^= rotl(k * 0xCC9E2D51 & MASK32, 15) * 0x1B873593 & MASK32
    h ^= len(data)
    h ^= h >> 16
    h = h * 0x85EBCA6B & MASK32
    h ^= h >> 13
    h = h * 0xC2B2AE35 & MASK32
    return h ^ (h >> 16)


def v2_hash32(seed: int, pos: int, token: int, domain: int = 0) -> int:
    """V2's noise word for (request seed, position, token id): MurmurHash3_x86_32 of the 16 bytes seed (int64,
    little-endian), pos's low 32 bits, token (uint32), under hash seed `domain`."""
    message = (seed & (2**64 - 1)).to_bytes(8, "little") + (pos & MASK32).to_bytes(4, "little") \
        + (token & MASK32).to_bytes(4, "little")
    return murmur3_x86_32(message, domain)


def v2_uniform64(seed: int, pos: int, token: int) -> float:
    """V2's fp64 uniform (use_fp64_gumbel): the top 53 bits of hash(domain 0x9E3779B9) : hash(domain 0), centred."""
    random53 = ((v2_hash32(seed, pos, token, DOMAIN_HI) << 32) | v2_hash32(seed, pos, token)) >> 11
    uniform = (random53 + 0.5) * 2.0 ** -53
    return uniform - 2.0 ** -53 if uniform == 1.0 else uniform


class _Int:
    """A Triton integer scalar: wraps at its width, shifts right arithmetically when signed."""

    def __init__(self, value: int, bits: int, signed: bool) -> None:
        value &= (1 << bits) - 1
        self.value = value - (1 << bits) if signed and value >> (bits - 1) else value
        self.bits, self.signed = bits, signed

    def _other(self, other: Any) -> _Int:
        if isinstance(other, _Int):
            return other
        return _Int(int(other), self.bits, self.signed)

    def _kind(self, other: _Int) -> tuple[int, bool]:
        if other.bits == self.bits:
            return self.bits, self.signed and other.signed
        return (self.bits, self.signed) if self.bits > other.bits else (other.bits, other.signed)

    def _op(self, other: Any, fn: Callable[[int, int], int]) -> _Int:
        o = self._other(other)
        return _Int(fn(self.value, o.value), *self._kind(o))

    def __xor__(self, o: Any) -> _Int:
        return self._op(o, lambda a, b: a ^ b)

    def __and__(self, o: Any) -> _Int:
        return self._op(o, lambda a, b: a & b)

    def __or__(self, o: Any) -> _Int:
        return self._op(o, lambda a, b: a | b)

    def __mul__(self, o: Any) -> _Int:
        return self._op(o, lambda a, b: a * b)

    def __add__(self, o: Any) -> _Int:
        return self._op(o, lambda a, b: a + b)

    def __lshift__(self, n: Any) -> _Int:
        return _Int(self.value << int(n), self.bits, self.signed)

    def __rshift__(self, n: Any) -> _Int:
        return _Int(self.value >> int(n), self.bits, self.signed)  # non-negative when unsigned: logical

    def to(self, dtype: tuple[str, int, bool]) -> Any:
        kind, bits, signed = dtype
        return _Int(self.value, bits, signed) if kind == "int" else float(self.value)


class _TL:
    """The part of `triton.language` V2's hash functions use, for executing them in Python."""

    int32, int64, uint32, uint64 = ("int", 32, True), ("int", 64, True), ("int", 32, False), ("int", 64, False)
    float64 = ("float", 64, True)

    @staticmethod
    def constexpr(value: Any = None) -> Any:
        return value

    @staticmethod
    def where(condition: bool, a: Any, b: Any) -> Any:
        return a if condition else b


HASH_FUNCTIONS = ("_murmur3_rotl32", "_murmur3_mix", "_murmur3_fmix32", "murmur3_hash32", "_uniform64_from_random53",
                  "murmur3_uniform64")


def wheel_hash_functions(src: Sources) -> dict[str, Callable[..., Any]]:
    """The wheel's integer hash functions from sample/gumbel.py, executed in Python on wrapping integers."""
    tree = src.tree(GUMBEL)
    found = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in HASH_FUNCTIONS}
    missing = set(HASH_FUNCTIONS) - found.keys()
    expect(not missing, f"vllm/{GUMBEL}: the hash functions {sorted(missing)} are gone")
    module = ast.Module(body=[copy.deepcopy(found[name]) for name in HASH_FUNCTIONS], type_ignores=[])
    for fn in module.body:
        fn.decorator_list = []  # triton.jit
    namespace: dict[str, Any] = {"tl": _TL}
    exec(compile(module, f"vllm/{GUMBEL}", "exec"), namespace)  # noqa: S102
    return {name: namespace[name] for name in HASH_FUNCTIONS}


# (seed, position, token id): signs and both halves of the seed, positions past 2**32, a large vocabulary's ids
HASH_VECTORS = [(seed, pos, token) for seed in (0, 1, -1, 2**63 - 1, -2**63, 0x0123456789ABCDEF, -0x5DEECE66D)
                for pos in (0, 1, 4095, 2**31 + 5, 2**40 + 3) for token in (0, 1, 151_935, 2**31 + 1)]


# ---- the checks ----

def check_v2_speculator_interface(src: Sources) -> None:
    tree = src.tree(SPECULATOR)
    base = find_class(tree, "BaseSpeculator")
    expect(base is not None and [ast.unparse(b) for b in base.bases] == ["ABC"],
           f"vllm/{SPECULATOR}: BaseSpeculator (an ABC) is gone or no longer abstract")
    assert base is not None
    abstract = {f.name: parameters(f) for f in base.body if isinstance(f, ast.FunctionDef)
                and any(ast.unparse(d) == "abstractmethod" for d in f.decorator_list)}
    expect(abstract == ABSTRACT, f"vllm/{SPECULATOR}: BaseSpeculator's abstract methods changed (what a DAS "
                                 f"speculator implements): {abstract}, expected {ABSTRACT}")
    fields = {ast.unparse(n.target): ast.unparse(n.value) for n in base.body
              if isinstance(n, ast.AnnAssign) and n.value is not None}
    expect(fields == {"num_query_per_req": "1", "num_extra_query_per_req": "0"},
           f"vllm/{SPECULATOR}: BaseSpeculator's query slots per request changed: {fields}")
    ngram = src.tree(NGRAM)
    cls = find_class(ngram, "NgramGPUSpeculator")
    expect(cls is not None and [ast.unparse(b) for b in cls.bases] == ["BaseSpeculator"],
           f"vllm/{NGRAM}: NgramGPUSpeculator (the host-drafter template) no longer derives from BaseSpeculator")
    assert cls is not None
    init = find_def(ngram, "NgramGPUSpeculator.__init__")
    expect(init is not None and parameters(init) == _pos("self", "vllm_config", "device", "req_states"),
           f"vllm/{NGRAM}: NgramGPUSpeculator(vllm_config, device, req_states) changed")
    propose = find_def(ngram, "NgramGPUSpeculator.propose")
    expect(propose is not None and parameters(propose) == PROPOSE,
           f"vllm/{NGRAM}: NgramGPUSpeculator.propose no longer takes BaseSpeculator.propose's parameters")
    assert propose is not None
    attrs = {ast.unparse(t): ast.unparse(n.value) for n in cls.body if isinstance(n, ast.Assign) for t in n.targets}
    expect(attrs.get("draft_logits") == "None" and attrs.get("supports_mm_inputs") == "False",
           f"vllm/{NGRAM}: a drafter without a model no longer declares draft_logits = None (one-hot drafts: the "
           f"runner hands speculator.draft_logits to the rejection sampler) and supports_mm_inputs = False: {attrs}")
    body = _statements(propose)
    expect("token_ids = req_states.all_token_ids.gpu" in body and "return self.drafts[:num_reqs]" in body,
           f"vllm/{NGRAM}: the n-gram speculator no longer reads the token table req_states.all_token_ids or "
           "returns its [num_reqs, K] drafts")


def check_v2_speculator_construction(src: Sources) -> None:
    init_path = SPEC + "__init__.py"
    build = _fn(src, init_path, "init_speculator")
    _params(build, init_path, "init_speculator", _pos("vllm_config", "device", "req_states"))
    text = ast.unparse(build)
    expect("custom_class" not in text and "raise NotImplementedError" in text,
           f"vllm/{init_path}: init_speculator now handles custom_class (or no longer refuses unknown methods): "
           "re-read the V2 plan, DAS may plug in without a patch")
    expect("return NgramGPUSpeculator(vllm_config, device, req_states)" in _statements(build),
           f"vllm/{init_path}: the n-gram speculator is no longer built with the request states")
    runner = src.tree(V2_RUNNER)
    expect(any(isinstance(n, ast.ImportFrom) and n.module == "vllm.v1.worker.gpu.spec_decode"
               and [a.name for a in n.names] == ["init_speculator"] for n in runner.body),
           f"vllm/{V2_RUNNER}: the runner no longer imports init_speculator by name (the name a port replaces)")
    init = _fn(src, V2_RUNNER, "GPUModelRunner.__init__")
    _has(init, V2_RUNNER, "GPUModelRunner.__init__",
         "self.speculator = init_speculator(self.vllm_config, self.device, self.req_states)",
         "how the runner builds its speculator")
    sample = _fn(src, V2_RUNNER, "GPUModelRunner.sample_tokens")
    calls = [c for c in calls_in(sample.body, "propose") if ast.unparse(c.func) == "self.speculator.propose"]
    expect(len(calls) == 1, f"vllm/{V2_RUNNER}: expected one speculator.propose call in sample_tokens, found "
                            f"{len(calls)}")
    args = [ast.unparse(a) for a in calls[0].args]
    keywords = {k.arg: ast.unparse(k.value) for k in calls[0].keywords}
    expect(args == PROPOSE_ARGS and keywords == {"num_speculative_tokens": "num_spec_tokens",
                                                 "dp_sync_state": "dp_sync_state", "mm_inputs": "mm_inputs"},
           f"vllm/{V2_RUNNER}: sample_tokens' propose({args}, {keywords}) changed")
    text = ast.unparse(sample)
    order = [text.find(s) for s in ("async_output = AsyncOutput(", "self.postprocess_sampled(",
                                    "self.speculator.observe_verification(", "self.speculator.propose(",
                                    "self.req_states.draft_tokens[input_batch.idx_mapping] = draft_tokens")]
    expect(all(i >= 0 for i in order) and order == sorted(order),
           f"vllm/{V2_RUNNER}: sample_tokens no longer starts the output copy, commits the sampled tokens on the "
           "device, grades the last drafts, then proposes and stores the drafts in req_states.draft_tokens on the "
           "device, in that order")
    sample_fn = _fn(src, V2_RUNNER, "GPUModelRunner.sample")
    verify = [c for c in calls_in(sample_fn.body, "rejection_sampler") if ast.unparse(c.func) ==
              "self.rejection_sampler"]
    expect(len(verify) == 1 and "self.speculator.draft_logits" in [ast.unparse(a) for a in verify[0].args],
           f"vllm/{V2_RUNNER}: the rejection sampler no longer gets speculator.draft_logits")


def check_v2_async_placeholders(src: Sources) -> None:
    path = "v1/core/sched/async_scheduler.py"
    update = _fn(src, path, "AsyncScheduler._update_after_schedule")
    _has(update, path, "AsyncScheduler._update_after_schedule",
         "self._spec_token_placeholders = [-1] * scheduler_output.num_spec_tokens_to_schedule",
         "every request's drafts are the same number of -1 placeholders")
    _has(update, path, "AsyncScheduler._update_after_schedule",
         "request.spec_token_ids = self._spec_token_placeholders",
         "the scheduler never sees draft token values")
    utils = SPEC + "utils.py"
    handler = _fn(src, utils, "DraftTokensHandler.get_draft_tokens")
    _has(handler, utils, "DraftTokensHandler.get_draft_tokens",
         "draft_token_ids = [[-1] * self.num_draft_tokens for _ in self.req_ids]",
         "without structured outputs the drafts reach the scheduler as placeholders only")
    prepare = _fn(src, V2_RUNNER, "GPUModelRunner.prepare_inputs")
    combine = calls_in(prepare.body, "combine_sampled_and_draft_tokens")
    expect(len(combine) == 1 and "self.req_states.draft_tokens" in [ast.unparse(a) for a in combine[0].args],
           f"vllm/{V2_RUNNER}: the next step no longer reads its draft tokens from req_states.draft_tokens on the "
           "device")
    config = src.tree(CONFIG)
    setters = [f for f in walk(config, ast.FunctionDef)
               if "self.scheduler_config.async_scheduling = True" in ast.unparse(f)]
    expect(len(setters) == 1, f"vllm/{CONFIG}: the function that turns async scheduling on is not where it was")
    body = ast.unparse(setters[0])
    expect("self.speculative_config.method not in get_args(NgramGPUTypes)" in body,
           f"vllm/{CONFIG}: async scheduling is no longer on for the GPU n-gram speculator (the V2 template)")


def check_v2_gumbel_hash(src: Sources) -> None:
    fns = wheel_hash_functions(src)
    _params(_fn(src, GUMBEL, "murmur3_hash32"), GUMBEL, "murmur3_hash32",
            _pos("seed", "pos", "offset") + [("pos", "domain", "0")])
    for seed, pos, token in HASH_VECTORS:
        theirs = fns["murmur3_hash32"](_Int(seed, 64, True), _Int(pos, 64, True), _Int(token, 64, True)).value
        ours = v2_hash32(seed, pos, token)
        expect(theirs == ours, f"vllm/{GUMBEL}: murmur3_hash32({seed}, {pos}, {token}) = {theirs:#x}, not "
                               f"MurmurHash3_x86_32(seed int64 LE | pos low 32 bits | token) = {ours:#x}: the "
                               "hash of V2's seeded draw changed")
        u = fns["murmur3_uniform64"](_Int(seed, 64, True), _Int(pos, 64, True), _Int(token, 64, True))
        expect(u == v2_uniform64(seed, pos, token),
               f"vllm/{GUMBEL}: murmur3_uniform64({seed}, {pos}, {token}) = {u!r}, not the centred top 53 bits of "
               f"hash(domain {DOMAIN_HI:#x}) : hash(domain 0) = {v2_uniform64(seed, pos, token)!r}")
    uniform32 = _fn(src, GUMBEL, "murmur3_uniform32")
    _has(uniform32, GUMBEL, "murmur3_uniform32", "random32 = murmur3_hash32(seed, pos, offset)",
         "the fp32 uniform is one hash word")
    text = ast.unparse(uniform32)
    expect("hi16.to(tl.float32) * 1.52587890625e-05 + (lo16.to(tl.float32) + 0.5) * 2.3283064365386963e-10" in text,
           f"vllm/{GUMBEL}: the fp32 uniform is no longer (random32 + 0.5) * 2**-32 rounded to fp32")


def check_v2_gumbel_draw(src: Sources) -> None:
    noised = _fn(src, GUMBEL, "gumbel_noised_argmax")
    where = "gumbel_noised_argmax"
    for statement, meaning in (
            ("u = murmur3_uniform64(seed, pos, keys)", "fp64 noise keyed by (seed, pos, token id)"),
            ("gumbel_noise = -tl.log(-tl.log(u))", "fp64 Gumbel noise -log(-log(u)), as our keyed draw's"),
            ("u = murmur3_uniform32(seed, pos, keys)", "fp32 noise keyed by (seed, pos, token id)"),
            ("gumbel_noise = -tl.log(-_log1p_neg_stable(u))", "fp32 Gumbel noise -log(-log(1 - u))"),
            ("pos = pos + _DRAFT_NOISE_SALT", "a drafter's noise is salted away from the target's"),
            ("logits = tl.where(mask, logits + gumbel_noise, float('-inf'))", "noise added to the logits"),
            ("return tl.max(logits, axis=0, return_indices=True)", "the block's argmax")):
        _has(noised, GUMBEL, where, statement, meaning)
    salt = [ast.unparse(n) for n in src.tree(GUMBEL).body if isinstance(n, ast.Assign)
            and ast.unparse(n.targets[0]) == "_DRAFT_NOISE_SALT"]
    expect(salt == ["_DRAFT_NOISE_SALT = tl.constexpr(1 << 30)"], f"vllm/{GUMBEL}: the draft noise salt changed")
    block = _fn(src, GUMBEL, "gumbel_block_argmax")
    statements = _statements(block)
    expect(any(s.startswith("seed = tl.load(seeds_ptr + req_state_idx") for s in statements)
           and "pos = tl.load(pos_ptr + token_idx)" in statements,
           f"vllm/{GUMBEL}: gumbel_block_argmax no longer reads one seed per request and one position per row")
    calls = calls_in(block.body, "gumbel_noised_argmax")
    expect(len(calls) == 1 and [ast.unparse(a) for a in calls[0].args[:6]] ==
           ["logits", "block", "mask", "seed", "pos", "temp"],
           f"vllm/{GUMBEL}: the noise is no longer indexed by the vocabulary entry (`block`) with the row's seed "
           "and position")
    kernel = _fn(src, GUMBEL, "_gumbel_sample_kernel")
    _has(kernel, GUMBEL, "_gumbel_sample_kernel", "block = block_idx * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)",
         "the noise's token index is the absolute vocabulary index")
    sample = _fn(src, GUMBEL, "gumbel_sample")
    _params(sample, GUMBEL, "gumbel_sample", GUMBEL_SAMPLE)
    _has(sample, GUMBEL, "gumbel_sample", "max_block_idx = local_max.argmax(dim=-1, keepdim=True)",
         "the first block holding the row's maximum wins")
    stable = _fn(src, GUMBEL, "_log1p_neg_stable")
    _has(stable, GUMBEL, "_log1p_neg_stable", "return tl.where(value < 0.25, series, direct)",
         "log(1 - u) by a degree-8 series below 0.25, tl.log above")


def check_v2_sampler_seeding(src: Sources) -> None:
    call = _fn(src, SAMPLER, "Sampler.__call__")
    _has(call, SAMPLER, "Sampler.__call__", "pos = input_batch.positions[input_batch.logits_indices]",
         "the draw's position is the row's absolute position (prompt included)")
    sample = _fn(src, SAMPLER, "Sampler.sample")
    text = ast.unparse(sample)
    expect("or self.sampling_states.any_explicit_seed(idx_mapping_np)" in text,
           f"vllm/{SAMPLER}: a request with an explicit seed may now take the fused (FlashInfer) sampler, which "
           "ignores the seed")
    random = _fn(src, SAMPLER, "Sampler._sample_random")
    _has(random, SAMPLER, "Sampler._sample_random",
         "processed_logits = apply_top_k_top_p(processed_logits, top_k, top_p)", "top-k / top-p mask before the draw")
    draws = calls_in(random.body, "gumbel_sample")
    expect(len(draws) == 1, f"vllm/{SAMPLER}: Sampler._sample_random no longer draws with gumbel_sample")
    args = [ast.unparse(a) for a in draws[0].args]
    keywords = {k.arg: ast.unparse(k.value) for k in draws[0].keywords}
    expect(args == ["processed_logits", "expanded_idx_mapping", "self.sampling_states.temperature.gpu",
                    "self.sampling_states.seeds.gpu", "pos"]
           and keywords == {"apply_temperature": "False", "is_drafting": "False", "use_fp64": "self.use_fp64_gumbel"},
           f"vllm/{SAMPLER}: the plain draw's inputs changed: gumbel_sample({args}, {keywords})")
    add = _fn(src, SAMPLING_STATES, "SamplingStates.add_request")
    for statement in ("seed = sampling_params.seed", "self.seeds.np[req_idx] = seed"):
        _has(add, SAMPLING_STATES, "SamplingStates.add_request", statement,
             "a request's seed is SamplingParams.seed (random when unset), fixed for the request")
    init = _fn(src, SAMPLING_STATES, "SamplingStates.__init__")
    _has(init, SAMPLING_STATES, "SamplingStates.__init__",
         "self.seeds = UvaBackedTensor(max_num_reqs, dtype=torch.int64)",
         "one int64 seed per request slot")


def check_v2_rejection_rule(src: Sources) -> None:
    call = find_def(src.tree(REJECTION), "RejectionSampler.__call__")
    expect(call is not None and parameters(call) == _pos("self", "logits", "input_batch") + [
        ("pos", "draft_logits", "None"), ("pos", "invalid_drafts", "None")],
        f"vllm/{REJECTION}: RejectionSampler.__call__(logits, input_batch, draft_logits, invalid_drafts) changed")
    gather = _fn(src, REJECTION, "_gather_draft_sampled_kernel")
    _has(gather, REJECTION, "_gather_draft_sampled_kernel", "pos = tl.load(positions_ptr + token_idx, mask=mask)",
         "a verification row's position is its absolute position, as the plain draw's")
    verify = _fn(src, REJECTION, "RejectionSampler._verify")
    calls = calls_in(verify.body, "rejection_sample")
    expect(len(calls) == 1 and [ast.unparse(a) for a in calls[0].args][4:10] ==
           ["pos", "idx_mapping", "expanded_idx_mapping", "expanded_local_pos",
            "self.sampler.sampling_states.temperature.gpu", "self.sampler.sampling_states.seeds.gpu"],
           f"vllm/{REJECTION}: verification no longer draws with the sampler's seeds at the rows' positions")
    _params(_fn(src, REJECTION_UTILS, "rejection_sample"), REJECTION_UTILS, "rejection_sample", REJECTION_SAMPLE)
    kernel = _fn(src, REJECTION_UTILS, "_rejection_kernel")
    for statement, meaning in (
            ("u = tl_rand32(seed, pos, includes_zero=False)",
             "the acceptance uniform is Philox's, keyed by (seed, pos)"),
            ("accepted = target_logprob > tl.log(u) + draft_logprob",
             "a draft is accepted by the probability-ratio test, not by equality with the Gumbel draw"),
            ("verifying &= is_valid_draft", "a -1 placeholder draft ends verification")):
        _has(kernel, REJECTION_UTILS, "_rejection_kernel", statement, meaning)
    onehot = _fn(src, REJECTION_UTILS, "_compute_global_logprobs_and_logsumexp")
    _has(onehot, REJECTION_UTILS, "_compute_global_logprobs_and_logsumexp", "draft_log_prob = 0.0",
         "a draft without draft logits is one-hot (q = 1)")
    resample = _fn(src, REJECTION_UTILS, "_resample_kernel")
    text = ast.unparse(resample)
    expect("residual_logits = tl.where(block != rejected_draft_token, target_logits, float('-inf')).to(tl.float32)"
           in text, f"vllm/{REJECTION_UTILS}: the correction after a rejected one-hot draft is no longer drawn from "
                    "the target row without that token")
    seeded = _fn(src, REJECTION_UTILS, "_seeded_resample_argmax")
    draws = calls_in(seeded.body, "gumbel_block_argmax")
    keywords = {k.arg: ast.unparse(k.value) for k in draws[0].keywords} if len(draws) == 1 else {}
    expect(keywords.get("IS_DRAFTING") == "False" and keywords.get("APPLY_TEMPERATURE") == "False",
           f"vllm/{REJECTION_UTILS}: corrections and bonus tokens are no longer the plain sampler's Gumbel draw "
           f"(unsalted, on processed logits): {keywords}")


def check_v2_adaptive_verification(src: Sources) -> None:
    tree = src.tree(ADAPTIVE)
    for name, expected in ADAPTIVE_METHODS.items():
        fn = find_def(tree, f"AdaptiveVerificationManager.{name}")
        expect(fn is not None and parameters(fn) == expected,
               f"vllm/{ADAPTIVE}: AdaptiveVerificationManager.{name}{[p[1] for p in expected]} changed or is gone")
    budget = _fn(src, ADAPTIVE, "AdaptiveVerificationManager.get_num_tokens")
    for statement, meaning in (
            ("survival_probability = np.cumprod(stale_confidences.astype(np.float64), axis=1)",
             "a slot's value is the running product of its request's per-position confidences, read one step "
             "stale on the host"),
            ("draft_budget = int(np.argmax(num_tokens_to_estimated_accepted_tokens / costs))",
             "the batch's draft budget maximises expected tokens per unit of profiled step cost")):
        _has(budget, ADAPTIVE, "get_num_tokens", statement, meaning)
    assign = _fn(src, ADAPTIVE, "_assign_draft_token_budget")
    for statement in ("survival = confidence_probs[idx_mapping].cumprod(dim=1)",
                      "winners = flat.topk(draft_budget).indices"):
        _has(assign, ADAPTIVE, "_assign_draft_token_budget", statement,
             "the budget goes to the globally most likely slots, on the device")
    runner = src.tree(V2_RUNNER)
    kv = _fn(src, V2_RUNNER, "GPUModelRunner.initialize_kv_cache")
    made = calls_in(kv.body, "maybe_create_adaptive_verification_manager")
    flag = {k.arg: ast.unparse(k.value) for k in made[0].keywords}.get("enable_adaptive_verification") if made else None
    expect(flag == "getattr(self.speculator, 'enable_adaptive_verification', False)",
           f"vllm/{V2_RUNNER}: adaptive verification is no longer switched on by the speculator's "
           f"enable_adaptive_verification attribute (found {flag})")
    sample = ast.unparse(find_def(runner, "GPUModelRunner.sample_tokens") or ast.Pass())
    expect("self.adaptive_verification.record_confidences(self.speculator.draft_token_confidence_probs, input_batch)"
           in sample, f"vllm/{V2_RUNNER}: the runner no longer feeds speculator.draft_token_confidence_probs to "
                      "adaptive verification")
    v1_only = _fn(src, CONFIG, "VllmConfig._get_v1_model_runner_unsupported_features")
    expect("adaptive draft verification" in ast.unparse(v1_only),
           f"vllm/{CONFIG}: adaptive verification is no longer V2-only")


def check_v2_acceptance_estimator(src: Sources) -> None:
    tree = src.tree(ESTIMATOR)
    for name, expected in ESTIMATOR_METHODS.items():
        fn = find_def(tree, f"OnlineAcceptanceEstimator.{name}")
        expect(fn is not None and parameters(fn) == expected,
               f"vllm/{ESTIMATOR}: OnlineAcceptanceEstimator.{name}{[p[1] for p in expected]} changed or is gone")
    accumulate = _fn(src, ESTIMATOR, "_accumulate_kernel")
    for statement, meaning in (("num_accepted = tl.maximum(num_sampled - 1, 0)", "accepted drafts = sampled - 1"),
                               ("label = tl.where(step < num_accepted, 1.0, 0.0)",
                                "per-position labels: accepted before the first rejection")):
        _has(accumulate, ESTIMATOR, "_accumulate_kernel", statement, meaning)
    observe = find_def(src.tree(SPECULATOR), "DraftModelSpeculator.observe_verification")
    expect(observe is not None and parameters(observe) == _pos("self", "idx_mapping", "num_sampled", "num_rejected"),
           f"vllm/{SPECULATOR}: DraftModelSpeculator.observe_verification(idx_mapping, num_sampled, num_rejected) "
           "changed (the runner grades the last drafts through it)")


CHECKS: dict[str, Callable[[Sources], None]] = {
    "V2 speculator interface": check_v2_speculator_interface,
    "V2 speculator construction and call": check_v2_speculator_construction,
    "V2 async scheduling placeholders": check_v2_async_placeholders,
    "V2 Gumbel hash": check_v2_gumbel_hash,
    "V2 Gumbel draw": check_v2_gumbel_draw,
    "V2 sampler seeding": check_v2_sampler_seeding,
    "V2 rejection rule": check_v2_rejection_rule,
    "V2 adaptive verification": check_v2_adaptive_verification,
    "V2 acceptance estimator": check_v2_acceptance_estimator,
}

__all__ = ["CHECKS", "ContractBroken", "murmur3_x86_32", "v2_hash32", "v2_uniform64"]
