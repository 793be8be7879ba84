"""Standalone launcher: `python -m vllm_servicer serve [vLLM engine flags]`.

Builds an `AsyncLLM` from vLLM's own engine arguments (every vLLM engine flag
passes through), mounts the servicer on a new grpc.aio server with the
recommended options and serves until SIGTERM/SIGINT. With no `--model`, it
serves the built-in tiny model (random weights, no download).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger("vllm_servicer.serve")


def build_parser() -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from .options import DEFAULT_MAX_MESSAGE_BYTES

    parser = FlexibleArgumentParser(prog="vllm-servicer", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model over vLLM's gRPC protocol")
    own = serve.add_argument_group("vllm-servicer")
    own.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    own.add_argument("--port", type=int, default=50051, help="port to bind (0: any free port)")
    own.add_argument(
        "--max-message-bytes",
        type=int,
        default=DEFAULT_MAX_MESSAGE_BYTES,
        help="largest request or response message accepted (bytes)",
    )
    own.add_argument(
        "--drain-grace",
        type=float,
        default=2.0,
        help="seconds the server keeps answering after health turns NOT_SERVING on SIGTERM",
    )
    own.add_argument("--no-reflection", action="store_true", help="do not serve reflection")
    AsyncEngineArgs.add_cli_args(serve)
    # Our drain waits this long for in-flight calls (vLLM's default 0 would cut them).
    serve.set_defaults(model=None, shutdown_timeout=30)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse launcher arguments; without --model, the tiny model's engine settings apply."""
    from .tiny_model import TINY_ENGINE_KWARGS, apply_cpu_env_defaults, ensure_tiny_model

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model is None:
        # Re-parse with the tiny model's settings as defaults, so flags the
        # user gave still win over them.
        serve = parser._subparsers._group_actions[0].choices["serve"]  # noqa: SLF001
        serve.set_defaults(**TINY_ENGINE_KWARGS)
        args = parser.parse_args(argv)
        apply_cpu_env_defaults()
        logger.info("no --model given: serving the built-in tiny model (random weights)")
        args.model = str(ensure_tiny_model())
        if args.tokenizer is None:
            args.tokenizer = args.model
    return args


async def serve(args: argparse.Namespace) -> int:
    """Run the server until a signal; return the process exit code."""
    import grpc
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from .drain import GracefulShutdown
    from .mount import mount
    from .options import server_options

    started = time.monotonic()
    logger.info("starting the vLLM engine for %s (loading the model)...", args.model)
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs.from_cli_args(args))
    logger.info("engine ready in %.1f s", time.monotonic() - started)
    try:
        server = grpc.aio.server(options=server_options(args.max_message_bytes))
        mounted = mount(server, engine, reflection_service=not args.no_reflection)
        address = f"{args.host}:{args.port}"
        port = server.add_insecure_port(address)
        if port == 0:
            logger.error("could not bind %s", address)
            return 1
        shutdown = GracefulShutdown(
            server,
            mounted,
            grace_period=args.drain_grace,
            timeout=float(args.shutdown_timeout or 0),
        )
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, shutdown.request_stop)
        await server.start()
        # Printed (not only logged) so scripts and tests can read the bound port.
        print(f"vllm-servicer listening on {args.host}:{port}", flush=True)
        await shutdown.wait_for_stop_request()
        await shutdown.run()
        return 0
    finally:
        logger.info("shutting down the engine")
        engine.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point of `vllm-servicer`."""
    args = parse_args(argv)
    # vLLM's own --log-level (when given) sets ours too.
    level = str(getattr(args, "log_level", "info")).upper()
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        import uvloop  # optional: a faster event loop when installed
    except ImportError:
        return asyncio.run(serve(args))
    return uvloop.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
