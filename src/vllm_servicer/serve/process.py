"""What every launcher process does at its start and its end, whichever launcher it serves.

The one-process launcher (`launcher.py`), the parent of `--api-server-count`
frontends and each frontend (`api_servers.py`) all log in vLLM's format, run
their serving on one event loop and end with one of the exit codes below,
without the interpreter's teardown. The process entry (`cli.py`) picks the launcher.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import sys
from collections.abc import Coroutine
from typing import Any, NoReturn

from .args import ServeArgs

__all__ = ["EXIT_FAILED", "EXIT_STOPPED", "configure_logging", "end_process", "run_until_done"]

EXIT_STOPPED = 0
"""Served until a stop signal, then drained."""
EXIT_FAILED = 1
"""Could not serve or stopped on its own: a port taken, the engine died, a frontend ended."""


def configure_logging(args: ServeArgs) -> None:
    """Lines in vLLM's format (process, level, time, source file) at vLLM's
    `--log-level`, so that one log reads as one: vLLM's own lines go through
    its handler, the rest through the root."""
    logging.basicConfig(
        level=str(args.engine.get("log_level") or "info").upper(),
        format="(%(processName)s pid=%(process)d) %(levelname)s %(asctime)s "
        "[%(filename)s:%(lineno)d] %(message)s",
        datefmt="%m-%d %H:%M:%S",
    )


def run_until_done(serving: Coroutine[Any, Any, int], event_loop: str = "auto") -> int:
    """Run `serving` on a new event loop, its exit code. `event_loop` (`--event-loop`):
    "uvloop", "asyncio" (the standard library's), or "auto": uvloop when installed."""
    if event_loop != "asyncio":
        try:
            import uvloop
        except ImportError:
            if event_loop == "uvloop":
                raise SystemExit("--event-loop uvloop: uvloop is not installed") from None
        else:
            return uvloop.run(serving)
    return asyncio.run(serving)


def end_process(code: int) -> NoReturn:
    """Exit once serving is over, without the interpreter's own teardown.

    The atexit handlers run (exporters flush their spans, multiprocessing reaps
    its children); the teardown after them does not: there a compiled module
    vLLM imports (triton's, built with nanobind) prints hundreds of lines of
    "leaked" objects, which read like a failed stop after a clean one.
    """
    atexit._run_exitfuncs()  # noqa: SLF001 - the handlers sys.exit would run
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
