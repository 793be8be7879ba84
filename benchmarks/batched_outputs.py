"""A prototype: the engine core's outputs consumed once per step for every stream,
against `AsyncLLM.generate` per request, in one process on one engine.

    python benchmarks/batched_outputs.py [--concurrency 64] [--tokens 64] [--rounds 6]
        [--response ids|text] [--quick] [vLLM engine flags]

What a streaming servicer pays vLLM's frontend per token, before any code of
its own: per request per engine step, `AsyncLLM`'s output handler builds a
`RequestOutput` (output processing, stats), puts it in the request's queue and
wakes the task that waits on it. The batched path below reads the same
`EngineCoreOutputs` (`engine_core.get_output_async()`, one batch per step for
every request) and hands each stream its new token ids in one pass, with
vLLM's own incremental detokenizer per request when text is asked for, and no
`RequestOutput`, queue nor wake-up per request. What a server would still pay
on either path (grpc's per-message write, this package's conversion) is left
out of both.

Both paths run on one engine in one process (uvloop), in alternating bursts
(A B B A, then B A A B) so drift cancels; each path's two bursts in a round
give its A/A noise. Counted: this process's CPU (all its threads: the event
loop and vLLM's output-decoding thread), per output token; the engine core's
process is not counted. Every request's token count is checked on both paths,
and the first burst checks that both return the same greedy tokens.

A prototype only, for the decision: it drives `EngineCoreClient` and
`InputProcessor` directly (vLLM 0.32's names) and handles no abort, no n > 1,
no logprobs, no stop strings.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ceiling import build_engine  # noqa: E402
from loadgen import make_prompt  # noqa: E402

PER_REQUEST, BATCHED = "per-request", "batched"


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return usage.ru_utime + usage.ru_stime


def params(tokens: int, text: bool) -> Any:
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    return SamplingParams(
        temperature=0.0,
        max_tokens=tokens,
        ignore_eos=True,
        detokenize=text,
        output_kind=RequestOutputKind.DELTA,
    )


async def per_request(
    engine: Any, prompts: list[list[int]], concurrency: int, tokens: int, text: bool, tag: str
) -> dict[str, list[int]]:
    """`AsyncLLM.generate` per request, as the servicers call it: each request's tokens."""
    from vllm.inputs import TokensPrompt

    sampling = params(tokens, text)
    got: dict[str, list[int]] = {}
    queue = iter(enumerate(prompts))

    async def worker() -> None:
        for i, prompt in queue:
            ids: list[int] = []
            chars = 0
            async for output in engine.generate(
                TokensPrompt(prompt_token_ids=prompt), sampling, f"{tag}-{i}"
            ):
                ids.extend(output.outputs[0].token_ids)
                chars += len(output.outputs[0].text)
            got[f"{tag}-{i}"] = ids

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return got


class _Stream:
    """One request on the batched path: its ids so far, its detokenizer."""

    __slots__ = ("done", "ids", "detokenizer", "chars")

    def __init__(self, detokenizer: Any) -> None:
        self.ids: list[int] = []
        self.detokenizer = detokenizer
        self.chars = 0
        self.done = asyncio.Event()


async def batched(
    engine: Any, prompts: list[list[int]], concurrency: int, tokens: int, text: bool, tag: str
) -> dict[str, list[int]]:
    """The engine core's outputs read once per step for every stream."""
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    core = engine.engine_core
    tasks = await engine.get_supported_tasks()
    sampling = params(tokens, text)
    streams: dict[str, _Stream] = {}
    by_name: dict[str, _Stream] = {}
    pending = iter(enumerate(prompts))
    in_flight = 0
    finished = asyncio.Event()

    async def add_next() -> None:
        nonlocal in_flight
        item = next(pending, None)
        if item is None:
            if in_flight == 0:
                finished.set()
            return
        i, prompt = item
        name = f"{tag}-{i}"
        request = engine.input_processor.process_inputs(
            name, TokensPrompt(prompt_token_ids=prompt), sampling.clone(), supported_tasks=tasks
        )
        engine.input_processor.assign_request_id(request)
        detokenizer = (
            IncrementalDetokenizer.from_new_request(engine.tokenizer, request) if text else None
        )
        stream = _Stream(detokenizer)
        streams[request.request_id] = by_name[name] = stream
        in_flight += 1
        await core.add_request_async(request)

    async def consume() -> None:
        nonlocal in_flight
        while not finished.is_set():
            outputs = await core.get_output_async()
            refill = 0
            for output in outputs.outputs:
                stream = streams.get(output.request_id)
                if stream is None:
                    continue
                new = output.new_token_ids
                stream.ids.extend(new)
                done = output.finish_reason is not None
                if stream.detokenizer is not None:
                    stream.detokenizer.update(new, False)
                    stream.chars += len(stream.detokenizer.get_next_output_text(done, True))
                if done:
                    del streams[output.request_id]
                    in_flight -= 1
                    refill += 1
            for _ in range(refill):
                await add_next()
            if in_flight == 0 and not streams:
                await add_next()

    for _ in range(concurrency):
        await add_next()
    await consume()
    return {name: stream.ids for name, stream in by_name.items()}


PATHS = {PER_REQUEST: per_request, BATCHED: batched}


async def burst(
    engine: Any,
    path: str,
    args: argparse.Namespace,
    tag: str,
    prompts: list[list[int]] | None = None,
) -> dict[str, Any]:
    """One burst on `path`: `prompts` (default: `args.requests` new ones), each checked."""
    prompts = prompts or [make_prompt(8) for _ in range(args.requests)]
    if path == BATCHED:
        # The batched path owns the engine core's output queue: AsyncLLM's
        # own reader is stopped (and starts again at the next generate).
        handler = engine.output_handler
        if handler is not None:
            handler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await handler
            engine.output_handler = None
    started_cpu, started = cpu_seconds(), time.perf_counter()
    got = await PATHS[path](
        engine, prompts, args.concurrency, args.tokens, args.response == "text", tag
    )
    cpu, wall = cpu_seconds() - started_cpu, time.perf_counter() - started
    wrong = [name for name, ids in got.items() if len(ids) != args.tokens]
    if len(got) != args.requests or wrong:
        raise SystemExit(f"{path}: {len(got)} requests, {len(wrong)} without {args.tokens} tokens")
    total = sum(len(ids) for ids in got.values())
    return {"cpu_us_per_token": cpu / total * 1e6, "tokens_per_s": total / wall, "got": got}


async def main_async(args: argparse.Namespace, engine_argv: list[str]) -> dict[str, Any]:
    engine = build_engine(engine_argv)
    try:
        # The same greedy tokens on both paths, for the same prompts.
        check = argparse.Namespace(**{**vars(args), "requests": 8, "concurrency": 8})
        prompts = [make_prompt(8) for _ in range(check.requests)]
        a = (await burst(engine, PER_REQUEST, check, "check-a", prompts))["got"]
        b = (await burst(engine, BATCHED, check, "check-b", prompts))["got"]
        same = [a[f"check-a-{i}"] for i in range(8)] == [b[f"check-b-{i}"] for i in range(8)]
        print(f"greedy check: both paths gave the same tokens: {same}", flush=True)
        if not same:
            raise SystemExit("the two paths gave different tokens")
        for path in (PER_REQUEST, BATCHED):  # warm-up, not counted
            await burst(engine, path, args, f"warm-{path}")
        runs: dict[str, list[dict[str, Any]]] = {PER_REQUEST: [], BATCHED: []}
        rounds = []
        for r in range(args.rounds):
            order = [PER_REQUEST, BATCHED, BATCHED, PER_REQUEST]
            if r % 2:
                order = order[::-1]
            this: dict[str, list[float]] = {PER_REQUEST: [], BATCHED: []}
            for k, path in enumerate(order):
                result = await burst(engine, path, args, f"r{r}-{k}")
                result.pop("got")
                runs[path].append(result)
                this[path].append(result["cpu_us_per_token"])
            rounds.append(this)
            print(
                f"round {r}: per-request {statistics.mean(this[PER_REQUEST]):.1f} us/tok, "
                f"batched {statistics.mean(this[BATCHED]):.1f} us/tok",
                flush=True,
            )
        return {"same_tokens": same, "runs": runs, "rounds": rounds}
    finally:
        engine.shutdown()


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    runs, rounds = result["runs"], result["rounds"]
    print(
        f"\nC={args.concurrency}, {args.tokens} tokens, {args.requests} requests per burst, "
        f"response {args.response}; this process's CPU per output token (medians over bursts)"
    )
    for path in (PER_REQUEST, BATCHED):
        cpu = statistics.median(r["cpu_us_per_token"] for r in runs[path])
        rate = statistics.median(r["tokens_per_s"] for r in runs[path])
        print(f"  {path:<12} {cpu:7.1f} us/token {rate:9.0f} tok/s")
    ratios = [
        statistics.mean(r[BATCHED]) / statistics.mean(r[PER_REQUEST]) for r in rounds if r[BATCHED]
    ]
    aa = [max(v) / min(v) for r in rounds for v in r.values() if len(v) == 2]
    print(
        f"  batched / per-request per round: {statistics.median(ratios):.2f} "
        f"[{min(ratios):.2f}-{max(ratios):.2f}]; A/A (a path's two bursts): "
        f"1.00-{max(aa):.2f}"
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=None, help="per burst (default 2 x C)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--response", choices=("ids", "text"), default="text")
    p.add_argument("--quick", action="store_true", help="C=8, 16 tokens, 1 round")
    p.add_argument("--json", type=Path)
    return p


def main() -> None:
    args, engine_argv = build_parser().parse_known_args()
    if args.quick:
        args.concurrency, args.tokens, args.rounds = 8, 16, 1
    args.requests = args.requests or 2 * args.concurrency
    import uvloop

    result = uvloop.run(main_async(args, engine_argv))
    report(result, args)
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, **result}))
    # As the launcher ends: without the interpreter's teardown, where the
    # engine's finalizer runs again after its modules are gone.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
