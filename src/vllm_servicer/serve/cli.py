"""The process entry: `python -m vllm_servicer serve [vLLM engine flags]`.

Parses the command line (`args.py`), sets up logging, then hands the process
to one of the launchers below it, as vLLM's `vllm serve` hands its
process to one API server, to several, or to a headless node's engines:
`launcher.py` serves in this process; with `--api-server-count` above 1,
`api_servers.py` starts the engine and that many serving processes; with
`--headless`, `headless.py` starts this node's engines for a head
elsewhere. Nothing below imports this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

from .api_servers import serve_frontends
from .args import parse_args
from .headless import serve_headless
from .kv_publisher import check_kv_publisher
from .launcher import serve
from .process import configure_logging, end_process, run_until_done

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Console entry point of `vllm-servicer`.

    Args:
        argv: the arguments after the program name (default: `sys.argv[1:]`).
    """
    args = parse_args(argv)
    configure_logging(args)
    check_kv_publisher(args.engine)
    if args.server.headless:
        end_process(serve_headless(args))
    if args.server.api_server_count > 1:
        end_process(serve_frontends(args))
    end_process(run_until_done(serve(args), args.server.event_loop))
