"""vllm_servicer.v1.Pooling against vLLM's own HTTP /classify, /score and /rerank.

One launcher as users run it (the tiny cross-encoder, `--runner pooling`,
keys, metrics, vLLM's HTTP API on the same engine, a small in-flight limit
and pooling budget), called over gRPC with stubs compiled from the `.proto`
the package ships and over HTTP with httpx: the numbers must be the same,
field for field. Then what every way in promises: keys, errors named by
field, the budget, the in-flight limit, request ids owned by their caller.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
import types
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import pytest
from support import bearer
from support.launcher import ROOT, Launched, launched, launcher_env
from support.node import run_node
from support.vllm_http import float32, post_json
from support.vllm_protocol import shipped_modules

from vllm_servicer.testing.tiny_model import tiny_engine_flags, write_tiny_classifier_model

KEY = "pooling-tenant-a-0123456789abcdef01"
OTHER_KEY = "pooling-tenant-b-0123456789abcdef01"
MAX_INPUTS = 64
MAX_INFLIGHT = 8
# Above what the huge-query test gives the tokenizer once cut (its 64 texts
# and the tiny model's 2,560 characters of query for each).
MAX_CHARS = 200_000
TEXTS = ["The cat sat on the mat.", "Paris is the capital of France.", "red green blue"]
QUERY = "What is the capital of France?"
DOCUMENTS = [
    "Paris is the capital of France.",
    "The dog sat on the log.",
    "Monday Tuesday Wednesday",
    "The capital of France is a city.",
]
# About 300 tokens: a pair with the query fits the tiny model's 512.
LONG = "The quick brown fox jumps over the lazy dog. " * 12


@pytest.fixture(scope="module")
def stubs() -> tuple[types.ModuleType, types.ModuleType]:
    """The messages and stubs a client compiles from the shipped pooling.proto."""
    return shipped_modules("pooling")


@pytest.fixture(scope="module")
async def launcher(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Launched]:
    cache = tmp_path_factory.mktemp("pooling-cache")
    model = write_tiny_classifier_model(cache / "tiny-cross-encoder")
    flags = (
        *("--model", str(model), *tiny_engine_flags(), "--runner", "pooling"),
        *("--http-port", "0", "--metrics-port", "0", "--api-key", KEY, "--api-key", OTHER_KEY),
        *("--max-pooling-inputs", str(MAX_INPUTS), "--max-inflight", str(MAX_INFLIGHT)),
        *("--max-pooling-chars", str(MAX_CHARS)),
    )
    async with launched(*flags, env=launcher_env(cache)) as served:
        yield served


@pytest.fixture(scope="module")
async def pooling(launcher: Launched, stubs: Any) -> AsyncIterator[Any]:
    async with grpc.aio.insecure_channel(launcher.address) as channel:
        yield stubs[1].PoolingStub(channel)


@pytest.fixture(scope="module")
async def http(launcher: Launched) -> AsyncIterator[httpx.AsyncClient]:
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=launcher.http_url, headers=headers, timeout=120) as c:
        yield c


AUTH = bearer(KEY)


async def test_classify_gives_vllms_numbers_for_each_text(
    pooling: Any, stubs: Any, http: httpx.AsyncClient
) -> None:
    pb = stubs[0]
    reply = await pooling.Classify(pb.ClassifyRequest(input=TEXTS), metadata=AUTH)
    body = await post_json(http, "/classify", {"input": TEXTS})
    assert [r.index for r in reply.results] == [d["index"] for d in body["data"]] == [0, 1, 2]
    assert [r.label for r in reply.results] == [d["label"] for d in body["data"]]
    assert [list(r.probs) for r in reply.results] == [
        [float32(p) for p in d["probs"]] for d in body["data"]
    ]
    assert reply.prompt_tokens == body["usage"]["prompt_tokens"] > 0
    assert reply.model == body["model"]
    assert all(r.label == "relevant" and len(r.probs) == 1 for r in reply.results)


async def test_score_gives_vllms_score_for_each_pair(
    pooling: Any, stubs: Any, http: httpx.AsyncClient
) -> None:
    pb = stubs[0]
    reply = await pooling.Score(pb.ScoreRequest(text_1=QUERY, text_2=DOCUMENTS), metadata=AUTH)
    body = await post_json(http, "/score", {"text_1": QUERY, "text_2": DOCUMENTS})
    assert [(r.index, r.score) for r in reply.results] == [
        (d["index"], float32(d["score"])) for d in body["data"]
    ]
    assert reply.prompt_tokens == body["usage"]["prompt_tokens"]
    # Each pair scored on its own: a different document, a different score.
    assert len({r.score for r in reply.results}) > 1


async def test_rerank_orders_as_vllm_does_and_keeps_top_n(
    pooling: Any, stubs: Any, http: httpx.AsyncClient
) -> None:
    pb = stubs[0]
    request = pb.RerankRequest(query=QUERY, documents=DOCUMENTS, top_n=3, return_documents=True)
    reply = await pooling.Rerank(request, metadata=AUTH)
    body = await post_json(http, "/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 3})
    assert [(r.index, r.relevance_score, r.document) for r in reply.results] == [
        (d["index"], float32(d["relevance_score"]), d["document"]["text"]) for d in body["results"]
    ]
    scores = [r.relevance_score for r in reply.results]
    assert len(scores) == 3 and scores == sorted(scores, reverse=True)
    assert reply.prompt_tokens == body["usage"]["prompt_tokens"]
    # Without return_documents the texts are not echoed back.
    bare = await pooling.Rerank(pb.RerankRequest(query=QUERY, documents=DOCUMENTS), metadata=AUTH)
    assert [r.document for r in bare.results] == [""] * len(DOCUMENTS)
    assert [r.index for r in bare.results[:3]] == [r.index for r in reply.results]


async def test_truncation_keeps_the_tokens_vllm_keeps(
    pooling: Any, stubs: Any, http: httpx.AsyncClient
) -> None:
    pb = stubs[0]
    options = pb.PoolingOptions(truncate_prompt_tokens=4)
    reply = await pooling.Classify(pb.ClassifyRequest(input=TEXTS, options=options), metadata=AUTH)
    body = await post_json(http, "/classify", {"input": TEXTS, "truncate_prompt_tokens": 4})
    assert reply.prompt_tokens == body["usage"]["prompt_tokens"] == 4 * len(TEXTS)
    assert [list(r.probs) for r in reply.results] == [
        [float32(p) for p in d["probs"]] for d in body["data"]
    ]
    # -1: the model's whole context, which these texts fit in.
    whole = pb.PoolingOptions(truncate_prompt_tokens=-1)
    full = await pooling.Classify(pb.ClassifyRequest(input=TEXTS, options=whole), metadata=AUTH)
    untruncated = await pooling.Classify(pb.ClassifyRequest(input=TEXTS), metadata=AUTH)
    assert full.prompt_tokens == untruncated.prompt_tokens > reply.prompt_tokens


# Far past the context (about 200 times the tiny model's 512 tokens).
HUGE = LONG * 200


async def test_a_text_far_past_the_context_is_truncated_as_vllm_truncates_it(
    pooling: Any, stubs: Any, http: httpx.AsyncClient
) -> None:
    """Cut to the context's bound of characters before it is tokenized, the
    text keeps the tokens vLLM keeps of it whole."""
    pb = stubs[0]
    for keep in (-1, 16):
        options = pb.PoolingOptions(truncate_prompt_tokens=keep)
        texts = [HUGE, TEXTS[0], "Paris " + HUGE]
        reply = await pooling.Classify(
            pb.ClassifyRequest(input=texts, options=options), metadata=AUTH
        )
        body = await post_json(http, "/classify", {"input": texts, "truncate_prompt_tokens": keep})
        assert [list(r.probs) for r in reply.results] == [
            [float32(p) for p in d["probs"]] for d in body["data"]
        ]
        assert reply.prompt_tokens == body["usage"]["prompt_tokens"]
    options = pb.PoolingOptions(truncate_prompt_tokens=-1)
    score = await pooling.Score(
        pb.ScoreRequest(text_1=HUGE, text_2=DOCUMENTS, options=options), metadata=AUTH
    )
    body = await post_json(
        http, "/score", {"text_1": HUGE, "text_2": DOCUMENTS, "truncate_prompt_tokens": -1}
    )
    assert [r.score for r in score.results] == [float32(d["score"]) for d in body["data"]]
    documents = [*DOCUMENTS, HUGE]
    rerank = await pooling.Rerank(
        pb.RerankRequest(query=QUERY, documents=documents, options=options), metadata=AUTH
    )
    body = await post_json(
        http, "/rerank", {"query": QUERY, "documents": documents, "truncate_prompt_tokens": -1}
    )
    assert [(r.index, r.relevance_score) for r in rerank.results] == [
        (d["index"], float32(d["relevance_score"])) for d in body["results"]
    ]


async def test_a_huge_query_with_truncation_is_cut_before_it_is_tokenized(
    pooling: Any, stubs: Any
) -> None:
    """vLLM tokenizes a query whole once per pair before it truncates it (and
    on one thread, for every caller): a 4 MB query against the budget's 64
    documents was minutes of tokenizing; cut first, it answers at once."""
    pb = stubs[0]
    options = pb.PoolingOptions(truncate_prompt_tokens=-1)
    request = pb.ScoreRequest(text_1="x" * 4_000_000, text_2=["d"] * MAX_INPUTS, options=options)
    reply = await pooling.Score(request, metadata=AUTH, timeout=60)
    assert len(reply.results) == MAX_INPUTS
    assert 0 < reply.prompt_tokens <= 512 * MAX_INPUTS


@pytest.mark.parametrize(
    ("method", "build", "code", "field"),
    [
        (
            "Classify",
            lambda pb: pb.ClassifyRequest(request_id="a\nforged log line", input=["x"]),
            "INVALID_ARGUMENT",
            "request_id",
        ),
        (
            "Classify",
            lambda pb: pb.ClassifyRequest(request_id="r" * 1025, input=["x"]),
            "INVALID_ARGUMENT",
            "request_id",
        ),
        # A tenant's priority no lower than its floor (--min-tenant-priority, 0).
        (
            "Rerank",
            lambda pb: pb.RerankRequest(
                query="q", documents=["d"], options=pb.PoolingOptions(priority=-1)
            ),
            "INVALID_ARGUMENT",
            "options.priority",
        ),
        # Refused before any tokenization (vLLM tokenizes a query once per pair).
        (
            "Score",
            lambda pb: pb.ScoreRequest(text_1="x" * 4_000_000, text_2=["d"] * 8),
            "INVALID_ARGUMENT",
            "text_1",
        ),
        (
            "Rerank",
            lambda pb: pb.RerankRequest(query="q", documents=["d", "x" * 4_000_000]),
            "INVALID_ARGUMENT",
            "documents[1]",
        ),
        ("Classify", lambda pb: pb.ClassifyRequest(), "INVALID_ARGUMENT", "input"),
        ("Score", lambda pb: pb.ScoreRequest(text_1="q"), "INVALID_ARGUMENT", "text_2"),
        ("Rerank", lambda pb: pb.RerankRequest(query="q"), "INVALID_ARGUMENT", "documents"),
        (
            "Classify",
            lambda pb: pb.ClassifyRequest(
                input=["x"], options=pb.PoolingOptions(truncate_prompt_tokens=100_000)
            ),
            "INVALID_ARGUMENT",
            "options.truncate_prompt_tokens",
        ),
        (
            "Score",
            lambda pb: pb.ScoreRequest(
                text_1="q", text_2=["d"], options=pb.PoolingOptions(truncate_prompt_tokens=-2)
            ),
            "INVALID_ARGUMENT",
            "options.truncate_prompt_tokens",
        ),
        (
            "Rerank",
            lambda pb: pb.RerankRequest(
                query="q", documents=["d"], options=pb.PoolingOptions(model="not-served")
            ),
            "NOT_FOUND",
            "options.model",
        ),
        (
            "Rerank",
            lambda pb: pb.RerankRequest(query="q", documents=["d"] * (MAX_INPUTS + 1)),
            "INVALID_ARGUMENT",
            "documents",
        ),
        (
            "Classify",
            lambda pb: pb.ClassifyRequest(input=["x"] * (MAX_INPUTS + 1)),
            "INVALID_ARGUMENT",
            "input",
        ),
        # Each text fits; the query once per document is past --max-pooling-chars.
        (
            "Rerank",
            lambda pb: pb.RerankRequest(query="q" * 2_500, documents=["d" * 1_000] * MAX_INPUTS),
            "INVALID_ARGUMENT",
            "documents",
        ),
    ],
    ids=[
        "a request id with a newline",
        "a request id too long",
        "a priority below the tenant's floor",
        "a query that cannot fit",
        "a document that cannot fit",
        "no input",
        "no text_2",
        "no documents",
        "truncation past the context",
        "truncation below -1",
        "a model not served",
        "documents past the budget",
        "inputs past the budget",
        "characters past the budget",
    ],
)
async def test_bad_input_is_refused_naming_the_field(
    pooling: Any, stubs: Any, method: str, build: Any, code: str, field: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await getattr(pooling, method)(build(stubs[0]), metadata=AUTH)
    assert err.value.code() == grpc.StatusCode[code], err.value.details()
    assert (err.value.details() or "").startswith(f"{field}: "), err.value.details()


async def test_a_text_past_the_context_is_refused_as_vllm_refuses_it(
    pooling: Any, stubs: Any
) -> None:
    pb = stubs[0]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await pooling.Classify(pb.ClassifyRequest(input=[LONG * 3]), metadata=AUTH)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert "512" in (err.value.details() or "")


async def test_every_method_needs_a_key(pooling: Any, stubs: Any) -> None:
    pb = stubs[0]
    for call in (
        pooling.Classify(pb.ClassifyRequest(input=["x"])),
        pooling.Score(pb.ScoreRequest(text_1="q", text_2=["d"])),
        pooling.Rerank(pb.RerankRequest(query="q", documents=["d"]), metadata=bearer("wrong-key")),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_the_in_flight_limit_counts_pooling_calls(pooling: Any, stubs: Any) -> None:
    """`--max-inflight 8`: nine long reranks at once, one is refused, the rest answered."""
    pb = stubs[0]
    calls = [
        pooling.Rerank(
            pb.RerankRequest(query=QUERY, documents=[f"{n} {i} {LONG}" for i in range(MAX_INPUTS)]),
            metadata=AUTH,
        )
        for n in range(MAX_INFLIGHT + 1)
    ]
    results = await asyncio.gather(*calls, return_exceptions=True)
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert [r.code() for r in refused] == [grpc.StatusCode.RESOURCE_EXHAUSTED], refused
    assert sum(not isinstance(r, BaseException) for r in results) == MAX_INFLIGHT


async def test_a_request_id_running_for_one_caller_is_not_anothers(
    pooling: Any, stubs: Any
) -> None:
    """Engine ids are vLLM's "score-<request_id>-<i>", one per text, each held until
    its text is scored: a second tenant's Score under the ids of a Rerank still
    running for the first is refused, and runs once the rerank has ended."""
    pb = stubs[0]
    # Distinct documents: no prefix-cache hits, so the rerank runs for a while.
    documents = [f"{index} {LONG}" for index in range(MAX_INPUTS)]
    long_call = pooling.Rerank(
        pb.RerankRequest(request_id="shared-id", query=QUERY, documents=documents), metadata=AUTH
    )
    running = asyncio.ensure_future(long_call)
    # As many texts: its ids are all of the rerank's, the last of which runs longest.
    other = pb.ScoreRequest(request_id="shared-id", text_1="q", text_2=["d"] * MAX_INPUTS)
    refusals = []
    answered = 0
    # Time for the rerank to claim its ids first (64 long pairs: about 0.3 s).
    await asyncio.sleep(0.05)
    while not running.done():
        try:
            await pooling.Score(other, metadata=bearer(OTHER_KEY))
            answered += 1
        except grpc.aio.AioRpcError as err:
            refusals.append(err)
    assert refusals, f"the rerank ended before the other tenant's call met it ({answered})"
    assert {err.code() for err in refusals} == {grpc.StatusCode.ALREADY_EXISTS}
    assert re.search(r"'score-shared-id-\d+'", refusals[0].details() or ""), refusals[0]
    assert len((await running).results) == MAX_INPUTS
    reply = await pooling.Score(other, metadata=bearer(OTHER_KEY))
    assert reply.request_id == "shared-id" and len(reply.results) == MAX_INPUTS


async def test_a_cancelled_rerank_leaves_the_engine_and_frees_its_ids(
    pooling: Any, stubs: Any, http: httpx.AsyncClient
) -> None:
    pb = stubs[0]
    documents = [f"cancelled {index} {LONG}" for index in range(MAX_INPUTS)]
    call = pooling.Rerank(
        pb.RerankRequest(request_id="dropped", query=QUERY, documents=documents), metadata=AUTH
    )
    await asyncio.sleep(0.1)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call

    async def engine_busy() -> float:
        page = (await http.get("/metrics")).text
        found = re.findall(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$", page, re.M)
        assert found, "no vllm:num_requests_* series"
        return sum(float(v) for v in found)

    # vLLM sets these gauges when its engine steps, so a reading taken once the
    # engine went idle may be the step's before; a short call of another id makes
    # the engine step again. A request of the rerank's left in the engine stays
    # counted however often it steps.
    deadline = time.monotonic() + 30
    readings = [await engine_busy()]
    while readings[-1] and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        await pooling.Classify(pb.ClassifyRequest(input=["a short call"]), metadata=AUTH)
        readings.append(await engine_busy())
    assert readings[-1] == 0, f"requests in the engine after the cancel: {readings}"
    # Its ids are free: another tenant may run under them at once.
    reply = await pooling.Score(
        pb.ScoreRequest(request_id="dropped", text_1="q", text_2=["d"] * MAX_INPUTS),
        metadata=bearer(OTHER_KEY),
    )
    assert len(reply.results) == MAX_INPUTS


async def test_a_burst_of_mixed_calls_at_the_limit_all_answer_as_alone(
    pooling: Any, stubs: Any
) -> None:
    """300 calls, Classify, Score and Rerank mixed, long texts, as many at once as
    `--max-inflight` allows: each answers as the same call alone does (batched
    with others, a text's numbers stay within float32 rounding)."""
    pb = stubs[0]
    documents = [f"{index} {LONG}"[: 40 + 13 * index] for index in range(8)]

    def call(n: int) -> Any:
        kind = n % 3
        if kind == 0:
            return pooling.Classify(pb.ClassifyRequest(input=documents), metadata=AUTH)
        if kind == 1:
            return pooling.Score(pb.ScoreRequest(text_1=QUERY, text_2=documents), metadata=AUTH)
        return pooling.Rerank(pb.RerankRequest(query=QUERY, documents=documents), metadata=AUTH)

    def numbers(reply: Any) -> list[tuple[int, float]]:
        """Each text's index and number, whichever call answered."""
        field = {"ClassifyResult": "probs", "ScoreResult": "score"}
        out = []
        for r in reply.results:
            name = field.get(type(r).__name__, "relevance_score")
            value = getattr(r, name)
            out.append((r.index, value[0] if name == "probs" else value))
        return sorted(out)

    alone = [numbers(await call(kind)) for kind in range(3)]
    gate = asyncio.Semaphore(MAX_INFLIGHT)

    async def limited(n: int) -> Any:
        async with gate:
            return await call(n)

    replies = await asyncio.gather(*(limited(n) for n in range(300)))
    for n, reply in enumerate(replies):
        got, expected = numbers(reply), alone[n % 3]
        assert [i for i, _ in got] == [i for i, _ in expected]
        assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-5)
        assert reply.prompt_tokens > 8 * 10


async def test_the_calls_are_counted_and_nothing_stays_in_flight(
    pooling: Any, stubs: Any, launcher: Launched
) -> None:
    pb = stubs[0]
    await pooling.Classify(pb.ClassifyRequest(input=["x"]), metadata=AUTH)
    await pooling.Score(pb.ScoreRequest(text_1="q", text_2=["d"]), metadata=AUTH)
    await pooling.Rerank(pb.RerankRequest(query="q", documents=["d"]), metadata=AUTH)

    def counted(page: str) -> bool:
        """Each method's OK calls counted, and none in flight."""
        ok: dict[str, float] = {}
        for labels, value in re.findall(
            r"^grpc_server_handled_total\{([^}]*)\} (\S+)$", page, re.M
        ):
            found = dict(re.findall(r'(\w+)="([^"]*)"', labels))
            if found.get("grpc_service") == "vllm_servicer.v1.Pooling" and (
                found.get("grpc_code") == "OK"
            ):
                ok[found["grpc_method"]] = ok.get(found["grpc_method"], 0.0) + float(value)
        if any(ok.get(method, 0.0) < 1 for method in ("Classify", "Score", "Rerank")):
            return False
        in_flight = re.findall(r"^vllm_servicer_requests_in_flight\S* (\S+)$", page, re.M)
        return bool(in_flight) and all(float(v) == 0 for v in in_flight)

    # A call is counted just after its status left: the page is read until it tells.
    page = ""
    async with httpx.AsyncClient(timeout=30) as client:
        for _ in range(50):
            page = (await client.get(launcher.metrics_url)).text
            if counted(page):
                break
            await asyncio.sleep(0.1)
    assert counted(page), page[-3000:]


async def test_a_render_call_on_a_pooling_model_names_what_is_missing(
    launcher: Launched,
) -> None:
    pb, stubs = shipped_modules("render")
    async with grpc.aio.insecure_channel(launcher.address) as channel:
        render = stubs.RenderStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await render.RenderCompletion(pb.RenderCompletionRequest(prompt=["x"]), metadata=AUTH)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "'generate' task" in (err.value.details() or "")


async def test_the_examples_rerank_the_same_in_python_and_node(
    launcher: Launched, http: httpx.AsyncClient
) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(ROOT / "examples" / "rerank.py"),
        launcher.address,
        "--api-key",
        KEY,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, out.decode()
    python = _lines(out.decode())
    code, output = await run_node("rerank.js", launcher.address, KEY)
    assert code == 0, output
    assert _lines(output) == python
    assert set(python) == {"classify", "score", "rerank"}
    assert len(python["rerank"]) == 3 and all(r["document"] for r in python["rerank"])
    scores = [r["relevance_score"] for r in python["rerank"]]
    assert scores == sorted(scores, reverse=True)


def _lines(output: str) -> dict[str, Any]:
    return {m[1]: json.loads(m[2]) for m in re.finditer(r"^(\w+): (.*)$", output, re.M)}
