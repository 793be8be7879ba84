"""Our servicer and vLLM's own gRPC servicer answer image and prefill/decode requests alike.

vLLM's `--grpc` server is `smg_grpc_servicer.vllm.servicer.VllmEngineServicer`.
Here each scenario's real engine is served twice in this process, on two
loopback ports: through `vllm_servicer.mounting` and through the reference
servicer on a plain `grpc.aio` server, registered with the reference's own
generated code. Every request is built with the reference's stubs and sent,
unchanged, to both; greedy tokens must be the same.

- Images (`mm_inputs`, inline tensors) on the tiny LLaVA, preprocessed the way
  a router does it: the model directory's HF processor expands the image
  placeholder and makes `pixel_values`. Two images must give two different
  outputs, so agreement cannot come from both servers ignoring the image.
- Prefill/decode params (`kv_transfer_params`, `kv_transfer_params_json`) on an
  engine whose test KV connector hands back what it was given: the params the
  connector returns must come back the same in `GenerateComplete`, typed and
  JSON (compared parsed: the two servers lay the JSON out differently).

Importing the reference next to this package also shows that their protobuf
descriptors coexist in one process (theirs in the default pool, ours in
`vllm_servicer.proto.POOL`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2 as ref_common
from smg_grpc_proto.generated import vllm_engine_pb2 as ref
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as ref_grpc
from support import collect, completes, serving, streamed_tokens
from support.router_side import BLUE, RED, Routed, router_request

from vllm_servicer.interceptors.tracing import FIRST_TOKEN_EVENT
from vllm_servicer.proto import POOL
from vllm_servicer.proto import vllm_engine_pb2 as ours

if importlib.util.find_spec("smg_grpc_servicer") is None:
    pytest.skip(
        "smg-grpc-servicer (vLLM's own gRPC servicer) is not installed",
        allow_module_level=True,
    )


# ----- two servers on one engine ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Servers:
    """Stubs (the reference's generated code) for the same engine behind both servicers."""

    ours: Any
    reference: Any


async def _started(server: grpc.aio.Server) -> grpc.aio.Channel:
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return grpc.aio.insecure_channel(f"127.0.0.1:{port}")


async def _serve_both(engine: Any) -> AsyncIterator[Servers]:
    # Imported here, not at collection: the reference's import installs its
    # launcher hooks, which only the tests that serve it need.
    from smg_grpc_servicer.vllm.servicer import VllmEngineServicer

    reference = grpc.aio.server()
    servicer = VllmEngineServicer(engine, time.time())
    ref_grpc.add_VllmEngineServicer_to_server(servicer, reference)
    reference_channel = await _started(reference)
    try:
        async with serving(engine, health=False, reflection_service=False) as served:
            yield Servers(
                ours=ref_grpc.VllmEngineStub(served.channel),
                reference=ref_grpc.VllmEngineStub(reference_channel),
            )
    finally:
        await reference_channel.close()
        await reference.stop(None)


async def _generate(stub: Any, req: ref.GenerateRequest) -> list[Any]:
    return await collect(stub.Generate(req, timeout=60))


def _tokens(messages: list[Any], *, stream: bool) -> list[int]:
    """The output tokens: from the chunks of a stream, else from its one `complete`.

    The reference's `complete` of a stream repeats only the last delta, so a
    stream's tokens are read from its chunks on both servers.
    """
    if stream:
        return streamed_tokens(messages)[0]
    return list(completes(messages)[0].output_ids)


def test_the_references_descriptors_and_ours_coexist_in_one_process() -> None:
    """Theirs register in protobuf's default pool, ours in a private one: no clash, same wire."""
    import smg_grpc_servicer.vllm.servicer  # noqa: F401 - everything the reference registers
    from google.protobuf import descriptor_pool

    name = "vllm.grpc.engine.GenerateRequest"
    assert descriptor_pool.Default().FindMessageTypeByName(name) is ref.GenerateRequest.DESCRIPTOR
    assert POOL.FindMessageTypeByName(name) is ours.GenerateRequest.DESCRIPTOR
    sent = ref.GenerateRequest(request_id="both", kv_transfer_params_json="{}")
    sent.mm_inputs.modality = ref_common.IMAGE
    assert ours.GenerateRequest.FromString(sent.SerializeToString()).mm_inputs.modality == (
        ref_common.IMAGE
    )


# ----- images: preprocessed tensors in `mm_inputs` ---------------------------------------------


@pytest.fixture(scope="module")
async def vlm_servers(vlm_engine: Any) -> AsyncIterator[Servers]:
    async for servers in _serve_both(vlm_engine):
        yield servers


async def _both_tokens(servers: Servers, req: ref.GenerateRequest) -> tuple[list[int], list[int]]:
    ours = _tokens(await _generate(servers.ours, req), stream=req.stream)
    reference = _tokens(await _generate(servers.reference, req), stream=req.stream)
    return ours, reference


async def test_image_tensors_give_the_references_tokens(
    vlm_servers: Servers, preprocess: Callable[[tuple[int, int, int]], Routed]
) -> None:
    # The reference keys the engine's caches by `mm_hashes` as sent (ours
    # derives its key from the tensors), so each image carries its own content
    # hash, as a router's does; different keys also keep either server from
    # being served the other's cached image.
    by_image = {}
    for name, color in (("red", RED), ("blue", BLUE)):
        ours, reference = await _both_tokens(
            vlm_servers, router_request(preprocess(color), f"image-{name}", content_hash=True)
        )
        assert len(ours) == 8, name
        assert ours == reference, name
        by_image[name] = ours
    assert by_image["red"] != by_image["blue"]


# ----- prefill/decode: `kv_transfer_params` in and out -----------------------------------------


@pytest.fixture(scope="module")
async def kv_servers(kv_echo_engine: Any) -> AsyncIterator[Servers]:
    """Both servicers on the session's engine whose KV connector echoes its params back."""
    async for servers in _serve_both(kv_echo_engine):
        yield servers


# Shorter than one KV block: the file-based connector then stores and loads
# nothing, so each server's request is computed by the engine, not read back
# from what the other one stored.
PROMPT_IDS = [5, 17, 42, 99, 7, 63, 21, 88]
ECHOED = {"echoed_by": "EchoConnector"}


def _kv_request(
    *,
    typed: tuple[str, int] | None = None,
    json_params: dict[str, Any] | None = None,
    stream: bool = False,
) -> ref.GenerateRequest:
    req = ref.GenerateRequest(
        request_id="prefill-decode",
        tokenized=ref.TokenizedInput(input_ids=PROMPT_IDS),
        sampling_params=ref.SamplingParams(temperature=0.0, max_tokens=4),
        stream=stream,
    )
    if typed is not None:
        req.kv_transfer_params.remote_host, req.kv_transfer_params.remote_port = typed
    if json_params is not None:
        req.kv_transfer_params_json = json.dumps(json_params)
    return req


@dataclasses.dataclass(frozen=True)
class Handed:
    """What one server answered: its tokens and the connector's params, typed and parsed."""

    tokens: list[int]
    params: dict[str, Any]
    typed: tuple[str, int] | None


def _handed(messages: list[Any], *, stream: bool) -> Handed:
    done = completes(messages)[0]
    typed = done.kv_transfer_params
    return Handed(
        tokens=_tokens(messages, stream=stream),
        params=json.loads(done.kv_transfer_params_json),
        typed=(typed.remote_host, typed.remote_port)
        if done.HasField("kv_transfer_params")
        else None,
    )


async def _both_handed(servers: Servers, req: ref.GenerateRequest) -> tuple[Handed, Handed]:
    ours = _handed(await _generate(servers.ours, req), stream=req.stream)
    reference = _handed(await _generate(servers.reference, req), stream=req.stream)
    return ours, reference


async def test_typed_params_come_back_as_from_the_reference(kv_servers: Servers) -> None:
    ours, reference = await _both_handed(kv_servers, _kv_request(typed=("10.0.0.3", 7001)))
    assert ours == reference
    assert ours.params == {"remote_host": "10.0.0.3", "remote_port": 7001, **ECHOED}
    assert ours.typed == ("10.0.0.3", 7001)
    assert len(ours.tokens) == 4


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
async def test_json_params_come_back_as_from_the_reference(
    kv_servers: Servers, stream: bool
) -> None:
    sent = {"do_remote_decode": True, "remote_host": "10.0.0.2", "remote_port": 7000, "ids": [1]}
    ours, reference = await _both_handed(kv_servers, _kv_request(json_params=sent, stream=stream))
    assert ours == reference
    assert ours.params == {**sent, **ECHOED}
    assert ours.typed == ("10.0.0.2", 7000)
    assert len(ours.tokens) == 4


async def test_json_params_without_an_address_come_back_without_the_typed_mirror(
    kv_servers: Servers,
) -> None:
    """The typed message mirrors only a usable host and port, on both servers."""
    sent = {"do_remote_decode": True, "remote_engine_id": "prefill-0", "remote_block_ids": [3]}
    ours, reference = await _both_handed(kv_servers, _kv_request(json_params=sent))
    assert ours == reference
    assert ours.params == {**sent, **ECHOED}
    assert ours.typed is None


async def test_typed_and_json_together_are_merged_here_but_json_wins_in_the_reference(
    kv_servers: Servers,
) -> None:
    """A documented difference (docs/protocol.md, "Prefill/decode").

    The reference reads `kv_transfer_params_json` and drops the typed params
    when both are sent; this servicer reads both, so a host and port sent only
    in the typed message reach the connector too. Tokens are the same.
    """
    sent = {"do_remote_decode": True, "remote_engine_id": "prefill-0"}
    req = _kv_request(typed=("10.0.0.4", 7002), json_params=sent)
    ours, reference = await _both_handed(kv_servers, req)
    assert ours.tokens == reference.tokens
    assert reference.params == {**sent, **ECHOED}
    assert reference.typed is None
    assert ours.params == {**sent, "remote_host": "10.0.0.4", "remote_port": 7002, **ECHOED}
    assert ours.typed == ("10.0.0.4", 7002)


async def test_typed_params_contradicting_the_json_are_refused_here_and_dropped_by_the_reference(
    kv_servers: Servers,
) -> None:
    """A documented difference: this servicer refuses a host the two forms disagree on."""
    sent = {"do_remote_decode": True, "remote_host": "10.0.0.5", "remote_port": 7003}
    req = _kv_request(typed=("10.0.0.6", 7003), json_params=sent)
    reference = _handed(await _generate(kv_servers.reference, req), stream=False)
    assert reference.params == {**sent, **ECHOED}
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _generate(kv_servers.ours, req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("kv_transfer_params.remote_host: ")


# ----- our metrics and tracing around the reference's Generate ---------------------------------


@dataclasses.dataclass(frozen=True)
class Observed:
    """A server with our metrics and tracing, and what they recorded."""

    stub: Any
    registry: Any
    exporter: Any


@contextlib.asynccontextmanager
async def _observed(engine: Any, *, reference: bool) -> AsyncIterator[Observed]:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from prometheus_client import CollectorRegistry
    from smg_grpc_servicer.vllm.servicer import VllmEngineServicer

    from vllm_servicer.interceptors import MetricsInterceptor, Pipeline
    from vllm_servicer.interceptors.tracing import TracingInterceptor

    registry = CollectorRegistry()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    stack = [TracingInterceptor(provider, model="tiny"), MetricsInterceptor(registry)]
    if not reference:
        async with serving(
            engine, health=False, reflection_service=False, interceptors=stack
        ) as served:
            yield Observed(ref_grpc.VllmEngineStub(served.channel), registry, exporter)
        return
    server = grpc.aio.server(interceptors=[Pipeline(stack)])
    ref_grpc.add_VllmEngineServicer_to_server(VllmEngineServicer(engine, time.time()), server)
    channel = await _started(server)
    try:
        yield Observed(ref_grpc.VllmEngineStub(channel), registry, exporter)
    finally:
        await channel.close()
        await server.stop(None)


@pytest.mark.parametrize("reference", [False, True], ids=["ours", "reference"])
async def test_our_metrics_and_spans_count_what_either_servicer_sent(
    kv_echo_engine: Any, reference: bool
) -> None:
    """The reference keeps no usage record: both interceptors read its messages, once each."""
    async with _observed(kv_echo_engine, reference=reference) as observed:
        received = 0
        messages = 0
        for stream in (True, False):
            req = ref.GenerateRequest(
                request_id=f"observed-{stream}",
                tokenized=ref.TokenizedInput(input_ids=PROMPT_IDS),
                sampling_params=ref.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                stream=stream,
            )
            answer = await _generate(observed.stub, req)
            received += len(_tokens(answer, stream=stream))
            messages += len(answer)
        assert received == 12
        deadline = time.monotonic() + 10
        while observed.registry.get_sample_value("grpc_server_handled_total", _HANDLED_OK) != 2:
            assert time.monotonic() < deadline, "the calls did not finish"
            await asyncio.sleep(0.05)

        def value(name: str, registry: Any = observed.registry, **labels: str) -> float | None:
            return registry.get_sample_value(name, labels)

        assert value("vllm_servicer_generation_tokens_total", model_name="") == received
        assert value("vllm_servicer_prompt_tokens_total", model_name="") == 2 * len(PROMPT_IDS)
        assert value("grpc_server_msg_sent_total", **_GENERATE) == messages
        finished = value(
            "vllm_servicer_request_finish_total", model_name="", finish_reason="length"
        )
        assert finished == 2
        assert value("vllm_servicer_time_to_first_token_seconds_count", model_name="") == 1
        spans = observed.exporter.get_finished_spans()
        assert len(spans) == 2
        for span in spans:
            assert span.attributes["gen_ai.usage.output_tokens"] == 6
            assert span.attributes["gen_ai.usage.input_tokens"] == len(PROMPT_IDS)
            assert tuple(span.attributes["gen_ai.response.finish_reasons"]) == ("length",)
            assert [e.name for e in span.events].count(FIRST_TOKEN_EVENT) == 1


_GENERATE = {
    "grpc_type": "server_stream",
    "grpc_service": "vllm.grpc.engine.VllmEngine",
    "grpc_method": "Generate",
}
_HANDLED_OK = {**_GENERATE, "grpc_code": "OK"}


# ----- several choices with the prompt's logprobs ----------------------------------------------


@pytest.fixture(scope="module")
async def text_servers(engine: Any) -> AsyncIterator[Servers]:
    """Both servicers on the session's text engine."""
    async for servers in _serve_both(engine):
        yield servers


def _prompt_logprobs_by_choice(messages: list[Any]) -> dict[int, list[tuple[str, int]]]:
    """Each choice's messages in order: their kind and how many prompt logprobs each carries."""
    by_choice: dict[int, list[tuple[str, int]]] = {}
    for message in messages:
        kind = message.WhichOneof("response")
        body = getattr(message, kind)
        by_choice.setdefault(body.index, []).append((kind, len(body.input_logprobs.token_ids)))
    return by_choice


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
@pytest.mark.parametrize(("n", "max_tokens"), [(2, 1), (2, 3), (2, 12), (3, 6)])
async def test_several_choices_carry_the_prompt_logprobs_as_from_the_reference(
    text_servers: Servers, n: int, max_tokens: int, stream: bool
) -> None:
    # The engine sends the prompt's logprobs in the step that carries them;
    # each choice's messages hold them where the reference's do.
    prompt = [(17 * i + 5) % 240 + 3 for i in range(41)]
    answers = []
    for name, stub in (("ours", text_servers.ours), ("reference", text_servers.reference)):
        req = ref.GenerateRequest(
            request_id=f"lp-{n}-{max_tokens}-{stream}-{name}",
            tokenized=ref.TokenizedInput(input_ids=prompt),
            sampling_params=ref.SamplingParams(
                n=n, max_tokens=max_tokens, temperature=1.0, seed=7, prompt_logprobs=1
            ),
            stream=stream,
        )
        answers.append(_prompt_logprobs_by_choice(await _generate(stub, req)))
    ours_by_choice, reference_by_choice = answers
    assert sorted(ours_by_choice) == list(range(n))
    # Every choice's first message carries them here. The reference's carry
    # them wherever vLLM's output still did, which is every choice unless a
    # busy server read late and vLLM merged them away (the next test): so
    # where the reference's first message carries them, ours carry the same.
    for index, messages in ours_by_choice.items():
        assert messages[0][1] == len(prompt), ours_by_choice
        assert all(count == 0 for kind, count in messages[1:] if kind == "chunk"), messages
        theirs = reference_by_choice[index]
        if theirs[0][1]:
            assert theirs[0] == messages[0], (ours_by_choice, reference_by_choice)


def test_every_choice_keeps_the_prompt_logprobs_when_a_slow_reader_merges_outputs() -> None:
    # Each choice of n > 1 is a request of its own in the engine, whose first
    # output carries the prompt's logprobs. A reader that falls behind gets
    # the outputs merged (vLLM's RequestOutputCollector, through
    # RequestOutput.add), and the merge keeps only the held output's prompt
    # logprobs: measured on this engine with a reader sleeping 0.3 s per
    # output, choice 0's first output came alone and choices 1 and 2's first
    # tokens came merged into one without them.
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    from vllm_servicer.wire.vllm_engine import ResponseBuilder

    prompt = [11, 12, 13, 14]
    logprobs = [None, *({t: Logprob(-1.5, 3, None)} for t in prompt[1:])]

    def step(index: int, token: int, with_prompt: bool) -> RequestOutput:
        return RequestOutput(
            "r",
            None,
            prompt,
            logprobs if with_prompt else None,
            [CompletionOutput(index, "", [token], None, None)],
            finished=False,
        )

    first = step(0, 100, with_prompt=True)
    held = step(0, 101, with_prompt=False)  # choice 0's next step, not yet read
    held.add(step(1, 200, with_prompt=True), aggregate=True)
    held.add(step(2, 300, with_prompt=True), aggregate=True)
    assert held.prompt_logprobs is None  # what vLLM's merge keeps

    build = ResponseBuilder(ours.SamplingParams(n=3, prompt_logprobs=1))
    chunks = [build.chunk(output, c) for output in (first, held) for c in output.outputs]
    carried = [(m.chunk.index, len(m.chunk.input_logprobs.token_ids)) for m in chunks]
    # Each choice's first chunk carries them, and only its first.
    assert carried == [(0, len(prompt)), (0, 0), (1, len(prompt)), (2, len(prompt))]
