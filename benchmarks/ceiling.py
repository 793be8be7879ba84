"""The ceiling: `AsyncLLM.generate` driven in-process, with no server in between.

Started by ``benchmarks/run.py`` as a subprocess. It builds the engine from the
same flags as the launcher (``python -m vllm_servicer serve``: with no
``--model``, the built-in tiny model and its engine settings), then reads one
JSON burst spec per line on stdin and writes one JSON result per line, in the
load generator's format, on its stdout. Everything else the process prints
(vLLM's logs included) goes to stderr.

    python benchmarks/ceiling.py [vLLM engine flags] < bursts.jsonl
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

sys.path.insert(0, str(Path(__file__).resolve().parent))

from loadgen import BurstSpec, Recorder, make_prompt, summarize  # noqa: E402


async def run_burst(
    engine: Any, spec: BurstSpec, tag: str, *, detokenize: bool = False
) -> dict[str, Any]:
    """One burst against the engine: the load generator's requests, in-process.

    `detokenize`: text too, as a server asked for text does.
    """
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(
        temperature=0.0,
        max_tokens=spec.max_tokens,
        ignore_eos=True,
        detokenize=detokenize,  # off: as the servers do when no text is asked for
        output_kind=RequestOutputKind.DELTA if spec.stream else RequestOutputKind.FINAL_ONLY,
    )
    prompts = [
        TokensPrompt(prompt_token_ids=make_prompt(spec.prompt_len)) for _ in range(spec.requests)
    ]
    rec = Recorder(expected_tokens=spec.max_tokens)
    clock = time.perf_counter
    queue = iter(enumerate(prompts))

    async def worker() -> None:
        for i, prompt in queue:
            arrivals: list[tuple[float, int]] = []
            total = 0
            note = ""
            sent = clock()
            try:
                async for output in engine.generate(prompt, params, f"{tag}-{i}"):
                    n = len(output.outputs[0].token_ids)
                    total += n
                    arrivals.append((clock(), n))
            except Exception as exc:
                note = f"{type(exc).__name__}: {exc}"[:200]
            rec.request_done(sent, arrivals, total, note)

    started = clock()
    await asyncio.gather(*(worker() for _ in range(min(spec.concurrency, spec.requests))))
    return summarize(spec, rec, clock() - started)


def build_engine(argv: list[str]) -> Any:
    """An `AsyncLLM` from vLLM engine flags (no --model: the built-in tiny model)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.engine.async_llm import AsyncLLM

    from vllm_servicer.testing.tiny_model import (
        TINY_ENGINE_KWARGS,
        apply_cpu_env_defaults,
        ensure_tiny_model,
    )

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(argv)
    if not any(a == "--model" or a.startswith("--model=") for a in argv):
        # No --model: the built-in tiny model with its settings (flags given still win).
        parser.set_defaults(**TINY_ENGINE_KWARGS)
        args = parser.parse_args(argv)
        apply_cpu_env_defaults()
        args.model = args.tokenizer = str(ensure_tiny_model())
    return AsyncLLM.from_engine_args(AsyncEngineArgs.from_cli_args(args))


async def serve(argv: list[str], out: TextIO) -> None:
    engine = build_engine(argv)
    try:
        out.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
        out.flush()
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        burst = 0
        while line := await reader.readline():
            command = json.loads(line)
            if command.get("op") == "quit":
                break
            burst += 1
            spec, detokenize = BurstSpec.from_dict(command), bool(command.get("detokenize"))
            result = await run_burst(engine, spec, f"ceiling-{burst}", detokenize=detokenize)
            out.write(json.dumps(result) + "\n")
            out.flush()
    finally:
        engine.shutdown()


def main() -> None:
    # The protocol gets the real stdout; fd 1 (inherited by the engine's
    # processes) becomes stderr, so no log line lands in the JSON stream.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(sys.argv[1:], out))
    else:
        uvloop.run(serve(sys.argv[1:], out))


if __name__ == "__main__":
    main()
