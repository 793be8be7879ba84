"""`serve --api-server-count 2`: two serving processes on one engine, seen from outside.

One launcher for the module, as users start it: the tiny model, keys for two
tenants and an admin, the three gRPC protocols, the HTTP API beside them,
metrics, tracing to an OTLP collector, a small in-flight limit and KV-event
cap. The kernel gives each new connection to one of the two processes; each
test opens connections until it holds one to each (`Connections`, told apart
by which process's socket the connection ends in), so that what must hold
across processes is tried across them: a request started in one process and
aborted through the other, one id, one limit, one count, one scrape. The
drain test starts a launcher of its own and stops it as systemd does.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import pickle
import signal
import sys
import time
import types
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from support import bearer, collect, completes, next_kv_event, request, streamed_tokens
from support.certs import CertificateAuthority
from support.launcher import (
    START_TIMEOUT,
    Launched,
    children,
    exit_code,
    gone,
    launch,
    launched,
    launcher_env,
    named,
)
from support.vllm_protocol import reference_modules
from test_tracing_otlp import Collector, _received
from test_tracing_otlp import collector as collector  # a fixture: an OTLP receiver

from vllm_servicer.health import LIVENESS_SERVICE
from vllm_servicer.load_reports.report import RATE_WINDOW_SECONDS
from vllm_servicer.proto import common_pb2, orca_pb2, orca_pb2_grpc, vllm_engine_pb2_grpc
from vllm_servicer.proto import vllm_engine_pb2 as pb

pytestmark = pytest.mark.timeout(START_TIMEOUT + 300)

TENANT_A = "tenant-a-0123456789abcdefABCDEF"
TENANT_B = "tenant-b-0123456789abcdefABCDEF"
ADMIN = "admin-0123456789abcdefABCDEF"
# KV events are a router's: two routers, to see one's cap leave the other its share.
ROUTER_A = "router-a-0123456789abcdefABCDEF"
ROUTER_B = "router-b-0123456789abcdefABCDEF"
MAX_INFLIGHT = 6
MAX_KV_SUBSCRIBERS = 4  # 2 per router
LONG = 2000  # tokens: a request that is still running when the test acts on it
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _launch_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return launcher_env(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
async def launcher(
    collector: Collector, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Launched]:
    env = _launch_env(tmp_path_factory)
    env.update(
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_SERVICE_NAME": "vllm-servicer-n2",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
        }
    )
    argv = [
        "--api-server-count",
        "2",
        "--metrics-port",
        "0",
        "--http-port",
        "0",
        "--services",
        "vllm-engine",
        "inference",
        "control",
        "--api-key",
        TENANT_A,
        "--api-key",
        TENANT_B,
        "--admin-api-key",
        ADMIN,
        "--router-api-key",
        ROUTER_A,
        "--router-api-key",
        ROUTER_B,
        "--max-inflight",
        str(MAX_INFLIGHT),
        "--max-kv-subscribers",
        str(MAX_KV_SUBSCRIBERS),
        "--kv-events-config",
        json.dumps(
            {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"ipc://{tmp_path_factory.mktemp('kv')}/kv-events",
            }
        ),
    ]
    async with launched(*argv, env=env) as served:
        yield served


class Connections:
    """One gRPC connection to each frontend process, told apart by the process
    whose socket each connection ends in.

    On the launcher's gRPC port by default; on `port` (the probe port) with
    `health_only`, where a connection is opened by a health check."""

    def __init__(
        self,
        launcher: Launched,
        *,
        port: int | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        health_only: bool = False,
    ) -> None:
        self._launcher = launcher
        self._port = port or launcher.port
        self._credentials = credentials
        self._health_only = health_only
        self.by_pid: dict[int, grpc.aio.Channel] = {}
        self._spare: list[grpc.aio.Channel] = []

    def _peers(self, pid: int) -> set[int]:
        """The client ports of the connections process `pid` holds on the port."""
        return {
            c.raddr.port
            for c in psutil.Process(pid).net_connections("tcp")
            if c.raddr and c.laddr.port == self._port
        }

    def _connect(self) -> grpc.aio.Channel:
        # A connection of its own: channels share one by default.
        options = [("grpc.use_local_subchannel_pool", 1)]
        address = f"127.0.0.1:{self._port}"
        if self._credentials is None:
            return grpc.aio.insecure_channel(address, options=options)
        return grpc.aio.secure_channel(address, self._credentials, options=options)

    async def open(self) -> Connections:
        for _ in range(40):
            if len(self.by_pid) == 2:
                return self
            before = {pid: self._peers(pid) for pid in self._launcher.pids}
            channel = self._connect()
            if self._health_only:
                await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=30
                )
            else:
                await vllm_engine_pb2_grpc.VllmEngineStub(channel).HealthCheck(
                    pb.HealthCheckRequest(), metadata=bearer(TENANT_A), timeout=30
                )
            (pid,) = [p for p in self._launcher.pids if self._peers(p) - before[p]]
            if pid in self.by_pid:
                self._spare.append(channel)
            else:
                self.by_pid[pid] = channel
        raise AssertionError("40 connections all went to one process")

    def engine(self, which: int) -> vllm_engine_pb2_grpc.VllmEngineStub:
        """VllmEngine on process `which` (0 or 1)."""
        return vllm_engine_pb2_grpc.VllmEngineStub(self.by_pid[self._launcher.pids[which]])

    def health(self, which: int) -> health_pb2_grpc.HealthStub:
        return health_pb2_grpc.HealthStub(self.by_pid[self._launcher.pids[which]])

    def channel(self, which: int) -> grpc.aio.Channel:
        return self.by_pid[self._launcher.pids[which]]

    async def close(self) -> None:
        for channel in [*self.by_pid.values(), *self._spare]:
            await channel.close()


@pytest.fixture
async def connections(launcher: Launched) -> AsyncIterator[Connections]:
    opened = Connections(launcher)
    try:
        yield await opened.open()
    finally:
        await opened.close()


async def _tokens(call: Any) -> list[int]:
    """A Generate's output tokens: its chunks' when streamed, else its complete's."""
    messages = await collect(call)
    return streamed_tokens(messages).get(0) or list(completes(messages)[0].output_ids)


async def _first(call: Any) -> Any:
    message = await call.read()
    assert message is not grpc.aio.EOF
    return message


async def _finish_reason(call: Any) -> str:
    """How a streamed Generate ended: the reason on its last message."""
    last = None
    while (message := await call.read()) is not grpc.aio.EOF:
        last = message
    assert last is not None and last.HasField("complete")
    return str(last.complete.finish_reason)


async def test_both_processes_serve_the_same_greedy_tokens(
    connections: Connections,
    ref_grpc: types.ModuleType,
    ref: types.ModuleType,
) -> None:
    a = bearer(TENANT_A)
    tokens = [
        await _tokens(connections.engine(i).Generate(request(max_tokens=8), metadata=a))
        for i in (0, 1)
    ]
    assert len(tokens[0]) == 8 and tokens[0] == tokens[1]
    # vLLM's own protocol too, from each process, with the reference's stubs.
    for i in (0, 1):
        message = ref.GenerateRequest()
        message.token_ids.ids.extend([5, 17, 42, 99, 7, 63, 21, 88])
        message.stopping.max_new_tokens = 8
        message.stopping.ignore_eos = True
        message.response.output_token_ids = True
        stub = ref_grpc.InferenceStub(connections.channel(i))
        reply = await stub.Generate(message, metadata=a, timeout=60)
        assert list(reply.outputs.token_ids) == tokens[0]


async def test_abort_through_one_process_stops_a_request_the_other_runs(
    connections: Connections, launcher: Launched
) -> None:
    a = bearer(TENANT_A)
    for started_on, aborted_on in ((0, 1), (1, 0)):
        rid = f"cross-abort-{started_on}"
        call = connections.engine(started_on).Generate(
            request(max_tokens=LONG, ignore_eos=True, stream=True, request_id=rid), metadata=a
        )
        await _first(call)
        await connections.engine(aborted_on).Abort(pb.AbortRequest(request_ids=[rid]), metadata=a)
        assert await asyncio.wait_for(_finish_reason(call), 60) == "abort"


async def test_vllms_control_abort_stops_an_inference_stream_the_other_process_runs(
    connections: Connections,
    ref_grpc: types.ModuleType,
    ref: types.ModuleType,
) -> None:
    control_pb2, control_grpc = reference_modules("control")
    a = bearer(TENANT_A)
    message = ref.GenerateRequest(request_id="inference-cross-abort")
    message.token_ids.ids.extend([5, 17, 42, 99])
    message.stopping.max_new_tokens = LONG
    message.stopping.ignore_eos = True
    stream = ref_grpc.InferenceStub(connections.channel(0)).GenerateStream(
        message, metadata=a, timeout=120
    )
    await _first(stream)
    await control_grpc.ControlStub(connections.channel(1)).Abort(
        control_pb2.AbortRequest(request_ids=["inference-cross-abort"]), metadata=a
    )
    last = None
    while (reply := await asyncio.wait_for(stream.read(), 60)) is not grpc.aio.EOF:
        last = reply
    abort = ref.FinishInfo.FinishReason.Value("ABORTED")
    assert last is not None and last.outputs.finish_info.finish_reason == abort


async def test_a_request_id_belongs_to_its_caller_in_every_process(
    connections: Connections,
) -> None:
    a, b = bearer(TENANT_A), bearer(TENANT_B)
    rid = "owned-by-a"
    call = connections.engine(0).Generate(
        request(max_tokens=40, ignore_eos=True, stream=True, request_id=rid), metadata=a
    )
    await _first(call)
    # Tenant B, at the other process: its Abort touches nothing, its reuse is refused.
    await connections.engine(1).Abort(pb.AbortRequest(request_ids=[rid]), metadata=b)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _tokens(connections.engine(1).Generate(request(request_id=rid), metadata=b))
    assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "already in use" in (refused.value.details() or "")
    assert await asyncio.wait_for(_finish_reason(call), 60) == "length"
    # Once it has ended, the id is free for anyone, in either process.
    assert len(await _tokens(connections.engine(1).Generate(request(request_id=rid), metadata=b)))


async def test_the_in_flight_limit_and_count_are_the_processes_together(
    connections: Connections,
) -> None:
    a = bearer(TENANT_A)
    running = [
        connections.engine(i % 2).Generate(
            request(max_tokens=LONG, ignore_eos=True, stream=True), metadata=a
        )
        for i in range(MAX_INFLIGHT)
    ]
    try:
        for call in running:
            await _first(call)
        for i in (0, 1):
            info = await connections.engine(i).GetServerInfo(pb.GetServerInfoRequest(), metadata=a)
            assert info.active_requests == MAX_INFLIGHT
            with pytest.raises(grpc.aio.AioRpcError) as busy:
                await _tokens(connections.engine(i).Generate(request(), metadata=a))
            assert busy.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"limit (max_inflight) is {MAX_INFLIGHT}" in (busy.value.details() or "")
    finally:
        for call in running:
            call.cancel()
    for _ in range(100):
        info = await connections.engine(1).GetServerInfo(pb.GetServerInfoRequest(), metadata=a)
        if info.active_requests == 0:
            break
        await asyncio.sleep(0.1)
    assert info.active_requests == 0
    assert len(await _tokens(connections.engine(0).Generate(request(), metadata=a))) == 8


async def test_get_loads_at_either_process_reports_the_whole_engine(
    connections: Connections,
) -> None:
    """vLLM hands each step's stats to one frontend: here to process 0 alone,
    which runs every request, while GetLoads is asked of process 1."""
    a = bearer(TENANT_A)

    async def running_seen_by(which: int) -> int:
        reply = await connections.engine(which).GetLoads(pb.GetLoadsRequest(), metadata=a)
        return sum(load.num_running_reqs for load in reply.loads) if reply.loads else -1

    calls = [
        connections.engine(0).Generate(
            request(max_tokens=LONG, ignore_eos=True, stream=True), metadata=a
        )
        for _ in range(2)
    ]
    try:
        for call in calls:
            await _first(call)
        # The peers' figures come a step's stats and a fetch later: on a busy
        # machine, more than three reads' time.
        seen: list[int] = []
        for _ in range(50):
            seen.append(await running_seen_by(1))
            if seen[-1] == 2:
                break
            await asyncio.sleep(0.1)
        assert 2 in seen, seen
    finally:
        for call in calls:
            call.cancel()
    for _ in range(50):
        if await running_seen_by(1) == 0:
            break
        await asyncio.sleep(0.1)
    assert await running_seen_by(1) == 0


async def test_load_reports_at_either_process_are_the_whole_engines(
    connections: Connections,
) -> None:
    """A balancer weighs the port, not one process: the ORCA report process 1
    streams counts the requests process 0 runs (from the peers' stats) and the
    calls it served (the group's shared counts)."""
    a = bearer(TENANT_A)
    interval = datetime.timedelta(seconds=1)

    def streams() -> list[Any]:
        return [
            orca_pb2_grpc.OpenRcaServiceStub(connections.channel(i)).StreamCoreMetrics(
                orca_pb2.OrcaLoadReportRequest(report_interval=interval)  # no key: a balancer's
            )
            for i in (0, 1)
        ]

    # Balancers watching both processes all along, as they would. Each report
    # samples the call counts; the rates span back to the newest sample at least
    # a window old, so a window of reports first keeps what ran before this test
    # (however long ago the last report was) out of them.
    watching, after = streams(), []
    await asyncio.sleep(RATE_WINDOW_SECONDS + 1)
    long = connections.engine(0).Generate(
        request(max_tokens=LONG, ignore_eos=True, stream=True), metadata=a
    )
    try:
        await _first(long)
        # The long stream ends at the tiny model's context (512 tokens, a second or
        # two): the 30 calls go five at a time (the long one holds a sixth slot of
        # --max-inflight) so that the reports are read while it still runs.

        async def six_calls() -> None:
            for _ in range(6):
                await collect(connections.engine(0).Generate(request(max_tokens=2), metadata=a))

        started = time.monotonic()
        await asyncio.gather(*(six_calls() for _ in range(5)))
        # Past the 250 ms a report is kept: each new stream's first report is
        # then made as it opens, counting these calls.
        await asyncio.sleep(0.3)
        after = streams()
        reports = [await asyncio.wait_for(stream.read(), 10) for stream in after]
        took = time.monotonic() - started
    finally:
        long.cancel()
        for stream in [*watching, *after]:
            stream.cancel()
    assert reports[1].named_metrics["num_requests_running"] >= 1, reports[1]
    # 30 calls in the last seconds, in the window of both: alike, whoever served them.
    # A rate over the last RATE_WINDOW_SECONDS (and a little more): all 30 when
    # they took less, a share when a busy machine stretched them past it.
    floor = 0.7 * 30 / max(took, RATE_WINDOW_SECONDS + 1)
    assert reports[0].rps_fractional >= floor, (took, reports[0])
    assert reports[1].rps_fractional >= 0.7 * reports[0].rps_fractional, reports


# ----- the peers socket ------------------------------------------------------
# Where the processes hand each other Aborts and GetLoads figures: a Unix socket
# each, in the group's private directory. The peers speak JSON and check who is
# at the other end; these tests are the processes that are not peers.

_LOADS = "/vllm_servicer.Peers/Loads"  # the method the peers served before they spoke JSON


class _OpensFile:
    """A pickle that, once loaded, creates the file `path`: code run by whoever unpickles it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def _peer_sockets(launcher: Launched) -> dict[int, str]:
    """Each frontend's peers socket by its pid: the Unix socket it listens on."""
    found = {}
    for pid in launcher.pids:
        for connection in psutil.Process(pid).net_connections("unix"):
            if os.path.basename(connection.laddr or "").startswith("frontend-"):
                found[pid] = connection.laddr
    assert len(found) == 2, found
    return found


async def _exchange(path: str, payload: bytes) -> bytes:
    """Send `payload` on the Unix socket `path`; what comes back before it
    closes (a refusal closes it at once, perhaps before the payload is sent)."""
    reader, writer = await asyncio.open_unix_connection(path)
    try:
        with contextlib.suppress(ConnectionError):
            writer.write(payload)
            await writer.drain()
        try:
            return await asyncio.wait_for(reader.read(), 10)
        except ConnectionError:
            return b""
    finally:
        writer.close()


async def _logged(launcher: Launched, text: str) -> None:
    deadline = time.monotonic() + 10
    while not any(text in line for line in launcher.output):
        assert time.monotonic() < deadline, f"not logged: {text!r}\n" + "".join(launcher.output)
        await asyncio.sleep(0.1)


async def test_a_process_that_is_not_a_frontend_gets_nothing_from_the_peers_sockets(
    launcher: Launched, tmp_path: Any
) -> None:
    """This test's process (the same user as the launcher) asks each peers
    socket for loads in gRPC (as the peers spoke before) and in JSON, and sends
    it a pickle: no answer, nothing unpickled, the refusal logged."""
    marker = tmp_path / "unpickled"
    for path in _peer_sockets(launcher).values():
        async with grpc.aio.insecure_channel(f"unix:{path}") as channel:
            ask: Any = channel.unary_unary(_LOADS)
            with pytest.raises(grpc.aio.AioRpcError):
                await ask(b"", timeout=5)
        assert await _exchange(path, b'{"op": "loads"}\n') == b""
        assert await _exchange(path, pickle.dumps(_OpensFile(str(marker))) + b"\n") == b""
    assert not marker.exists()
    await _logged(launcher, f"refused a connection: pid {os.getpid()} is not one of")


@pytest.mark.skipif(os.geteuid() != 0, reason="becoming another user takes root")
async def test_another_user_is_refused_where_the_directory_would_let_it_in(
    launcher: Launched,
) -> None:
    """The group's directory keeps other users out first (0700); opened to them
    here, the socket still refuses a client running as `nobody`."""
    path = next(iter(_peer_sockets(launcher).values()))
    directory = os.path.dirname(path)
    modes = {p: os.stat(p).st_mode & 0o7777 for p in (directory, path)}
    os.chmod(directory, 0o711)
    os.chmod(path, 0o777)
    client = (
        "import os, socket, sys\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "s = socket.socket(socket.AF_UNIX); s.settimeout(10); s.connect(sys.argv[1])\n"
        "try:\n"
        '    s.sendall(b\'{"op": "loads"}\\n\'); print(repr(s.recv(65536)))\n'
        "except ConnectionError:\n"
        "    print(repr(b''))  # closed at once: refused\n"
    )
    try:
        ran = await asyncio.create_subprocess_exec(
            sys.executable, "-c", client, path, stdout=asyncio.subprocess.PIPE
        )
        out, _ = await asyncio.wait_for(ran.communicate(), 60)
    finally:
        for name, mode in modes.items():
            os.chmod(name, mode)
    assert ran.returncode == 0 and out.strip() == b"b''", out
    await _logged(launcher, "runs as uid 65534")


async def test_a_socket_planted_in_a_peers_place_is_not_believed(
    launcher: Launched, connections: Connections, tmp_path: Any
) -> None:
    """Each peers socket is moved aside and a server of this test's put in its
    place, answering Loads with a pickle as the peers did: GetLoads at either
    process still answers, and never unpickles it."""
    marker = tmp_path / "unpickled"
    payload = pickle.dumps(_OpensFile(str(marker)))

    async def loads(request: bytes, context: Any) -> bytes:
        return payload

    planted = grpc.aio.server()
    planted.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "vllm_servicer.Peers", {"Loads": grpc.unary_unary_rpc_method_handler(loads)}
            ),
        )
    )
    sockets = list(_peer_sockets(launcher).values())
    for path in sockets:
        os.rename(path, path + ".aside")
        planted.add_insecure_port(f"unix:{path}")
    await planted.start()
    try:
        for which in (0, 1):
            await connections.engine(which).GetLoads(
                pb.GetLoadsRequest(), metadata=bearer(TENANT_A), timeout=30
            )
    finally:
        await planted.stop(None)
        for path in sockets:
            os.replace(path + ".aside", path)
    assert not marker.exists()
    await _logged(launcher, "socket refused: pid")


async def test_the_kv_event_caps_hold_across_processes(connections: Connections) -> None:
    a, b = bearer(ROUTER_A), bearer(ROUTER_B)
    subscribe = common_pb2.SubscribeKvEventsRequest()
    for i in (0, 1):  # a tenant's key reads no KV events in either process
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await (
                connections.engine(i).SubscribeKvEvents(subscribe, metadata=bearer(TENANT_A)).read()
            )
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # Router A's share is 2 (half of 4): one in each process, then none in either.
    held = [connections.engine(i).SubscribeKvEvents(subscribe, metadata=a) for i in (0, 1)]
    try:
        await asyncio.sleep(1.0)  # both streams opened
        for i in (0, 1):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await connections.engine(i).SubscribeKvEvents(subscribe, metadata=a).read()
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "per-caller limit is 2" in (refused.value.details() or "")
        # Router B still gets its own share.
        other = connections.engine(1).SubscribeKvEvents(subscribe, metadata=b)
        await asyncio.sleep(0.5)
        assert not other.done()
        other.cancel()
    finally:
        for call in held:
            call.cancel()


async def test_kv_events_reach_subscribers_in_both_processes(connections: Connections) -> None:
    """The engine publishes once; each process relays it to its own subscribers."""
    admin = bearer(ADMIN)  # held to the total only: the caps test's streams may linger
    subscribe = common_pb2.SubscribeKvEventsRequest()
    calls = [connections.engine(i).SubscribeKvEvents(subscribe, metadata=admin) for i in (0, 1)]
    try:
        for call in calls:
            await call.initial_metadata()  # subscribed
        await asyncio.sleep(0.5)  # ZMQ subscriptions reach the publisher asynchronously
        # A prompt no earlier test sent: its blocks are new to the prefix cache.
        start = int(time.time() * 1000)
        prompt = [(start + 11 * i) % 300 + 3 for i in range(130)]
        await _tokens(connections.engine(0).Generate(request(prompt, max_tokens=2), metadata=admin))
        for i, call in enumerate(calls):
            _, event = await next_kv_event(call, "stored")
            first = list(event.stored.blocks[0].token_ids)
            assert first and first == prompt[: len(first)], i
    finally:
        for call in calls:
            call.cancel()


async def test_one_scrape_counts_every_process_with_vllms_own_series(
    connections: Connections, launcher: Launched
) -> None:
    a = bearer(TENANT_A)

    def scrape() -> dict[str, float]:
        text = urllib.request.urlopen(launcher.metrics_url, timeout=10).read().decode()
        return {
            sample.name: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name
            in {
                "vllm_servicer_generation_tokens_total",
                "vllm_servicer_requests_in_flight",
                "vllm:generation_tokens_total",
            }
        }

    before = scrape()
    for i in (0, 1, 0, 1):
        assert len(await _tokens(connections.engine(i).Generate(request(), metadata=a))) == 8
    after = scrape()
    assert (
        after["vllm_servicer_generation_tokens_total"]
        - before.get("vllm_servicer_generation_tokens_total", 0)
        == 32
    )
    assert (
        after["vllm:generation_tokens_total"] - before.get("vllm:generation_tokens_total", 0) >= 32
    )
    assert after["vllm_servicer_requests_in_flight"] == 0


async def test_the_http_api_is_served_beside_on_one_engine(launcher: Launched) -> None:
    body = json.dumps(
        {"model": _model(launcher), "prompt": [5, 17, 42, 99], "max_tokens": 4, "temperature": 0}
    ).encode()
    # Several connections: the kernel spreads them over both processes.
    for _ in range(4):
        req = urllib.request.Request(
            f"{launcher.http_url}/v1/completions",
            data=body,
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {TENANT_A}"},
        )
        reply = json.loads(await asyncio.to_thread(_read, req))
        assert reply["usage"]["completion_tokens"] == 4
    unauthorized = urllib.request.Request(f"{launcher.http_url}/v1/completions", data=body)
    with pytest.raises(urllib.error.HTTPError) as refused:
        await asyncio.to_thread(_read, unauthorized)
    assert refused.value.code == 401


def _read(req: urllib.request.Request) -> bytes:
    with urllib.request.urlopen(req, timeout=60) as reply:
        return bytes(reply.read())


async def test_an_http_requests_id_is_its_callers_in_both_frontend_processes(
    launcher: Launched, connections: Connections
) -> None:
    """The HTTP request runs in one process; its engine id (vLLM's `cmpl-X-0` for
    `X-Request-Id: X`, test_one_guard.py) is refused to another caller and its
    slot counted in both (the frontends' shared table)."""
    from test_one_guard import http_stream

    a, b = bearer(TENANT_A), bearer(TENANT_B)
    for _ in range(100):  # the slots of earlier tests' cancelled calls come back
        info = await connections.engine(0).GetServerInfo(pb.GetServerInfoRequest(), metadata=a)
        if info.active_requests == 0:
            break
        await asyncio.sleep(0.1)
    async with httpx.AsyncClient(base_url=launcher.http_url, headers=dict(a), timeout=120) as http:
        # Still running when the test acts on it: the model's context is 512.
        async with http_stream(http, _model(launcher), max_tokens=500, request_id="n2-trace"):
            reused = request(request_id="cmpl-n2-trace-0")
            for i in (0, 1):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await collect(connections.engine(i).Generate(reused, metadata=b))
                assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
                info = await connections.engine(i).GetServerInfo(
                    pb.GetServerInfoRequest(), metadata=b
                )
                assert info.active_requests == 1


def _model(launcher: Launched) -> str:
    with urllib.request.urlopen(
        urllib.request.Request(
            f"{launcher.http_url}/v1/models", headers={"Authorization": f"Bearer {TENANT_A}"}
        ),
        timeout=30,
    ) as reply:
        return str(json.loads(reply.read())["data"][0]["id"])


async def test_each_process_traces_its_calls(
    connections: Connections, collector: Collector
) -> None:
    a = bearer(TENANT_A)
    ids = [f"traced-{i}" for i in (0, 1)]
    for i, rid in enumerate(ids):
        await _tokens(connections.engine(i).Generate(request(request_id=rid), metadata=a))
    for _ in range(100):
        traced = {
            value
            for span in _received(collector.receiver)
            for value in span.attributes.values()
            if value in ids
        }
        if traced == set(ids):
            break
        await asyncio.sleep(0.2)
    assert traced == set(ids)


@contextlib.asynccontextmanager
async def _own_launcher(
    argv: list[str], env: dict[str, str]
) -> AsyncIterator[tuple[Launched, set[int]]]:
    """A launcher of the test's own, in a session of its own (so that its process
    group can be signalled), with its processes; all reaped after."""
    served = await launch(*argv, env=env, new_session=True)
    processes = children(served.proc.pid)
    try:
        yield served, processes
    finally:
        if served.proc.returncode is None:
            served.proc.kill()
        if served.reader is not None:
            served.reader.cancel()
        with contextlib.suppress(ProcessLookupError):
            for pid in processes:
                os.kill(pid, signal.SIGKILL)


async def test_a_burst_then_one_sigterm_to_the_group_drains_every_process(
    collector: Collector, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The launcher's full stack (TLS with a plaintext probe port, tracing,
    metrics, keys, the in-flight limit): 300 seeded calls with long prompts at
    once over both processes all complete; then, on one SIGTERM to the group,
    both processes' probes read unready and live, streams running in both
    complete, and everything exits 0."""
    env = _launch_env(tmp_path_factory)
    env.update(
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
        }
    )
    ca = CertificateAuthority("n2-ca")
    cert, key = ca.server().write(tmp_path_factory.mktemp("n2-tls"), "server")
    # The grace: readiness reads NOT_SERVING for 3 s before either port closes.
    argv = ["--api-server-count", "2", "--drain-grace", "3", "--metrics-port", "0"]
    argv += ["--api-key", TENANT_A, "--shutdown-timeout", "120"]
    argv += ["--tls-cert", str(cert), "--tls-key", str(key), "--health-port", "0"]
    async with _own_launcher(argv, env) as (served, processes):
        proc, output = served.proc, served.output
        tls = grpc.ssl_channel_credentials(ca.pem)
        opened = await Connections(served, credentials=tls).open()
        probe_port = int(served.probe_address.rsplit(":", 1)[1])
        # The probe port: one port, both processes answering on it.
        probes = await Connections(served, port=probe_port, health_only=True).open()
        for i in (0, 1):
            ready = await probes.health(i).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert ready.status == SERVING, i
        a = bearer(TENANT_A)
        try:
            prompt = [(7 * i) % 300 + 5 for i in range(121)]
            burst = [
                _tokens(
                    opened.engine(i % 2).Generate(
                        request(
                            prompt, temperature=0.8, seed=i, ignore_eos=True, stream=i % 3 == 0
                        ),
                        metadata=a,
                    )
                )
                for i in range(300)
            ]
            assert [len(t) for t in await asyncio.gather(*burst)] == [8] * 300
            calls = [
                opened.engine(i).Generate(
                    request(max_tokens=300, ignore_eos=True, stream=True), metadata=a
                )
                for i in (0, 1)
            ]
            for call in calls:
                await _first(call)
            # As systemd's KillMode=mixed and a terminal's Ctrl-C do: the whole group.
            os.killpg(os.getpgid(proc.pid), signal.SIGTERM)
            # Kubernetes' probes, whichever process they reach: unready, still live.
            probed = await asyncio.gather(*(_probed_in_drain(probes.health(i)) for i in (0, 1)))
            assert probed == [(NOT_SERVING, SERVING)] * 2
            finished = asyncio.gather(*(_finish_reason(c) for c in calls))
            assert await asyncio.wait_for(finished, 120) == ["length", "length"]
            assert await asyncio.wait_for(exit_code(proc), 120) == 0, "".join(output)
            left = await gone(processes, 30)
            assert not left, named(left)
        finally:
            await opened.close()
            await probes.close()


async def _probed_in_drain(health: health_pb2_grpc.HealthStub) -> tuple[int, int]:
    """Readiness once it leaves SERVING (within 10 s), then liveness, as a probe reads them."""
    for _ in range(100):
        ready = (await health.Check(health_pb2.HealthCheckRequest(), timeout=10)).status
        if ready != SERVING:
            break
        await asyncio.sleep(0.1)
    live = await health.Check(health_pb2.HealthCheckRequest(service=LIVENESS_SERVICE), timeout=10)
    return ready, live.status


async def test_the_engines_death_ends_every_process_with_exit_code_1(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The engine core killed at a chosen moment: each frontend sees it, stops,
    and the launcher exits 1 with nothing left behind (a supervisor restarts it)."""
    env = _launch_env(tmp_path_factory)
    env["VLLM_KEEP_ALIVE_ON_ENGINE_DEATH"] = "0"
    # A context long enough that the stream is still running when the engine
    # dies, however slowly this test gets there on a busy machine.
    env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    async with (
        _own_launcher(["--api-server-count", "2", "--max-model-len", "65536"], env) as (
            served,
            processes,
        ),
        grpc.aio.insecure_channel(served.address) as channel,
    ):
        proc, output, frontends = served.proc, served.output, set(served.pids)
        running = vllm_engine_pb2_grpc.VllmEngineStub(channel).Generate(
            request(max_tokens=60000, ignore_eos=True, stream=True)
        )
        await _first(running)
        (engine_core,) = [
            p
            for p in psutil.Process(proc.pid).children()
            if p.pid not in frontends and "EngineCore" in " ".join([p.name(), *p.cmdline()])
        ]
        engine_core.kill()
        # The call in flight fails at once rather than waiting on a dead engine.
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await asyncio.wait_for(_finish_reason(running), 30)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert await asyncio.wait_for(exit_code(proc), 120) == 1, "".join(output)
        left = await gone(processes, 30)
        assert not left, named(left)
