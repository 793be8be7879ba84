"""A light tenant's request is not queued behind a heavy tenant's long prompts, on the launcher.

Fair shares count calls: tenant A inside its share can queue a dozen
1,800-token prompts, each a whole engine step, and in arrival order tenant
B's 8-token request waits for every one of them. The launcher runs the
engine with `--scheduling-policy priority` and tags each request by the work
its tenant has been served (`fair_work.py`), so B's request, arriving while
A's queue is long, runs in the next step or so: it ends before most of A's
requests that were still waiting when it came.

On the launcher with two keys, over gRPC and over the HTTP API, with one
frontend process and with `--api-server-count 2` (the tags' counters in the
processes' shared memory). Also: while tenants want the prompt tokens
waiting for prefill, each is held to its share of `--max-queued-prompt-tokens`,
a request past it answered RESOURCE_EXHAUSTED with a retry hint, naming the
share; GetLoads gives them as work queued; the launcher's metrics count each
tenant's tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import httpx
import pytest
from support import bearer, request, unique_prompt
from support.launcher import START_TIMEOUT, Launched, launched, launcher_env

from vllm_servicer.proto import vllm_engine_pb2 as pb
from vllm_servicer.proto import vllm_engine_pb2_grpc

pytestmark = pytest.mark.timeout(START_TIMEOUT + 300)

KEY_A = "fair-order-tenant-a-0123456789abcdef"
KEY_B = "fair-order-tenant-b-0123456789abcdef"
KEY_FILE = f"a: {KEY_A}\nb: {KEY_B}\n"
LONG = 1800
FLOOD = 12
QUEUED_LIMIT = 30_000  # A alone is never refused; with B waiting too, A's share is 15,000


@pytest.fixture(scope="module", params=[1, 2], ids=["one-process", "two-processes"])
async def launcher(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Launched]:
    work = tmp_path_factory.mktemp("fair-order")
    keys = work / "keys"
    keys.write_text(KEY_FILE)
    flags = [
        *("--api-key-file", str(keys), "--max-model-len", "2048", "--http-port", "0"),
        *("--max-queued-prompt-tokens", str(QUEUED_LIMIT)),
        *("--api-server-count", str(request.param), "--metrics-port", "0"),
    ]
    env = launcher_env(work / "cache", VLLM_ALLOW_LONG_MAX_MODEL_LEN="1")
    async with launched(*flags, env=env) as served:
        yield served


async def _finish_order(launcher: Launched, b_call: object) -> tuple[int, int]:
    """A's flood, then B's request once A's first has ended: how many of A's
    requests still unfinished when B came ended before B, and how many after."""
    ended: list[str] = []
    first_ended = asyncio.Event()
    options = [("grpc.max_send_message_length", 1 << 24)]
    async with grpc.aio.insecure_channel(launcher.address, options=options) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)

        async def a_call() -> None:
            await stub.Generate(
                request(unique_prompt(LONG), max_tokens=1, ignore_eos=True),
                metadata=bearer(KEY_A),
                timeout=120,
            ).read()
            ended.append("A")
            first_ended.set()

        flood = [asyncio.create_task(a_call()) for _ in range(FLOOD)]
        await first_ended.wait()
        waiting_when_b_came = FLOOD - len(ended)
        await b_call()  # type: ignore[operator]
        a_before_b = len(ended) - (FLOOD - waiting_when_b_came)
        ended.append("B")
        await asyncio.gather(*flood)
    return a_before_b, waiting_when_b_came


async def test_a_light_tenants_request_goes_ahead_of_a_heavy_tenants_queue(
    launcher: Launched,
) -> None:
    async with grpc.aio.insecure_channel(launcher.address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)

        async def b_call() -> None:
            async for _ in stub.Generate(
                request(unique_prompt(8), max_tokens=1, ignore_eos=True),
                metadata=bearer(KEY_B),
                timeout=120,
            ):
                pass

        a_before_b, waiting = await _finish_order(launcher, b_call)
    # In arrival order B would end after every one of A's waiting requests.
    assert waiting >= 4, f"A's flood had {waiting} requests waiting when B came"
    assert a_before_b <= waiting // 2, (
        f"{a_before_b} of A's {waiting} waiting requests ended before B's: B queued behind A"
    )


async def test_the_order_holds_over_the_http_api(launcher: Launched) -> None:
    async with httpx.AsyncClient(base_url=launcher.http_url, timeout=120) as http:

        async def b_call() -> None:
            body = {"prompt": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 1}
            answer = await http.post("/v1/completions", json=body, headers=dict(bearer(KEY_B)))
            assert answer.status_code == 200, answer.text

        a_before_b, waiting = await _finish_order(launcher, b_call)
    assert waiting >= 4, f"A's flood had {waiting} requests waiting when B came"
    assert a_before_b <= waiting // 2, (
        f"{a_before_b} of A's {waiting} waiting requests ended before B's over HTTP"
    )


async def test_a_tenant_past_its_share_of_the_waiting_prompts_is_refused_with_a_retry_hint(
    launcher: Launched,
) -> None:
    """B's long prompts wait for prefill when A's flood comes: A is held to half
    of `--max-queued-prompt-tokens` (15,000 tokens, 8 of its prompts), the rest
    refused RESOURCE_EXHAUSTED naming its share, with a retry hint."""
    options = [("grpc.max_send_message_length", 1 << 24)]
    async with grpc.aio.insecure_channel(launcher.address, options=options) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)

        async def call(key: str) -> grpc.aio.AioRpcError | None:
            try:
                async for _ in stub.Generate(
                    request(unique_prompt(LONG), max_tokens=1, ignore_eos=True),
                    metadata=bearer(key),
                    timeout=120,
                ):
                    pass
            except grpc.aio.AioRpcError as err:
                return err
            return None

        b_calls = [asyncio.create_task(call(KEY_B)) for _ in range(6)]
        await asyncio.sleep(0.01)  # B's prompts admitted first
        results = await asyncio.gather(*(call(KEY_A) for _ in range(20)))
        assert not any(await asyncio.gather(*b_calls)), "B was refused within its share"
    refused = [err for err in results if err is not None]
    assert refused, "A was admitted past its share while B's prompts waited"
    assert len(refused) < 20
    for err in refused:
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
        details = err.details() or ""
        assert details.startswith("tenant 'a' holds "), details
        assert "its share while 2 tenants want them is 15000" in details, details
        trailers = dict(err.trailing_metadata() or ())
        assert trailers.get("grpc-retry-pushback-ms") == "1000", trailers


async def test_loads_give_the_prompt_tokens_waiting(launcher: Launched) -> None:
    """GetLoads's `num_waiting_uncached_tokens` counts prompt tokens, not requests,
    while a flood waits; none once it has run."""
    options = [("grpc.max_send_message_length", 1 << 24)]
    async with grpc.aio.insecure_channel(launcher.address, options=options) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        flood = [
            asyncio.create_task(
                stub.Generate(
                    request(unique_prompt(LONG), max_tokens=1, ignore_eos=True),
                    metadata=bearer(KEY_A),
                    timeout=120,
                ).read()
            )
            for _ in range(FLOOD)
        ]
        seen = 0
        while not all(task.done() for task in flood):
            loads = await stub.GetLoads(pb.GetLoadsRequest(), metadata=bearer(KEY_A), timeout=30)
            # Until the engine's first step GetLoads has no figures for its rank.
            seen = max([seen, *(load.num_waiting_uncached_tokens for load in loads.loads)])
        await asyncio.gather(*flood)
        after = await stub.GetLoads(pb.GetLoadsRequest(), metadata=bearer(KEY_A), timeout=30)
    assert seen >= 2 * LONG, f"at most {seen} prompt tokens seen waiting during a flood"
    assert seen % LONG == 0, seen
    assert after.loads[0].num_waiting_uncached_tokens == 0


async def test_each_tenants_tokens_are_in_the_metrics(launcher: Launched) -> None:
    """A streamed generation's every token is counted for its tenant (DELTA
    outputs, each with its new tokens), and its prompt's, on the launcher's
    metrics port: one process's collector, or every frontend's counters merged
    by the parent (`--api-server-count 2`)."""

    async def scrape() -> str:
        async with httpx.AsyncClient(timeout=30) as http:
            return (await http.get(launcher.metrics_url)).text

    def value(text: str, series: str, tenant: str | None = None) -> float:
        for line in text.splitlines():
            if line.startswith(series + "{") and (tenant is None or f'tenant="{tenant}"' in line):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = await scrape()
    async with grpc.aio.insecure_channel(launcher.address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        for _ in range(2):  # with two processes, likely one in each
            message = request(unique_prompt(40), max_tokens=37, ignore_eos=True, stream=True)
            replies = stub.Generate(message, metadata=bearer(KEY_B), timeout=120)
            chunks = [reply async for reply in replies]
            assert sum(len(m.chunk.token_ids) for m in chunks if m.HasField("chunk")) == 37
    after = await scrape()
    for series, tokens in (
        ("vllm_servicer_tenant_prompt_tokens_total", 80),
        ("vllm_servicer_tenant_output_tokens_total", 74),
    ):
        assert value(after, series, "b") - value(before, series, "b") == tokens, series
    assert "vllm_servicer_waiting_prompt_tokens{" in after
    assert value(after, "vllm_servicer_waiting_prompt_tokens") == 0
