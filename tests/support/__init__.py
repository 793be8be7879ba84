"""The tests' support package: what more than one test file needs.

The everyday names are importable from the package itself
(``from support import request, serving``); the rest from their modules:

- `calls`: GenerateRequests to send, and reading what a call answered (a refusal's
  google.rpc.Status and its details too: `error_info`, `detail`, `status_of`).
- `probes`: polling a condition, the requests an engine still holds, memory.
- `servers`: `serving` (an engine mounted on loopback), interceptor placements,
  bearer metadata, free ports.
- `launcher`: the launcher and examples run in processes of their own.
- `recipe`: the Kubernetes recipe's launcher, with its Deployment's arguments
  (the `recipe_launcher` session fixture, offered by conftest.py).
- `certs`: CAs and certificates made on the fly.
- `router_side`: image input as a router preprocesses it.
- `vllm_http`: vLLM's own HTTP API as an oracle (a JSON body posted, float32 numbers).
- `kv_echo_connector`: a KV connector that hands its params back (loaded by the engine).

`tests/` has no `__init__.py`, so pytest's default import mode ("prepend") puts
it on `sys.path` when it imports `conftest.py`; the engine processes vLLM
spawns inherit that path, so they can load `support.kv_echo_connector`.
"""

from .calls import (
    collect,
    completes,
    error_info,
    next_kv_event,
    request,
    streamed_tokens,
    unique_prompt,
)
from .probes import hold_hand_over, note_releases, rss_kb, settle, unfinished, wait_until_idle
from .servers import (
    ENGINE_STOP_SECONDS,
    KV_TOPIC,
    PLACEMENTS,
    Serving,
    bearer,
    free_port,
    loopback_kv_events,
    placed,
    serving,
)

__all__ = [
    "ENGINE_STOP_SECONDS",
    "KV_TOPIC",
    "PLACEMENTS",
    "Serving",
    "bearer",
    "collect",
    "completes",
    "error_info",
    "next_kv_event",
    "free_port",
    "hold_hand_over",
    "loopback_kv_events",
    "placed",
    "note_releases",
    "request",
    "rss_kb",
    "serving",
    "settle",
    "streamed_tokens",
    "unique_prompt",
    "unfinished",
    "wait_until_idle",
]
