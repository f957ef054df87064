"""The HTTP gateway (FastAPI) over a `RolloutBackend`: the batch API, the OpenAI-compatible and RL-control routes,
Prometheus metrics and the journal of accepted batches."""
