"""Start a real engine on the tiny model and stream greedy tokens; print what vLLM it was.

    VLLM_TARGET_DEVICE=cpu VLLM_SERVICER_SKIP_VLLM_VERSION_CHECK=1 \
        build/venv-vllm-0.33.0-over-cpu-0.32.0/bin/python tests/release/smoke_engine.py

Run twice (or in two venvs) it also shows the tokens are the same each time:
the tiny model's dummy weights are seeded. Exits 1 when no token streams.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time


async def stream(engine: object, prompt_ids: list[int], max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )
    chunks: list[list[int]] = []
    async for output in engine.generate(  # type: ignore[attr-defined]
        TokensPrompt(prompt_token_ids=prompt_ids), params, request_id="smoke-0"
    ):
        delta = list(output.outputs[0].token_ids)
        chunks.append(delta)
        print(f"  +{delta}", flush=True)
    return chunks


def main() -> int:
    import vllm.version

    from vllm_servicer.testing.tiny_model import build_tiny_engine

    print(f"vllm.version.__version__ = {vllm.version.__version__}", flush=True)
    print(f"VLLM_TARGET_DEVICE = {os.environ.get('VLLM_TARGET_DEVICE')!r}", flush=True)
    started = time.monotonic()
    engine = build_tiny_engine()
    print(f"engine up in {time.monotonic() - started:.1f} s", flush=True)
    try:
        chunks = asyncio.run(stream(engine, [1, 5, 6, 7, 8, 9, 10, 11], 16))
    finally:
        engine.shutdown()
    tokens = [t for chunk in chunks for t in chunk]
    print(f"greedy tokens ({len(tokens)} in {len(chunks)} streamed messages): {tokens}", flush=True)
    return 0 if len(tokens) == 16 and len(chunks) > 1 else 1


if __name__ == "__main__":
    sys.exit(main())
