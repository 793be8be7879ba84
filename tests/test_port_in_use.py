"""A port that one server already serves is refused, by the options and by the launcher."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from support.certs import CertificateAuthority
from support.launcher import serve_to_end, taken_port

from vllm_servicer import server_options


async def _bind(options: list[tuple[str, int]], port: int) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(options=options)
    try:
        bound = server.add_insecure_port(f"127.0.0.1:{port}")
    except RuntimeError:
        bound = 0
    return server, bound


@pytest.mark.parametrize(("options", "second_binds"), [([], True), (server_options(), False)])
async def test_a_second_server_on_a_served_port(
    options: list[tuple[str, int]], second_binds: bool
) -> None:
    """grpc's default (SO_REUSEPORT on) lets two servers share a port; ours does not."""
    first, port = await _bind(options, 0)
    await first.start()
    try:
        second, bound = await _bind(options, port)
        assert (bound == port) is second_binds
        await second.stop(None)
    finally:
        await first.stop(None)


@pytest.mark.parametrize("count", ["1", "2"])
@pytest.mark.parametrize("flag", ["--port", "--health-port"])
async def test_the_launcher_refuses_a_port_in_use_before_loading_the_model(
    flag: str, count: str, tmp_path: Path
) -> None:
    """One process or several (`--api-server-count`): the main port, or the
    plaintext probe port beside a TLS one."""
    cert, key = CertificateAuthority("port-ca").server().write(tmp_path, "server")
    with taken_port() as port:
        ports = {"--port": "0", "--health-port": "0", flag: str(port)}
        started = time.monotonic()
        code, text = await serve_to_end(
            "--host", "127.0.0.1", "--api-server-count", count,
            "--tls-cert", str(cert), "--tls-key", str(key),
            *(arg for pair in ports.items() for arg in pair),
        )  # fmt: skip
    assert code == 1, text[-2000:]
    assert f"127.0.0.1:{port} is already in use" in text
    assert f"choose another {flag}" in text
    assert "starting the vLLM engine" not in text, "it loaded the model first"
    print(f"refused in {time.monotonic() - started:.1f} s")
