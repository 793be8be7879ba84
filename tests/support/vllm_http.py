"""vLLM's own HTTP API as the tests' oracle: a body posted, its numbers as gRPC carries them."""

from __future__ import annotations

import struct
from typing import Any

import httpx


async def post_json(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> Any:
    """vLLM's JSON answer to `body` at `path`, which must be 200."""
    reply = await http.post(path, json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def float32(value: float) -> float:
    """A float as the wire's `float` carries it (vLLM computes in float32)."""
    return float(struct.unpack("f", struct.pack("f", value))[0])
