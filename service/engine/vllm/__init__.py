"""vLLM's room: every module of the engine that imports vLLM or torch, or runs inside vLLM's engine core."""
