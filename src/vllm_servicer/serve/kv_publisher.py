"""A warning when vLLM's KV-event publisher listens beyond this machine.

With KV events on (`--kv-events-config '{"enable_kv_cache_events": true}'`),
vLLM's engine publishes every block stored and evicted on a ZeroMQ socket it
binds itself, `tcp://*:5557` unless told otherwise: every interface, no
authentication, no encryption. The events carry the block hashes of every
tenant's cached prompts (see docs/security.md), and anyone who reaches the
port may subscribe, outside the keys that guard `SubscribeKvEvents`. The
launcher cannot put keys on vLLM's socket, so it says so and how to keep it
on this machine.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from ..tls import is_loopback

logger = logging.getLogger("vllm_servicer.serve")

__all__ = ["exposed_publisher_endpoints", "warn_if_publisher_exposed"]


def exposed_publisher_endpoints(config: Any) -> list[str]:
    """The TCP endpoints of vLLM's KV-event publisher that bind beyond loopback.

    Args:
        config: vLLM's `kv_events_config` as the engine flags hold it (a
            `KVEventsConfig`, a mapping, JSON text, or None).
    """
    if isinstance(config, str):
        config = json.loads(config)
    if config is None:
        return []
    fields: Mapping[str, Any] = config if isinstance(config, Mapping) else vars(config)

    def get(name: str) -> Any:
        return fields.get(name)

    enabled = bool(get("enable_kv_cache_events"))
    publisher = get("publisher") or ("zmq" if enabled else "null")
    if not enabled or publisher != "zmq":
        return []
    endpoints = [get("endpoint") or "tcp://*:5557", get("replay_endpoint")]
    return [e for e in endpoints if isinstance(e, str) and _tcp_beyond_loopback(e)]


def _tcp_beyond_loopback(endpoint: str) -> bool:
    if not endpoint.startswith("tcp://"):
        return False  # ipc:// and inproc:// stay on this machine
    host = endpoint.removeprefix("tcp://").rpartition(":")[0]
    # ZeroMQ's "source;destination" form: the local side is what binds.
    host = host.partition(";")[0]
    return not is_loopback(host)


def warn_if_publisher_exposed(engine_flags: Mapping[str, Any]) -> bool:
    """Log a WARNING for each exposed publisher endpoint; True when it warned."""
    exposed = exposed_publisher_endpoints(engine_flags.get("kv_events_config"))
    for endpoint in exposed:
        logger.warning(
            "vLLM's KV-event publisher binds %s: unauthenticated and unencrypted, so "
            "anyone who reaches it reads every tenant's cached block hashes, outside the "
            "launcher's keys. Bind it to this machine with "
            '--kv-events-config \'{"enable_kv_cache_events": true, "endpoint": '
            '"tcp://127.0.0.1:5557"}\' (or an ipc:// path), and let subscribers use '
            "SubscribeKvEvents.",
            endpoint,
        )
    return bool(exposed)
