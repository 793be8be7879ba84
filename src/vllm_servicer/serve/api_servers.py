"""`serve --api-server-count N`: N serving processes, one engine.

Every token costs the serving process CPU (grpc's send, vLLM's output path),
and one process is one core. With N above 1 this process starts the engine
core, then N frontend processes, each an `AsyncLLM` client of that engine
(vLLM's `client_count` / `client_index`, as its HTTP server's
`--api-server-count` does), each serving the gRPC protocols, the HTTP API
with `--http-port` and the plaintext probe port with `--health-port`, all on
the same ports: each is bound with SO_REUSEPORT and the kernel hands each
new connection to one of the processes. A router holding one HTTP/2
connection is thus served by one process; open several connections (or set
`--max-connection-age`) to spread. The process entry (`cli.py`) hands the
process here; each frontend runs the one-process launcher's `serve`
(`launcher.py`), as a client of the engine this process started.

What must hold across the processes they share (`frontends.FrontendGroup`):
request ids and their owners, the in-flight count and its limit, the KV-event
streams. An Abort for a request another process runs is handed to it
(`peers.py`). This process serves the metrics of all of them (prometheus
multiprocess mode, vLLM's `vllm:*` series included) and passes stop signals
on: one SIGTERM drains every frontend, then the engine stops. LoRA adapters
are fixed at start (`--lora-modules`), as vLLM's HTTP server fixes them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import queue
import signal
import socket
import time
from dataclasses import dataclass
from multiprocessing import connection
from typing import TYPE_CHECKING, Any

from ..frontends import FrontendGroup, id_room, table_capacity
from ..shares import WANTING_ONLY_RECORDS
from .args import ServeArgs
from .engine_processes import apart_from_stop_signals
from .launcher import Frontend, serve
from .preflight import addresses_usable
from .process import EXIT_FAILED, EXIT_STOPPED, configure_logging, end_process, run_until_done

if TYPE_CHECKING:
    from multiprocessing.queues import Queue
    from types import FrameType
    from wsgiref.simple_server import WSGIServer

    from ..vllm_releases import EngineWithFrontends

logger = logging.getLogger("vllm_servicer.serve")

# Beyond a frontend's own drain and hard stop: the time to end its process.
_EXIT_MARGIN = 15.0


@dataclass
class _Launch:
    """What each frontend process receives (pickled by multiprocessing at spawn)."""

    args: ServeArgs
    group: FrontendGroup
    ready: Queue[tuple[int, int]]  # (index, pid) once serving


def frontend_main(
    listen_address: str, sock: socket.socket, launch: _Launch, client_config: dict[str, Any]
) -> None:
    """A frontend process: serve as client `client_index` until told to stop."""
    from vllm.utils.system_utils import set_process_title

    index = client_config["client_index"]
    # vLLM's title for its own API server processes: VLLM::APIServer_<index>.
    set_process_title("APIServer", str(index))
    launch.group.join(index)
    configure_logging(launch.args)
    frontend = Frontend(launch.group, client_config, launch.ready)
    end_process(run_until_done(serve(launch.args, frontend), launch.args.server.event_loop))


def serve_frontends(args: ServeArgs) -> int:
    """Start the engine and `args.server.api_server_count` frontends; serve until a
    stop signal, then drain them all and stop the engine. The exit code.

    `EXIT_STOPPED` (0) after a stop asked for by a signal; `EXIT_FAILED` (1)
    when a port is taken, the engine died or a frontend ended on its own.
    """
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.metrics.prometheus import setup_multiprocess_prometheus

    from .. import vllm_releases

    count = args.server.api_server_count
    # Before anything imports prometheus_client's value class in a frontend:
    # each process writes its series to files in a directory this one reads.
    setup_multiprocess_prometheus()  # type: ignore[no-untyped-call]
    if not addresses_usable(args):
        return EXIT_FAILED
    args = _with_fixed_ports(args)
    # Sized from what the budgets let run at once, and no one identity holds
    # more ids than that: others always find room in the table.
    ids = id_room(args.slots.max_inflight, args.options.budgets.max_pooling_inputs)
    capacity = table_capacity(
        args.slots.max_inflight,
        args.options.budgets.max_pooling_inputs,
        args.options.streaming.max_kv_subscribers,
    )
    # A fair-share record for every tenant that can hold a slot, and some that only want one.
    group = FrontendGroup(
        count,
        capacity,
        claims_per_owner=ids,
        share_records=args.slots.max_inflight + WANTING_ONLY_RECORDS,
    )
    ready = multiprocessing.get_context("spawn").Queue()
    engine_args = args.engine_args()
    engine_args._api_process_count = count
    engine_args._api_process_rank = -1
    vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    started = time.monotonic()
    logger.info("starting the vLLM engine and %d frontend processes...", count)
    with vllm_releases.engine_with_frontends(
        vllm_config,
        count,
        frontend_main,
        _Launch(args, group, ready),
        log_stats=not engine_args.disable_log_stats,
        apart=apart_from_stop_signals,
    ) as frontends:
        return _run(args, group, frontends, ready, started)


def _run(
    args: ServeArgs,
    group: FrontendGroup,
    frontends: EngineWithFrontends,
    ready: Queue[tuple[int, int]],
    started: float,
) -> int:
    """From the engine up to every process gone."""
    processes: list[multiprocessing.process.BaseProcess] = list(frontends.processes)
    stop = _StopForwarding(processes)
    metrics = None
    try:
        if not _wait_until_serving(processes, ready, stop):
            return EXIT_FAILED
        logger.info(
            "engine and %d frontends ready in %.1f s", len(processes), time.monotonic() - started
        )
        if args.observability.metrics_port is not None:
            metrics = _serve_metrics(args, group)
        # Printed (not only logged) so scripts and tests can read the ports.
        print(f"vllm-servicer listening on {args.server.host}:{args.server.port}", flush=True)
        if args.http.http_port is not None:
            scheme = "https" if args.security.tls is not None else "http"
            print(
                f"vllm-servicer http on {scheme}://{args.http_address}:{args.http.http_port}",
                flush=True,
            )
        if (health_port := args.security.health_port) is not None:
            print(
                f"vllm-servicer health (plaintext) on {args.server.host}:{health_port}", flush=True
            )
        pids = " ".join(str(p.pid) for p in processes)
        print(f"vllm-servicer frontends: {len(processes)} processes, pids {pids}", flush=True)
        return _wait_until_ended(args, group, processes, frontends.engine_manager, stop)
    finally:
        stop.restore()
        for process in processes:
            if process.is_alive():
                process.kill()
        logger.info("shutting down the engine")
        frontends.engine_manager.shutdown(
            timeout=float(args.engine.get("shutdown_timeout") or 0) or None
        )
        if frontends.coordinator is not None:
            frontends.coordinator.shutdown()
        group.remove_directory()
        if metrics is not None:
            metrics.shutdown()
        logger.info("stopped")


class _StopForwarding:
    """SIGTERM and SIGINT passed on to every frontend (each in a process group
    of its own, so a signal to this one's group reaches them once, from here).
    A frontend drains on the first and hurries on the second, as one process does."""

    def __init__(self, processes: list[multiprocessing.process.BaseProcess]) -> None:
        self._processes = processes
        self.requested_at: float | None = None
        self._previous = {
            sig: signal.signal(sig, self._forward) for sig in (signal.SIGTERM, signal.SIGINT)
        }

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        if self.requested_at is None:
            self.requested_at = time.monotonic()
            logger.info("stop requested: draining %d frontends", len(self._processes))
        self.send(signum)

    def send(self, signum: int = signal.SIGTERM) -> None:
        for process in self._processes:
            if process.pid is not None and process.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signum)

    def stop_all(self) -> None:
        """Drain the frontends, as a signal to this process would."""
        if self.requested_at is None:
            self._forward(signal.SIGTERM, None)

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def _wait_until_serving(
    processes: list[multiprocessing.process.BaseProcess],
    ready: Queue[tuple[int, int]],
    stop: _StopForwarding,
) -> bool:
    """Until each frontend serves; False (logged) when one ended first or a stop came."""
    waiting = {p.pid for p in processes}
    while waiting:
        if stop.requested_at is not None:
            return False
        try:
            _, pid = ready.get(timeout=0.5)
        except queue.Empty:
            ended = [p for p in processes if p.exitcode is not None]
            if ended:
                logger.error(
                    "frontend %s ended with exit code %s before serving",
                    ended[0].name,
                    ended[0].exitcode,
                )
                stop.stop_all()
                return False
            continue
        waiting.discard(pid)
    return True


def _wait_until_ended(
    args: ServeArgs,
    group: FrontendGroup,
    processes: list[multiprocessing.process.BaseProcess],
    engine_manager: object,
    stop: _StopForwarding,
) -> int:
    """Until every frontend has ended; the exit code. A frontend that ends on
    its own, or the engine's death, stops the others."""
    code = EXIT_STOPPED
    alive: dict[Any, multiprocessing.process.BaseProcess] = {p.sentinel: p for p in processes}
    engine = list(engine_manager.sentinels()) if hasattr(engine_manager, "sentinels") else []
    # A frontend's longest stop: its drain, then its hard stop's deadline.
    allowed = (
        args.server.drain_grace + float(args.engine.get("shutdown_timeout") or 0) + _EXIT_MARGIN
    )
    while alive:
        timeout = 1.0
        if stop.requested_at is not None:
            left = stop.requested_at + allowed - time.monotonic()
            if left <= 0:
                for process in alive.values():
                    logger.error("frontend %s did not stop in time: killed", process.name)
                    process.kill()
                return EXIT_FAILED
            timeout = min(timeout, left)
        for sentinel in connection.wait([*alive, *engine], timeout=timeout):
            if sentinel in engine:
                engine.remove(sentinel)
                if stop.requested_at is None:
                    logger.error("the vLLM engine died: its frontends stop")
                    code = EXIT_FAILED
                    group.engine_died()  # each ends itself, exit code 1
                    stop.requested_at = time.monotonic()  # in time, or killed
                continue
            process = alive.pop(sentinel)
            process.join(5)  # its pipe closes a moment before its exit status is there
            logger.info("frontend %s ended (exit code %s)", process.name, process.exitcode)
            if process.exitcode != EXIT_STOPPED:
                code = EXIT_FAILED
            if stop.requested_at is None:
                logger.error(
                    "frontend %s ended (exit code %s): stopping the others",
                    process.name,
                    process.exitcode,
                )
                code = EXIT_FAILED
                stop.stop_all()
    return code


def _with_fixed_ports(args: ServeArgs) -> ServeArgs:
    """`args` with each port 0 (any free one) made a port free now: every
    frontend must bind the same one."""

    def fixed(host: str, port: int | None) -> int | None:
        if port != 0:
            return port
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((host.strip("[]"), 0))
            return int(sock.getsockname()[1])

    port = fixed(args.server.host, args.server.port)
    assert port is not None  # --port always has a value
    return dataclasses.replace(
        args,
        server=dataclasses.replace(args.server, port=port),
        http=dataclasses.replace(
            args.http, http_port=fixed(args.http_address, args.http.http_port)
        ),
        security=dataclasses.replace(
            args.security, health_port=fixed(args.server.host, args.security.health_port)
        ),
    )


def _serve_metrics(args: ServeArgs, group: FrontendGroup) -> WSGIServer:
    """Every frontend's series, and vLLM's, at one `/metrics`; the prompt
    tokens waiting for prefill from the frontends' shared memory."""
    from prometheus_client import CollectorRegistry, multiprocess

    from ..interceptors import start_metrics_server
    from ..tenant_metrics import WaitingPromptTokens

    server: WSGIServer
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    # The model label as the frontends' series carry it (vLLM's served name).
    names = args.engine.get("served_model_name")
    registry.register(WaitingPromptTokens(group, names[0] if names else str(args.engine["model"])))
    server, _ = start_metrics_server(
        args.observability.metrics_port or 0, addr=args.metrics_address, registry=registry
    )
    print(
        f"vllm-servicer metrics on http://{args.metrics_address}:{server.server_port}/metrics",
        flush=True,
    )
    return server
