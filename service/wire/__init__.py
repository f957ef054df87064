"""The types that cross a boundary (HTTP, Ray, the engine): the batch API, OpenAI's protocol, keyed sampling's seeds.
Pydantic only (no numpy): the trainer's client imports it."""
