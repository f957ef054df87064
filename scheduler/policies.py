"""The names of the draft-budget policies an engine runs: the one list (`BudgetSettings.policy`, `das serve
--budget`, the chart's `engine.budget`, the simulator's arms). Free of numpy, so the command line reads it cheaply.

das: the length-aware optimum (scheduler/budget.py `OptimalPolicy`); uniform: K tokens every step; classes: by
predicted length class."""

from __future__ import annotations

from typing import Literal, get_args

PolicyName = Literal["das", "uniform", "classes"]
POLICIES: tuple[str, ...] = get_args(PolicyName)
