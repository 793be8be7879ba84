"""A light tenant's request joins the next engine step, not the end of a heavy tenant's prefill.

The fair order (`test_fair_work_order.py`) puts tenant B's request ahead of
tenant A's queue, but vLLM gives the running requests the step's budget
first: with chunked prefill, B waits for every chunk of A's prompts already in
prefill, and for the long step in progress. The launcher's scheduler
(`fair_steps.FairStepScheduler`, with `--scheduling-policy priority` and
chunked prefill) lets B's request into the next step before those chunks, and
keeps steps short while it does, so B's first token comes before the first
token of A's prompt that was in prefill when B came, except when that
prompt's last chunk was already in the step under way.

On the launcher as users start it, with chunked prefill on (a GPU's default;
on a CPU before vLLM 0.34 the launcher keeps whole prompts unless asked, since
a split prompt's seeded draw stops the engine), two keys, over gRPC and the
HTTP API, with one frontend process and with `--api-server-count 2`.
With `--shared-step-tokens 0` (vLLM's own scheduler) nearly every one of B's
rounds counts one of A's first tokens first, and the assertions below fail.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import httpx
import pytest
from support import bearer, request, unique_prompt
from support.launcher import START_TIMEOUT, Launched, launched, launcher_env

from vllm_servicer.context import Identity, current_identity
from vllm_servicer.fair_work import TENANT_ARG
from vllm_servicer.proto import vllm_engine_pb2_grpc
from vllm_servicer.servicer.tenancy import RunningRequests
from vllm_servicer.servicer.tenant_engine import TenantEngine

pytestmark = pytest.mark.timeout(START_TIMEOUT + 300)

KEY_A = "fair-steps-tenant-a-0123456789abcdef"
KEY_B = "fair-steps-tenant-b-0123456789abcdef"
LONG = 1800
FLOOD = 24
ROUNDS = 8


async def test_each_request_names_its_tenant_where_the_scheduler_reads_it(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mount's engine puts the caller's key name in `extra_args`, over a
    client's own value under that key, beside what else is there."""
    from vllm import SamplingParams

    handed: list[Any] = []
    generate = engine.generate

    def spy(*args: Any, **kwargs: Any) -> Any:
        handed.append(kwargs.get("sampling_params", args[1] if len(args) > 1 else None))
        return generate(*args, **kwargs)

    monkeypatch.setattr(engine, "generate", spy)
    tenants = TenantEngine(engine, RunningRequests())
    for identity, named in ((Identity(name="b", kind="api_key"), "b"), (None, "")):
        params = SamplingParams(max_tokens=1, extra_args={TENANT_ARG: "a", "kept": 1})
        token = current_identity.set(identity)
        try:
            outputs = tenants.generate({"prompt_token_ids": [5, 6, 7]}, params, f"named-{named}")
            assert [o.finished async for o in outputs][-1]
        finally:
            current_identity.reset(token)
        assert handed[-1].extra_args == {TENANT_ARG: named, "kept": 1}


@pytest.fixture(scope="module", params=[1, 2], ids=["one-process", "two-processes"])
async def launcher(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Launched]:
    work = tmp_path_factory.mktemp("fair-steps")
    keys = work / "keys"
    keys.write_text(f"a: {KEY_A}\nb: {KEY_B}\n")
    flags = [
        *("--api-key-file", str(keys), "--max-model-len", "2048", "--http-port", "0"),
        *("--enable-chunked-prefill", "--api-server-count", str(request.param)),
    ]
    env = launcher_env(work / "cache", VLLM_ALLOW_LONG_MAX_MODEL_LEN="1")
    async with launched(*flags, env=env) as served:
        yield served


async def _a_first_tokens_before_b(
    launcher: Launched, b_call: Callable[[], Awaitable[None]]
) -> int:
    """B's rounds, one after another while A's flood is in prefill: how many of
    A's first tokens came between a round's start and its first token, summed.

    Only rounds that began and ended with several of A's prompts still to run
    count; there must be `ROUNDS` of them.
    """
    ended = 0
    first_ended = asyncio.Event()
    options = [("grpc.max_send_message_length", 1 << 24)]
    async with grpc.aio.insecure_channel(launcher.address, options=options) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)

        async def a_call() -> None:
            nonlocal ended
            await stub.Generate(
                request(unique_prompt(LONG), max_tokens=1, ignore_eos=True),
                metadata=bearer(KEY_A),
                timeout=120,
            ).read()
            ended += 1
            first_ended.set()

        flood = [asyncio.create_task(a_call()) for _ in range(FLOOD)]
        await first_ended.wait()  # A's prompts are in the engine and its steps run
        counted, a_first = 0, 0
        while counted < ROUNDS and FLOOD - ended >= 4:
            before = ended
            await b_call()
            if FLOOD - ended >= 2:
                counted += 1
                a_first += ended - before
        await asyncio.gather(*flood)
    assert counted == ROUNDS, f"A's flood ran out after {counted} of B's rounds"
    return a_first


async def test_a_light_tenants_request_joins_the_next_step(launcher: Launched) -> None:
    async with grpc.aio.insecure_channel(launcher.address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)

        async def b_call() -> None:
            await stub.Generate(
                request(unique_prompt(8), max_tokens=1, ignore_eos=True),
                metadata=bearer(KEY_B),
                timeout=120,
            ).read()

        a_first = await _a_first_tokens_before_b(launcher, b_call)
    # Behind A's running prefill, each round would count at least one.
    assert a_first <= ROUNDS // 2, (
        f"{a_first} of A's first tokens came during B's {ROUNDS} rounds: B waited for A's prefill"
    )


async def test_it_joins_the_next_step_over_the_http_api(launcher: Launched) -> None:
    async with httpx.AsyncClient(base_url=launcher.http_url, timeout=120) as http:

        async def b_call() -> None:
            body = {"prompt": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 1}
            answer = await http.post("/v1/completions", json=body, headers=dict(bearer(KEY_B)))
            assert answer.status_code == 200, answer.text

        a_first = await _a_first_tokens_before_b(launcher, b_call)
    assert a_first <= ROUNDS // 2, (
        f"{a_first} of A's first tokens came during B's {ROUNDS} rounds over HTTP"
    )
