"""What the service relies on in vLLM, checked against the source of the GPU wheel (gpu_wheel.Sources): each check
raises ContractBroken, naming the file and what changed, when vLLM no longer does what our code assumes.

- the `custom_class` proposer: how the V1 model runner builds it and the arguments of its `propose` call, against
  DasProposer's constructor and `propose` signature;
- the model-runner choice: `custom_class` (and `suffix`) are on model runner V2's unsupported list, the V2 switch
  is VLLM_USE_V2_MODEL_RUNNER, async scheduling is off for them (what `das bench e2e` equalises across arms);
- the pause rules: `pause_generation(mode, clear_cache)`, abort / wait pause new work and keep freezes it, and no
  mode makes the engine reject new requests (the README promises they are held until /resume);
- the RL routes our gateway mirrors (service/http/rl_control.py), and the worker RPCs and model-runner methods we call;
- the weight transfer's NCCL path (service/engine/vllm/weight_transfer.py, service/client/weights.py): both factories'
  public `register_engine` and their "nccl" entries, the trainer init info's fields and the round trip of vLLM's
  NCCL trainer engine, the workers' ranks at `rank_offset` + their rank (the coordinator's layout), the worker's
  update flag our abort reads, and the tie of a tied output layer (`refresh_tied_head`);
- the sampler and rejection-sampler functions our patches replace (service/engine/vllm/patches.py): every target
  exists, and each replacement takes exactly vLLM's parameters;
- keyed sampling's CUDA wrappers (service/engine/vllm/keyed_cuda.py): the signatures `WRAPPED_SIGNATURES` records (what
  `install_cuda` demands on a GPU before wrapping anything) are the GPU wheel's, and each wrapper takes them.

What a port to model runner V2 would rely on is checked in gpu_contract_v2.py (test_gpu_contract.py runs both).
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable, Iterator
from typing import Any

from tests.service.engine.vllm.gpu_wheel import Sources

RUNNER = "v1/worker/gpu_model_runner.py"
CONFIG = "config/vllm.py"


class ContractBroken(AssertionError):
    """The GPU build no longer does what the service relies on."""


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise ContractBroken(message)


# ---- reading the source ----

def module_file(module: str) -> str:
    """`vllm.v1.sample.rejection_sampler` -> `v1/sample/rejection_sampler.py`."""
    return module.removeprefix("vllm.").replace(".", "/") + ".py"


def walk(node: ast.AST, kind: type) -> Iterator[Any]:
    return (n for n in ast.walk(node) if isinstance(n, kind))


def find_class(tree: ast.Module, name: str) -> ast.ClassDef | None:
    return next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)


def find_def(tree: ast.Module, qualname: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The top-level function or class method `qualname` ("f" or "Class.method"), None if not defined there."""
    scope: list[ast.stmt] = tree.body
    *owners, name = qualname.split(".")
    for owner in owners:
        cls = next((n for n in scope if isinstance(n, ast.ClassDef) and n.name == owner), None)
        if cls is None:
            return None
        scope = cls.body
    return next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name),
                None)


def resolve_def(src: Sources, module: str, qualname: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """`qualname` in `module`, following a class's bases imported from other vLLM modules (an inherited method)."""
    tree = src.tree(module_file(module))
    found = find_def(tree, qualname)
    if found is not None or "." not in qualname:
        return found
    owner, name = qualname.rsplit(".", 1)
    cls = find_class(tree, owner)
    if cls is None:
        return None
    for base in (b.id for b in cls.bases if isinstance(b, ast.Name)):
        for imp in walk(tree, ast.ImportFrom):
            if imp.module and imp.module.startswith("vllm") and any(a.name == base for a in imp.names):
                inherited = resolve_def(src, imp.module, f"{base}.{name}")
                if inherited is not None:
                    return inherited
    return None


def parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[tuple[str, str, str | None]]:
    """(kind, name, default source) of each parameter: kind "pos" (positional or keyword), "kw" (keyword-only),
    "*" / "**" (varargs)."""
    args = fn.args
    positional = args.posonlyargs + args.args
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    out = [("pos", a.arg, None if d is None else ast.unparse(d)) for a, d in zip(positional, defaults)]
    if args.vararg:
        out.append(("*", args.vararg.arg, None))
    out += [("kw", a.arg, None if d is None else ast.unparse(d)) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        out.append(("**", args.kwarg.arg, None))
    return out


def python_parameters(fn: Callable[..., Any]) -> list[tuple[str, str, str | None]]:
    """`parameters` of a Python function of ours (defaults as source text, as vLLM writes them)."""
    kinds = {inspect.Parameter.POSITIONAL_ONLY: "pos", inspect.Parameter.POSITIONAL_OR_KEYWORD: "pos",
             inspect.Parameter.KEYWORD_ONLY: "kw", inspect.Parameter.VAR_POSITIONAL: "*",
             inspect.Parameter.VAR_KEYWORD: "**"}
    return [(kinds[p.kind], p.name, None if p.default is inspect.Parameter.empty else repr(p.default))
            for p in inspect.signature(fn, follow_wrapped=False).parameters.values()]


def branch_of_method(tree: ast.AST, method: str) -> Iterator[ast.If]:
    """The `if ... .method == "<method>"` statements in tree."""
    for node in walk(tree, ast.If):
        test = node.test
        if (isinstance(test, ast.Compare) and isinstance(test.left, ast.Attribute) and test.left.attr == "method"
                and len(test.comparators) == 1 and isinstance(test.comparators[0], ast.Constant)
                and test.comparators[0].value == method and isinstance(test.ops[0], ast.Eq)):
            yield node


def calls_in(nodes: list[ast.stmt], name: str) -> list[ast.Call]:
    """Calls of `name` (a function name or a method attribute) in `nodes`."""
    found = []
    for node in nodes:
        for call in walk(node, ast.Call):
            func = call.func
            if (isinstance(func, ast.Name) and func.id == name) or (isinstance(func, ast.Attribute)
                                                                    and func.attr == name):
                found.append(call)
    return found


def string_tuples(node: ast.AST) -> list[set[str]]:
    """The tuples / lists of string constants in node."""
    return [{e.value for e in t.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
            for t in walk(node, (ast.Tuple, ast.List))]


# ---- the checks ----

def check_custom_class_proposer(src: Sources) -> None:
    from das.service.engine.vllm.proposer import DasProposer

    where = f"vllm/{RUNNER}"
    tree = src.tree(RUNNER)
    branches = list(branch_of_method(tree, "custom_class"))
    builds = [c for b in branches for c in calls_in(b.body, "create_custom_proposer")]
    expect(len(builds) == 1 and [ast.unparse(a) for a in builds[0].args] == ["self.vllm_config"],
           f"{where}: the runner no longer builds the custom_class drafter with create_custom_proposer("
           f"self.vllm_config) (found {[ast.unparse(c) for c in builds]})")
    assigned = [n for b in branches for n in walk(b, ast.Assign) if any(
        ast.unparse(t) == "self.drafter" for t in n.targets) and isinstance(n.value, ast.Call)]
    expect(bool(assigned), f"{where}: the custom_class proposer is no longer the runner's `drafter` (our worker "
                           "extension reaches it as model_runner.drafter)")
    maker = src.tree("v1/spec_decode/custom_class_proposer.py")
    made = calls_in(maker.body, "user_class")
    expect(len(made) == 1 and [ast.unparse(a) for a in made[0].args] == ["vllm_config"] and not made[0].keywords,
           "vllm/v1/spec_decode/custom_class_proposer.py: the proposer class is no longer instantiated as "
           "cls(vllm_config)")
    proposes = [c for b in branches for c in calls_in(b.body, "propose")]
    expect(len(proposes) == 1, f"{where}: expected one propose call in the custom_class branch, found "
                               f"{len(proposes)}")
    call = proposes[0]
    args = [ast.unparse(a) for a in call.args]
    keywords = {k.arg: ast.unparse(k.value) for k in call.keywords}
    expected_args = ["sampled_token_ids", "self.input_batch.num_tokens_no_spec", "self.input_batch.token_ids_cpu"]
    expect(args == expected_args and keywords == {"slot_mappings": "slot_mappings"},
           f"{where}: custom_class propose({', '.join(args)}, {keywords}) is not the call DasProposer.propose "
           f"was written for (positional {expected_args}, slot_mappings=...)")
    ours = python_parameters(DasProposer.propose)
    expect([name for _, name, _ in ours[1:4]] == [a.rsplit(".", 1)[-1] for a in args],
           f"DasProposer.propose's parameters {ours} do not take vLLM's arguments in its order {args}")
    try:
        inspect.signature(DasProposer.propose).bind(None, *args, **keywords)
    except TypeError as exc:
        raise ContractBroken(f"DasProposer.propose cannot take vLLM's call {args} {keywords}: {exc}") from None


def check_runner_choice(src: Sources) -> None:
    where = f"vllm/{CONFIG}"
    tree = src.tree(CONFIG)
    unsupported = find_def(tree, "VllmConfig._get_v2_model_runner_unsupported_features")
    expect(unsupported is not None, f"{where}: VllmConfig._get_v2_model_runner_unsupported_features is gone")
    methods = [t for t in string_tuples(unsupported) if "custom_class" in t]
    expect(bool(methods) and "suffix" in methods[0],
           f"{where}: custom_class / suffix are no longer on model runner V2's unsupported list: the das and "
           "suffix arms may run V2 while `das bench e2e` assumes V1 for them")
    choose = find_def(tree, "VllmConfig.use_v2_model_runner")
    expect(choose is not None, f"{where}: VllmConfig.use_v2_model_runner is gone")
    text = ast.unparse(choose)
    env_at = text.find("envs.VLLM_USE_V2_MODEL_RUNNER\n")
    expect(0 <= env_at < text.find("_get_v2_model_runner_unsupported_features()"),
           f"{where}: VLLM_USE_V2_MODEL_RUNNER no longer decides the runner before the unsupported features "
           "(`das bench e2e` forces V1 on a GPU with it)")
    envs = src.text("envs.py")
    expect('"VLLM_USE_V2_MODEL_RUNNER": lambda: maybe_convert_bool(' in envs,
           "vllm/envs.py: VLLM_USE_V2_MODEL_RUNNER is no longer a boolean environment variable")
    setters = [f for f in walk(tree, ast.FunctionDef)
               if "self.scheduler_config.async_scheduling = True" in ast.unparse(f)]
    expect(len(setters) == 1, f"{where}: the function that turns async scheduling on is not where it was")
    kept = [t for t in string_tuples(setters[0]) if "custom_class" in t]
    body = ast.unparse(setters[0])
    expect(not kept and "'custom_class'" not in body and "'suffix'" not in body
           and "self.scheduler_config.async_scheduling = False" in body,
           f"{where}: async scheduling may now be on for custom_class / suffix speculation")
    arg_utils = src.tree("engine/arg_utils.py")
    engine_args = find_class(arg_utils, "EngineArgs")
    expect(engine_args is not None and any(isinstance(n, ast.AnnAssign) and ast.unparse(n.target) ==
                                           "async_scheduling" for n in engine_args.body),
           "vllm/engine/arg_utils.py: EngineArgs.async_scheduling is gone")


def check_pause_rules(src: Sources) -> None:
    llm = src.tree("v1/engine/async_llm.py")
    pause = find_def(llm, "AsyncLLM.pause_generation")
    expect(pause is not None and [(k, n, d) for k, n, d in parameters(pause) if k == "kw"] ==
           [("kw", "mode", "'abort'"), ("kw", "clear_cache", "True")],
           "vllm/v1/engine/async_llm.py: AsyncLLM.pause_generation(*, mode='abort', clear_cache=True) changed")
    for name in ("resume_generation", "is_paused", "abort"):
        expect(find_def(llm, f"AsyncLLM.{name}") is not None, f"vllm/v1/engine/async_llm.py: AsyncLLM.{name} "
                                                              "is gone")
    modes = src.text("v1/engine/__init__.py")
    expect('PauseMode = Literal["abort", "wait", "keep"]' in modes,
           "vllm/v1/engine/__init__.py: the pause modes are no longer abort, wait, keep")
    core = src.tree("v1/engine/core.py")
    for owner in ("EngineCore", "EngineCoreProc"):
        fn = find_def(core, f"{owner}.pause_scheduler")
        expect(fn is not None, f"vllm/v1/engine/core.py: {owner}.pause_scheduler is gone")
        body = ast.unparse(fn)
        expect("pause_state = PauseState.PAUSED_ALL if mode == 'keep' else PauseState.PAUSED_NEW" in body,
               f"vllm/v1/engine/core.py: {owner}.pause_scheduler no longer pauses new work in abort / wait mode "
               "and everything in keep mode")
        expect("reject" not in body, f"vllm/v1/engine/core.py: {owner}.pause_scheduler now rejects something "
                                     "while paused: a batch sent during /pause would fail instead of being held")
    scheduler = src.text("v1/core/sched/scheduler.py")
    engine_texts = scheduler + src.text("v1/engine/core.py") + src.text("v1/engine/async_llm.py")
    expect("reject_new_requests" not in engine_texts,
           "vLLM now rejects new requests while paused (reject_new_requests): a batch sent during /pause would "
           "end with finish_reason 'error'")


# (method, path) of vLLM's RL routes that service/http/rl_control.py mirrors
RL_ROUTES = {("post", "/pause"), ("post", "/resume"), ("get", "/is_paused"), ("post", "/abort_requests"),
             ("post", "/update_weights"), ("post", "/init_weight_transfer_engine"),
             ("post", "/shutdown_weight_transfer_engine"), ("post", "/start_weight_update"),
             ("post", "/start_draft_weight_update"), ("post", "/finish_weight_update")}


def check_rl_routes(src: Sources) -> None:
    path = "entrypoints/rl/online/api_router.py"
    tree = src.tree(path)
    routes: dict[tuple[str, str], ast.AsyncFunctionDef | ast.FunctionDef] = {}
    for fn in tree.body:
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for deco in fn.decorator_list:
                if (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute)
                        and ast.unparse(deco.func.value) == "router" and deco.args
                        and isinstance(deco.args[0], ast.Constant)):
                    routes[(deco.func.attr, deco.args[0].value)] = fn
    missing = RL_ROUTES - routes.keys()
    expect(not missing, f"vllm/{path}: routes our gateway mirrors are gone or moved: {sorted(missing)}")
    pause = {n: d for _, n, d in parameters(routes[("post", "/pause")])}
    expect(pause.get("mode") == "'abort'" and pause.get("clear_cache") == "True",
           f"vllm/{path}: POST /pause's query parameters changed (ours: mode=abort, clear_cache=true): {pause}")


def check_worker_calls(src: Sources) -> None:
    runner = src.tree(RUNNER)
    reload = find_def(runner, "GPUModelRunner.reload_weights")
    expect(reload is not None and "weights_path" in [n for _, n, _ in parameters(reload)],
           f"vllm/{RUNNER}: GPUModelRunner.reload_weights(weights_path=...) is gone (VllmEngine.reload_weights calls "
           "collective_rpc('reload_weights', kwargs={'weights_path': ...}))")
    worker = find_def(src.tree("v1/worker/gpu_worker.py"), "Worker.reload_weights")
    expect(worker is not None and ast.unparse(worker).count("self.model_runner.reload_weights(*args, **kwargs)"),
           "vllm/v1/worker/gpu_worker.py: Worker.reload_weights no longer hands its arguments to the model runner")
    expect("worker_extension_cls" in src.text("v1/worker/worker_base.py"),
           "vllm/v1/worker/worker_base.py: worker_extension_cls (our das_* RPCs) is no longer mixed into the worker")
    # what the worker extension, the proposer and the step profiler read or wrap on the V1 model runner
    for name in ("execute_model", "sample_tokens", "_sample", "propose_draft_token_ids"):
        expect(find_def(runner, f"GPUModelRunner.{name}") is not None, f"vllm/{RUNNER}: GPUModelRunner.{name} "
                                                                        "is gone")
    init = ast.unparse(find_def(runner, "GPUModelRunner.__init__"))
    expect("self.requests: dict[str, CachedRequestState] = {}" in init and "self.input_batch = InputBatch(" in init,
           f"vllm/{RUNNER}: the runner's `requests` / `input_batch` (read by the proposer) changed")
    batch = src.tree("v1/worker/gpu_input_batch.py")
    state = find_class(batch, "CachedRequestState")
    fields = {ast.unparse(n.target) for n in state.body if isinstance(n, ast.AnnAssign)} if state else set()
    expect({"prompt_token_ids", "sampling_params", "output_token_ids"} <= fields,
           f"vllm/v1/worker/gpu_input_batch.py: CachedRequestState lost fields the proposer reads: {fields}")
    text = ast.unparse(find_def(batch, "InputBatch.__init__"))
    expect("self.num_tokens_no_spec = " in text and "self.token_ids_cpu = " in text
           and "self.num_prompt_tokens = " in text,
           "vllm/v1/worker/gpu_input_batch.py: InputBatch's token table / counts (the proposer's and the keyed "
           "sampler's inputs) changed")


WEIGHT_TRANSFER = "distributed/weight_transfer/"


def check_weight_transfer(src: Sources) -> None:
    factory = src.tree(WEIGHT_TRANSFER + "factory.py")
    for cls in ("WeightTransferEngineFactory", "WeightTransferTrainerFactory"):
        register = find_def(factory, f"{cls}.register_engine")
        names = [n for _, n, _ in parameters(register)] if register is not None else []
        expect(names == ["cls", "name", "module_path_or_cls", "class_name"],
               f"vllm/{WEIGHT_TRANSFER}factory.py: {cls}.register_engine(name, module_path_or_cls, class_name) "
               f"changed (our gloo backend registers through it): {names}")
    text = src.text(WEIGHT_TRANSFER + "factory.py")
    expect(text.count('"nccl",\n    "vllm.distributed.weight_transfer.nccl_engine",') == 2,
           f"vllm/{WEIGHT_TRANSFER}factory.py: nccl is no longer registered on both sides")
    nccl = src.tree(WEIGHT_TRANSFER + "nccl_engine.py")
    info = find_class(nccl, "NCCLTrainerInitInfo")
    fields = [ast.unparse(n.target) for n in info.body if isinstance(n, ast.AnnAssign)] if info else []
    expect(fields[:4] == ["backend", "master_address", "master_port", "world_size"],
           f"vllm/{WEIGHT_TRANSFER}nccl_engine.py: NCCLTrainerInitInfo's fields changed (nccl_trainer builds it): "
           f"{fields}")
    send = ast.unparse(find_def(nccl, "NCCLTrainerWeightTransferEngine.send_weights") or ast.Pass())
    expect(all(f"self.client.{m}" in send for m in ("start_weight_update", "update_weights",
                                                     "finish_weight_update")),
           f"vllm/{WEIGHT_TRANSFER}nccl_engine.py: the NCCL trainer's round trip no longer calls start, update and "
           "finish on its client (the service's routes)")
    init = ast.unparse(find_def(nccl, "NCCLTrainerWeightTransferEngine.trainer_init") or ast.Pass())
    expect("rank_offset=1" in init, f"vllm/{WEIGHT_TRANSFER}nccl_engine.py: the trainer no longer asks for workers "
                                    "at rank_offset 1 (the service adds each engine's offset to it)")
    ranks = ast.unparse(find_def(src.tree(WEIGHT_TRANSFER + "nccl_common.py"), "worker_init_process_group")
                        or ast.Pass())
    expect("rank = worker_rank + init_info.rank_offset" in ranks,
           f"vllm/{WEIGHT_TRANSFER}nccl_common.py: a worker's rank is no longer its rank + rank_offset")
    worker = src.tree("v1/worker/gpu_worker.py")
    finish = ast.unparse(find_def(worker, "Worker.finish_weight_update") or ast.Pass())
    expect("self._weight_update_active = False" in finish,
           "vllm/v1/worker/gpu_worker.py: Worker._weight_update_active (das_abort_weight_update reads it) changed")
    tie = ast.unparse(find_def(src.tree("model_executor/layers/vocab_parallel_embedding.py"),
                               "UnquantizedEmbeddingMethod.tie_weights") or ast.Pass())
    expect("layer.weight = embed_tokens.weight" in tie,
           "vllm/model_executor/layers/vocab_parallel_embedding.py: a tied head no longer shares the embedding's "
           "weight (refresh_tied_head ties them again after a reload)")


def our_replacements() -> dict[str, Callable[..., Any]]:
    """vLLM target -> the function our patch puts there (wrappers built around a stand-in original)."""
    from das.service.engine.vllm.cpu_fixes.plugin import expand_kernel_impl, sample_plainly_without_drafts
    from das.service.engine.vllm.cpu_fixes.rejection import logprobs_of_kept_cells, make_rejection_sample
    from das.service.engine.vllm.keyed_sampler import keyed_forward_cpu, publish_step_keys

    def original(*args: Any, **kwargs: Any) -> None:
        return None

    return {
        "vllm.utils.cpu_triton_utils:_expand_kernel_impl": expand_kernel_impl,
        "vllm.v1.sample.rejection_sampler:rejection_sample": make_rejection_sample(original),
        "vllm.v1.sample.rejection_sampler:RejectionSampler._get_logprobs_tensors": logprobs_of_kept_cells,
        "vllm.v1.worker.cpu_model_runner:CPUModelRunner._sample": sample_plainly_without_drafts(original),
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample": publish_step_keys(original),
        "vllm.v1.sample.ops.topk_topp_sampler:TopKTopPSampler.forward_cpu": keyed_forward_cpu(original),
    }


def check_patch_targets(src: Sources) -> None:
    from das.service.engine.vllm.patches import PATCHES

    replacements = our_replacements()
    for patch in PATCHES:
        for target in patch.targets:
            module, qualname = target.split(":")
            found = resolve_def(src, module, qualname)
            expect(found is not None, f"patch {patch.name!r}: {target} is gone from vllm/{module_file(module)}")
            ours = replacements.get(target)
            if ours is not None:
                theirs = parameters(found)
                expect(theirs == python_parameters(ours),
                       f"patch {patch.name!r}: vLLM's {target}{theirs} is not what our replacement takes "
                       f"{python_parameters(ours)}")


def recorded_form(params: list[tuple[str, str, str | None]]) -> str:
    """`parameters` as keyed_cuda.WRAPPED_SIGNATURES writes them: names in order, `=default` where one is."""
    return ", ".join(name if default is None else f"{name}={default}" for _, name, default in params)


def check_keyed_cuda_wrappers(src: Sources) -> None:
    """check_patch_targets finds every target of the keyed-sampling-cuda patch and compares `_sample` and
    `rejection_sample` with the CPU path's wrappers; this compares the table install_cuda enforces at run time
    (keyed_cuda.check_signatures, which reads the installed vLLM: the CPU build in CI) with the GPU wheel, for all
    its targets, and keyed_cuda's own wrappers with the table."""
    from das.service.engine.vllm import keyed_cuda
    from das.service.engine.vllm.keyed_sampler import publish_step_keys
    from das.service.engine.vllm.patches import PATCHES

    def original(*args: Any, **kwargs: Any) -> None:
        return None

    table = keyed_cuda.WRAPPED_SIGNATURES
    targets = {f"{module}:{owner + '.' if owner else ''}{name}": (module, owner, name)
               for module, owner, name in table}
    patch = next((p for p in PATCHES if p.name == "keyed-sampling-cuda"), None)
    expect(patch is not None and set(patch.targets) == set(targets),
           f"keyed_cuda.WRAPPED_SIGNATURES {sorted(targets)} and the keyed-sampling-cuda patch's targets "
           f"{sorted(patch.targets) if patch else None} disagree")
    forward = keyed_cuda.keyed_forward(original)
    wrappers = {"forward_native": forward, "forward_cuda": forward,
                "rejection_sample": keyed_cuda.make_rejection_sample(original), "_sample": publish_step_keys(original),
                "_dummy_sampler_run": keyed_cuda.keyed_dummy_sampler_run(original)}
    for target, (module, owner, name) in targets.items():
        recorded = table[(module, owner, name)]
        found = resolve_def(src, module, f"{owner}.{name}" if owner else name)
        expect(found is not None, f"keyed CUDA: {target} is gone from vllm/{module_file(module)}")
        assert found is not None
        theirs = recorded_form(parameters(found))
        expect(theirs == recorded, f"vllm/{module_file(module)}: {target.split(':')[1]}({theirs}) is not what "
                                   f"keyed_cuda.WRAPPED_SIGNATURES records ({recorded}): install_cuda would refuse "
                                   "this vLLM on a GPU")
        ours = recorded_form(python_parameters(wrappers[name]))
        expect(ours == recorded, f"keyed_cuda's wrapper of {target} takes ({ours}), not the recorded ({recorded})")


CHECKS: dict[str, Callable[[Sources], None]] = {
    "custom_class proposer": check_custom_class_proposer,
    "runner choice": check_runner_choice,
    "pause rules": check_pause_rules,
    "RL routes": check_rl_routes,
    "worker calls": check_worker_calls,
    "weight transfer": check_weight_transfer,
    "patch targets and signatures": check_patch_targets,
    "keyed CUDA wrappers": check_keyed_cuda_wrappers,
}
