"""vLLM's KV-event publisher, checked before the engine starts: where it listens, and for whom.

With KV events on (`--kv-events-config '{"enable_kv_cache_events": true}'`),
vLLM's engine publishes every block stored and evicted on a ZeroMQ socket of
its own, with no authentication and no encryption; the events carry every
tenant's cached tokens and block hashes (see docs/security.md), outside the
keys that guard `SubscribeKvEvents`. vLLM decides by the endpoint's text
whether that socket listens or dials (`servicer.kv_events.listens`): it
listens on an endpoint with `*` or `::` in it, or an `ipc://` or `inproc://`
one, and connects to any other. Hence three cases, each settled before the
model loads:

- it listens beyond this machine (`tcp://*:5557`, vLLM's default): a WARNING
  names the endpoint and how to keep it here; the launcher cannot put keys on
  vLLM's socket;
- it would dial this machine (`tcp://127.0.0.1:5557`, `localhost`,
  `0.0.0.0`): whoever writes a local TCP address means vLLM to listen on it,
  which it cannot as written, so neither a router nor `SubscribeKvEvents`
  would ever see an event; the launcher refuses to start, naming the forms
  that listen. (A collector on this machine that listens itself is refused
  too: name it by this machine's network address, the case below.)
- it dials another host: vLLM's way of pushing events to a subscriber that
  listens (llm-d's scheduler does, in its central mode), so it starts, with a
  WARNING that this launcher has no events to relay or name.
"""

from __future__ import annotations

import ipaddress
import json
import logging
from collections.abc import Mapping
from typing import Any

from ..servicer.kv_events import LISTENING_FORMS, listens
from ..tls import is_loopback

logger = logging.getLogger("vllm_servicer.serve")

__all__ = [
    "check_kv_publisher",
    "dialled_endpoint",
    "exposed_publisher_endpoints",
    "refusal",
    "warn_if_publisher_exposed",
]

# The exit status of a launcher refused for its flags, as argparse's.
REFUSED_EXIT = 2


def _fields(config: Any) -> Mapping[str, Any] | None:
    """vLLM's `kv_events_config` as a mapping, when it publishes over ZeroMQ; else None.

    Args:
        config: as the engine flags hold it (a `KVEventsConfig`, a mapping,
            JSON text, or None).
    """
    if isinstance(config, str):
        config = json.loads(config)
    if config is None:
        return None
    fields: Mapping[str, Any] = config if isinstance(config, Mapping) else vars(config)
    enabled = bool(fields.get("enable_kv_cache_events"))
    publisher = fields.get("publisher") or ("zmq" if enabled else "null")
    return fields if enabled and publisher == "zmq" else None


def _endpoint(fields: Mapping[str, Any]) -> str:
    return str(fields.get("endpoint") or "tcp://*:5557")  # vLLM's default


def exposed_publisher_endpoints(config: Any) -> list[str]:
    """The endpoints vLLM's KV-event publisher listens on beyond this machine.

    The publisher's own endpoint when vLLM binds it (see the module's
    docstring) to anything but loopback; its replay endpoint, which vLLM
    always binds, likewise.

    Args:
        config: vLLM's `kv_events_config` as the engine flags hold it (a
            `KVEventsConfig`, a mapping, JSON text, or None).
    """
    fields = _fields(config)
    if fields is None:
        return []
    endpoint, replay = _endpoint(fields), fields.get("replay_endpoint")
    exposed = [endpoint] if listens(endpoint) and _tcp_beyond_loopback(endpoint) else []
    if isinstance(replay, str) and _tcp_beyond_loopback(replay):
        exposed.append(replay)
    return exposed


def dialled_endpoint(config: Any) -> str | None:
    """The publisher's endpoint when vLLM connects to it rather than listening; else None.

    Args:
        config: as `exposed_publisher_endpoints` takes it.
    """
    fields = _fields(config)
    if fields is None:
        return None
    endpoint = _endpoint(fields)
    return None if listens(endpoint) else endpoint


def refusal(config: Any) -> str | None:
    """Why the launcher must not start with this publisher configuration; None when it may.

    Refused: a publisher that would dial an address of this machine, where
    its events reach no one.

    Args:
        config: as `exposed_publisher_endpoints` takes it.
    """
    endpoint = dialled_endpoint(config)
    if endpoint is None or not _dials_this_machine(endpoint):
        return None
    return (
        f"--kv-events-config: vLLM's KV-event publisher would connect to {endpoint}, not "
        "listen on it (vLLM listens only on an endpoint with '*' or '::' in it, or an "
        "ipc:// or inproc:// one), so no router and no SubscribeKvEvents stream would ever "
        f"receive an event. Give it an endpoint that listens: {LISTENING_FORMS}"
    )


def _host(endpoint: str) -> str:
    """The host of a `tcp://host:port` endpoint, brackets and an IPv4-mapped prefix removed."""
    host = endpoint.removeprefix("tcp://").rpartition(":")[0]
    host = host.removeprefix("[").removesuffix("]")
    try:
        mapped = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(mapped, ipaddress.IPv6Address) and mapped.ipv4_mapped is not None:
        return str(mapped.ipv4_mapped)  # ZeroMQ binds [::ffff:a.b.c.d] as a.b.c.d
    return host


def _tcp_beyond_loopback(endpoint: str) -> bool:
    """Whether a bound endpoint is reachable from other machines."""
    if not endpoint.startswith("tcp://"):
        return False  # ipc:// and inproc:// stay on this machine
    # ZeroMQ's "source;destination" form: the local side is what binds.
    return not is_loopback(_host(endpoint.partition(";")[0]))


def _dials_this_machine(endpoint: str) -> bool:
    """Whether a dialled endpoint is this machine: loopback, or 0.0.0.0 (Linux dials itself)."""
    if not endpoint.startswith("tcp://"):
        return False
    # ZeroMQ's "source;destination" form: the destination is what is dialled.
    destination = "tcp://" + endpoint.removeprefix("tcp://").rpartition(";")[2]
    host = _host(destination)
    if is_loopback(host):
        return True
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def warn_if_publisher_exposed(engine_flags: Mapping[str, Any]) -> bool:
    """Log a WARNING for each exposed publisher endpoint; True when it warned."""
    exposed = exposed_publisher_endpoints(engine_flags.get("kv_events_config"))
    for endpoint in exposed:
        logger.warning(
            "vLLM's KV-event publisher binds %s: unauthenticated and unencrypted, so "
            "anyone who reaches it reads every tenant's cached tokens and block hashes, "
            "outside the launcher's keys. Keep it on this machine with an ipc:// path "
            '(--kv-events-config \'{"enable_kv_cache_events": true, "endpoint": '
            '"ipc:///run/vllm/kv-events"}\') or "tcp://[::ffff:127.0.0.1]:5557" (not '
            '"tcp://127.0.0.1:5557", which vLLM dials instead of listening on), and let '
            "subscribers use SubscribeKvEvents; or firewall the port to the routers.",
            endpoint,
        )
    return bool(exposed)


def check_kv_publisher(engine_flags: Mapping[str, Any]) -> None:
    """Refuse a publisher that would dial this machine; warn of one exposed or dialling out.

    Args:
        engine_flags: the launcher's engine flags (`ServeArgs.engine`).

    Raises:
        SystemExit: with status 2, after logging why, for a configuration
            `refusal` names.
    """
    config = engine_flags.get("kv_events_config")
    why = refusal(config)
    if why is not None:
        logger.error("%s", why)
        raise SystemExit(REFUSED_EXIT)
    warn_if_publisher_exposed(engine_flags)
    endpoint = dialled_endpoint(config)
    if endpoint is not None:
        logger.warning(
            "vLLM's KV-event publisher connects to %s (vLLM dials any endpoint without "
            "'*' or '::' in it, other than ipc:// and inproc://): its events go to the "
            "subscriber listening there and nowhere else, so GetKvEventSources names no "
            "source and SubscribeKvEvents has none to relay here. For those, give it an "
            "endpoint that listens: %s",
            endpoint,
            LISTENING_FORMS,
        )
