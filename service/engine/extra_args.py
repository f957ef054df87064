"""Keys of what `Engine` passes per request, in `SamplingParams.extra_args`, to the code it runs inside vLLM's
worker (plain data: vLLM serializes it to the worker). Free of torch and vLLM, so that the service's processes that
never run an engine (stub engines, the coordinator, a restarted actor) import neither."""

SAMPLE_KEY = "das_sample_key"
"""The sample's key (an int64) under keyed sampling (keyed_sampler.py); absent: the request samples unkeyed."""
