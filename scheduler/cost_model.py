"""Engine cost model: the time of one engine step as a function of what it processes.

    t_step = c_base + c_tok * n_tokens + (c_spec + c_spec_req * n_requests) * [the step verifies drafts]
             + c_prefill * n_prompt
             (seconds; n_tokens = running requests + their draft tokens; n_requests = running requests; n_prompt =
             prompt tokens the step prefills, as chunks beside the decodes)

c_base is what a step costs however little it computes (reading the weights, launching kernels, scheduling);
c_tok is the marginal cost of one more token verified in the step; c_spec + c_spec_req * n_requests is the price
of a step that verifies drafts: the rejection sampler instead of the plain sampler, the proposer's bookkeeping
(c_spec), and gathers over every request's rows that grow with the batch (c_spec_req). Decoding at small batch
is memory-bound (c_base dominates: drafts are nearly free), at large batch compute-bound (c_tok dominates:
drafts cost what they verify). c_prefill is the price of one prompt token: a prompt is computed as one wide
matrix product rather than a token per request, so on a compute-bound CPU it is cheaper than c_tok, and on a GPU
about c_tok's FLOPs at a better efficiency. The budget reads c_base, c_tok and the
drafted-step price (it plans decode steps); the simulator all five.

`OnlineCostModel` fits them from an engine's own steps while it serves (docs/design "The online cost model"),
starting from a prior: a `CostModel` from `das calibrate`, a shipped calibration, or `GENERIC_PRIOR`.

Named models:
  * `h100-7b`: a 7-8B dense model in bf16 on one H100 SXM, derived from NVIDIA's H100 SXM datasheet (HBM3
    3.35 TB/s, 989 TFLOPS dense BF16) by a roofline with stated efficiencies: reading 15.2 GB of weights
    (Qwen2.5-7B, 7.6e9 parameters) at 75% of peak bandwidth gives c_base = 6.1 ms; 2 * 7.6e9 FLOPs per token at
    50% of peak compute gives c_tok = 30.7 us. These are estimates from published hardware figures, not a
    measurement; every simulated result built on them says so.
  * `h200-7b`: the same shape measured on one H200 by `das bench gpu-cost` (docs/results "First figures from a
    GPU").
  * calibrated models written by `das calibrate` (JSON, one per engine type) are loaded by path or by name from
    the data directory.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

_H100_SXM_HBM_BYTES_PER_S = 3.35e12
_H100_SXM_BF16_DENSE_FLOPS = 989e12
_QWEN25_7B_PARAMS = 7.6e9


@dataclass(frozen=True)
class CostModel:
    """t_step = c_base_s + c_tok_s * n_tokens (+ c_spec_s + c_spec_req_s * requests when the step verifies
    drafts) + c_prefill_s * prompt tokens. `source` says where the numbers come from. c_prefill_s None: not
    measured, priced as c_tok_s."""

    name: str
    c_base_s: float
    c_tok_s: float
    source: str
    fit_error: float | None = None  # relative RMS error of the fit, for calibrated models
    c_spec_s: float = 0.0
    c_prefill_s: float | None = None
    c_spec_req_s: float = 0.0

    def __post_init__(self) -> None:
        values = (self.c_base_s, self.c_tok_s, self.c_spec_s, self.prefill_token_s, self.c_spec_req_s)
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
            raise ValueError(f"cost model {self.name!r}: c_base_s, c_tok_s, c_spec_s, c_prefill_s, c_spec_req_s must "
                             f"be finite numbers")
        if not (min(values) >= 0 and self.c_base_s + self.c_tok_s > 0):
            raise ValueError(f"cost model {self.name!r}: need c_base_s, c_tok_s, c_spec_s, c_prefill_s, c_spec_req_s "
                             f">= 0, c_base_s and c_tok_s not both 0")

    @property
    def prefill_token_s(self) -> float:
        """Seconds per prompt token prefilled: c_prefill_s, or c_tok_s where it was not measured."""
        return self.c_tok_s if self.c_prefill_s is None else self.c_prefill_s

    def spec_price(self, requests: float) -> float:
        """Seconds a step of `requests` running requests costs more when it verifies drafts."""
        return self.c_spec_s + self.c_spec_req_s * requests

    def step_time(self, n_tokens: float, drafted: bool = False, prompt_tokens: float = 0.0,
                  requests: float | None = None) -> float:
        """Seconds for a step of `n_tokens` decode tokens (requests + drafts) of `requests` running requests
        (None: n_tokens, a step without drafts) and `prompt_tokens` prefilled."""
        spec = self.spec_price(n_tokens if requests is None else requests) if drafted else 0.0
        return self.c_base_s + self.c_tok_s * n_tokens + spec + self.prefill_token_s * prompt_tokens

    @property
    def crossover_tokens(self) -> float:
        """Tokens per step at which the per-token cost equals the fixed cost: beyond it drafts stop being cheap."""
        return self.c_base_s / self.c_tok_s if self.c_tok_s else float("inf")

    def with_host(self, host_s: float) -> CostModel:
        """This model with `host_s` seconds of host work added to every step (c_base_s): the price of an engine
        that runs without async scheduling, whose scheduling, input preparation, proposer and output handling sit
        between its forward passes instead of under them."""
        if not (math.isfinite(host_s) and host_s >= 0):
            raise ValueError(f"host seconds a step must be a finite number >= 0, got {host_s}")
        if host_s == 0:
            return self
        return CostModel(f"{self.name}+host {host_s * 1e3:g} ms", self.c_base_s + host_s, self.c_tok_s,
                         f"{self.source}; plus {host_s * 1e3:g} ms of host work a step", self.fit_error,
                         self.c_spec_s, self.c_prefill_s, self.c_spec_req_s)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def _h100_7b() -> CostModel:
    c_tok = 2 * _QWEN25_7B_PARAMS / (0.5 * _H100_SXM_BF16_DENSE_FLOPS)
    return CostModel(
        name="h100-7b",
        c_base_s=_QWEN25_7B_PARAMS * 2 / (0.75 * _H100_SXM_HBM_BYTES_PER_S),
        c_tok_s=c_tok,
        c_prefill_s=c_tok,
        source="roofline from the NVIDIA H100 SXM datasheet (3.35 TB/s HBM3 at 75%, 989 TFLOPS dense BF16 at 50%) "
               "for a 7.6e9-parameter bf16 model; an estimate, not a measurement",
    )


def _h200_7b() -> CostModel:
    return CostModel(
        name="h200-7b",
        c_base_s=7.5655e-3,
        c_tok_s=31.55e-6,
        fit_error=0.0646,
        source="measured by das bench gpu-cost on an NVIDIA H200 (docs/results/2026-11-27-h200-gpu-cost.md): a "
               "7B-shaped Llama (Qwen2.5-7B's dimensions), random weights, bfloat16, decode forwards at context "
               "4096 with transformers (no vLLM, no sampler, no scheduler); the fit's per-request attention term "
               "(transformers', far dearer than vLLM's) left out",
    )


NAMED = {"h100-7b": _h100_7b, "h200-7b": _h200_7b}


def cost_model_dir(data_dir: Path | None = None) -> Path:
    root = data_dir or Path(os.environ.get("DAS_DATA_DIR", Path.home() / ".cache" / "das"))
    return root / "cost-models"


def load_cost_model(name_or_path: str, data_dir: Path | None = None) -> CostModel:
    """A named model, a JSON file written by `das calibrate`, the name of one in the data directory, or the name of
    a shipped calibration (`SHIPPED`, e.g. cpu-smollm2; one stored under the same name wins)."""
    if name_or_path in NAMED:
        return NAMED[name_or_path]()
    path = Path(name_or_path)
    if not path.exists():
        path = cost_model_dir(data_dir) / f"{name_or_path}.json"
    shipped = {m.name: m for m in SHIPPED.values()}
    if not path.exists() and name_or_path in shipped:
        return shipped[name_or_path]
    if not path.exists():
        known = sorted(NAMED) + sorted(shipped) + sorted(p.stem for p in cost_model_dir(data_dir).glob("*.json"))
        raise ValueError(f"unknown cost model {name_or_path!r}; known: {known}")
    try:
        doc = json.loads(path.read_text())
        return CostModel(**doc)
    except (json.JSONDecodeError, TypeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a cost model file ({exc})") from exc


def save_cost_model(model: CostModel, data_dir: Path | None = None) -> Path:
    """Writes the model as <data_dir>/cost-models/<name>.json (temp file + rename)."""
    out = cost_model_dir(data_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{model.name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(model.to_json())
    os.replace(tmp, path)
    return path


def fit_cost_model(name: str, n_tokens: list[float], step_s: list[float], source: str) -> CostModel:
    """Least-squares fit of t = c_base + c_tok * n over measured steps (at least two distinct n, every step time
    finite and > 0); a negative intercept or slope is clipped to 0."""
    n = np.asarray(n_tokens, dtype=np.float64)
    t = np.asarray(step_s, dtype=np.float64)
    if n.shape != t.shape or len(np.unique(n)) < 2:
        raise ValueError("need step times at two or more distinct token counts")
    if not np.all(np.isfinite(t) & (t > 0)):
        raise ValueError(f"step times must be finite and > 0 seconds, got {t.tolist()}")
    a = np.stack([np.ones_like(n), n], axis=1)
    (c_base, c_tok), *_ = np.linalg.lstsq(a, t, rcond=None)
    c_base, c_tok = max(float(c_base), 0.0), max(float(c_tok), 0.0)
    pred = c_base + c_tok * n
    err = float(np.sqrt(np.mean(((pred - t) / t) ** 2)))
    return CostModel(name=name, c_base_s=c_base, c_tok_s=c_tok, source=source, fit_error=err)


# `das calibrate` of the served engine (float32, compiled, the model worker in the engine core process) on the CPU
# development machine, shipped as priors for the models `das models list` prepares; c_spec and c_spec_req from
# `das bench e2e --profile` (drafted steps against plain ones of the same batch size, less c_tok per draft token).
# Where and how they were measured: docs/design "The online cost model". A prior only starts the fit: every
# engine's cost warm-up measures the drafted-step price at batch sizes 16 to 1 before its first batch.
# Keyed by the directory an engine serves: the registry name in the model's stored dtype (SmolLM2: float32),
# `<name>-<dtype>` for a cast copy (Qwen2.5-Coder is stored in bfloat16, measured in float32).
SHIPPED: dict[str, CostModel] = {
    "smollm2": CostModel("cpu-smollm2", 38.4e-3, 2.23e-3, "das calibrate of the served engine on the 2-core AMD "
                         "development machine, float32", 0.038, c_spec_s=3e-3, c_prefill_s=1.54e-3,
                         c_spec_req_s=0.2e-3),
    "qwen2.5-coder-0.5b-float32": CostModel("cpu-qwen2.5-coder-0.5b", 106e-3, 8.32e-3, "das calibrate of the served "
                                    "engine on the 2-core AMD development machine, float32", 0.051, c_spec_s=7e-3,
                                    c_prefill_s=6.12e-3, c_spec_req_s=0.25e-3),
}

# c_prefill at half of c_tok: a prompt token is computed in one wide pass, cheaper than a decoded one (the measured
# ratios: docs/results "Issue 19's goals re-run"). Without it the online fit has no prefill price: prompts cost c_tok.
GENERIC_PRIOR = CostModel(
    "generic", 20e-3, 0.5e-3, "generic prior: compute-bound (drafts cost 1/40 of a step each) and a drafted step "
    "dearer by half a step, so an engine drafts little until its own steps say otherwise", c_spec_s=10e-3,
    c_prefill_s=0.25e-3)


def prior_name(model_dir: str | os.PathLike[str]) -> str:
    """The name a `das calibrate` result is stored under and looked up by as the prior of an engine serving
    `model_dir` (the prepared directory: a cast copy `<name>-<dtype>` is calibrated apart)."""
    return f"cpu-{Path(model_dir).name}"


def prior_cost_model(model: str, data_dir: Path | None = None) -> CostModel:
    """The prior an engine serving `model` (a known model name or a model directory) starts its online fit from:
    the `das calibrate` result stored for it (`prior_name`) if there is a readable one, else the shipped
    calibration of a named model, else `GENERIC_PRIOR`. A stored file that is corrupt, or that was written for
    another model (its own name is not the file's: a calibration copied or renamed into place), logs a warning and
    is skipped, never raises. A model served in another dtype than its registry's is a copy named `<name>-<dtype>`
    and a model of its own here: a calibration describes the dtype it was measured in,
    so `SHIPPED` is keyed by the served directory's name, and a dtype nobody calibrated starts from the generic
    prior unless `das calibrate` stored one for it."""
    name = Path(model).name
    stored = cost_model_dir(data_dir) / f"{prior_name(model)}.json"
    if stored.exists():
        fallback = "shipped" if name in SHIPPED else "generic"
        try:
            loaded = load_cost_model(str(stored))
        except (ValueError, OSError) as exc:
            log.warning("ignoring the stored cost model %s (%s); using the %s prior", stored, exc, fallback)
        else:
            if loaded.name == stored.stem:
                return loaded
            log.warning("ignoring the stored cost model %s: it was measured for %r, not %r; using the %s prior",
                        stored, loaded.name, stored.stem, fallback)
    return SHIPPED.get(name, GENERIC_PRIOR)


@dataclass(frozen=True)
class CostFitStats:
    """What the online fit has seen: steps used, steps rejected (non-finite, non-positive or implausibly slow
    step times), solves rejected (a fit with a negative or exploding coefficient: the last good fit is kept) and
    the recent relative RMS error of its predictions."""

    steps: int
    rejected_steps: int
    rejected_fits: int
    fit_error: float | None


class OnlineCostModel:
    """`t_step = c_base + c_tok * n_tokens + (c_spec + c_spec_req * requests) * drafted`, fitted from an engine's
    own measured steps.

    Exponentially weighted least squares (a step's weight halves every `half_life_steps` steps, so the fit follows
    the machine's load as it moves) regularised towards the prior with the weight of `prior_steps` steps that
    never fades. The prior is kept as a shape: the fit is t = s (1 + tau n + rho d + rho_r d r) + e_tok n + e_spec d
    + e_req d r, with tau, rho and rho_r the prior's c_tok, c_spec and c_spec_req over c_base, s's prior the prior's
    c_base and the e's prior 0, so c_base = s, c_tok = s tau + e_tok, c_spec = s rho + e_spec, c_spec_req = s rho_r
    + e_req. The scale s weighs 1/200 of the shape in the prior: a machine faster or slower than the prior (the
    common case) moves s at once, and a coefficient the recent steps cannot tell apart (no drafted step seen, one
    batch size only) keeps the prior's proportion to c_base rather than its absolute value, which on a faster
    machine would make drafts look dear for good. The drafted-step price needs drafted steps at several batch sizes
    to split into c_spec and c_spec_req: the engine's cost warm-up gives it sizes 16 down to 1.

    Robust to outliers: a step whose residual exceeds 4 recent mean absolute residuals counts with a Huber weight
    (less the further out it is), and a step time that is not finite, not positive, or more than `max_ratio`
    times the prediction (a paused machine) is rejected and counted. A solve that gives a negative c_base or c_tok
    or a step over 100x the prior's is rejected and counted; the last good fit stays.

    Decode steps only (the proposer skips steps with a prefill in them): c_prefill keeps the prior's proportion to
    c_tok, both being the price of a token's compute.

    n_tokens and requests are scaled by `token_scale` so that the shape's prior weighs about the same on every
    coefficient. Cost: O(1) per step, `observe` a few numpy operations on 4x4 arrays plus one 4x4 solve, `current`
    one CostModel.
    """

    def __init__(self, prior: CostModel, *, prior_steps: float = 2.0, half_life_steps: float = 400.0,
                 token_scale: float = 32.0, max_ratio: float = 20.0) -> None:
        if not (prior_steps > 0 and half_life_steps > 0 and token_scale > 0 and max_ratio > 1):
            raise ValueError("OnlineCostModel: prior_steps, half_life_steps, token_scale > 0 and max_ratio > 1")
        self.prior = prior
        self._decay = 0.5 ** (1.0 / half_life_steps)
        self._token_scale = token_scale
        base = max(prior.c_base_s, 1e-9)
        self._shape = np.array([prior.c_tok_s, prior.c_spec_s, prior.c_spec_req_s]) / base  # tau, rho, rho_r
        self._theta0 = np.array([prior.c_base_s, 0.0, 0.0, 0.0])  # (s, e_tok * token_scale, e_spec, e_req * scale)
        # the scale s is nearly free (a machine faster or slower than the prior is the common case), the shape is not
        self._lambda0 = prior_steps * np.diag([0.005, 1.0, 1.0, 1.0])
        self._gram = np.zeros((4, 4))
        self._moment = np.zeros(4)
        self._max_ratio = max_ratio
        self._theta = self._theta0.copy()
        self._abs_residual = 0.1 * prior.step_time(token_scale)  # running mean |residual|, seconds
        self._sq_rel_error: float | None = None
        self._steps = self._rejected_steps = self._rejected_fits = 0

    def observe(self, n_tokens: float, drafted: bool, step_s: float, requests: float | None = None) -> bool:
        """One measured step of `n_tokens` decode tokens (requests + drafts) of `requests` running requests (None:
        n_tokens, a step without drafts); False when it was rejected. Refits at once."""
        d = 1.0 if drafted else 0.0
        r = n_tokens if requests is None else requests
        tau, rho, rho_r = self._shape
        x = np.array([1.0 + tau * n_tokens + rho * d + rho_r * d * r, n_tokens / self._token_scale, d,
                      d * r / self._token_scale])
        predicted = float(self._theta @ x)
        if not (math.isfinite(step_s) and step_s > 0 and n_tokens >= 0 and r >= 0) \
                or step_s > self._max_ratio * predicted:
            self._rejected_steps += 1
            return False
        residual = step_s - predicted
        weight = 1.0
        bound = 4.0 * self._abs_residual
        if abs(residual) > bound > 0:
            weight = bound / abs(residual)
        self._abs_residual = 0.98 * self._abs_residual + 0.02 * min(abs(residual), 3.0 * bound)
        rel2 = (residual / step_s) ** 2
        self._sq_rel_error = rel2 if self._sq_rel_error is None else 0.98 * self._sq_rel_error + 0.02 * rel2
        self._gram *= self._decay
        self._moment *= self._decay
        self._gram += weight * np.outer(x, x)
        self._moment += weight * step_s * x
        self._steps += 1
        theta = np.linalg.solve(self._gram + self._lambda0, self._moment + self._lambda0 @ self._theta0)
        # c_base or c_tok below 0, or a step beyond 100x the prior's, is no machine: keep the last good fit
        c_base, c_tok, _, _ = self._coefficients(theta)
        limit = 100.0 * self.prior.step_time(self._token_scale, drafted=True)
        if not (np.all(np.isfinite(theta)) and c_base >= 0 and c_tok >= 0
                and c_base + c_tok * self._token_scale < limit):
            self._rejected_fits += 1
            return True
        self._theta = theta
        return True

    def _coefficients(self, theta: np.ndarray) -> tuple[float, float, float, float]:
        """(c_base, c_tok, c_spec, c_spec_req) of the fit's (s, e_tok * token_scale, e_spec, e_req * token_scale)."""
        s, e_tok, e_spec, e_req = (float(v) for v in theta)
        tau, rho, rho_r = (float(v) for v in self._shape)
        return s, s * tau + e_tok / self._token_scale, s * rho + e_spec, s * rho_r + e_req / self._token_scale

    def current(self) -> CostModel:
        """The live fit (c_spec and c_spec_req each clipped at 0: a drafted step is never cheaper than a plain
        one)."""
        c_base, c_tok, c_spec, c_spec_req = self._coefficients(self._theta)
        if c_base + c_tok <= 0:
            return self.prior
        fit_error = math.sqrt(self._sq_rel_error) if self._sq_rel_error is not None else None
        prefill = None
        if self.prior.c_prefill_s is not None and self.prior.c_tok_s > 0:
            prefill = c_tok * self.prior.c_prefill_s / self.prior.c_tok_s
        return CostModel(f"{self.prior.name}+online", c_base, c_tok, f"online fit from {self.prior.name}",
                         fit_error, c_spec_s=max(c_spec, 0.0), c_prefill_s=prefill, c_spec_req_s=max(c_spec_req, 0.0))

    def stats(self) -> CostFitStats:
        fit_error = math.sqrt(self._sq_rel_error) if self._sq_rel_error is not None else None
        return CostFitStats(self._steps, self._rejected_steps, self._rejected_fits, fit_error)
