"""The trainer's side of the service: the HTTP client (`client.py`, re-exported here, so a trainer writes
`from das.service.client import RolloutClient`) and the `das rollout` driver (`rollout_run.py`, with its prompt sets
and code tasks). Importing the package loads the client only: the wire contract, httpx, msgpack and pydantic."""

from das.service.client.client import (
    DEFAULT_TIMEOUT,
    AsyncRolloutClient,
    AsyncRolloutStream,
    BatchFromPreviousRunError,
    RolloutClient,
    RolloutError,
    RolloutStream,
)

__all__ = ["DEFAULT_TIMEOUT", "AsyncRolloutClient", "AsyncRolloutStream", "BatchFromPreviousRunError", "RolloutClient",
           "RolloutError", "RolloutStream"]
