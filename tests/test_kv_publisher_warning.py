"""vLLM's KV-event publisher, checked by the launcher before the engine starts.

vLLM binds or dials its ZeroMQ publisher by the endpoint's text alone (it
listens on `*`, `::`, `ipc://` and `inproc://` endpoints, dials any other),
with no keys either way. The launcher warns when it listens beyond this
machine, refuses an endpoint it would dial on this machine (nothing listens
there: the events would reach no one), and warns that one dialling another
host leaves it nothing to relay. All of it happens before the model loads, so
each launcher here is stopped at once, by a port that is taken (its refusal is
tested in test_port_in_use.py) or by the refusal itself, with no engine; the
classification is tested on the functions the launcher calls. A launcher that
serves events on the wire: test_router_reads.py.
"""

from __future__ import annotations

import json

import pytest
from support.launcher import serve_to_end, taken_port

WARNING = "KV-event publisher binds"


async def _launcher_log(*flags: str, code: int = 1) -> str:
    """The output of a launcher given `flags`, ended before any engine starts: by a
    taken --port (exit status 1), or by refusing `flags` (`code` 2)."""
    with taken_port() as port:
        exit_code, text = await serve_to_end("--port", str(port), *flags)
    assert exit_code == code and "starting the vLLM engine" not in text, text[-2000:]
    return text


def _events(endpoint: str) -> tuple[str, str]:
    config = {"enable_kv_cache_events": True, "endpoint": endpoint}
    return "--kv-events-config", json.dumps(config)


async def test_vllms_default_endpoint_is_named_in_a_warning() -> None:
    text = await _launcher_log("--kv-events-config", json.dumps({"enable_kv_cache_events": True}))
    (line,) = [line for line in text.splitlines() if WARNING in line]
    assert "WARNING" in line and "tcp://*:5557" in line, line
    # What keeps it on this machine: forms vLLM listens on, not one it dials.
    assert "unauthenticated" in line and "ipc://" in line, line
    assert "tcp://[::ffff:127.0.0.1]:5557" in line and "dials" in line, line


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "0.0.0.0"])
async def test_a_publisher_that_would_dial_this_machine_is_refused(host: str) -> None:
    """vLLM connects to `tcp://127.0.0.1:P` instead of listening on it: no
    router and no SubscribeKvEvents stream would ever see an event."""
    endpoint = f"tcp://{host}:5557"
    text = await _launcher_log(*_events(endpoint), code=2)
    (line,) = [line for line in text.splitlines() if "would connect to" in line]
    assert "ERROR" in line and f"would connect to {endpoint}, not listen" in line, line
    for listening in ("ipc:///path", "tcp://[::ffff:127.0.0.1]:PORT", "tcp://*:PORT"):
        assert listening in line, line


async def test_a_publisher_dialling_another_host_starts_with_a_warning() -> None:
    """vLLM's connect form, as llm-d's scheduler takes events in its central mode."""
    endpoint = "tcp://192.0.2.1:5557"  # an address kept for documentation (RFC 5737)
    text = await _launcher_log(*_events(endpoint))
    (line,) = [line for line in text.splitlines() if "publisher connects to" in line]
    assert "WARNING" in line and endpoint in line, line
    assert "GetKvEventSources names no source" in line, line
    assert WARNING not in text


@pytest.mark.parametrize(
    ("config", "exposed", "dialled"),
    [
        ({"enable_kv_cache_events": True}, ["tcp://*:5557"], None),
        (
            {"enable_kv_cache_events": True, "endpoint": "tcp://[::ffff:10.0.0.7]:6001"},
            ["tcp://[::ffff:10.0.0.7]:6001"],
            None,
        ),
        # Bound on loopback alone (ZeroMQ reads the mapped address as 127.0.0.1).
        ({"enable_kv_cache_events": True, "endpoint": "tcp://[::ffff:127.0.0.1]:6001"}, [], None),
        (
            {
                "enable_kv_cache_events": True,
                "endpoint": "tcp://[::1]:6001",
                "replay_endpoint": "tcp://*:6002",
            },
            ["tcp://*:6002"],
            None,
        ),
        # The replay socket always binds: on loopback here.
        (
            {
                "enable_kv_cache_events": True,
                "endpoint": "ipc:///tmp/kv-events",
                "replay_endpoint": "tcp://127.0.0.1:6002",
            },
            [],
            None,
        ),
        # Dialled, not bound: nothing listens on these.
        (
            {"enable_kv_cache_events": True, "endpoint": "tcp://0.0.0.0:6001"},
            [],
            "tcp://0.0.0.0:6001",
        ),
        (
            {"enable_kv_cache_events": True, "endpoint": "tcp://eth0:6001"},
            [],
            "tcp://eth0:6001",
        ),
        (
            {"enable_kv_cache_events": True, "endpoint": "tcp://localhost:6001"},
            [],
            "tcp://localhost:6001",
        ),
        ({"enable_kv_cache_events": True, "endpoint": "ipc:///tmp/kv-events"}, [], None),
        ({"enable_kv_cache_events": True, "publisher": "null"}, [], None),
        ({"enable_kv_cache_events": False}, [], None),
        (None, [], None),
    ],
)
def test_which_endpoints_are_exposed_or_dialled(
    config: object, exposed: list[str], dialled: str | None
) -> None:
    """Every form the launcher is given (vLLM's parsed config, a mapping, JSON text) alike."""
    from vllm.config import KVEventsConfig

    from vllm_servicer.serve.kv_publisher import dialled_endpoint, exposed_publisher_endpoints

    forms: list[object] = [config]
    if config is not None:
        forms += [json.dumps(config), KVEventsConfig(**config)]  # type: ignore[arg-type]
    for form in forms:
        assert exposed_publisher_endpoints(form) == exposed
        assert dialled_endpoint(form) == dialled


@pytest.mark.parametrize(
    ("endpoint", "refused"),
    [
        ("tcp://127.0.0.1:5557", True),
        ("tcp://127.0.0.2:5557", True),
        ("tcp://localhost:5557", True),
        ("tcp://0.0.0.0:5557", True),
        ("tcp://192.168.1.5;127.0.0.1:5557", True),  # ZeroMQ's source;destination
        ("tcp://10.0.0.7:5557", False),
        ("tcp://epp.example.svc:5557", False),
        ("tcp://*:5557", False),
        ("tcp://[::ffff:127.0.0.1]:5557", False),
        ("ipc:///tmp/kv-events", False),
    ],
)
def test_which_endpoints_are_refused(endpoint: str, refused: bool) -> None:
    from vllm_servicer.serve.kv_publisher import refusal

    assert (refusal({"enable_kv_cache_events": True, "endpoint": endpoint}) is not None) == refused
