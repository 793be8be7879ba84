"""`serve --headless`: a node's data-parallel engines for a head launcher elsewhere.

What vLLM's own `vllm serve --headless` does (`run_headless` in
`vllm/entrypoints/cli/serve.py`), in the launcher, so that one command starts
every node: the engine configuration is built from the same engine flags,
this node's `--data-parallel-size-local` engines are started with ranks from
`--data-parallel-start-rank`, and each one registers with the head's
frontend at `--data-parallel-address`:`--data-parallel-rpc-port`. Nothing is
served here and no port is bound: the head's launcher serves every rank.

Unlike vLLM's, which exits 0 whatever ended its engines, this process exits
`EXIT_FAILED` (1) when an engine ends without being asked to (killed, crashed,
or stopped because the head went away), so that a supervisor that restarts
failed processes (`Restart=on-failure`, a Kubernetes container's restart)
brings the node back; after SIGTERM or SIGINT it stops its engines
(`--shutdown-timeout` seconds each at most) and exits 0. As the launcher's
own, the engine processes run apart from stop signals sent to the process
group (`engine_processes.py`) and die with this process.

Multi-node tensor or pipeline parallelism inside one rank (vLLM's headless
workers for `--nnodes` above the ranks) is not started here.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import signal
import threading
from typing import Any

from ..ranks import describe
from .args import ServeArgs
from .engine_processes import apart_from_stop_signals
from .process import EXIT_FAILED, EXIT_STOPPED

__all__ = ["serve_headless"]

logger = logging.getLogger("vllm_servicer.serve")

_POLL_SECONDS = 0.5
"""How often the wait for an engine's end looks for a stop signal too."""


def serve_headless(args: ServeArgs) -> int:
    """Start this node's engines, wait until one ends or a stop signal; the exit code.

    Returns:
        `EXIT_STOPPED` (0) after SIGTERM or SIGINT; `EXIT_FAILED` (1) when an
        engine ended on its own or the configuration starts none here.
    """
    from vllm.usage.usage_lib import UsageContext

    config = args.engine_args().create_engine_config(
        usage_context=UsageContext.OPENAI_API_SERVER, headless=True
    )
    parallel = config.parallel_config
    count = int(parallel.data_parallel_size_local)
    if count <= 0:
        logger.error("--headless starts this node's engines: give --data-parallel-size-local")
        return EXIT_FAILED
    if parallel.node_rank_within_dp > 0:
        logger.error(
            "--headless starts data-parallel engines; this node would hold only workers of "
            "another node's rank (--nnodes above the data-parallel ranks), which vLLM's own "
            "`vllm serve --headless` starts"
        )
        return EXIT_FAILED
    stop = threading.Event()

    def stop_requested(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, stop_requested)
    signal.signal(signal.SIGINT, stop_requested)
    # Held as long as the engines run: each process starts through the block's
    # stand-in executable whenever the system gets to it.
    with apart_from_stop_signals():
        return _run_engines(args, config, count, stop)


def _run_engines(args: ServeArgs, config: Any, count: int, stop: threading.Event) -> int:
    """Start the engines, wait for a stop signal or an engine's end, stop the rest."""
    from vllm.utils.network_utils import get_tcp_uri
    from vllm.v1.engine.utils import CoreEngineProcManager
    from vllm.v1.executor import Executor

    parallel = config.parallel_config
    first = int(parallel.data_parallel_rank)
    head = get_tcp_uri(parallel.data_parallel_master_ip, parallel.data_parallel_rpc_port)
    engines = CoreEngineProcManager(
        local_engine_count=count,
        start_index=first,
        local_start_index=0,
        vllm_config=config,
        local_client=False,
        handshake_address=head,
        executor_class=Executor.get_class(config),
        log_stats=not args.engine.get("disable_log_stats", False),
    )
    ranks = describe(range(first, first + count))
    # Printed (not only logged) so scripts and tests can read that it started.
    print(f"vllm-servicer headless: {ranks} started for the head at {head}", flush=True)
    finished: dict[str, int] = {}
    try:
        if not _wait_for_an_end(engines.sentinels(), stop):
            return EXIT_STOPPED
        finished = engines.finished_procs()
    finally:
        # vLLM's own headless stop: the engines finish their steps, then end.
        timeout = args.engine.get("shutdown_timeout") if stop.is_set() else None
        if stop.is_set():
            logger.info("stopping the engines (up to %s s)", timeout)
        engines.shutdown(timeout=timeout)
    logger.error(
        "an engine ended without being asked to (%s); stopping this node",
        ", ".join(f"{name}: exit code {code}" for name, code in sorted(finished.items()))
        or "unknown",
    )
    return EXIT_FAILED


def _wait_for_an_end(sentinels: list[Any], stop: threading.Event) -> bool:
    """Whether an engine process ended (True) before a stop signal (False)."""
    while not stop.is_set():
        if multiprocessing.connection.wait(sentinels, timeout=_POLL_SECONDS):
            return True
    return False
