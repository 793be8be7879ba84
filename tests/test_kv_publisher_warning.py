"""The launcher warns when vLLM's KV-event publisher binds beyond this machine.

vLLM binds its ZeroMQ publisher itself (`tcp://*:5557` by default), with no
keys: the warning is all the launcher can add. It is logged before the model
loads, so each launcher here is stopped at once by a port that is taken (its
refusal is tested in test_port_in_use.py), with no engine; which endpoints
count as exposed is tested on the function the launcher calls.
"""

from __future__ import annotations

import json

import pytest
from support.launcher import serve_to_end, taken_port

WARNING = "KV-event publisher binds"


async def _launcher_log(*flags: str) -> str:
    """The output of a launcher given `flags`, ended by a taken --port before any engine starts."""
    with taken_port() as port:
        code, text = await serve_to_end("--port", str(port), *flags)
    assert code == 1 and "starting the vLLM engine" not in text, text[-2000:]
    return text


async def test_vllms_default_endpoint_is_named_in_a_warning() -> None:
    text = await _launcher_log("--kv-events-config", json.dumps({"enable_kv_cache_events": True}))
    (line,) = [line for line in text.splitlines() if WARNING in line]
    assert "WARNING" in line and "tcp://*:5557" in line, line
    assert "unauthenticated" in line and "tcp://127.0.0.1:5557" in line, line


@pytest.mark.parametrize(
    ("config", "exposed"),
    [
        ({"enable_kv_cache_events": True}, ["tcp://*:5557"]),
        (
            {"enable_kv_cache_events": True, "endpoint": "tcp://0.0.0.0:6001"},
            ["tcp://0.0.0.0:6001"],
        ),
        ({"enable_kv_cache_events": True, "endpoint": "tcp://eth0:6001"}, ["tcp://eth0:6001"]),
        (
            {
                "enable_kv_cache_events": True,
                "endpoint": "tcp://[::1]:6001",
                "replay_endpoint": "tcp://*:6002",
            },
            ["tcp://*:6002"],
        ),
        ({"enable_kv_cache_events": True, "endpoint": "tcp://localhost:6001"}, []),
        ({"enable_kv_cache_events": True, "endpoint": "ipc:///tmp/kv-events"}, []),
        ({"enable_kv_cache_events": True, "publisher": "null"}, []),
        ({"enable_kv_cache_events": False}, []),
        (None, []),
    ],
)
def test_which_endpoints_count_as_exposed(config: object, exposed: list[str]) -> None:
    """Every form the launcher is given (vLLM's parsed config, a mapping, JSON text) alike."""
    from vllm.config import KVEventsConfig

    from vllm_servicer.serve.kv_publisher import exposed_publisher_endpoints

    assert exposed_publisher_endpoints(config) == exposed
    if config is not None:
        assert exposed_publisher_endpoints(json.dumps(config)) == exposed
        assert exposed_publisher_endpoints(KVEventsConfig(**config)) == exposed  # type: ignore[arg-type]
