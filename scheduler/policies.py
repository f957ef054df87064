"""The draft budgets an engine can run, in one grammar: a configuration class per plan (`DasBudget`,
`UniformBudget`, `ClassesBudget`; the pydantic union `Budget`, discriminated by `policy`) and one parser from a
short name to it (`parse_budget`). Every budget a user or a benchmark names goes through here: the engine's
setting (`EngineConfig.budget`, which crosses into vLLM's engine core as plain data: `model_dump`), `das serve
--budget`, the chart's `engine.budget`, `das bench e2e --budget`, the simulator's arms and the e2e arms that run a
budget. Free of numpy (a class builds its `das.scheduler.budget` policy only when asked), so the command line reads
it cheaply.

The names (`GRAMMAR`):
  das | das-lengths | das-token | das-lengths-exact | das-token-exact   the length-aware optimum
      (`budget.OptimalPolicy`): das prices each draft token by the drafter's own estimate, das-lengths
      plans K_i from acceptance counts, das-token uses those K_i's marginal as a per-token floor; -exact charges
      only the draft tokens expected to be rejected. Each takes `:COST_MODEL` (a named or calibrated cost model,
      `cost_model.load_cost_model`): the prior of its step cost fit.
  uniform | uniform-K      K draft tokens per request every step (uniform: K_max).
  classes | classes-L-M-S  by predicted length class: long / medium / short (default 16 / 8 / 4).
A name is the class's `name`, so `parse_budget(b.name)` gives `b` back (cost model aside).

Adding a plan: its class (the fields its plan reads, its guard default, `name`, `name_fields`, `budget_policy`) and
its line in `BUDGETS`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, model_validator

if TYPE_CHECKING:
    from das.scheduler.budget import BudgetPolicy
    from das.scheduler.cost_model import CostModel

DasPlan = Literal["confidence", "lengths", "token"]
_COEFFICIENTS = ("c_base_s", "c_tok_s", "c_spec_s", "c_spec_req_s")
_COUNT = re.compile(r"0|[1-9][0-9]*")


class BudgetBase(BaseModel):
    """What every budget shares: the step cost model it starts from, `prior` (CostModel fields; default `GENERIC_PRIOR`,
    or the engine's prior for its model: the engine configuration's `budget_settings`) or its coefficients alone
    (`c_base_s`, `c_tok_s`, `c_spec_s`, `c_spec_req_s`, seconds); `online` (fit it from the engine's own steps; False:
    keep the prior); `guard` (the never-a-loss guard, `budget_hook.SpeculationGuard`: each class sets its default) and
    `acceptance` (the geometric ratio assumed for requests without measured acceptance)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    grammar: ClassVar[str]  # its names, as `GRAMMAR` lists them
    priced: ClassVar[bool] = False  # whether its plan reads the cost model: then its name takes `:COST_MODEL`

    policy: str  # the discriminator: each class narrows it to its key in `BUDGETS`
    prior: dict[str, Any] | None = None
    c_base_s: float | None = Field(None, ge=0, allow_inf_nan=False)
    c_tok_s: float | None = Field(None, ge=0, allow_inf_nan=False)
    c_spec_s: float | None = Field(None, ge=0, allow_inf_nan=False)
    c_spec_req_s: float | None = Field(None, ge=0, allow_inf_nan=False)
    online: bool = True
    guard: bool = False
    acceptance: float = Field(0.6, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _one_cost_model(self) -> BudgetBase:
        if self.prior is not None and self.coefficients():
            raise ValueError("give the budget's cost model as prior or as its coefficients, not both")
        if self.names_cost_model():
            self.cost_prior()  # a prior that is not a cost model fails here, where the service starts
        return self

    @property
    def name(self) -> str:
        """Its name in the grammar (the policy's `name` where that does not depend on K_max)."""
        raise NotImplementedError

    @classmethod
    def name_fields(cls, rest: str) -> dict[str, Any] | None:
        """The fields a name of this class sets, from what follows `<policy>-` in it ("" for the bare policy);
        None where `rest` is not one of its names."""
        raise NotImplementedError

    def budget_policy(self, k_max: int) -> BudgetPolicy:
        """The scheduler.budget policy this budget names, for drafts of at most `k_max` tokens."""
        raise NotImplementedError

    def fields(self) -> dict[str, Any]:
        """Its policy and the fields that differ from its class's defaults, as plain data."""
        return {"policy": self.policy, **self.model_dump(exclude_defaults=True)}

    def coefficients(self) -> dict[str, float]:
        """The cost coefficients given one by one."""
        return {key: value for key in _COEFFICIENTS if (value := getattr(self, key)) is not None}

    def names_cost_model(self) -> bool:
        """Whether this budget gives its cost model (else the engine supplies its prior)."""
        return self.prior is not None or bool(self.coefficients())

    def cost_prior(self) -> CostModel:
        """The cost model the budget starts from. ValueError where `prior` is not a valid cost model."""
        from das.scheduler.cost_model import GENERIC_PRIOR, CostModel  # numpy: only once a cost model is read

        if self.prior is not None:
            try:
                return CostModel(**self.prior)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"budget prior {self.prior!r} is not a cost model: {exc}") from None
        fixed = self.coefficients()
        if fixed:  # shorthand: the prior's coefficients given one by one (e.g. a bench arm's fixed cost model)
            try:
                return CostModel("configured", **{"c_base_s": 0.0, "c_tok_s": 0.0, **fixed}, source="budget settings")
            except ValueError as exc:
                raise ValueError(f"budget cost settings {fixed!r}: {exc}") from None
        return GENERIC_PRIOR


class DasBudget(BudgetBase):
    """The length-aware optimum (`budget.OptimalPolicy`), guarded by default. `plan`: confidence (up
    to K_max tokens while the drafter's estimate pays for each: `confidence_plan`), lengths (the optimum's K_i
    from acceptance counts) or token (up to K_max tokens above the K_i's marginal as a per-token floor);
    `exact_tokens` (lengths and token only): the optimum's token term charges only the draft tokens expected to be
    rejected. The settings of earlier releases, `confidence`, `per_token` (booleans), are read as their plan."""

    grammar: ClassVar[str] = "das | das-lengths | das-token | das-lengths-exact | das-token-exact"
    priced: ClassVar[bool] = True

    policy: Literal["das"] = "das"
    plan: DasPlan = "confidence"
    exact_tokens: bool = False
    guard: bool = True

    @model_validator(mode="before")
    @classmethod
    def _earlier_settings(cls, data: Any) -> Any:
        """The plan of the settings of earlier releases, booleans: {"confidence": false} (das-lengths), {"per_token":
        true} (das-token), {"exact_tokens": true} without a plan (das-lengths-exact)."""
        if not isinstance(data, Mapping) or ("plan" in data and not {"confidence", "per_token"} & set(data)):
            return data
        data = dict(data)
        confidence, per_token = data.pop("confidence", None), data.pop("per_token", None)
        if "plan" in data:
            raise ValueError("give the das budget's plan, not confidence or per_token beside it")
        exact = data.get("exact_tokens")
        if confidence is None:
            confidence = not (per_token or exact)
        if confidence and (per_token or exact):
            raise ValueError("the das budget's confidence plan takes neither per_token nor exact_tokens")
        data["plan"] = "confidence" if confidence else "token" if per_token else "lengths"
        return data

    @model_validator(mode="after")
    def _exact_needs_lengths(self) -> DasBudget:
        if self.exact_tokens and self.plan == "confidence":
            raise ValueError("the das budget's confidence plan takes no exact_tokens (das-lengths-exact and "
                             "das-token-exact do)")
        return self

    @property
    def name(self) -> str:
        return ("das" if self.plan == "confidence" else f"das-{self.plan}") + ("-exact" if self.exact_tokens else "")

    @classmethod
    def name_fields(cls, rest: str) -> dict[str, Any] | None:
        plan, _, exact = rest.partition("-")
        if rest == "":
            return {}
        if plan in ("lengths", "token") and exact in ("", "exact"):
            return {"plan": plan, "exact_tokens": exact == "exact"}
        return None

    def budget_policy(self, k_max: int) -> BudgetPolicy:
        from das.scheduler.budget import OptimalPolicy

        return OptimalPolicy(self.plan, exact_tokens=self.exact_tokens)


class UniformBudget(BudgetBase):
    """`k` draft tokens per request every step (default: K_max), unguarded: the fixed-K baseline."""

    grammar: ClassVar[str] = "uniform | uniform-K"

    policy: Literal["uniform"] = "uniform"
    k: int | None = Field(None, ge=0)

    @property
    def name(self) -> str:
        return "uniform" if self.k is None else f"uniform-{self.k}"

    @classmethod
    def name_fields(cls, rest: str) -> dict[str, Any] | None:
        if rest == "":
            return {}
        return {"k": int(rest)} if _COUNT.fullmatch(rest) else None

    def budget_policy(self, k_max: int) -> BudgetPolicy:
        from das.scheduler.budget import UniformPolicy

        return UniformPolicy(k_max if self.k is None else self.k)


class ClassesBudget(BudgetBase):
    """Draft tokens by predicted length class (`budget.ClassPolicy`): `long`, `medium`, `short`,
    unguarded."""

    grammar: ClassVar[str] = "classes | classes-L-M-S"

    policy: Literal["classes"] = "classes"
    long: int = Field(16, ge=0)
    medium: int = Field(8, ge=0)
    short: int = Field(4, ge=0)

    @property
    def name(self) -> str:
        default = (self.long, self.medium, self.short) == (16, 8, 4)
        return "classes" if default else f"classes-{self.long}-{self.medium}-{self.short}"

    @classmethod
    def name_fields(cls, rest: str) -> dict[str, Any] | None:
        if rest == "":
            return {}
        levels = rest.split("-")
        if len(levels) != 3 or not all(_COUNT.fullmatch(v) for v in levels):
            return None
        return dict(zip(("long", "medium", "short"), map(int, levels)))

    def budget_policy(self, k_max: int) -> BudgetPolicy:
        from das.scheduler.budget import ClassPolicy

        return ClassPolicy(self.long, self.medium, self.short)


# The registry: a name's policy (its first word) -> the class that reads the rest.
BUDGETS: dict[str, type[BudgetBase]] = {
    "das": DasBudget,
    "uniform": UniformBudget,
    "classes": ClassesBudget,
}
DEFAULT_POLICY = "das"  # a budget given as fields without a policy
_PRICED = " or ".join(policy for policy, kind in BUDGETS.items() if kind.priced)
GRAMMAR = " | ".join(kind.grammar for kind in BUDGETS.values()) + f" (a {_PRICED} name may end in :COST_MODEL)"


def parse_budget(text: str) -> BudgetBase:
    """The budget a name of the grammar (module docstring, `GRAMMAR`) names, e.g. `uniform-8`, `das-lengths` or
    `das:h100-7b` (whose cost model is loaded here: `cost_model.load_cost_model`). ValueError naming
    the grammar where `text` is none of its names."""
    name, colon, cost = text.strip().partition(":")
    policy, dash, rest = name.partition("-")
    kind = BUDGETS.get(policy)
    fields = kind.name_fields(rest) if kind is not None and bool(dash) == bool(rest) else None
    if kind is None or fields is None:
        raise ValueError(f"unknown budget {text!r}; a budget is one of: {GRAMMAR}")
    if colon:
        if not (kind.priced and cost):
            why = "name a cost model after the colon" if kind.priced else f"only a {_PRICED} name takes :COST_MODEL"
            raise ValueError(f"budget {text!r}: {why} (a named or calibrated cost model, e.g. das:h100-7b); a "
                             f"budget is one of: {GRAMMAR}")
        from das.scheduler.cost_model import load_cost_model

        fields["prior"] = dataclasses.asdict(load_cost_model(cost))
    return kind(**fields)


def _read(data: Any) -> Any:
    """A budget from its name or from its fields (plain data): a name is parsed; fields without a policy are das's."""
    if isinstance(data, str):
        return parse_budget(data)
    if isinstance(data, Mapping) and "policy" not in data:
        return {"policy": DEFAULT_POLICY, **data}
    return data


Budget = Annotated[Union[tuple(BUDGETS.values())], Field(discriminator="policy"),  # type: ignore[valid-type]
                   BeforeValidator(_read)]
"""One engine's draft budget: an instance of a class of `BUDGETS`; read from a name of the grammar or from its
fields as plain data (`{"policy": "uniform", "k": 4}`; no policy: das), as `EngineConfig.budget` and
`budget_from_config` do."""

_BUDGET = TypeAdapter(Budget, config=ConfigDict(title="budget"))


def budget_from_config(config: BudgetBase | Mapping[str, Any] | str) -> BudgetBase:
    """The budget `config` describes: a budget, its fields as plain data (what crosses into vLLM's engine core) or
    a name of the grammar. ValueError (pydantic's ValidationError) where it is none."""
    return config if isinstance(config, BudgetBase) else _BUDGET.validate_python(config)
