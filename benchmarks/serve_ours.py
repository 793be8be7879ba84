"""This project's launcher, for flags that include ``--model``.

``python -m vllm_servicer serve --model X`` is rewritten by vLLM's argument
parser into ``serve X`` (the positional form of ``vllm serve``), which the
launcher does not accept. This wrapper parses the same flags with plain
argparse and runs the launcher's own ``serve()``: the serving code measured is
the same.

    python benchmarks/serve_ours.py --model X [--port N] [vLLM engine flags]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys


def main(argv: list[str]) -> int:
    from vllm_servicer.__main__ import build_parser, serve

    parser = build_parser()
    args = argparse.ArgumentParser.parse_args(parser, ["serve", *argv])
    if args.model is None:
        raise SystemExit("serve_ours.py needs --model; without it use python -m vllm_servicer")
    if args.tokenizer is None:
        args.tokenizer = args.model
    level = str(getattr(args, "log_level", "info")).upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import uvloop
    except ImportError:
        return asyncio.run(serve(args))
    return uvloop.run(serve(args))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
