"""The Ray service: the coordinator (the gateway's `RolloutBackend`), the per-node engine actors, the history store
and what survives an engine's death. The driver's process imports no vLLM from here (pyproject.toml contracts)."""
