"""Keys of what `Engine` passes per request, in `SamplingParams.extra_args`, to the code it runs inside vLLM's
worker (plain data: vLLM serializes it to the worker). Free of torch and vLLM, so that the service's processes that
never run an engine (stub engines, the coordinator, a restarted actor) import neither."""

SAMPLE_KEY = "das_sample_key"
"""The sample's key (an int64) under keyed sampling (keyed_sampler.py); absent: the request samples unkeyed."""

POSITION_OFFSET = "das_position_offset"
"""Tokens of the sample generated before this request (an int; absent: 0): a sample resumed after its engine died
runs as prompt + the tokens it had delivered, and its keyed positions (keyed_sampler.py) count those tokens, so it
draws what the undisturbed sample would have."""
