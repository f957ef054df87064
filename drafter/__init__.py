"""The drafter: suffix index over recent rollouts, per-problem windowed history, draft selection."""
