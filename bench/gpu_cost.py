"""`das bench gpu-cost`: what a GPU machine with PyTorch and transformers but no vLLM (and no internet) can measure
for the service in a few minutes, standalone: it imports torch, transformers, the keyed draw
and the cost model (`das.scheduler.cost_model`) only.

(a) The keyed draw on the device: rows x vocabulary (Qwen2.5's 151,936 entries) of random float32 logits drawn on
    the device, eager and compiled, and, from the same logits and keys, on CPU tensors; the tokens must be identical
    (the CPU draw is the fused CPU kernel's token, as the keyed draw's tests check). Median milliseconds per
    draw on the device, for each row count, beside vLLM's unkeyed draw re-stated in torch (`--draw-only` stops
    here).
(b) A decode step-cost surface: a 7B-shaped Llama (Qwen2.5-7B's shape: 28 layers, hidden 3,584, 28 query / 4 KV
    heads, MLP 18,944, vocabulary 152,064; random weights, bfloat16) on the device, a static KV cache of `context`
    positions per request, and one forward of batch x tokens-per-request (1 + K drafts) tokens at the cache's end:
    median seconds over `repeats` timed forwards (after warm-ups), the device synchronised around each. On CUDA each
    shape is captured as a CUDA graph and replayed, as vLLM replays its decode steps (eager if capture fails; the
    output says which). The KV cache's contents are zeros: attention's cost does not depend on them.
(c) The host's share: our proposer's draft step (history bank and budget) at `proposer_batches` running requests
    over the bundled 66 x 16 trace set, on this machine's CPU (`proposer_cost`; it needs our native drafter,
    built by `pip install`: without it the part is skipped and says why). With (a), the host work a step that das
    adds to a 7B decode step's forward pass on a GPU without async scheduling (`das bench simulate --host-ms`).

Written to `--out`: `<name>.json`, a `CostModel` (c_base and c_tok of a least-squares fit of c_base + per-request x
requests + c_tok x tokens over the surface at the fit context; the per-request term, transformers' attention, is
left out of the model) that `das bench simulate --cost-model <path>` takes in place of the estimated `h100-7b`, and
`<name>-surface.json` with every point and the keyed-draw figures. `--tiny` runs a tiny config on the CPU in
seconds (what the tests run). Without das installed, from a checkout: a directory holding a link named `das` to the
checkout on PYTHONPATH, then `python -m das.bench.gpu_cost`.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from das.scheduler.cost_model import CostModel
from das.service.engine.vllm.keyed_draw import keyed_draw

QWEN25_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064, attention_bias=True, max_position_embeddings=32768)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096)


@dataclass(frozen=True)
class GpuCostConfig:
    """One run: the model shape (`tiny` or 7B), the grid (batches x tokens per request x contexts, in requests,
    tokens, KV positions), the keyed draw's row counts and vocabulary, `repeats` timed calls per point, `kv_gib` the most KV cache a
    point may allocate (GiB; larger points are skipped and listed), `fit_context` the context the cost model is
    fitted at (the grid's middle one by default)."""

    device: str
    tiny: bool
    batches: tuple[int, ...]
    tokens: tuple[int, ...]
    contexts: tuple[int, ...]
    repeats: int
    draw_rows: tuple[int, ...]
    draw_vocab: int
    kv_gib: float
    fit_context: int | None = None
    draw_only: bool = False
    proposer_batches: tuple[int, ...] = ()  # (c): running requests; empty: not measured

    @classmethod
    def default(cls, device: str, tiny: bool) -> GpuCostConfig:
        if tiny:
            return cls(device, True, (1, 4), (1, 3), (16, 64), 3, (1, 16), 512, 1.0, proposer_batches=(16,))
        return cls(device, False, (1, 8, 32, 64, 128), (1, 2, 4, 8, 16), (1024, 4096, 16384), 10,
                   (1, 8, 64, 256, 1024), 151936, 40.0, proposer_batches=(64, 128, 256, 512))


def _median_s(call: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    for _ in range(2):
        call()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sync(device: torch.device) -> Callable[[], None]:
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def unkeyed_draw(logits: torch.Tensor) -> torch.Tensor:
    """The draw keyed sampling replaces: vLLM 0.32's plain random sampling (`TopKTopPSampler.forward_native` without
    top-k/top-p, then `random_sample` without per-request generators), re-stated in torch because the machines
    that time it may have no vLLM: float32 softmax, Exp(1) noise, argmax of probs / noise."""
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    return probs.div_(torch.empty_like(probs).exponential_()).argmax(dim=-1)


def keyed_draw_figures(cfg: GpuCostConfig) -> list[dict[str, object]]:
    """(a): for each row count, the draw's identity with its CPU-tensor run, eager and compiled (torch.compile, the
    CUDA default), and each one's median milliseconds on the device; beside them the unkeyed draw's
    (`unkeyed_draw`: what a plain vLLM engine pays)."""
    device = torch.device(cfg.device)
    figures = []
    for rows in cfg.draw_rows:
        gen = torch.Generator().manual_seed(rows)
        logits = torch.randn(rows, cfg.draw_vocab, generator=gen) * 2
        logits[:, cfg.draw_vocab // 2:] = torch.where(torch.rand(rows, 1, generator=gen) < 0.5, float("-inf"),
                                                      logits[:, cfg.draw_vocab // 2:])  # top-k-like masks on half
        keys = torch.randint(-2**63, 2**63 - 1, (rows,), generator=gen)
        on_cpu = keyed_draw(logits, keys, compiled=False)
        dev_logits, dev_keys = logits.to(device), keys.to(device)
        row: dict[str, object] = {"rows": rows, "vocab": cfg.draw_vocab, "device": str(device)}
        for mode, compiled in (("eager", False), ("compiled", True)):
            on_device = keyed_draw(dev_logits, dev_keys, compiled=compiled)
            ms = _median_s(lambda: keyed_draw(dev_logits, dev_keys, compiled=compiled), cfg.repeats,
                           _sync(device)) * 1e3
            row[f"{mode}_identical_to_cpu"] = bool(torch.equal(on_device.cpu(), on_cpu))
            row[f"{mode}_median_ms"] = round(ms, 3)
        row["unkeyed_median_ms"] = round(_median_s(lambda: unkeyed_draw(dev_logits), cfg.repeats, _sync(device)) * 1e3,
                                         3)
        figures.append(row)
    return figures


def _model(cfg: GpuCostConfig) -> tuple[torch.nn.Module, object]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**(TINY if cfg.tiny else QWEN25_7B))
    dtype = torch.float32 if torch.device(cfg.device).type == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    with torch.device(cfg.device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    return model, config


def _step_timer(model: torch.nn.Module, config: object, batch: int, tokens: int, context: int,
                device: torch.device, graphs: bool) -> tuple[Callable[[], object], bool]:
    """A call running one decode forward of batch x tokens at positions context.. of a static cache (the same
    slots every call), as a CUDA graph replay when `graphs` and capture succeeds; and whether it is one."""
    from transformers import StaticCache

    cache = StaticCache(config=config, max_cache_len=context + tokens)
    ids = torch.randint(0, config.vocab_size, (batch, tokens), device=device)
    at = torch.arange(context, context + tokens, device=device)

    def forward() -> object:
        with torch.inference_mode():
            return model(input_ids=ids, past_key_values=cache, cache_position=at, use_cache=True).logits

    forward()  # allocates the cache
    if not graphs:
        return forward, False
    try:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward()
        return graph.replay, True
    except RuntimeError:
        return forward, False


def step_surface(cfg: GpuCostConfig) -> tuple[list[dict[str, object]], list[dict[str, int]]]:
    """(b): one point per (batch, tokens per request, context) within the KV budget, and the points skipped."""
    device = torch.device(cfg.device)
    model, config = _model(cfg)
    head_dim = config.hidden_size // config.num_attention_heads
    kv_bytes_per_position = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * (
        4 if device.type == "cpu" else 2)
    points, skipped = [], []
    for context in cfg.contexts:
        for batch in cfg.batches:
            for tokens in cfg.tokens:
                shape = {"batch": batch, "tokens_per_request": tokens, "context": context}
                if batch * (context + tokens) * kv_bytes_per_position > cfg.kv_gib * 2**30:
                    skipped.append(shape)
                    continue
                call, graphed = _step_timer(model, config, batch, tokens, context, device, device.type == "cuda")
                seconds = _median_s(call, cfg.repeats, _sync(device))
                points.append({**shape, "step_s": seconds, "cuda_graph": graphed})
                del call
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return points, skipped


def fit_step_terms(points: Sequence[dict[str, object]]) -> dict[str, float]:
    """Least squares of step = c_base + per_request x batch + c_tok x batch x tokens_per_request (seconds) over
    surface points at one context; coefficients clipped at 0; `fit_error` the RMS relative error. A token's
    marginal price (c_tok) is what a draft token costs to verify; the per-request term is the attention over each
    request's cache."""
    b = np.array([float(p["batch"]) for p in points])
    k = np.array([float(p["tokens_per_request"]) for p in points])
    t = np.array([float(p["step_s"]) for p in points])
    if len(np.unique(b)) < 2 or len(np.unique(b * k)) < 3:
        raise ValueError("the fit needs at least two batch sizes and three batch x tokens-per-request products")
    a = np.stack([np.ones_like(b), b, b * k], axis=1)
    coef = np.clip(np.linalg.lstsq(a, t, rcond=None)[0], 0.0, None)
    error = float(np.sqrt(np.mean(((a @ coef - t) / t) ** 2)))
    return {"c_base_s": float(coef[0]), "per_request_s": float(coef[1]), "c_tok_s": float(coef[2]),
            "fit_error": error}


def proposer_figures(batches: Sequence[int]) -> dict[str, object]:
    """(c): the draft step's host time at each batch size (`proposer_cost`), or why it could not run."""
    if not batches:
        return {"skipped": "no --proposer-batches"}
    try:
        from das.bench.drafter_replay import default_trace_path
        from das.bench.proposer_cost import proposer_cost
        from das.drafter.records import load_rollouts
        from das.scheduler.cost_model import load_cost_model
    except ImportError as exc:  # the native drafter was not built here
        return {"skipped": f"our drafter does not import ({type(exc).__name__}: {exc}): pip install the checkout"}
    traces = default_trace_path("traces-smollm2-66x16.jsonl.gz")
    records = load_rollouts(traces)
    rows = [asdict(proposer_cost(records, load_cost_model("h100-7b"), n)) for n in batches]
    return {"traces": traces.name, "cpu": platform.processor() or platform.machine(), "per_batch": rows}


def run_gpu_cost(cfg: GpuCostConfig, out: Path, name: str) -> dict[str, object]:
    """Runs (a), (c) and (b) and writes `<out>/<name>.json` (the cost model) and `<out>/<name>-surface.json`; returns
    the surface document."""
    if min(cfg.batches + cfg.tokens + cfg.contexts) < 1 or cfg.repeats < 1:
        raise ValueError("batches, tokens per request, contexts and repeats must be >= 1")
    if not cfg.draw_only and (len(set(cfg.batches)) < 2 or len({b * t for b in cfg.batches for t in cfg.tokens}) < 3):
        raise ValueError("the cost model's fit needs at least two batch sizes and three distinct batch x "
                         "tokens-per-request products")
    if not cfg.draw_rows or min(cfg.draw_rows) < 1:
        raise ValueError("draw rows must be >= 1")
    draw = keyed_draw_figures(cfg)
    device_name = torch.cuda.get_device_name(torch.device(cfg.device)) if cfg.device.startswith("cuda") else "cpu"
    doc: dict[str, object] = {"config": asdict(cfg), "device_name": device_name, "torch": torch.__version__,
                              "keyed_draw": draw, "proposer_host": proposer_figures(cfg.proposer_batches)}
    if cfg.draw_only:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}-draw.json").write_text(json.dumps(doc, indent=2))
        return doc
    points, skipped = step_surface(cfg)
    fit_context = cfg.fit_context or sorted(cfg.contexts)[len(cfg.contexts) // 2]
    fit = fit_step_terms([p for p in points if p["context"] == fit_context])
    shape = "tiny Llama" if cfg.tiny else "7B-shaped Llama (Qwen2.5-7B's dimensions), random weights, bfloat16"
    model = CostModel(name=name, c_base_s=fit["c_base_s"], c_tok_s=fit["c_tok_s"], fit_error=fit["fit_error"],
                      source=f"measured by das bench gpu-cost on {device_name}: {shape}, decode forwards at context "
                             f"{fit_context} (no sampler, no scheduler; transformers, not vLLM); fitted as c_base + "
                             f"per-request x requests + c_tok x tokens, the per-request term "
                             f"({fit['per_request_s'] * 1e3:.3f} ms: transformers' attention over the cache, far "
                             f"dearer than vLLM's) left out")
    doc.update({"points": points, "skipped_over_kv_budget": skipped, "fit_context": fit_context, "fit": fit,
                "cost_model": json.loads(model.to_json())})
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(model.to_json())
    (out / f"{name}-surface.json").write_text(json.dumps(doc, indent=2))
    return doc


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="das bench gpu-cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model and grid (seconds on a CPU)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--out", type=Path, default=Path("gpu-cost"), help="directory for the JSON files")
    parser.add_argument("--name", default=None, help="cost model name (default: gpu-7b, or tiny-cpu with --tiny)")
    parser.add_argument("--batches", type=_ints, default=None, help="comma-separated batch sizes")
    parser.add_argument("--tokens", type=_ints, default=None, help="comma-separated tokens per request (1 + K)")
    parser.add_argument("--contexts", type=_ints, default=None, help="comma-separated KV cache lengths")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per point (medians)")
    parser.add_argument("--draw-rows", type=_ints, default=None, help="comma-separated keyed-draw row counts")
    parser.add_argument("--draw-only", action="store_true", help="time the keyed draw only (no step surface)")
    parser.add_argument("--kv-gib", type=float, default=None, help="skip points whose KV cache exceeds this")
    parser.add_argument("--proposer-batches", type=_ints, default=None,
                        help="comma-separated running requests at which to time our proposer's draft step on this "
                             "host (default 64,128,256,512; 16 with --tiny; 0: skip)")
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = GpuCostConfig.default(device, args.tiny)
    overrides = {k: v for k, v in (("batches", args.batches), ("tokens", args.tokens), ("contexts", args.contexts),
                                   ("repeats", args.repeats), ("kv_gib", args.kv_gib),
                                   ("draw_rows", args.draw_rows)) if v is not None}
    if args.proposer_batches is not None:
        overrides["proposer_batches"] = tuple(b for b in args.proposer_batches if b > 0)
    cfg = GpuCostConfig(**{**asdict(cfg), **overrides, "draw_only": args.draw_only})
    name = args.name or ("tiny-cpu" if args.tiny else "gpu-7b")
    try:
        doc = run_gpu_cost(cfg, args.out, name)
    except ValueError as exc:
        parser.error(str(exc))
    if cfg.draw_only:
        print(json.dumps({"keyed_draw": doc["keyed_draw"], "proposer_host": doc["proposer_host"],
                          "files": [str(args.out / f"{name}-draw.json")]}, indent=2))
        return
    print(json.dumps({"keyed_draw": doc["keyed_draw"], "proposer_host": doc["proposer_host"], "fit": doc["fit"], "cost_model": doc["cost_model"],
                      "points": len(doc["points"]), "skipped": len(doc["skipped_over_kv_budget"]),
                      "files": [str(args.out / f"{name}.json"), str(args.out / f"{name}-surface.json")]}, indent=2))

if __name__ == "__main__":
    main()
