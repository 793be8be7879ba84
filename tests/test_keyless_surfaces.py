"""What needs no key stays apart from keyed work, at the launcher as shipped.

Health `Watch` and reflection streams need no key. They used to count toward
`--max-concurrent-rpcs` like any call: thirty of them, at a limit of 30, and
every later call was RESOURCE_EXHAUSTED, keyed or not; the probe port's 64
slots filled the same way, and a liveness probe failed. Now they have caps of
their own, on top of the keyed calls' slots, and `Check` keeps slots the
streams cannot take. And without a key, `vllm.Control` (shutdown, sleep,
adapters, weight updates) is served only when `--services` names it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from support import bearer, collect, request
from support.certs import CertificateAuthority
from support.launcher import START_TIMEOUT, launch, launched, stop_launched

from vllm_servicer.interceptors.keyless import KeylessLimits
from vllm_servicer.proto import control_pb2, control_pb2_grpc, vllm_engine_pb2_grpc
from vllm_servicer.proto import vllm_engine_pb2 as pb
from vllm_servicer.serve.args import parse_args
from vllm_servicer.serve.preflight import CONTROL_ALLOWS, addresses_usable
from vllm_servicer.serve.probe_port import PROBE_PORT_LIMITS

pytestmark = pytest.mark.timeout(START_TIMEOUT + 240)

KEY = "keyless-test-0123456789abcdefABCDEF"
SERVING = health_pb2.HealthCheckResponse.SERVING
MAX_CONCURRENT_RPCS = 30
DEFAULTS = KeylessLimits()


@pytest.fixture(autouse=True)
def _no_key_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_SERVICER_ADMIN_API_KEY", raising=False)


def _env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    env = {**os.environ, "VLLM_SERVICER_CACHE": str(tmp_path_factory.mktemp("cache"))}
    env.pop("VLLM_API_KEY", None)
    env.pop("VLLM_SERVICER_ADMIN_API_KEY", None)
    return env


class Connections:
    """Channels that each hold a TCP connection of their own (no shared subchannel)."""

    def __init__(self, address: str, credentials: grpc.ChannelCredentials | None) -> None:
        self._address = address
        self._credentials = credentials
        self._channels: list[grpc.aio.Channel] = []
        self._calls: list[Any] = []

    def open(self) -> grpc.aio.Channel:
        options = [("grpc.use_local_subchannel_pool", 1)]
        if self._credentials is None:
            channel = grpc.aio.insecure_channel(self._address, options=options)
        else:
            channel = grpc.aio.secure_channel(self._address, self._credentials, options=options)
        self._channels.append(channel)
        return channel

    async def watch(self, channel: grpc.aio.Channel) -> grpc.StatusCode | str:
        """A health Watch left open: OK once its first status came, else the refusal."""
        call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        self._calls.append(call)
        return await _first(call)

    async def reflect(self, channel: grpc.aio.Channel) -> grpc.StatusCode | str:
        """A reflection stream left open after its first answer, or the refusal."""
        requests: asyncio.Queue[Any] = asyncio.Queue()
        await requests.put(reflection_pb2.ServerReflectionRequest(list_services=""))

        async def pending() -> AsyncIterator[Any]:
            while True:
                yield await requests.get()

        call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(pending())
        self._calls.append(call)
        return await _first(call)

    async def close(self) -> None:
        for call in self._calls:
            call.cancel()
        for channel in self._channels:
            await channel.close()


async def _first(call: Any) -> grpc.StatusCode | str:
    try:
        await asyncio.wait_for(call.read(), 30)
    except grpc.aio.AioRpcError as err:
        return f"{err.code().name}: {err.details()}"
    return grpc.StatusCode.OK


async def _check(channel: grpc.aio.Channel) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(), timeout=10
    )
    return int(reply.status)


async def _generate(channel: grpc.aio.Channel) -> str:
    replies = await collect(
        vllm_engine_pb2_grpc.VllmEngineStub(channel).Generate(
            request(max_tokens=2, ignore_eos=True), metadata=bearer(KEY), timeout=60
        )
    )
    return str(replies[-1].complete.finish_reason)


async def test_keyless_streams_take_no_slot_of_a_keyed_call_nor_of_a_probe(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    folder = tmp_path_factory.mktemp("keyless")
    ca = CertificateAuthority("keyless-ca")
    cert, key = ca.server().write(folder, "server")
    served = await launch(
        "--tls-cert", str(cert), "--tls-key", str(key), "--health-port", "0", "--api-key", KEY,
        "--max-concurrent-rpcs", str(MAX_CONCURRENT_RPCS), env=_env(tmp_path_factory),
    )  # fmt: skip
    main = probe = None
    try:
        main = Connections(served.address, grpc.ssl_channel_credentials(ca.pem))
        probe = Connections(served.probe_address, None)

        # Main port: more keyless streams than --max-concurrent-rpcs, Watch and
        # reflection, each connection up to its share; then the total is full.
        per_connection = DEFAULTS.max_keyless_per_connection
        opened = []
        while len(opened) < DEFAULTS.max_keyless_streams:
            channel = main.open()
            for i in range(per_connection):
                opened.append(await (main.reflect(channel) if i % 4 == 0 else main.watch(channel)))
        assert opened == [grpc.StatusCode.OK] * DEFAULTS.max_keyless_streams
        assert DEFAULTS.max_keyless_streams > MAX_CONCURRENT_RPCS
        refused = str(await main.watch(main.open()))
        assert refused.startswith("RESOURCE_EXHAUSTED") and "max_keyless_streams" in refused
        # A keyed caller still has every slot of --max-concurrent-rpcs.
        fresh = main.open()
        results = await asyncio.gather(*(_generate(fresh) for _ in range(8)))
        assert results == ["length"] * 8
        # So does a probe on the main port: checks have slots of their own.
        assert await _check(main.open()) == SERVING
        # vllm.Control is served by default with a key (GetServerInfo needs no admin key).
        info = await control_pb2_grpc.ControlStub(fresh).GetServerInfo(
            control_pb2.GetServerInfoRequest(), metadata=bearer(KEY), timeout=30
        )
        assert info.max_model_len > 0

        # Probe port: Watch streams from every side fill only their own share.
        limits = PROBE_PORT_LIMITS
        answers = []
        for n in range(limits.slots // limits.max_keyless_per_connection):
            channel = probe.open()
            for _ in range(limits.max_keyless_per_connection):
                answers.append(await probe.watch(channel))
            if n == 0:  # one connection holds its share at most
                refused = str(await probe.watch(channel))
                assert refused.startswith("RESOURCE_EXHAUSTED")
                assert "max_keyless_per_connection" in refused
        admitted = [a for a in answers if a == grpc.StatusCode.OK]
        assert len(admitted) == limits.max_keyless_streams
        assert all("max_keyless_streams" in str(a) for a in answers if a not in admitted)
        # A liveness probe (a new connection each time) is answered all the same.
        for _ in range(3):
            assert await _check(probe.open()) == SERVING

    finally:
        for connections in (main, probe):
            if connections is not None:
                with contextlib.suppress(Exception):
                    await connections.close()
        await stop_launched(served)


async def _control_answers(address: str) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            await control_pb2_grpc.ControlStub(channel).GetServerInfo(
                control_pb2.GetServerInfoRequest(), timeout=30
            )
        except grpc.aio.AioRpcError as err:
            return err.code()
        # The inference protocol is served either way.
        await vllm_engine_pb2_grpc.VllmEngineStub(channel).HealthCheck(
            pb.HealthCheckRequest(), timeout=30
        )
    return grpc.StatusCode.OK


async def _keyless_launcher(
    env: dict[str, str], flags: tuple[str, ...], says: str
) -> tuple[grpc.StatusCode, str]:
    """Start a launcher without keys: how it answers Control, and its line saying why
    (it comes before the engine starts, so before the port opens)."""
    async with launched(*flags, env=env, lines={"says": says}) as served:
        return await _control_answers(served.address), served.said["says"].string


async def test_control_is_served_without_keys_only_when_named(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # Both at once: each start is mostly waiting on its engine.
    (default, why), (named, warning) = await asyncio.gather(
        _keyless_launcher(_env(tmp_path_factory), (), r"vllm\.Control is not served"),
        _keyless_launcher(
            _env(tmp_path_factory),
            ("--services", "vllm-engine", "inference", "control"),
            r"serving vllm\.Control without authentication",
        ),
    )
    assert (default, named) == (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.OK)
    assert "--services vllm-engine inference control" in why
    assert "WARNING" in warning and CONTROL_ALLOWS in warning


def test_the_exposure_warning_names_what_an_unauthenticated_control_allows(
    caplog: pytest.LogCaptureFixture,
) -> None:
    exposed = ["serve", "--model", "m", "--host", "0.0.0.0", "--port", "0"]
    with caplog.at_level(logging.INFO, logger="vllm_servicer"):
        assert addresses_usable(parse_args([*exposed, "--services", "inference", "control"]))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("vllm.Control" in w and CONTROL_ALLOWS in w and "0.0.0.0" in w for w in warnings)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm_servicer"):
        assert addresses_usable(parse_args([*exposed, "--api-key", KEY]))
    assert not [r for r in caplog.records if "vllm.Control" in r.getMessage()]
