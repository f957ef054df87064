"""The one budget grammar (scheduler/policies.py): names, classes and the plain data that crosses into the engine."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import get_args

import pytest

from das.scheduler.budget import OptimalPolicy
from das.scheduler.cost_model import load_cost_model
from das.scheduler.policies import (
    BUDGETS,
    GRAMMAR,
    ClassesBudget,
    DasBudget,
    DasPlan,
    UniformBudget,
    budget_from_config,
    parse_budget,
)

NAMES = ["das", "das-lengths", "das-token", "das-lengths-exact", "das-token-exact", "uniform", "uniform-0",
         "uniform-8", "uniform-16", "classes", "classes-16-8-0", "classes-12-6-2"]


@pytest.mark.parametrize("name", NAMES)
def test_every_name_round_trips(name):
    budget = parse_budget(name)
    assert budget.name == name
    assert parse_budget(budget.name) == budget
    # as plain data (what crosses into vLLM's engine core) and as its short form (what `das serve --budget` sets)
    assert budget_from_config(budget.model_dump()) == budget_from_config(budget.fields()) == budget
    assert budget_from_config(name) == budget


@pytest.mark.parametrize("name", NAMES)
def test_a_name_is_its_policys_name_where_that_does_not_depend_on_k_max(name):
    policy = parse_budget(name).budget_policy(16)
    assert policy.name == (name if name != "uniform" else "uniform-16")


def test_each_name_makes_its_class():
    assert parse_budget("das") == DasBudget() and DasBudget().plan == "confidence"
    assert parse_budget("das-lengths") == DasBudget(plan="lengths")
    assert parse_budget("das-token-exact") == DasBudget(plan="token", exact_tokens=True)
    assert parse_budget("uniform") == UniformBudget() and UniformBudget().k is None
    assert parse_budget("uniform-8") == UniformBudget(k=8)
    assert parse_budget("classes") == ClassesBudget() and (ClassesBudget().long, ClassesBudget().short) == (16, 4)
    assert parse_budget("classes-16-8-0") == ClassesBudget(short=0)
    assert set(BUDGETS) == {"das", "uniform", "classes"}
    assert all(kind.grammar in GRAMMAR for kind in BUDGETS.values())
    assert get_args(DasPlan) == OptimalPolicy.PLANS  # every plan a das budget names is one the optimum implements


def test_a_das_name_takes_a_cost_model_as_its_prior():
    budget = parse_budget("das-lengths:h100-7b")
    assert budget.name == "das-lengths" and budget.names_cost_model()
    assert budget.prior == dataclasses.asdict(load_cost_model("h100-7b"))
    assert budget.cost_prior() == load_cost_model("h100-7b")
    assert not parse_budget("das").names_cost_model()


@pytest.mark.parametrize("text", ["", "fastest", "none", "das-", "das-exact", "das-confidence", "das-lengths-foo",
                                  "das-token-exact-exact", "uniform-", "uniform-x", "uniform--1", "uniform-08",
                                  "uniform-4..8", "classes-16-8", "classes-a-b-c", "Das", "oracle-k"])
def test_a_bad_name_is_refused_naming_the_grammar(text):
    with pytest.raises(ValueError, match="a budget is one of: das \\| das-lengths") as err:
        parse_budget(text)
    assert f"unknown budget {text!r}" in str(err.value)


@pytest.mark.parametrize("text, why", [("uniform:h100-7b", "only a das name takes :COST_MODEL"),
                                       ("classes:h100-7b", "only a das name takes :COST_MODEL"),
                                       ("das:", "name a cost model after the colon")])
def test_only_das_names_take_a_cost_model(text, why):
    with pytest.raises(ValueError, match=why):
        parse_budget(text)


def test_an_unknown_cost_model_is_refused():
    with pytest.raises(ValueError, match="unknown cost model 'no-such-model'"):
        parse_budget("das:no-such-model")


@pytest.mark.parametrize("kind, option", [(DasBudget, {"k": 4}), (DasBudget, {"long": 8}),
                                          (UniformBudget, {"plan": "lengths"}), (UniformBudget, {"short": 0}),
                                          (UniformBudget, {"exact_tokens": True}), (ClassesBudget, {"k": 4}),
                                          (ClassesBudget, {"plan": "token"}), (ClassesBudget, {"confidence": False})])
def test_each_class_refuses_options_of_another(kind, option):
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):
        kind(**option)
    with pytest.raises(ValueError, match=f"{kind().policy}.{next(iter(option))}\n  Extra inputs"):
        budget_from_config({"policy": kind().policy, **option})


def test_the_spellings_users_could_type_still_parse():
    # `das serve --budget` took das, uniform and classes; `das bench e2e --budget` also das-lengths and das:COST
    for name, expected in (("das", DasBudget()), ("uniform", UniformBudget()), ("classes", ClassesBudget()),
                           ("das-lengths", DasBudget(plan="lengths"))):
        assert parse_budget(name) == expected
    assert parse_budget("das:h100-7b").prior["name"] == "h100-7b"
    # the engine's settings as plain data: no policy is das; earlier releases' booleans read as their plan
    assert budget_from_config({}) == DasBudget()
    assert budget_from_config({"policy": "uniform"}) == UniformBudget()
    assert budget_from_config({"confidence": False}) == DasBudget(plan="lengths")
    assert budget_from_config({"per_token": True}) == DasBudget(plan="token")
    assert budget_from_config({"confidence": False, "per_token": True}) == DasBudget(plan="token")
    assert budget_from_config({"exact_tokens": True}) == DasBudget(plan="lengths", exact_tokens=True)
    assert budget_from_config({"per_token": True, "exact_tokens": True}).name == "das-token-exact"
    assert budget_from_config({"confidence": True}) == DasBudget()
    with pytest.raises(ValueError, match="not confidence or per_token beside it"):
        budget_from_config({"plan": "lengths", "confidence": False})


def test_fields_are_the_policy_and_what_differs_from_the_defaults():
    assert parse_budget("das").fields() == {"policy": "das"}
    assert parse_budget("das-lengths").fields() == {"policy": "das", "plan": "lengths"}
    assert parse_budget("uniform-8").fields() == {"policy": "uniform", "k": 8}
    assert parse_budget("classes-16-8-0").fields() == {"policy": "classes", "short": 0}
    assert DasBudget(guard=False, online=False).fields() == {"policy": "das", "online": False, "guard": False}


def test_the_grammar_loads_no_numpy():
    """The command line reads the grammar (`das serve --budget`) without the numerical code."""
    code = ("import sys; from das.scheduler.policies import parse_budget; "
            "[parse_budget(n).fields() for n in ('das', 'das-lengths', 'uniform-8', 'classes-16-8-0')]; "
            "print('numpy' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"
