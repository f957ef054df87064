"""Checks of sampled tokens against their distribution (`fit_p_value`) and a rejection sampler's metadata
(`metadata`), shared by the keyed sampling tests."""

from __future__ import annotations

from types import SimpleNamespace

import torch


def fit_p_value(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit of token counts to probs (cells with expected count < 5 merged)."""
    expected = probs.double() * observed.sum()
    big = expected >= 5
    obs = torch.cat([observed[big].double(), observed[~big].double().sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def metadata(temperature: torch.Tensor, generators: dict | None = None) -> SimpleNamespace:
    greedy = temperature == 0
    return SimpleNamespace(temperature=temperature, all_greedy=bool(greedy.all()), all_random=bool((~greedy).all()),
                           generators=generators or {})
