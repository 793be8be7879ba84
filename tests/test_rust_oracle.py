"""vLLM's Rust frontend (vllm-rs) as the oracle for vLLM 0.34.0's released fields.

Both servers run from the vLLM 0.33 hybrid venv (the one `make test-engine
ENGINE=vllm==0.33.0` builds; its vLLM ships vllm-rs and serves the released
`vllm.Inference`), on the tiny model with the same engine flags. One client,
compiled from the release's own schema (protos/reference/vllm/), sends each
request to both. Each case says what the two must share: the same greedy
tokens, or the same refusal (status code; the words may differ). Where this
server answers otherwise on purpose, the case says so and why (docs/protocol.md,
"Fields of vLLM's released schema"):

- a thinking budget on an engine without a reasoning parser: vllm-rs answers
  as if there were none, this server refuses it (FAILED_PRECONDITION naming
  `--reasoning-parser`), since the budget cannot be kept;
- a field number the schema lacks: vllm-rs drops it (protobuf's default), this
  server refuses it naming the number and its schema's version, so that a
  client newer than the server learns its field was not applied.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from support.vllm_protocol import reference_modules

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import rust_frontend  # noqa: E402

# Run by make test-rust-oracle, not by make test (CI runs both).
pytestmark = [pytest.mark.engine, pytest.mark.rust_oracle]

VENV = rust_frontend.DEFAULT_VENV
PROBLEM = rust_frontend.venv_problem(VENV)
if PROBLEM:
    pytest.skip(f"needs vllm-rs: {PROBLEM}", allow_module_level=True)

inf, inf_grpc = reference_modules("inference")
PROMPT = [5, 17, 42, 99, 7, 63, 21, 88]
START_S = 600.0


@dataclass
class Pair:
    ours: Any
    rust: Any


@pytest.fixture(scope="module")
async def stubs() -> AsyncIterator[Pair]:
    """Both servers started from the hybrid venv; a stub of the released schema for each."""
    args = argparse.Namespace(venv=VENV.resolve(), ours_args="", rust_args="")
    engine = rust_frontend.engine_flags([])
    (rust_frontend.run.RESULTS / "logs").mkdir(parents=True, exist_ok=True)
    driver = rust_frontend.Driver(args, engine, f"oracle-{int(time.time())}")
    ours_port, rust_port = rust_frontend.run.free_port(), rust_frontend.run.free_port()
    started = [
        driver.start_ours("ours", ROOT, ours_port, ""),
        driver.start_rust(rust_port),
    ]
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{p}") for p in (ours_port, rust_port)]
    try:
        pair = Pair(*(inf_grpc.InferenceStub(c) for c in channels))
        await asyncio.gather(
            *(_ready(s, m) for s, m in zip((pair.ours, pair.rust), started, strict=True))
        )
        yield pair
    finally:
        for channel in channels:
            await channel.close()
        driver.procs.stop_all()


async def _ready(stub: Any, managed: Any) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if not managed.alive():
            raise RuntimeError(f"{managed.name} exited; see {managed.log_path}")
        try:
            await stub.Generate(_request(1), timeout=5)
            return
        except grpc.aio.AioRpcError:
            await asyncio.sleep(1)
    raise RuntimeError(f"{managed.name} not ready in {START_S} s; see {managed.log_path}")


def _request(max_new_tokens: int = 8) -> Any:
    message = inf.GenerateRequest()
    message.token_ids.ids.extend(PROMPT)
    message.stopping.max_new_tokens = max_new_tokens
    message.stopping.ignore_eos = True
    message.response.output_token_ids = True
    return message


async def _answer(stub: Any, message: Any) -> tuple[str, Any]:
    """("OK", the token ids) or (the status code's name, its details)."""
    try:
        reply = await stub.Generate(message, timeout=120)
    except grpc.aio.AioRpcError as err:
        return err.code().name, err.details()
    return "OK", list(reply.outputs.token_ids)


async def _both(stubs: Pair, message: Any) -> tuple[tuple[str, Any], tuple[str, Any]]:
    return await _answer(stubs.ours, message), await _answer(stubs.rust, message)


# Each case: a name, and how it changes a greedy request given the greedy tokens.
SAME_TOKENS: dict[str, Callable[[Any, list[int]], None]] = {
    "greedy": lambda m, g: None,
    "bad words: the first greedy token": lambda m, g: m.decoding.bad_words_token_ids.add(
        ids=[g[0]]
    ),
    "bad words: the first two greedy tokens as one sequence": lambda m, g: (
        m.decoding.bad_words_token_ids.add(ids=[g[0], g[1]])
    ),
    "top_k present and 1 at temperature 1": lambda m, g: (
        setattr(m, "temperature", 1.0),
        setattr(m.sampling, "top_k", 1),
    ),
    "top_p present and 1 (greedy)": lambda m, g: setattr(m.sampling, "top_p", 1.0),
    "min_p present and 0 (greedy)": lambda m, g: setattr(m.sampling, "min_p", 0.0),
    "engine reasoning gate, reasoning ended": lambda m, g: setattr(
        m.engine_reasoning_gate, "reasoning_ended", True
    ),
    "thinking budget -1 (none)": lambda m, g: setattr(m.stopping, "thinking_token_budget", -1),
    "KV hints, one action": lambda m, g: m.kv_hints.actions.add(
        action_id="a1", action_type="prefetch", action_version="1"
    ),
}

SAME_REFUSAL: dict[str, Callable[[Any], None]] = {
    "top_p present and 0": lambda m: setattr(m.sampling, "top_p", 0.0),
    "top_p present and 1.5": lambda m: setattr(m.sampling, "top_p", 1.5),
    "min_p present and 2": lambda m: setattr(m.sampling, "min_p", 2.0),
    "thinking budget -2": lambda m: setattr(m.stopping, "thinking_token_budget", -2),
    "a bad word past the vocabulary": lambda m: m.decoding.bad_words_token_ids.add(ids=[10**8]),
}


@pytest.mark.parametrize("case", list(SAME_TOKENS))
async def test_the_same_tokens_as_vllm_rs(case: str, stubs: Pair) -> None:
    plain = await _both(stubs, _request())
    assert plain[0] == plain[1], plain
    greedy = plain[0][1]
    message = _request()
    SAME_TOKENS[case](message, greedy)
    ours, rust = await _both(stubs, message)
    assert ours == rust, (case, ours, rust)
    assert ours[0] == "OK", ours


@pytest.mark.parametrize("case", list(SAME_REFUSAL))
async def test_the_same_refusal_as_vllm_rs(case: str, stubs: Pair) -> None:
    message = _request()
    SAME_REFUSAL[case](message)
    ours, rust = await _both(stubs, message)
    assert ours[0] == rust[0] == "INVALID_ARGUMENT", (case, ours, rust)


async def test_the_cached_token_count_is_filled_as_vllm_rs_fills_it(stubs: Pair) -> None:
    # The same prompt twice: the second finds the first's blocks in the prefix cache.
    counts = []
    for stub in (stubs.ours, stubs.rust):
        replies = [await stub.Generate(_request(2), timeout=120) for _ in range(2)]
        assert all(r.outputs.HasField("finish_info") for r in replies), replies
        counts.append([r.outputs.finish_info.num_cached_tokens for r in replies])
    assert counts[0] == counts[1], counts


async def test_an_unknown_field_dropped_by_vllm_rs_is_refused_here(stubs: Pair) -> None:
    # Field 127 (varint 1), which no release has; protobuf keeps it as an unknown
    # field, so the stub sends it on.
    raw = _request().SerializeToString() + bytes([0xF8, 0x07, 0x01])
    message = inf.GenerateRequest.FromString(raw)
    ours, rust = await _both(stubs, message)
    assert rust[0] == "OK", rust
    assert ours[0] == "INVALID_ARGUMENT" and "127" in ours[1], ours


async def test_a_thinking_budget_vllm_rs_cannot_keep_is_refused_here(stubs: Pair) -> None:
    # The tiny model's engine runs no reasoning parser: nothing can end its thinking.
    message = _request()
    message.stopping.thinking_token_budget = 0
    ours, rust = await _both(stubs, message)
    assert rust[0] == "OK", rust
    assert ours[0] == "FAILED_PRECONDITION", ours
    assert "thinking_token_budget" in ours[1] and "--reasoning-parser" in ours[1], ours
