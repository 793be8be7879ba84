"""vLLM's own `vllm.Control` service on a real engine, called with the reference's stubs.

One engine for the module: the tiny Llama with real random weights on disk
(on vLLM's dummy weights an adapter changes nothing), LoRA on (rank 8, two
adapters per batch), KV events published over ZMQ, and weight transfer
configured (the "ipc" backend starts on CPU; its start/finish calls work
there, an actual transfer needs CUDA). What needs an engine without a
feature (no LoRA, no weight transfer) or one that can be stopped at will
(Shutdown) runs on the package's stand-in engine, and says so.

`vllm.Inference` is mounted beside it: an adapter Control loads is one a
request names by `lora_name`, and its tokens are compared with the engine's
own `generate(..., lora_request=...)`.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import vllm
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import ENGINE_STOP_SECONDS, bearer, request, serving, settle, wait_until_idle
from support.vllm_protocol import reference_modules
from vllm import SamplingParams
from vllm.config.kv_events import KVEventsConfig

from vllm_servicer import SERVICE_NAME, mount
from vllm_servicer.errors import NotFoundError, UnsupportedError
from vllm_servicer.frontends import FrontendGroup
from vllm_servicer.interceptors.api_keys import ApiKeyVerifier
from vllm_servicer.interceptors.auth import AuthInterceptor
from vllm_servicer.proto import CONTROL_SERVICE, INFERENCE_SERVICE, vllm_engine_pb2_grpc
from vllm_servicer.servicer.lora import BASE_MODEL, AdapterHold, LoraRegistry
from vllm_servicer.testing.stand_in import StandInEngine
from vllm_servicer.testing.tiny_lora import (
    TINY_LORA_ENGINE_KWARGS,
    write_tiny_lora_adapter,
    write_tiny_weighted_model,
)
from vllm_servicer.testing.tiny_model import build_tiny_engine

ctl, ctl_grpc = reference_modules("control")
inf, inf_grpc = reference_modules("inference")

PROMPT = [5, 17, 42, 99, 7, 63, 21, 88]
ALICE = "alice-0123456789abcdefABCDEF"
BOB = "bob-0123456789abcdefABCDEF"
# Long enough to be running when another call arrives (prompt + this < max_model_len 512).
LONG = 480


# ----- the engine and its server ---------------------------------------------


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The weighted model, three adapters (two good, one of rank 16) and a work directory."""
    root = tmp_path_factory.mktemp("control")
    return SimpleNamespace(
        root=root,
        model=write_tiny_weighted_model(root / "model"),
        alpha=write_tiny_lora_adapter(root / "alpha", seed=0),
        preloaded=write_tiny_lora_adapter(root / "preloaded", seed=1),
        rank16=write_tiny_lora_adapter(root / "rank16", seed=2, rank=16),
    )


@pytest.fixture(scope="module")
async def engine(files: SimpleNamespace) -> AsyncIterator[Any]:
    llm = build_tiny_engine(
        files.model,
        **TINY_LORA_ENGINE_KWARGS,
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=f"ipc://{files.root}/kv-events",
            replay_endpoint=f"ipc://{files.root}/kv-replay",
        ),
        weight_transfer_config={"backend": "ipc"},
    )
    try:
        yield llm
    finally:
        llm.shutdown(timeout=ENGINE_STOP_SECONDS)


@pytest.fixture(scope="module")
async def served(engine: Any, files: SimpleNamespace) -> AsyncIterator[Any]:
    async with serving(
        engine,
        services=(SERVICE_NAME, INFERENCE_SERVICE, CONTROL_SERVICE),
        lora_modules={"preloaded": str(files.preloaded)},
    ) as running:
        yield running


@pytest.fixture
def stub(served: Any) -> Any:
    return ctl_grpc.ControlStub(served.channel)


async def greedy(
    engine: Any, adapter: AdapterHold = BASE_MODEL, prompt: list[int] = PROMPT
) -> list[int]:
    """The engine's greedy tokens for `prompt`, with the adapter held (the registry's `hold`)."""
    final = None
    params = SamplingParams(temperature=0.0, max_tokens=8)
    rid = f"greedy-{time.monotonic_ns()}"
    with adapter as lora:
        async for output in engine.generate(
            {"prompt_token_ids": prompt}, params, rid, lora_request=lora
        ):
            final = output
    assert final is not None
    return list(final.outputs[0].token_ids)


async def refused(call: Any) -> grpc.aio.AioRpcError:
    """The error a unary call ends with (failing the test if it succeeds)."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value


async def finish_reasons(call: Any) -> list[str]:
    """Read a VllmEngine Generate stream to its end; the finish reasons it carried."""
    reasons = []
    while (message := await call.read()) is not grpc.aio.EOF:
        if message.WhichOneof("response") == "complete":
            reasons.append(message.complete.finish_reason)
    return reasons


async def first_message(call: Any) -> None:
    """Wait for a Generate stream's first message: the request is running in the engine."""
    message = await call.read()
    assert message is not grpc.aio.EOF


# ----- LoRA adapters -----------------------------------------------------------


async def test_a_loaded_adapter_is_listed_and_changes_the_greedy_tokens(
    stub: Any, served: Any, engine: Any, files: SimpleNamespace
) -> None:
    loaded = await stub.LoadLora(
        ctl.LoadLoraRequest(lora_name="alpha", source_path=str(files.alpha)), timeout=60
    )
    assert loaded.adapter.lora_name == "alpha" and loaded.adapter.lora_id > 0
    assert loaded.adapter.source_path == str(files.alpha)
    assert loaded.adapter.lora_id in await engine.list_loras()  # in the engine, by its id

    listed = (await stub.ListLoras(ctl.ListLorasRequest(), timeout=10)).adapters
    assert [a.lora_name for a in listed] == ["alpha", "preloaded"]  # sorted; preloaded listed
    assert listed[0] == loaded.adapter

    registry = served.mounted.control.loras
    base = await greedy(engine)
    with_alpha = await greedy(engine, registry.hold("alpha"))
    with_preloaded = await greedy(engine, registry.hold("preloaded"))  # loaded at first use
    assert len({tuple(base), tuple(with_alpha), tuple(with_preloaded)}) == 3
    assert await greedy(engine, registry.hold("alpha")) == with_alpha  # deterministic
    assert registry.hold("") is BASE_MODEL  # the base model

    unloaded = await stub.UnloadLora(ctl.UnloadLoraRequest(lora_name="alpha"), timeout=60)
    assert unloaded.adapter == loaded.adapter
    assert loaded.adapter.lora_id not in await engine.list_loras()
    err = await refused(stub.UnloadLora(ctl.UnloadLoraRequest(lora_name="alpha"), timeout=10))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(NotFoundError):
        registry.hold("alpha")
    listed = (await stub.ListLoras(ctl.ListLorasRequest(), timeout=10)).adapters
    assert [a.lora_name for a in listed] == ["preloaded"]


async def inference_greedy(served: Any, lora_name: str = "") -> list[int]:
    """Greedy tokens for PROMPT through vllm.Inference's Generate, naming adapter `lora_name`."""
    message = inf.GenerateRequest(lora_name=lora_name)
    message.token_ids.ids.extend(PROMPT)
    message.stopping.max_new_tokens = 8
    message.stopping.ignore_eos = True
    message.response.output_token_ids = True
    reply = await inf_grpc.InferenceStub(served.channel).Generate(message, timeout=60)
    return list(reply.outputs.token_ids)


async def test_an_adapter_control_loads_is_one_inference_requests_name(
    stub: Any, served: Any, engine: Any, files: SimpleNamespace
) -> None:
    await stub.LoadLora(
        ctl.LoadLoraRequest(lora_name="beta", source_path=str(files.alpha)), timeout=60
    )
    try:
        registry = served.mounted.control.loras
        assert served.mounted.inference.loras is registry  # one registry for both protocols
        base = await inference_greedy(served)
        with_beta = await inference_greedy(served, "beta")
        assert base == await greedy(engine)
        assert with_beta == await greedy(engine, registry.hold("beta"))
        assert with_beta != base
        # --lora-modules serve Inference too, loaded into the engine at first use.
        assert await inference_greedy(served, "preloaded") not in (base, with_beta)
    finally:
        await stub.UnloadLora(ctl.UnloadLoraRequest(lora_name="beta"), timeout=60)
    err = await refused(
        inf_grpc.InferenceStub(served.channel).Generate(
            inf.GenerateRequest(lora_name="beta", text="hi"), timeout=10
        )
    )
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert "beta" in (err.details() or "")


def inference_stream(served: Any, lora_name: str, max_tokens: int) -> Any:
    """A vllm.Inference GenerateStream of PROMPT on adapter `lora_name`."""
    message = inf.GenerateRequest(lora_name=lora_name)
    message.token_ids.ids.extend(PROMPT)
    message.stopping.max_new_tokens = max_tokens
    message.stopping.ignore_eos = True
    message.response.output_token_ids = True
    return inf_grpc.InferenceStub(served.channel).GenerateStream(message, timeout=120)


async def read_rest(call: Any) -> list[Any]:
    """The messages of a stream from where it stands to its end."""
    messages = []
    while (message := await call.read()) is not grpc.aio.EOF:
        messages.append(message)
    return messages


async def test_an_adapter_is_dropped_only_once_the_calls_using_it_end(
    stub: Any, served: Any, engine: Any, files: SimpleNamespace
) -> None:
    """A call that named an adapter keeps it until its request ends, though the
    adapter is unloaded and its directory deleted before the engine runs it.

    Two long calls on two other adapters fill the engine's two adapter slots,
    so the third call waits in the engine's queue. The engine would load an
    adapter it had dropped from its directory when it schedules the call: with
    the directory gone, that kills the engine for every caller.
    """
    doomed = files.root / "doomed"
    shutil.copytree(files.alpha, doomed)
    names = ("slot-1", "slot-2", "doomed")
    for name in names:
        source = str(doomed if name == "doomed" else files.alpha)
        await stub.LoadLora(ctl.LoadLoraRequest(lora_name=name, source_path=source), timeout=60)
    registry = served.mounted.control.loras
    long_calls = [inference_stream(served, name, LONG) for name in names[:2]]
    try:
        for call in long_calls:
            await call.read()  # running: both adapter slots taken
        waiting = inference_stream(served, "doomed", 8)
        assert await settle(lambda: registry.holders("doomed") == 1)
        unload = asyncio.ensure_future(
            stub.UnloadLora(ctl.UnloadLoraRequest(lora_name="doomed"), timeout=120)
        )
        assert await settle(lambda: "doomed" not in registry)
        # No new call may name it; the unload waits for the one that did.
        err = await refused(inference_greedy(served, "doomed"))
        assert err.code() == grpc.StatusCode.NOT_FOUND
        listed = (await stub.ListLoras(ctl.ListLorasRequest(), timeout=10)).adapters
        assert "doomed" not in [a.lora_name for a in listed]
        assert not unload.done()
        messages = await read_rest(waiting)
        assert messages[-1].outputs.HasField("finish_info")
        assert sum(len(m.outputs.token_ids) for m in messages) == 8
        unloaded = (await unload).adapter
        assert unloaded.lora_name == "doomed"
        assert unloaded.lora_id not in await engine.list_loras()
        shutil.rmtree(doomed)  # an administrator's clean-up once the unload answered
        for call in long_calls:
            assert (await read_rest(call))[-1].outputs.HasField("finish_info")
        # The engine lives, and loads from disk only what is still served.
        assert await inference_greedy(served, "slot-1") == await greedy(
            engine, registry.hold("slot-1")
        )
        assert await inference_greedy(served) == await greedy(engine)
    finally:
        for call in long_calls:
            call.cancel()
        for name in names[:2]:
            await stub.UnloadLora(ctl.UnloadLoraRequest(lora_name=name), timeout=60)


async def test_an_unload_whose_caller_leaves_still_drops_the_adapter(
    stub: Any, served: Any, engine: Any, files: SimpleNamespace
) -> None:
    """The engine is paused ("keep": new requests wait in its queue), so the call
    naming the adapter waits there as long as the test wants."""
    loaded = await stub.LoadLora(
        ctl.LoadLoraRequest(lora_name="left", source_path=str(files.alpha)), timeout=60
    )
    registry = served.mounted.control.loras
    unload = ctl.UnloadLoraRequest(lora_name="left")
    await stub.PauseGeneration(ctl.PauseGenerationRequest(mode=ctl.PAUSE_MODE_KEEP), timeout=60)
    try:
        call = inference_stream(served, "left", 8)
        assert await settle(lambda: registry.holders("left") == 1)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.UnloadLora(unload, timeout=0.5)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "left" not in registry  # the unload took effect for new calls
        assert loaded.adapter.lora_id in await engine.list_loras()  # still under the call
        # Unloading it again waits for the same end, rather than NOT_FOUND.
        again = asyncio.ensure_future(stub.UnloadLora(unload, timeout=60))
        await asyncio.sleep(0.5)
        assert not again.done()
    finally:
        await stub.ResumeGeneration(ctl.ResumeGenerationRequest(), timeout=60)
    assert (await read_rest(call))[-1].outputs.HasField("finish_info")
    assert (await again).adapter == loaded.adapter
    assert loaded.adapter.lora_id not in await engine.list_loras()
    err = await refused(stub.UnloadLora(unload, timeout=10))
    assert err.code() == grpc.StatusCode.NOT_FOUND


async def test_a_client_slow_to_read_a_finished_stream_holds_up_no_unload(
    stub: Any, served: Any, engine: Any, files: SimpleNamespace
) -> None:
    await stub.LoadLora(
        ctl.LoadLoraRequest(lora_name="slow", source_path=str(files.alpha)), timeout=60
    )
    message = inf.GenerateRequest(lora_name="slow")
    message.token_ids.ids.extend(PROMPT)
    message.stopping.max_new_tokens = 64
    message.stopping.ignore_eos = True
    message.response.output_candidates.top_n = 20  # large messages: the writes soon wait
    # A small window the client never widens, and it stops reading.
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
    address = f"127.0.0.1:{served.port}"
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        call = inf_grpc.InferenceStub(channel).GenerateStream(message, timeout=120)
        await call.read()
        assert await wait_until_idle(engine) == 0  # the engine is done; the server waits to write
        assert served.mounted.control.loras.holders("slow") == 1
        unloaded = await stub.UnloadLora(ctl.UnloadLoraRequest(lora_name="slow"), timeout=10)
        assert unloaded.adapter.lora_id not in await engine.list_loras()
        # The stream is whole all the same.
        assert (await read_rest(call))[-1].outputs.HasField("finish_info")


@pytest.mark.parametrize(
    ("lora_name", "path", "code", "words"),
    [
        ("", "alpha", grpc.StatusCode.INVALID_ARGUMENT, "lora_name"),
        ("x", "", grpc.StatusCode.INVALID_ARGUMENT, "source_path"),
        ("x", "no-such-dir", grpc.StatusCode.INVALID_ARGUMENT, "no adapter directory"),
        ("x", "empty", grpc.StatusCode.INVALID_ARGUMENT, "not a LoRA adapter"),
        ("x", "rank16", grpc.StatusCode.INVALID_ARGUMENT, "max_lora_rank 8"),
        ("x", "corrupt", grpc.StatusCode.INVALID_ARGUMENT, "the engine could not load it"),
        ("preloaded", "alpha", grpc.StatusCode.ALREADY_EXISTS, "is loaded"),
        ("<base>", "alpha", grpc.StatusCode.ALREADY_EXISTS, "base model"),
    ],
)
async def test_load_lora_refusals(
    stub: Any,
    engine: Any,
    files: SimpleNamespace,
    lora_name: str,
    path: str,
    code: grpc.StatusCode,
    words: str,
) -> None:
    (files.root / "empty").mkdir(exist_ok=True)
    corrupt = write_tiny_lora_adapter(files.root / "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"not safetensors")
    paths = {"": "", "no-such-dir": str(files.root / "no-such-dir")}
    source = paths.get(path, str(files.root / path))
    name = engine.model_config.served_model_name if lora_name == "<base>" else lora_name
    request_ = ctl.LoadLoraRequest(lora_name=name, source_path=source)
    err = await refused(stub.LoadLora(request_, timeout=60))
    assert err.code() == code
    assert words in (err.details() or "")
    assert not engine.errored  # the engine refused it and serves on
    assert [a.lora_name for a in (await stub.ListLoras(ctl.ListLorasRequest())).adapters] == [
        "preloaded"
    ]


@pytest.mark.parametrize(
    ("lora_name", "code"),
    [("", grpc.StatusCode.INVALID_ARGUMENT), ("never-loaded", grpc.StatusCode.NOT_FOUND)],
)
async def test_unload_lora_refusals(stub: Any, lora_name: str, code: grpc.StatusCode) -> None:
    err = await refused(stub.UnloadLora(ctl.UnloadLoraRequest(lora_name=lora_name), timeout=10))
    assert err.code() == code


async def test_concurrent_loads_of_one_name_do_not_both_succeed(
    stub: Any, files: SimpleNamespace
) -> None:
    load = ctl.LoadLoraRequest(lora_name="twin", source_path=str(files.alpha))
    results = await asyncio.gather(
        *(stub.LoadLora(load, timeout=60) for _ in range(3)), return_exceptions=True
    )
    loaded = [r for r in results if not isinstance(r, BaseException)]
    assert len(loaded) == 1
    assert {r.code() for r in results if isinstance(r, grpc.aio.AioRpcError)} == {
        grpc.StatusCode.ALREADY_EXISTS
    }
    await stub.UnloadLora(ctl.UnloadLoraRequest(lora_name="twin"), timeout=60)


async def test_preloaded_adapters_are_checked_when_given_and_loaded_on_start(
    engine: Any, files: SimpleNamespace
) -> None:
    with pytest.raises(ValueError, match="no adapter directory"):
        LoraRegistry(engine, {"missing": str(files.root / "missing")})
    with pytest.raises(ValueError, match="max_lora_rank"):
        LoraRegistry(engine, {"big": str(files.rank16)})
    with pytest.raises(ValueError, match="base model"):
        LoraRegistry(engine, {engine.model_config.served_model_name: str(files.alpha)})

    registry = LoraRegistry(engine, {"early": str(files.alpha)})
    (adapter,) = registry.list()
    assert adapter.lora_id not in await engine.list_loras()  # listed, not loaded yet
    await registry.start()
    assert adapter.lora_id in await engine.list_loras()
    await registry.unload("early")


async def test_lora_needs_an_engine_started_with_it_on_a_stand_in() -> None:
    # A stand-in engine without a LoRA config: an engine started without --enable-lora.
    engine = StandInEngine()
    with pytest.raises(ValueError, match="--enable-lora"):
        LoraRegistry(engine, {"a": "/somewhere"})
    async with serving(engine, services=(CONTROL_SERVICE,)) as running:
        stub = ctl_grpc.ControlStub(running.channel)
        for call in (
            stub.LoadLora(ctl.LoadLoraRequest(lora_name="a", source_path="/x"), timeout=10),
            stub.UnloadLora(ctl.UnloadLoraRequest(lora_name="a"), timeout=10),
        ):
            err = await refused(call)
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "--enable-lora" in (err.details() or "")
        assert not (await stub.ListLoras(ctl.ListLorasRequest(), timeout=10)).adapters
        registry = running.mounted.control.loras
        assert registry.hold("") is BASE_MODEL
        with pytest.raises(UnsupportedError, match="--enable-lora"):
            registry.hold("a")
        info = await stub.GetModelInfo(ctl.GetModelInfoRequest(), timeout=10)
        assert not info.supports_lora


async def test_with_several_frontend_processes_adapters_are_fixed_at_start(
    engine: Any, files: SimpleNamespace
) -> None:
    """As mounted by each of `serve --api-server-count 2`'s processes: a load or
    unload would reach one process's registry only, so both are refused with the
    flag named; the adapters given at start serve Inference requests."""
    group = FrontendGroup(2)
    try:
        with pytest.raises(ValueError, match="join"):
            mount(grpc.aio.server(), engine, frontends=group)
        group.join(0)
        async with serving(
            engine,
            services=(INFERENCE_SERVICE, CONTROL_SERVICE),
            lora_modules={"preloaded": str(files.preloaded)},
            frontends=group,
        ) as running:
            stub = ctl_grpc.ControlStub(running.channel)
            for call in (
                stub.LoadLora(
                    ctl.LoadLoraRequest(lora_name="gamma", source_path=str(files.alpha)), timeout=10
                ),
                stub.UnloadLora(ctl.UnloadLoraRequest(lora_name="preloaded"), timeout=10),
            ):
                err = await refused(call)
                assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert "--api-server-count" in (err.details() or "")
                assert "--lora-modules" in (err.details() or "")
            listed = (await stub.ListLoras(ctl.ListLorasRequest(), timeout=10)).adapters
            assert [a.lora_name for a in listed] == ["preloaded"]
            registry = running.mounted.control.loras
            assert await inference_greedy(running, "preloaded") == await greedy(
                engine, registry.hold("preloaded")
            )
            assert await inference_greedy(running, "preloaded") != await greedy(engine)
    finally:
        group.remove_directory()  # its peers' socket directory


# ----- Abort -------------------------------------------------------------------------


async def test_abort_is_idempotent(stub: Any) -> None:
    for ids in ([], ["never-seen"], ["x", "x", ""], ["finished-long-ago"] * 3):
        await stub.Abort(ctl.AbortRequest(request_ids=ids), timeout=10)


async def test_abort_stops_a_running_request(served: Any, stub: Any, engine: Any) -> None:
    generate = vllm_engine_pb2_grpc.VllmEngineStub(served.channel)
    call = generate.Generate(
        request(PROMPT, stream=True, request_id="ctl-abort", max_tokens=LONG, ignore_eos=True)
    )
    await first_message(call)
    await stub.Abort(ctl.AbortRequest(request_ids=["ctl-abort", "ctl-abort"]), timeout=10)
    assert await finish_reasons(call) == ["abort"]
    assert await wait_until_idle(engine) == 0


@pytest.fixture(scope="module")
async def tenants(engine: Any) -> AsyncIterator[Any]:
    """The engine served with API keys for two callers, neither an administrator."""
    auth = AuthInterceptor(ApiKeyVerifier({"alice": ALICE, "bob": BOB}))
    async with serving(
        engine, services=(SERVICE_NAME, CONTROL_SERVICE), interceptors=[auth]
    ) as running:
        yield running


async def test_a_caller_cannot_abort_another_callers_request(tenants: Any, engine: Any) -> None:
    generate = vllm_engine_pb2_grpc.VllmEngineStub(tenants.channel)
    control = ctl_grpc.ControlStub(tenants.channel)
    long = request(PROMPT, stream=True, request_id="alice-1", max_tokens=LONG, ignore_eos=True)

    call = generate.Generate(long, metadata=bearer(ALICE))
    await first_message(call)
    await control.Abort(ctl.AbortRequest(request_ids=["alice-1"]), metadata=bearer(BOB))
    assert await finish_reasons(call) == ["length"]  # Bob's Abort was a no-op for it

    call = generate.Generate(long, metadata=bearer(ALICE))
    await first_message(call)
    await control.Abort(ctl.AbortRequest(request_ids=["alice-1"]), metadata=bearer(ALICE))
    assert await finish_reasons(call) == ["abort"]  # her own
    assert await wait_until_idle(engine) == 0


# ----- pause and resume -------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "clear_cache"),
    [
        (ctl.PAUSE_MODE_UNSPECIFIED, None),
        (ctl.PAUSE_MODE_ABORT, True),
        (ctl.PAUSE_MODE_WAIT, None),
        (ctl.PAUSE_MODE_KEEP, False),
    ],
)
async def test_pause_then_resume(stub: Any, mode: int, clear_cache: bool | None) -> None:
    pause = ctl.PauseGenerationRequest(mode=mode)
    if clear_cache is not None:
        pause.clear_cache = clear_cache
    await stub.PauseGeneration(pause, timeout=60)
    assert (await stub.IsPaused(ctl.IsPausedRequest(), timeout=10)).paused
    await stub.ResumeGeneration(ctl.ResumeGenerationRequest(), timeout=60)
    assert not (await stub.IsPaused(ctl.IsPausedRequest(), timeout=10)).paused


async def test_each_pause_mode_treats_running_requests_as_vllm_does(
    served: Any, stub: Any, engine: Any
) -> None:
    generate = vllm_engine_pb2_grpc.VllmEngineStub(served.channel)
    outcomes = {}
    for name, mode in (("abort", ctl.PAUSE_MODE_UNSPECIFIED), ("keep", ctl.PAUSE_MODE_KEEP)):
        call = generate.Generate(
            request(PROMPT, stream=True, max_tokens=LONG, ignore_eos=True, request_id=name)
        )
        await first_message(call)
        await stub.PauseGeneration(ctl.PauseGenerationRequest(mode=mode), timeout=60)
        await stub.ResumeGeneration(ctl.ResumeGenerationRequest(), timeout=60)
        outcomes[name] = await finish_reasons(call)
    # Unspecified is abort; keep freezes the request and runs it on after the resume.
    assert outcomes == {"abort": ["abort"], "keep": ["length"]}
    assert await wait_until_idle(engine) == 0


async def test_rl_calls_run_one_at_a_time(served: Any, stub: Any, engine: Any) -> None:
    generate = vllm_engine_pb2_grpc.VllmEngineStub(served.channel)
    call = generate.Generate(request(PROMPT, stream=True, max_tokens=LONG, ignore_eos=True))
    await first_message(call)
    # "wait" lasts until the running request ends; the resume sent after it must not overtake it.
    pause = asyncio.ensure_future(
        stub.PauseGeneration(ctl.PauseGenerationRequest(mode=ctl.PAUSE_MODE_WAIT), timeout=120)
    )
    await asyncio.sleep(0.2)
    await stub.ResumeGeneration(ctl.ResumeGenerationRequest(), timeout=120)
    await pause
    assert await finish_reasons(call) == ["length"]
    assert not (await stub.IsPaused(ctl.IsPausedRequest(), timeout=10)).paused


async def test_readiness_follows_pause_and_sleep_liveness_does_not(
    served: Any, stub: Any, engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Routers stop sending to a replica that is not ready: a paused or sleeping
    # engine is NOT_SERVING for readiness ("" and each protocol), Check and
    # Watch alike, and SERVING again once resumed; liveness stays SERVING.
    health = health_pb2_grpc.HealthStub(served.channel)
    ready, not_ready = (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )

    async def check(service: str = "") -> int:
        reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        return int(reply.status)

    watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
    seen = [int((await watch.read()).status)]
    await stub.PauseGeneration(ctl.PauseGenerationRequest(mode=ctl.PAUSE_MODE_KEEP), timeout=60)
    assert [await check(s) for s in ("", SERVICE_NAME, CONTROL_SERVICE)] == [not_ready] * 3
    assert await check("liveness") == ready
    seen.append(int((await asyncio.wait_for(watch.read(), 10)).status))
    await stub.ResumeGeneration(ctl.ResumeGenerationRequest(), timeout=60)
    assert await check() == ready
    seen.append(int((await asyncio.wait_for(watch.read(), 10)).status))
    assert seen == [ready, not_ready, ready]

    monkeypatch.setattr(engine.model_config, "enable_sleep_mode", True)  # as in the sleep test
    await stub.Sleep(ctl.SleepRequest(), timeout=60)
    try:
        assert (await check(), await check("liveness")) == (not_ready, ready)
    finally:
        await stub.WakeUp(ctl.WakeUpRequest(), timeout=60)
    assert await check() == ready
    watch.cancel()


async def test_an_unknown_pause_mode_is_invalid(stub: Any) -> None:
    err = await refused(stub.PauseGeneration(ctl.PauseGenerationRequest(mode=9), timeout=10))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not (await stub.IsPaused(ctl.IsPausedRequest(), timeout=10)).paused


# ----- sleep and wake ------------------------------------------------------------------


async def test_sleep_needs_sleep_mode(stub: Any) -> None:
    # vLLM refuses --enable-sleep-mode on CPU ("Sleep mode is not supported on
    # current platform"), so this engine, like every CPU engine, runs without it.
    for call in (
        stub.Sleep(ctl.SleepRequest(), timeout=10),
        stub.WakeUp(ctl.WakeUpRequest(), timeout=10),
    ):
        err = await refused(call)
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "--enable-sleep-mode" in (err.details() or "")
    assert not (await stub.IsSleeping(ctl.IsSleepingRequest(), timeout=10)).sleeping


async def test_sleep_and_wake_up_on_the_cpu_engine(
    stub: Any, engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The frontend's config claims sleep mode, which vLLM will not start with on
    # CPU. The engine core still sleeps and wakes (measured: is_sleeping follows,
    # the scheduler pauses and resumes); the CPU worker keeps its memory (it logs
    # "sleep mode is not supported on CPU, ignore it"), so the weights never leave.
    monkeypatch.setattr(engine.model_config, "enable_sleep_mode", True)
    before = await greedy(engine)
    assert (await stub.GetServerInfo(ctl.GetServerInfoRequest())).rl_capabilities.sleep_mode_enabled

    await stub.Sleep(ctl.SleepRequest(), timeout=60)  # level 1
    assert (await stub.IsSleeping(ctl.IsSleepingRequest(), timeout=10)).sleeping
    assert (await stub.IsPaused(ctl.IsPausedRequest(), timeout=10)).paused
    await stub.WakeUp(ctl.WakeUpRequest(), timeout=60)
    assert not (await stub.IsSleeping(ctl.IsSleepingRequest(), timeout=10)).sleeping
    assert not (await stub.IsPaused(ctl.IsPausedRequest(), timeout=10)).paused
    assert await greedy(engine) == before

    await stub.Sleep(ctl.SleepRequest(level=2, mode=ctl.PAUSE_MODE_KEEP), timeout=60)
    await stub.WakeUp(ctl.WakeUpRequest(tags=["weights"]), timeout=60)  # partly
    assert (await stub.IsSleeping(ctl.IsSleepingRequest(), timeout=10)).sleeping
    await stub.WakeUp(ctl.WakeUpRequest(), timeout=60)
    assert not (await stub.IsSleeping(ctl.IsSleepingRequest(), timeout=10)).sleeping
    assert await greedy(engine) == before

    err = await refused(stub.Sleep(ctl.SleepRequest(level=3), timeout=10))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not (await stub.IsSleeping(ctl.IsSleepingRequest(), timeout=10)).sleeping


# ----- weight updates ------------------------------------------------------------------


def _code_and_details(err: grpc.aio.AioRpcError) -> tuple[grpc.StatusCode, str]:
    return err.code(), err.details() or ""


async def test_a_weight_update_needs_a_pause_and_a_draft_update_a_draft_model(stub: Any) -> None:
    code, details = _code_and_details(
        await refused(stub.StartWeightUpdate(ctl.StartWeightUpdateRequest(), timeout=30))
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "PauseGeneration" in details
    code, details = _code_and_details(
        await refused(stub.UpdateWeights(ctl.UpdateWeightsRequest(), timeout=30))
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "PauseGeneration" in details
    code, details = _code_and_details(
        await refused(stub.StartDraftWeightUpdate(ctl.StartDraftWeightUpdateRequest(), timeout=30))
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "--speculative-config" in details


async def test_a_weight_update_under_a_pause(stub: Any, engine: Any) -> None:
    await stub.InitWeightTransferEngine(
        ctl.InitWeightTransferEngineRequest(init_info_json=b"{}"), timeout=60
    )
    await stub.PauseGeneration(ctl.PauseGenerationRequest(), timeout=60)
    try:
        await stub.StartWeightUpdate(ctl.StartWeightUpdateRequest(), timeout=60)
        # The engine's own refusal of a second start comes back in its words.
        code, details = _code_and_details(
            await refused(stub.StartWeightUpdate(ctl.StartWeightUpdateRequest(), timeout=60))
        )
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "already active" in details
        bad = ctl.UpdateWeightsRequest(update_info_json=b"not json")
        code, _ = _code_and_details(await refused(stub.UpdateWeights(bad, timeout=10)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        finish = ctl.FinishWeightUpdateRequest(weight_version="step-1")
        await stub.FinishWeightUpdate(finish, timeout=60)
    finally:
        await stub.ResumeGeneration(ctl.ResumeGenerationRequest(), timeout=60)
    reply = await stub.GetWeightVersion(ctl.GetWeightVersionRequest(), timeout=10)
    assert reply.weight_version == "step-1" == await engine.get_weight_version()


async def test_the_weight_version_can_be_set_without_a_transfer(stub: Any) -> None:
    await stub.UpdateWeightVersion(ctl.UpdateWeightVersionRequest(weight_version="v2"), timeout=10)
    reply = await stub.GetWeightVersion(ctl.GetWeightVersionRequest(), timeout=10)
    assert reply.weight_version == "v2"
    err = await refused(stub.UpdateWeightVersion(ctl.UpdateWeightVersionRequest(), timeout=10))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    bad = ctl.InitWeightTransferEngineRequest(init_info_json=b"[1, 2]")
    err = await refused(stub.InitWeightTransferEngine(bad, timeout=10))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_weight_updates_need_weight_transfer_on_a_stand_in() -> None:
    # A stand-in engine with no weight-transfer config: refused before any engine call.
    async with serving(StandInEngine(), services=(CONTROL_SERVICE,)) as running:
        stub = ctl_grpc.ControlStub(running.channel)
        for call in (
            stub.InitWeightTransferEngine(ctl.InitWeightTransferEngineRequest(), timeout=10),
            stub.StartWeightUpdate(ctl.StartWeightUpdateRequest(), timeout=10),
            stub.StartDraftWeightUpdate(ctl.StartDraftWeightUpdateRequest(), timeout=10),
            stub.UpdateWeights(ctl.UpdateWeightsRequest(), timeout=10),
            stub.FinishWeightUpdate(ctl.FinishWeightUpdateRequest(), timeout=10),
        ):
            code, details = _code_and_details(await refused(call))
            assert code == grpc.StatusCode.FAILED_PRECONDITION
            assert "--weight-transfer-config" in details
        assert not (await stub.GetKvEventSources(ctl.GetKvEventSourcesRequest())).sources


# ----- what the engine is ---------------------------------------------------------------


async def test_server_info_is_the_engines_configuration(stub: Any, engine: Any) -> None:
    config = engine.vllm_config
    info = await stub.GetServerInfo(ctl.GetServerInfoRequest(), timeout=10)
    assert info.api_version == "vllm" and info.engine_version == vllm.__version__
    assert info.instance_id == str(config.instance_id) and info.instance_id
    assert info.max_model_len == engine.model_config.max_model_len == 512
    assert info.kv_block_size == config.cache_config.block_size
    assert info.total_kv_blocks == config.cache_config.num_gpu_blocks > 0
    assert info.max_running_requests == config.scheduler_config.max_num_seqs == 64
    assert info.max_batched_tokens == config.scheduler_config.max_num_batched_tokens
    assert info.max_loras == 2
    parallel = info.parallelism
    assert (parallel.tensor_parallel_size, parallel.pipeline_parallel_size) == (1, 1)
    assert (parallel.data_parallel_size, parallel.data_parallel_rank, parallel.world_size) == (
        1,
        0,
        1,
    )
    assert info.effective_attention_block_size == config.cache_config.block_size
    rl = info.rl_capabilities
    assert rl.weight_transfer_enabled and rl.weight_transfer_backend == "ipc"
    assert not rl.sleep_mode_enabled and not rl.draft_weight_updates_enabled


async def test_server_info_states_the_schemas_version(stub: Any) -> None:
    # As vLLM's Rust frontend reports it: the version of vLLM 0.34.0's vllm-proto crate.
    info = await stub.GetServerInfo(ctl.GetServerInfoRequest(), timeout=10)
    assert info.proto_version == "0.7.0"


async def test_a_control_field_the_schema_does_not_know_is_refused(served: Any) -> None:
    # GetServerInfoRequest is empty in vLLM 0.34.0's schema: field 1 is a newer client's.
    call = served.channel.unary_unary("/vllm.Control/GetServerInfo")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call(b"\x08\x01", timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = err.value.details() or ""
    assert details.startswith("request: field number 1 is not in vllm.GetServerInfoRequest")
    assert 'proto_version "0.7.0"' in details, details
    # A Sleep with a field beside `reset_connector` (3) is refused before it reaches the engine.
    sleep = served.channel.unary_unary("/vllm.Control/Sleep")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await sleep(ctl.SleepRequest(level=1).SerializeToString() + b"\x20\x01", timeout=10)
    assert (err.value.details() or "").startswith("request: field number 4 is not in")


async def test_a_connector_reset_on_sleep_is_refused_where_vllm_cannot_do_it(
    stub: Any, engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm_servicer import vllm_releases

    assert not vllm_releases.sleep_resets_connector(engine)  # vLLM 0.32's sleep has no such flag
    monkeypatch.setattr(engine.model_config, "enable_sleep_mode", True)
    err = await refused(stub.Sleep(ctl.SleepRequest(reset_connector=True), timeout=10))
    assert err.code() == grpc.StatusCode.UNIMPLEMENTED
    assert (err.details() or "").startswith("reset_connector: "), err.details()
    assert not (await stub.IsSleeping(ctl.IsSleepingRequest(), timeout=10)).sleeping


async def test_model_info_is_the_engines_model(
    stub: Any, engine: Any, files: SimpleNamespace
) -> None:
    info = await stub.GetModelInfo(ctl.GetModelInfoRequest(), timeout=10)
    assert info.model_id == str(files.model) == info.served_model_name
    assert not info.served_model_aliases
    assert info.supports_text_input and info.supports_token_ids_input and info.supports_lora
    assert not info.supports_multimodal and not info.reasoning_parser


async def test_kv_event_sources_are_the_zmq_publishers(stub: Any, files: SimpleNamespace) -> None:
    (source,) = (await stub.GetKvEventSources(ctl.GetKvEventSourcesRequest(), timeout=10)).sources
    assert source.transport == "zmq" and source.encoding == "msgpack"
    assert source.schema_version == 1
    assert source.endpoint == f"ipc://{files.root}/kv-events"
    assert source.replay_endpoint == f"ipc://{files.root}/kv-replay"
    assert source.HasField("data_parallel_rank") and source.data_parallel_rank == 0
    assert (source.buffer_steps, source.hwm, source.max_queue_size) == (10_000, 100_000, 100_000)


# ----- Shutdown (a stand-in engine: a real one is ~30 s to start again) -------------------


class _SlowToStop(StandInEngine):
    """A stand-in whose shutdown blocks as AsyncLLM's does while its processes
    stop: here until the test lets it end (or 30 s, longer than any call's deadline)."""

    def __init__(self) -> None:
        super().__init__()
        self.shutdowns: list[int] = []  # the thread each ran in
        self.release = threading.Event()
        self.stopped = threading.Event()

    def shutdown(self, timeout: float | None = None) -> None:
        self.shutdowns.append(threading.get_ident())
        self.release.wait(30)
        self.stopped.set()


async def test_shutdown_answers_first_then_stops_the_engine_off_the_event_loop() -> None:
    engine = _SlowToStop()
    async with serving(engine, services=(CONTROL_SERVICE,)) as running:
        stub = ctl_grpc.ControlStub(running.channel)
        control = running.mounted.control
        await stub.Shutdown(ctl.ShutdownRequest(), timeout=10)
        assert not engine.stopped.is_set()  # answered, not waited for
        await stub.Shutdown(ctl.ShutdownRequest(), timeout=10)  # acknowledged again
        # The server answers while the engine stops: the event loop is not blocked.
        await stub.IsPaused(ctl.IsPausedRequest(), timeout=10)
        assert not engine.stopped.is_set()
        engine.release.set()
        task = control.shutdown_task
        assert task is not None
        await task
        assert engine.stopped.is_set()
        assert len(engine.shutdowns) == 1
        assert engine.shutdowns[0] != threading.get_ident()
