"""A large history import through `RolloutClient.add_history`: the client cuts it into requests under the gateway's
body limit (`GatewaySettings.max_body_bytes`, 64 MiB by default), so an import of any size goes through.

The gateway (StubBackend, which validates and counts the records as the engines do) runs in this process, called
through httpx's ASGI transport (no socket), with its default limits. Prints the import's size in JSON bytes, the
requests it took, the records stored and the seconds.

Run: .venv/bin/python loadtests/history_import.py --mb 100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import httpx

from das.service.client import AsyncRolloutClient
from das.service.client.history_chunks import history_bodies
from das.service.cluster.rollout_backend import StubBackend
from das.service.http.gateway import GatewaySettings, create_app


def records(megabytes: float, output_tokens: int) -> list[dict[str, Any]]:
    """History records of `output_tokens` tokens each, about `megabytes` MB of JSON in all."""
    one = {"problem_id": "p0", "policy_version": 0, "sample_index": 0, "prompt_token_ids": [1, 2, 3, 4],
           "output_token_ids": [(7 * t) % 30000 for t in range(output_tokens)], "finish_reason": "stop"}
    count = max(1, int(megabytes * 1e6 / len(json.dumps(one, separators=(",", ":")))))
    return [{**one, "problem_id": f"p{i % 1000}", "sample_index": i} for i in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=100.0, help="size of the import, MB of JSON")
    parser.add_argument("--tokens", type=int, default=2048, help="output tokens per record")
    args = parser.parse_args()
    data = records(args.mb, args.tokens)
    settings = GatewaySettings()
    backend = StubBackend()

    async def run() -> tuple[int, int, float]:
        transport = httpx.ASGITransport(app=create_app(backend, settings))
        async with AsyncRolloutClient("http://gateway", transport=transport, timeout=600) as client:
            bodies = sum(1 for _ in history_bodies(data, client.max_body_bytes, client.max_history_records))
            start = time.perf_counter()
            added = await client.add_history(data)
            return bodies, added, time.perf_counter() - start

    bodies, added, elapsed = asyncio.run(run())
    size = sum(len(json.dumps(r, separators=(",", ":"))) for r in data)
    print(json.dumps({"records": len(data), "json_mb": round(size / 1e6, 1), "requests": bodies,
                      "body_limit_mb": round(settings.max_body_bytes / 1e6, 1), "added": added,
                      "stored_by_backend": backend.history_records, "seconds": round(elapsed, 1)}))
    if added != len(data) or backend.history_records != len(data):
        raise SystemExit("not every record was stored")


if __name__ == "__main__":
    main()
