"""The one-process launcher: one engine and its servers in this process.

Builds an `AsyncLLM` from vLLM's own engine arguments (every vLLM engine flag
passes through), mounts the servicer on a new grpc.aio server with the
recommended options, optional metrics, authentication, TLS and tracing, and
serves until SIGTERM/SIGINT, then drains gracefully. With `--http-port` the
same engine also serves vLLM's own OpenAI-compatible HTTP API (`http_api.py`).
With no `--model`, it serves the built-in tiny model (random weights, no
download). The process entry above it is `cli.py`; the command line is
`args.py`'s, the checks before any port opens `preflight.py`'s, the interceptor
stack `stack.py`'s. Each `--api-server-count` frontend (`api_servers.py`) runs
`serve` too, as a client of the engine its parent started.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from ..drain import GracefulShutdown, HardStop
from ..engine import EngineClient, served_model_name
from ..frontends import FrontendGroup
from ..guard import EngineGuard
from ..health import EngineHealthServicer
from ..interceptors import CallInterceptor, MetricsInterceptor, start_metrics_server
from ..interceptors.call_slots import CallSlotsInterceptor
from ..interceptors.keyless import KeylessLimitInterceptor
from ..interceptors.verifiers import Verifier
from ..mounting import mount
from ..options import server_options, shared_port
from ..tenant_metrics import TenantWorkCollector, TenantWorkCounters
from ..tls import server_credentials
from ..vllm_releases import engine_core_died
from .args import ServeArgs
from .engine_processes import apart_from_stop_signals, exit_now
from .http_api import HttpApi
from .peers import Peers, start_peers
from .preflight import addresses_usable
from .probe_port import start_probe_port
from .process import EXIT_FAILED, EXIT_STOPPED
from .remote_engines import watch_remote_engines
from .stack import build_interceptors, http_verifier, key_verifier

if TYPE_CHECKING:
    from multiprocessing.queues import Queue
    from wsgiref.simple_server import WSGIServer

    from vllm.v1.engine.async_llm import AsyncLLM

    from ..mounting import MountedServices

__all__ = ["Frontend", "serve", "settle_process_for_serving", "stop_when_engine_dies"]

logger = logging.getLogger("vllm_servicer.serve")


@dataclass
class Frontend:
    """What one of several frontend processes on one engine is given (`api_servers.py`).

    Attributes:
        group: the processes' shared state; `group.index` is this process's.
        client_config: vLLM's engine endpoints for this client, with
            `client_count` and `client_index`.
        ready: told (index, pid) once this process serves.
    """

    group: FrontendGroup
    client_config: dict[str, Any]
    ready: Queue[tuple[int, int]]


async def serve(args: ServeArgs, frontend: Frontend | None = None) -> int:
    """Run the server until a signal, drain it; return the process exit code.

    Args:
        args: the launcher's arguments.
        frontend: set when this process is one of `--api-server-count`
            frontends, whose parent checked the addresses, started the engine
            and serves the metrics.

    Returns:
        `EXIT_STOPPED` (0) after a stop asked for by a signal; `EXIT_FAILED`
        (1) when a port is taken or the engine died.
    """
    group = frontend.group if frontend is not None else None
    # One verifier for both protocols: a key file re-read for one is re-read for both.
    verifier = key_verifier(args)
    credentials = server_credentials(*args.security.tls) if args.security.tls is not None else None
    if frontend is None and not addresses_usable(args):
        return EXIT_FAILED
    engine = _start_engine(args, frontend)
    if args.server.warm_up and frontend is None:
        await _warm_up(engine)
    settle_process_for_serving()
    side = _SideServers()
    try:
        interceptors, metrics = build_interceptors(
            args, verifier, group=group, model=served_model_name(engine)
        )
        server, mounted, port = _grpc_server(args, engine, interceptors, credentials, group)
        if port == 0:
            return EXIT_FAILED
        if metrics is not None and group is None:
            # Each tenant's tokens, read at each scrape (one process's counts).
            collector = TenantWorkCollector(mounted.state.tenant, metrics.model_name)
            metrics.registry.register(collector)
        elif metrics is not None:
            # Counters the parent's multiprocess collector merges (api_servers.py).
            counters = TenantWorkCounters(metrics.model_name)
            mounted.state.tenant.work.mirror = counters.add
        if group is not None:
            side.peers = await start_peers(group, engine)
        http_keys = http_verifier(args, verifier)
        slots = next(i for i in interceptors if isinstance(i, CallSlotsInterceptor))
        await side.prepare(
            args, engine, http_keys, metrics=frontend is None, guard=mounted.guard, slots=slots
        )
        shutdown = _shutdown(args, server, mounted, metrics, side)
        await side.open(args, mounted, shared=frontend is not None)
        await server.start()
        if frontend is not None:
            frontend.ready.put((frontend.group.index, os.getpid()))
            index = frontend.group.index
            print(f"vllm-servicer frontend {index} serving (pid {os.getpid()})", flush=True)
        else:
            # Printed (not only logged) so scripts and tests can read the bound ports.
            print(f"vllm-servicer listening on {args.server.host}:{port}", flush=True)
            if side.http is not None:
                url = f"{side.http.scheme}://{args.http_address}:{side.http.port}"
                print(f"vllm-servicer http on {url}", flush=True)
        return await _serve_until_stopped(engine, shutdown, group, mounted.health)
    finally:
        await side.close(engine)


def _start_engine(args: ServeArgs, frontend: Frontend | None = None) -> AsyncLLM:
    """vLLM's engine, its model loaded, its processes apart from our stop signals;
    for a frontend, a client of the engine its parent started."""
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    if frontend is not None:
        return _engine_client(args, frontend)
    started = time.monotonic()
    logger.info("starting the vLLM engine for %s (loading the model)...", args.engine["model"])
    # Its processes must leave stop signals to us: we drain, then stop them.
    with apart_from_stop_signals():
        # A server's batch defaults, as vLLM's own servers take (on a large GPU,
        # up to 1024 sequences rather than the engine context's 128).
        engine = AsyncLLM.from_engine_args(
            args.engine_args(), usage_context=UsageContext.OPENAI_API_SERVER
        )
    logger.info("engine ready in %.1f s", time.monotonic() - started)
    return engine


def _engine_client(args: ServeArgs, frontend: Frontend) -> AsyncLLM:
    """This frontend's `AsyncLLM`: client `client_index` of `client_count` of the
    engine, as vLLM's HTTP server builds each of its API server processes'."""
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    config = dict(frontend.client_config)
    count, index = config.pop("client_count"), config.pop("client_index")
    config.pop("api_server_loads", None)  # for vLLM's HTTP accept balancing only
    engine_args = args.engine_args()
    engine_args._api_process_count = count
    engine_args._api_process_rank = index
    usage = UsageContext.OPENAI_API_SERVER
    return AsyncLLM.from_vllm_config(
        vllm_config=engine_args.create_engine_config(usage_context=usage),
        usage_context=usage,
        enable_log_requests=engine_args.enable_log_requests,
        aggregate_engine_logging=engine_args.aggregate_engine_logging,
        disable_log_stats=engine_args.disable_log_stats,
        client_addresses=config,
        client_count=count,
        client_index=index,
    )


async def _warm_up(engine: AsyncLLM) -> None:
    """One short greedy generation, logged with its time; the port is not open yet."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.monotonic()
    prompt_len = max(1, min(16, engine.model_config.max_model_len - 8))
    prompt = TokensPrompt(prompt_token_ids=[1] * prompt_len)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    async for _ in engine.generate(prompt, params, request_id=f"warm-up-{os.getpid()}"):
        pass
    logger.info("warm-up generation done in %.2f s", time.monotonic() - started)


def settle_process_for_serving() -> None:
    """Per-token savings that only the process's owner may opt into.

    vLLM reads its environment variables through a module `__getattr__` that
    re-parses `os.environ` on every access (several per engine step in the
    output path); its engine processes cache them once started, and this does
    the same for the serving process. The start-up heap is frozen out of the
    garbage collector's reach, as vLLM's HTTP server does, so the oldest
    generation's collections do not walk the model's static objects. `mount()`
    does neither: a host's process is the host's to configure.
    """
    from vllm.envs import enable_envs_cache
    from vllm.utils.gc_utils import freeze_gc_heap

    enable_envs_cache()
    freeze_gc_heap()


def _grpc_server(
    args: ServeArgs,
    engine: AsyncLLM,
    interceptors: list[CallInterceptor],
    credentials: grpc.ServerCredentials | None,
    group: FrontendGroup | None = None,
) -> tuple[grpc.aio.Server, MountedServices, int]:
    """The gRPC server (not started), the servicer mounted, and its bound port (0: logged)."""
    options = server_options(
        args.server.max_message_bytes,
        max_connection_age=args.server.max_connection_age,
        request_compression=args.server.allow_request_compression,
    )
    if group is not None:
        options = shared_port(options)  # every frontend binds this one port
    limits = args.keyless
    server = grpc.aio.server(
        # Health and reflection need no key: their slots come on top of what
        # --max-concurrent-rpcs keeps for every other call, and their own caps
        # (outermost, so that a refusal costs no span nor key check) keep them there.
        maximum_concurrent_rpcs=limits.grpc_cap(args.slots.max_concurrent_rpcs or None),
        options=options,
    )
    mounted = mount(
        server,
        engine,
        args.options,
        interceptors=[KeylessLimitInterceptor(limits), *interceptors],
        frontends=group,
    )
    address = f"{args.server.host}:{args.server.port}"
    if credentials is not None:
        port = server.add_secure_port(address, credentials)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        logger.error("could not bind %s", address)
    return server, mounted, port


@dataclass
class _SideServers:
    """The servers beside the gRPC one, each None until started: metrics, HTTP, probes."""

    metrics: WSGIServer | None = None  # prometheus_client's
    http: HttpApi | None = None
    probes: grpc.aio.Server | None = None
    peers: Peers | None = None  # the other frontends' way in (api_servers.py)

    async def prepare(
        self,
        args: ServeArgs,
        engine: AsyncLLM,
        verifier: Verifier | None,
        *,
        metrics: bool,
        guard: EngineGuard | None = None,
        slots: CallSlotsInterceptor | None = None,
    ) -> None:
        """Start the metrics endpoint (when `metrics`); build the HTTP API, whose
        port `open` opens."""
        if args.observability.metrics_port is not None and metrics:
            self.metrics, _ = start_metrics_server(
                args.observability.metrics_port, addr=args.metrics_address
            )
            print(
                f"vllm-servicer metrics on http://{args.metrics_address}:"
                f"{self.metrics.server_port}/metrics",
                flush=True,
            )
        if args.http.http_port is not None:
            self.http = await HttpApi.build(
                engine,
                args,
                host=args.http_address,
                port=args.http.http_port,
                verifier=verifier,
                tls=args.security.tls,
                guard=guard,
                slots=slots,
            )

    async def open(self, args: ServeArgs, mounted: MountedServices, *, shared: bool) -> None:
        """Open the HTTP API's port and the plaintext probe port, when asked for;
        `shared`: other frontend processes bind them too."""
        if self.http is not None:
            await self.http.start(reuse_port=shared)
        if args.security.health_port is not None and mounted.health is not None:
            self.probes, port = await start_probe_port(
                mounted.health, args.server.host, args.security.health_port, shared=shared
            )
            if not shared:  # else the parent prints the one port they share
                print(f"vllm-servicer health (plaintext) on {args.server.host}:{port}", flush=True)

    async def close(self, engine: AsyncLLM) -> None:
        """Stop these servers and the engine, in the order a clean end needs, and log it."""
        if self.http is not None:
            await self.http.stop(0)  # a no-op after a drain; ends it on an error
        if self.probes is not None:
            await self.probes.stop(0)  # last: liveness answered through the drain
        if self.peers is not None:
            await self.peers.stop(0)
        logger.info("shutting down the engine")
        engine.shutdown()
        if self.metrics is not None:
            self.metrics.shutdown()
        logger.info("stopped")


def _shutdown(
    args: ServeArgs,
    server: grpc.aio.Server,
    mounted: MountedServices,
    metrics: MetricsInterceptor | None,
    side: _SideServers,
) -> GracefulShutdown:
    """The drain, asked for by SIGTERM and SIGINT from now on."""
    shutdown = GracefulShutdown(
        server,
        mounted,
        grace_period=args.server.drain_grace,
        timeout=float(args.engine["shutdown_timeout"] or 0),
        on_drain=[metrics.mark_shutdown] if metrics is not None else [],
        # Whatever hangs (a client, the engine), the process ends in time.
        hard_stop=HardStop(exit_now),
        companions=[side.http] if side.http is not None else [],
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, shutdown.request_stop)
    return shutdown


async def _serve_until_stopped(
    engine: AsyncLLM,
    shutdown: GracefulShutdown,
    group: FrontendGroup | None = None,
    health: EngineHealthServicer | None = None,
) -> int:
    """Serve until a stop request or the engine's death, then drain; the exit code."""
    watchdog = asyncio.ensure_future(stop_when_engine_dies(engine, shutdown.request_stop, group))
    # Engines on other nodes: one that stops answering counts as the engine's
    # death; one that misses a question makes its rank's health NOT_SERVING.
    on_answer = health.rank_answered if health is not None else None
    remote = asyncio.ensure_future(watch_remote_engines(engine, on_answer=on_answer))
    await shutdown.wait_for_stop_request()
    # Died first, or stopped by a signal (that may reach the engine's processes too).
    died = watchdog.done() and not watchdog.cancelled() and watchdog.result()
    watchdog.cancel()
    remote.cancel()
    await shutdown.run()
    return EXIT_FAILED if died else EXIT_STOPPED


async def stop_when_engine_dies(
    engine: EngineClient,
    stop: Callable[[], object],
    group: FrontendGroup | None = None,
    interval: float = 0.5,
) -> bool:
    """Call `stop` once the engine has died, as vLLM's HTTP server ends itself
    then; True when it did.

    A dead EngineCore never comes back: a server left running answers every
    call UNAVAILABLE, and only a liveness probe would restart it, not systemd
    or a container's restart policy. `VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1`
    (vLLM's own switch) keeps serving, health NOT_SERVING. `group`: this
    process is one of several frontends, told of the engine's death by their parent.
    """
    import vllm.envs

    if vllm.envs.VLLM_KEEP_ALIVE_ON_ENGINE_DEATH:
        return False
    while not engine.errored:  # noqa: ASYNC110 - vLLM offers no event; one attribute read
        if group is not None and group.engine_dead:
            # One of several frontends: the parent saw the engine's process end.
            engine_core_died(engine)
            break
        await asyncio.sleep(interval)
    logger.error(
        "the vLLM engine died: draining and stopping with exit code 1 "
        "(VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1 keeps serving, health NOT_SERVING)"
    )
    stop()
    return True
