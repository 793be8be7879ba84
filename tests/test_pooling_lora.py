"""LoRA adapters by name on vllm_servicer.v1.Pooling, against vLLM's HTTP routes.

One launcher: the tiny cross-encoder with real weights (an adapter changes
its scores), LoRA on, an adapter given at start (`--lora-modules`), vLLM's
HTTP API beside it with adapters loaded at run time, a tenant key and an
admin key. vLLM's HTTP routes know the adapters loaded over HTTP: the same
adapter directory loaded there under a name of its own is the oracle for the
numbers of a gRPC call naming the adapter.
"""

from __future__ import annotations

import asyncio
import shutil
import types
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from support import bearer
from support.launcher import START_TIMEOUT, launched, launcher_env
from support.vllm_http import float32, post_json
from support.vllm_protocol import reference_modules, shipped_modules

from vllm_servicer.testing.tiny_lora import (
    TINY_LORA_ENGINE_KWARGS,
    write_tiny_lora_adapter,
    write_tiny_weighted_classifier_model,
)
from vllm_servicer.testing.tiny_model import tiny_engine_flags

pytestmark = pytest.mark.timeout(START_TIMEOUT + 180)

ctl, ctl_grpc = reference_modules("control")

TENANT = "pooling-lora-tenant-0123456789abcdef"
ADMIN = "pooling-lora-admin-0123456789abcdefAB"
TEXTS = ["The cat sat on the mat.", "Paris is the capital of France.", "red green blue"]
QUERY = "What is the capital of France?"
DOCUMENTS = ["Paris is the capital of France.", "The dog sat on the log.", "Monday Tuesday"]


@dataclass
class Served:
    pooling: Any  # the Pooling stub, on one channel for the module
    control: Any  # the Control stub, on the same channel
    http: httpx.AsyncClient  # vLLM's HTTP API, with the tenant's key
    admin_http: httpx.AsyncClient  # the same, with the admin key
    adapters: dict[str, Path]


@pytest.fixture(scope="module")
def pb() -> types.ModuleType:
    """The messages a client compiles from the shipped pooling.proto."""
    return shipped_modules("pooling")[0]


@pytest.fixture(scope="module")
async def served(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Served]:
    root = tmp_path_factory.mktemp("pooling-lora")
    model = write_tiny_weighted_classifier_model(root / "model")
    adapters = {name: write_tiny_lora_adapter(root / name, seed=seed) for name, seed in
                (("a", 0), ("b", 1))}  # fmt: skip
    settings = {**TINY_LORA_ENGINE_KWARGS, "runner": "pooling"}
    flags = (
        *("--model", str(model), *tiny_engine_flags(settings), "--http-port", "0"),
        *("--lora-modules", f"start-a={adapters['a']}"),
        *("--api-key", TENANT, "--admin-api-key", ADMIN),
    )
    env = launcher_env(root / "cache", VLLM_ALLOW_RUNTIME_LORA_UPDATING="1")
    async with launched(*flags, env=env) as launcher:
        async with (
            grpc.aio.insecure_channel(launcher.address) as channel,
            httpx.AsyncClient(
                base_url=launcher.http_url, headers=_bearer(TENANT), timeout=120
            ) as http,
            httpx.AsyncClient(
                base_url=launcher.http_url, headers=_bearer(ADMIN), timeout=120
            ) as admin_http,
        ):
            for name, path in adapters.items():  # the oracle's names: http-a, http-b
                body = {"lora_name": f"http-{name}", "lora_path": str(path)}
                loaded = await admin_http.post("/v1/load_lora_adapter", json=body)
                assert loaded.status_code == 200, loaded.text
            yield Served(
                shipped_modules("pooling")[1].PoolingStub(channel),
                ctl_grpc.ControlStub(channel),
                http,
                admin_http,
                adapters,
            )


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _classify(
    served: Served, pb: Any, model: str, texts: list[str] = TEXTS
) -> list[list[float]]:
    request = pb.ClassifyRequest(input=texts, options=pb.PoolingOptions(model=model))
    reply = await served.pooling.Classify(request, metadata=bearer(TENANT), timeout=60)
    assert reply.model == (model or reply.model)
    return [list(result.probs) for result in reply.results]


async def _http_classify(served: Served, model: str, texts: list[str] = TEXTS) -> list[list[float]]:
    body = await post_json(served.http, "/classify", {"model": model, "input": texts})
    return [[float32(p) for p in item["probs"]] for item in body["data"]]


async def test_an_adapter_given_at_start_gives_vllms_numbers_for_that_adapter(
    served: Served, pb: Any
) -> None:
    adapted = await _classify(served, pb, "start-a")
    base = await _classify(served, pb, "")
    assert adapted != base, "the adapter changes nothing: the test cannot tell it apart"
    assert adapted == await _http_classify(served, "http-a")

    options = pb.PoolingOptions(model="start-a")
    score = await served.pooling.Score(
        pb.ScoreRequest(text_1=QUERY, text_2=DOCUMENTS, options=options), metadata=bearer(TENANT)
    )
    body = await post_json(
        served.http, "/score", {"model": "http-a", "text_1": QUERY, "text_2": DOCUMENTS}
    )
    assert score.model == "start-a"
    assert [(r.index, r.score) for r in score.results] == [
        (d["index"], float32(d["score"])) for d in body["data"]
    ]
    rerank = await served.pooling.Rerank(
        pb.RerankRequest(query=QUERY, documents=DOCUMENTS, options=options),
        metadata=bearer(TENANT),
    )
    body = await post_json(
        served.http, "/rerank", {"model": "http-a", "query": QUERY, "documents": DOCUMENTS}
    )
    assert rerank.model == "start-a"
    assert [(r.index, r.relevance_score) for r in rerank.results] == [
        (d["index"], float32(d["relevance_score"])) for d in body["results"]
    ]


async def test_an_adapter_control_loads_is_named_until_it_is_unloaded(
    served: Served, pb: Any
) -> None:
    load = ctl.LoadLoraRequest(lora_name="grpc-b", source_path=str(served.adapters["b"]))
    await served.control.LoadLora(load, metadata=bearer(ADMIN), timeout=120)
    adapted = await _classify(served, pb, "grpc-b")
    assert adapted == await _http_classify(served, "http-b")
    assert adapted != await _classify(served, pb, "start-a")  # b's weights, not a's

    unload = ctl.UnloadLoraRequest(lora_name="grpc-b")
    await served.control.UnloadLora(unload, metadata=bearer(ADMIN), timeout=120)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _classify(served, pb, "grpc-b")
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    assert "options.model" in str(refused.value.details())


async def test_an_adapter_unloaded_amid_a_burst_stays_until_its_calls_end(
    served: Served, pb: Any, tmp_path: Path
) -> None:
    """UnloadLora amid a burst of calls on the adapter, its directory deleted as
    soon as the unload answers: each call is answered with the adapter's numbers
    or refused as NOT_FOUND, and the engine lives (a call whose engine requests
    were still queued once the engine had dropped the adapter would make it
    load the adapter again from the deleted directory, and die)."""
    doomed = shutil.copytree(served.adapters["b"], tmp_path / "doomed")
    load = ctl.LoadLoraRequest(lora_name="grpc-doomed", source_path=str(doomed))
    await served.control.LoadLora(load, metadata=bearer(ADMIN), timeout=120)
    texts = [" ".join(TEXTS * 12)] * 16  # long enough to keep the engine busy for a while
    expected = await _http_classify(served, "http-b", texts)
    calls = [asyncio.ensure_future(_classify(served, pb, "grpc-doomed", texts)) for _ in range(128)]
    await asyncio.wait(calls, return_when=asyncio.FIRST_COMPLETED)
    unload = ctl.UnloadLoraRequest(lora_name="grpc-doomed")
    await served.control.UnloadLora(unload, metadata=bearer(ADMIN), timeout=120)
    shutil.rmtree(doomed)
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    answered = [o for o in outcomes if not isinstance(o, BaseException)]
    refused = [o for o in outcomes if isinstance(o, BaseException)]
    assert answered and all(numbers == expected for numbers in answered)
    for error in refused:
        assert isinstance(error, grpc.aio.AioRpcError), error
        assert error.code() == grpc.StatusCode.NOT_FOUND, error
        assert "options.model" in str(error.details())
    # The engine lives.
    assert await _classify(served, pb, "start-a") == await _http_classify(served, "http-a")


async def test_a_name_neither_served_nor_an_adapter_is_not_found_naming_both(
    served: Served, pb: Any
) -> None:
    # http-a is loaded over HTTP only: vLLM's HTTP registry and the mount's are apart.
    for name in ("http-a-typo", "http-a"):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _classify(served, pb, name)
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        details = str(refused.value.details())
        assert "options.model" in details and repr(name) in details
        assert "'start-a'" in details  # the adapters it may name
