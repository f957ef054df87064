"""Engine cost model: the time of one forward pass as a function of the tokens it processes.

    t_step = c_base + c_tok * n_tokens        (seconds; n_tokens = running requests + their draft tokens)

c_base is what a step costs however little it computes (reading the weights, launching kernels, scheduling);
c_tok is the marginal cost of one more token verified in the step. Decoding at small batch is memory-bound
(c_base dominates: drafts are nearly free), at large batch compute-bound (c_tok dominates: drafts cost what they
verify). The budget policy and the simulator read these two numbers only.

Named models:
  * `h100-7b`: a 7-8B dense model in bf16 on one H100 SXM, derived from NVIDIA's H100 SXM datasheet (HBM3
    3.35 TB/s, 989 TFLOPS dense BF16) by a roofline with stated efficiencies: reading 15.2 GB of weights
    (Qwen2.5-7B, 7.6e9 parameters) at 75% of peak bandwidth gives c_base = 6.1 ms; 2 * 7.6e9 FLOPs per token at
    50% of peak compute gives c_tok = 30.7 us. These are estimates from published hardware figures, not a
    measurement; every simulated result built on them says so.
  * calibrated models written by `das calibrate` (JSON, one per engine type) are loaded by path or by name from
    the data directory.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

_H100_SXM_HBM_BYTES_PER_S = 3.35e12
_H100_SXM_BF16_DENSE_FLOPS = 989e12
_QWEN25_7B_PARAMS = 7.6e9


@dataclass(frozen=True)
class CostModel:
    """t_step = c_base_s + c_tok_s * n_tokens. `source` says where the numbers come from."""

    name: str
    c_base_s: float
    c_tok_s: float
    source: str
    fit_error: float | None = None  # relative RMS error of the fit, for calibrated models

    def __post_init__(self) -> None:
        if not (self.c_base_s >= 0 and self.c_tok_s >= 0 and self.c_base_s + self.c_tok_s > 0):
            raise ValueError(f"cost model {self.name!r}: need c_base_s, c_tok_s >= 0, not both 0")

    def step_time(self, n_tokens: float) -> float:
        return self.c_base_s + self.c_tok_s * n_tokens

    @property
    def crossover_tokens(self) -> float:
        """Tokens per step at which the per-token cost equals the fixed cost: beyond it drafts stop being cheap."""
        return self.c_base_s / self.c_tok_s if self.c_tok_s else float("inf")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def _h100_7b() -> CostModel:
    return CostModel(
        name="h100-7b",
        c_base_s=_QWEN25_7B_PARAMS * 2 / (0.75 * _H100_SXM_HBM_BYTES_PER_S),
        c_tok_s=2 * _QWEN25_7B_PARAMS / (0.5 * _H100_SXM_BF16_DENSE_FLOPS),
        source="roofline from the NVIDIA H100 SXM datasheet (3.35 TB/s HBM3 at 75%, 989 TFLOPS dense BF16 at 50%) "
               "for a 7.6e9-parameter bf16 model; an estimate, not a measurement",
    )


NAMED = {"h100-7b": _h100_7b}


def cost_model_dir(data_dir: Path | None = None) -> Path:
    root = data_dir or Path(os.environ.get("DAS_DATA_DIR", Path.home() / ".cache" / "das"))
    return root / "cost-models"


def load_cost_model(name_or_path: str, data_dir: Path | None = None) -> CostModel:
    """A named model, a JSON file written by `das calibrate`, or the name of one in the data directory."""
    if name_or_path in NAMED:
        return NAMED[name_or_path]()
    path = Path(name_or_path)
    if not path.exists():
        path = cost_model_dir(data_dir) / f"{name_or_path}.json"
    if not path.exists():
        known = sorted(NAMED) + sorted(p.stem for p in cost_model_dir(data_dir).glob("*.json"))
        raise ValueError(f"unknown cost model {name_or_path!r}; known: {known}")
    try:
        doc = json.loads(path.read_text())
        return CostModel(**doc)
    except (json.JSONDecodeError, TypeError) as exc:
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
    """Least-squares fit of t = c_base + c_tok * n over measured steps (at least two distinct n)."""
    import numpy as np

    n = np.asarray(n_tokens, dtype=np.float64)
    t = np.asarray(step_s, dtype=np.float64)
    if n.shape != t.shape or len(np.unique(n)) < 2:
        raise ValueError("need step times at two or more distinct token counts")
    a = np.stack([np.ones_like(n), n], axis=1)
    (c_base, c_tok), *_ = np.linalg.lstsq(a, t, rcond=None)
    c_base, c_tok = max(float(c_base), 0.0), max(float(c_tok), 0.0)
    pred = c_base + c_tok * n
    err = float(np.sqrt(np.mean(((pred - t) / t) ** 2)))
    return CostModel(name=name, c_base_s=c_base, c_tok_s=c_tok, source=source, fit_error=err)
