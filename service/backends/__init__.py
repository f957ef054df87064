"""Engines without vLLM that the cluster can run in place of it: the stub engine (tests and load tests)."""
