"""Every difference between the vLLM releases this package supports, in one place.

Supported: 0.31 to 0.34 (`_vllm_version.SUPPORTED_VLLM`). Each name
below says which release it is for and is feature-detected, not read off a
version number, so a backport or a patch release works too. Porting to the
next release is a change to this module and its tests: run
`make vllm-api-check VERSION=X` to list what moved, then add a branch here.

What each difference means for clients is in `docs/index.md` ("vLLM releases").
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

# Before vLLM is imported below: an untested vLLM release fails here, naming both versions.
from . import _vllm_version  # noqa: F401
from .fair_work import SCHEDULER_NAME

# isort: split
from vllm import exceptions as _exceptions

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from vllm.config import VllmConfig
    from vllm.entrypoints.pooling.base.io_processor import PoolingIOProcessor
    from vllm.entrypoints.pooling.base.serving import PoolingServing
    from vllm.entrypoints.pooling.typing import AnyPoolingRequest, PoolingServeContext
    from vllm.sampling_params import SamplingParams
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.engine.coordinator import DPCoordinator

# ----- errors ----------------------------------------------------------------


class _NeverRaised(Exception):
    """Stand-in for an exception class a release does not have: no row matches it."""


ProfilerAlreadyActiveError: type[Exception] = getattr(
    _exceptions, "ProfilerAlreadyActiveError", _NeverRaised
)
"""0.32+: a second profiler start is refused with it; 0.31 never refuses."""

RetryableRequestError: type[Exception] = getattr(_exceptions, "RetryableRequestError", _NeverRaised)
"""0.32+: a transient request failure, safe to retry (0.32 raises it only for
pooling requests; 0.33 also for a multimodal cache miss and, below, a pause)."""


EngineFaultedError: type[Exception] = getattr(_exceptions, "EngineFaultedError", _NeverRaised)
"""0.34+: with `--enable-fault-tolerance`, an engine that faulted and awaits
recovery refuses admission (`AsyncLLM.check_admission`) with it; vLLM's HTTP
server answers 503 so that clients retry on another replica."""


def _takes_stream_interval() -> bool:
    from vllm.sampling_params import SamplingParams

    return "stream_interval" in SamplingParams.__struct_fields__


PER_REQUEST_STREAM_INTERVAL = _takes_stream_interval()
"""0.32 has it: `SamplingParams.stream_interval`, a request's own interval
between streamed outputs (never below the engine's `--stream-interval`)."""


def _engine_rejects_while_paused() -> bool:
    from vllm.v1.engine.core import EngineCoreProc

    return hasattr(EngineCoreProc, "_reject_add_while_paused")


PAUSE_REJECTS = _engine_rejects_while_paused()
"""0.33+: an engine paused in "abort" or "wait" mode rejects each new request
with RetryableRequestError; on 0.31 and 0.32 such requests wait in the queue
until it resumes. "keep" mode queues them on every release."""

# A paused 0.33 engine also marks a rejected request with KV-transfer params
# `abort_immediately` and adds it, "to let the KV connector free any remote
# blocks"; measured with a connector that logs its hook, that path never
# reaches `request_finished`, so the servicer still sends its one rejection
# notice (test_protocol_fields: exactly one notice reaches the connector).


# ----- the HTTP API's argument parser ------------------------------------------


def make_arg_parser(parser: FlexibleArgumentParser) -> FlexibleArgumentParser:
    """vLLM's OpenAI-server argument parser, wherever the release keeps it.

    0.33 moved it to `vllm.entrypoints.common.cli_args`; 0.31 and 0.32 have
    it in `vllm.entrypoints.launchers.cli_args`.
    """
    try:
        from vllm.entrypoints.common.cli_args import (  # type: ignore[import-not-found,unused-ignore]
            make_arg_parser as make,
        )
    except ImportError:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser as make
    made: FlexibleArgumentParser = make(parser)
    return made


def serve_defaults() -> argparse.Namespace:
    """vLLM's OpenAI-server arguments, each at its default (`make_arg_parser`'s parse of none)."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    new_parser: Callable[[], FlexibleArgumentParser] = FlexibleArgumentParser  # untyped __init__
    served: argparse.Namespace = make_arg_parser(new_parser()).parse_args([])
    return served


# ----- the profiler ------------------------------------------------------------


def start_profile_options(start_profile: Callable[..., object]) -> frozenset[str]:
    """The keyword arguments beyond the prefix that `AsyncLLM.start_profile` takes.

    0.31: none. 0.32: `delay_iterations`, `max_iterations`. 0.33 adds
    `profiler_kwargs` (overrides of the torch profiler's options for one
    session: `with_stack`, `record_shapes`).
    """
    params = inspect.signature(start_profile).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return frozenset({"delay_iterations", "max_iterations", "profiler_kwargs"})
    return frozenset(p.name for p in params if p.name != "profile_prefix")


# ----- KV events ---------------------------------------------------------------

BLOCK_STORED_LOOKAHEAD = "lookahead_token_ids"
"""0.33+: `BlockStored.lookahead_token_ids`, the draft tokens (EAGLE/MTP with
prefix caching) that a block's hash covers beyond its `token_ids`. The
protocol's `KvBlocksStored` has no field for them: they are dropped, and such
a block's hash cannot be recomputed from the tokens a router sees."""


# ----- seeded sampling on CPU (0.31 to 0.33) ------------------------------------------

_SAMPLING_EPS = 1e-5  # vLLM's: a lower temperature is greedy and draws nothing


def _runner_rewinds_generators() -> bool:
    """Whether the installed vLLM has Model Runner V1, which rewinds generators.

    0.31 to 0.33 run CPU models on it (`v1/worker/gpu_model_runner.py`, which
    the CPU runner subclasses). 0.34 deleted it: its runner draws each
    sampling step's noise from (seed, position) and rewinds nothing.
    """
    try:
        return importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is not None
    except ImportError:  # a parent package missing
        return False


SEEDED_DRAW_REWINDS = _runner_rewinds_generators()
"""0.31 to 0.33: a partial prefill rewinds the request's random generator,
which a CPU generator refuses (see `seeded_sampling_hazard`); 0.34+: no rewind."""


def seeded_sampling_hazard(vllm_config: object, *, rewinds: bool | None = None) -> str | None:
    """Why a seeded sampling request would kill this engine, or None when it is safe.

    When vLLM 0.31 to 0.33 schedule part of a prompt (a chunked prefill), they
    discard the token sampled for it and rewind the request's random generator
    with `Generator.set_offset`, which a CPU generator refuses ("CPU Generator
    does not use offset"): the worker raises and the EngineCore dies, for every
    client (`GPUModelRunner._bookkeeping_sync`; the CPU runner inherits it).
    Only requests with a seed and a temperature above zero own a generator. A
    partial prefill happens on CPU when chunked prefill is on and the prompts
    waiting at one step can exceed the token budget, or with a
    `long_prefill_token_threshold`. vLLM 0.34's runner rewinds nothing: no hazard.

    Args:
        vllm_config: the engine's configuration.
        rewinds: whether the runner rewinds generators (default: what the
            installed vLLM does, `SEEDED_DRAW_REWINDS`).
    """
    if not (SEEDED_DRAW_REWINDS if rewinds is None else rewinds):
        return None
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", "")
    scheduler = getattr(vllm_config, "scheduler_config", None)
    model = getattr(vllm_config, "model_config", None)
    if device != "cpu" or scheduler is None:
        return None
    if (getattr(scheduler, "long_prefill_token_threshold", 0) or 0) > 0:
        return "long_prefill_token_threshold > 0 splits prompts"
    if getattr(scheduler, "enable_chunked_prefill", False):
        if getattr(scheduler, "scheduler_cls", None) == SCHEDULER_NAME:
            return "chunked prefill is on and the fair order's shared steps split prompts"
        budget = int(getattr(scheduler, "max_num_batched_tokens", 0) or 0)
        seqs = int(getattr(scheduler, "max_num_seqs", 0) or 0)
        longest = int(getattr(model, "max_model_len", 0) or 0)
        if budget < seqs * longest:
            return (
                f"chunked prefill is on with a budget of {budget} tokens "
                f"(below max_num_seqs x max_model_len = {seqs * longest})"
            )
    return None


def draws_from_own_generator(sampling: SamplingParams) -> bool:
    """Whether vLLM gives this request a random generator of its own (a seed, sampling)."""
    return sampling.seed is not None and sampling.temperature >= _SAMPLING_EPS


# ----- the engine's state: readiness and the checkpoint lifecycle --------------


def _core_answers_inference_ready() -> bool:
    from vllm.v1.engine.core import EngineCore

    return hasattr(EngineCore, "is_inference_ready")


INFERENCE_READY_UTILITY = _core_answers_inference_ready()
"""0.34+: the engine core answers `is_inference_ready`, the state vLLM's Rust
frontend publishes as gRPC readiness."""


async def accepts_new_requests(engine: object) -> bool:
    """Whether the engine would run a request sent now (what readiness reports).

    0.34+: the engine core's own answer: not paused (a checkpoint's drain
    included), not asleep, and no weight update left half done. 0.31 to 0.33
    have no such call: not paused and not asleep (a weight update runs paused).
    An engine without these calls (a host's stand-in) always accepts.
    """
    call = getattr(getattr(engine, "engine_core", None), "call_utility_async", None)
    if INFERENCE_READY_UTILITY and call is not None:
        return bool(await call("is_inference_ready"))
    is_paused = getattr(engine, "is_paused", None)
    is_sleeping = getattr(engine, "is_sleeping", None)
    if is_paused is not None and await is_paused():
        return False
    return not (is_sleeping is not None and await is_sleeping())


# What each control call needs of 0.34's process-checkpoint state (vLLM's
# EngineCore: sleep only while running; waking and resuming also while a
# restore is under way).
_CHECKPOINT_STATES_ALLOWED = {
    "sleep": ("running",),
    "wake up": ("running", "restoring"),
    "resume": ("running", "restoring"),
}


async def checkpoint_refusal(engine: object, action: str) -> str | None:
    """Why the engine's checkpoint state forbids `action` now, None when it does not.

    0.34 added a process-checkpoint lifecycle (prepare, restore; driven over
    vLLM's HTTP API): while a checkpoint is prepared or under way, the engine
    core refuses to sleep, wake or resume with a bare message. Asked first,
    the refusal names the state. Releases without the lifecycle: None.

    Args:
        engine: the engine client.
        action: "sleep", "wake up" or "resume".
    """
    state_of = getattr(engine, "checkpoint_state", None)
    if state_of is None:
        return None
    state, error = await state_of()
    if str(state) in _CHECKPOINT_STATES_ALLOWED[action]:
        return None
    detail = f" ({error})" if error else ""
    return (
        f"cannot {action} while the engine's process checkpoint is {state}{detail}: "
        "finish it with vLLM's /checkpoint/restore first"
    )


# ----- several frontend processes on one engine (--api-server-count) ----------


@dataclass
class EngineWithFrontends:
    """The engine's processes and its frontend processes, once the engine is up."""

    processes: list[BaseProcess]  # the frontends
    engine_manager: Any  # vLLM's CoreEngineProcManager: sentinels(), shutdown()
    coordinator: DPCoordinator | None


@contextlib.contextmanager
def engine_with_frontends(
    vllm_config: VllmConfig,
    count: int,
    target: Callable[..., None],
    payload: object,
    *,
    log_stats: bool,
    apart: Callable[[], contextlib.AbstractContextManager[None]],
) -> Iterator[EngineWithFrontends]:
    """Start the engine core, then `count` processes that each run
    `target(listen_address, sock, payload, client_config)` as its clients.

    vLLM's own `APIServerProcessManager` starts them, as for its HTTP server:
    `client_config` holds the engine's ZMQ endpoints and `client_count` /
    `client_index`, for `AsyncLLM.from_vllm_config`. The engine is up when
    the block's body runs. The engine's processes and the frontends start
    inside `apart()`.

    0.32+ binds the engine's sockets here and hands them over
    (`bind_engine_zmq_listeners`); 0.31 lets each frontend bind its own and
    collects the bound addresses (`gather_actual_addresses`).
    """
    from vllm.v1.engine import utils
    from vllm.v1.executor import Executor
    from vllm.v1.utils import APIServerProcessManager

    engine_utils: Any = utils
    manager_class: Any = APIServerProcessManager
    executor_class = Executor.get_class(vllm_config)
    bind = getattr(engine_utils, "bind_engine_zmq_listeners", None)
    # The frontends are still starting when the engine's launch is left:
    # `apart()` lasts until its handshake, when every process has started.
    with apart(), contextlib.ExitStack() as launching:
        if bind is not None:  # 0.32+
            listeners = bind(vllm_config, count)
            addresses = listeners.addresses
            inputs, outputs = listeners.inputs, listeners.outputs
        else:  # 0.31
            addresses = engine_utils.get_engine_zmq_addresses(
                vllm_config, count, defer_api_server_ports=True
            )
            inputs, outputs = addresses.inputs, addresses.outputs
        launch = launching.enter_context(
            engine_utils.launch_core_engines(vllm_config, executor_class, log_stats, addresses)
        )
        coordinator = launch.coordinator
        manager = manager_class(
            "",
            None,
            payload,
            count,
            inputs,
            outputs,
            target_server_fn=target,
            stats_update_address=(coordinator.get_stats_publish_address() if coordinator else None),
            tensor_queue=launch.tensor_queue,
        )
        if bind is None:
            launch.addresses.inputs, launch.addresses.outputs = manager.gather_actual_addresses()
        launch.watched_frontend_processes = manager.processes
    # Leaving the launch waited for the engine's handshake: it is up.
    yield EngineWithFrontends(list(manager.processes), launch.engine_manager, coordinator)


async def ask_engine_core(engine: Any, index: int) -> None:
    """One cheap question (`is_sleeping`, an attribute read in the engine core)
    to the frontend's engine at `index` (in rank order), answered between two
    of its steps; alike in 0.31 to 0.34 (`AsyncMPClient._call_utility_async`
    and its `core_engines` identities). Raises what the call raises; an engine
    that is gone never answers.
    """
    core = engine.engine_core
    await core._call_utility_async("is_sleeping", engine=core.core_engines[index])


def engine_core_died(engine: Any) -> None:
    """Do what vLLM's client does when it sees its engine core's process end
    (`MPClient.monitor_engine_cores`, alike in 0.31 to 0.33): mark the engine
    dead and close the client, so that every request waiting on it fails
    with EngineDeadError. A client of an engine another process started
    (`client_addresses`) has no process to watch: its parent tells it.
    """
    core = engine.engine_core
    if not core.resources.engine_dead:
        core.resources.engine_dead = True
        core.shutdown()


def runs_adapter(engine: object, lora_id: int) -> bool | None:
    """Whether the engine still has a request on LoRA adapter `lora_id`, from its
    frontend's records of unfinished requests (`OutputProcessor.request_states`,
    alike in 0.31 to 0.34; a request leaves them when the engine core has
    finished it or it is aborted); None where they cannot be read.
    """
    states = getattr(getattr(engine, "output_processor", None), "request_states", None)
    if not isinstance(states, dict):
        return None
    for state in list(states.values()):
        if not hasattr(state, "lora_request"):
            return None  # a release that keeps it elsewhere: unknown, not "none"
        lora = state.lora_request
        if lora is not None and lora.lora_int_id == lora_id:
            return True
    return False


# ----- vllm.Inference's and vllm.Control's released fields (protos/inference.proto) ------


def _generate_takes(name: str) -> bool:
    from vllm.v1.engine.async_llm import AsyncLLM

    return name in inspect.signature(AsyncLLM.generate).parameters


GENERATE_TAKES_KV_HINTS = _generate_takes("kv_hints")
"""Whether `AsyncLLM.generate` takes `kv_hints` (vLLM's `KvHintsEnvelope`; vLLM 0.32
has it): `GenerateRequest.kv_hints` reaches the engine, else it is refused naming it."""

GENERATE_TAKES_REASONING_GATE = _generate_takes("reasoning_ended") and _generate_takes(
    "reasoning_parser_kwargs"
)
"""Whether `GenerateRequest.engine_reasoning_gate` can become `generate(reasoning_ended=...,
reasoning_parser_kwargs=...)` (vLLM 0.32 takes both); else it is refused naming it."""


def _sampling_takes(name: str) -> bool:
    from vllm.sampling_params import SamplingParams

    return name in SamplingParams.__struct_fields__


THINKING_TOKEN_BUDGET = _sampling_takes("thinking_token_budget")
"""Whether vLLM's `SamplingParams` has `thinking_token_budget` (vLLM 0.32 has; the
engine needs a reasoning parser, `--reasoning-parser`); else the field is refused."""


def sleep_resets_connector(engine: object) -> bool:
    """Whether the engine's `sleep` takes `reset_connector` (0.34's does, default true;
    0.31 to 0.33's do not: a `SleepRequest` asking for a reset is refused naming the
    field). Read off the engine's own method, so a stand-in engine answers for itself."""
    sleep = getattr(engine, "sleep", None)
    if sleep is None:
        return False
    try:
        return "reset_connector" in inspect.signature(sleep).parameters
    except (TypeError, ValueError):
        return False


# ----- vLLM's Pooling and Render handlers, below their HTTP answers ------------
#
# vLLM's pooling handlers answer with a `JSONResponse` (their response model
# dumped, then written as JSON) and its render handler with a `GenerateRequest`
# carrying the sampling parameters of a generation nobody runs here. The
# services take the handlers' own work up to the objects their replies are
# made of: the stages below are vLLM's, named alike in 0.31 to 0.34.


def _posts_nothing(io_processor: PoolingIOProcessor) -> bool:
    """Whether a pooling handler's IO processor leaves the outputs as the engine
    gave them (the base class's `post_process_online`: classification and
    cross-encoder scoring); bi-encoder and late-interaction scoring compute
    the scores there."""
    from vllm.entrypoints.pooling.base.io_processor import PoolingIOProcessor

    return type(io_processor).post_process_online is PoolingIOProcessor.post_process_online


async def pooling_outputs(
    handler: PoolingServing, request: AnyPoolingRequest
) -> PoolingServeContext[AnyPoolingRequest] | None:
    """vLLM's pooling handler run on `request` up to its outputs, before it
    writes its answer: its serving context (`PoolingServeContext`), whose
    `final_res_batch` holds one `PoolingRequestOutput` per engine request in
    the order of the texts, `engine_inputs` their prompts and `model_name` the
    name the answer states. The stages are `PoolingServing.__call__`'s, alike
    in 0.31 to 0.34; the IO processor's post-processing, when it has any, runs
    on the handler's executor under `torch.inference_mode`, as vLLM runs it.

    None for a handler that runs another path (late-interaction scoring on the
    workers, `enable_flash_late_interaction`): call the handler itself then.
    Raises what the handler raises.
    """
    if getattr(handler, "enable_flash_late_interaction", False):
        return None
    io_processor = handler.get_io_processor(request)
    ctx: PoolingServeContext[AnyPoolingRequest] = await handler._init_ctx(
        io_processor, request, None
    )
    await handler._preprocessing(io_processor, ctx)
    await handler._prepare_generators(ctx)
    await handler._collect_batch(ctx)
    if not _posts_nothing(io_processor):
        import asyncio

        import torch

        def post_process() -> None:
            with torch.inference_mode():
                io_processor.post_process_online(ctx)

        await asyncio.get_running_loop().run_in_executor(handler._executor, post_process)
    return ctx


@functools.cache
def render_features_without_tensors() -> bool:
    """0.32+: the render handler's multimodal features can leave the processed
    tensors out (`mm_payload="none"`), keeping the hashes and placeholders; 0.31
    always encodes the tensors. Read at first use (the handler's module is
    imported with vLLM's HTTP handlers, not before)."""
    from vllm.entrypoints.scale_out.render.serving import ServingRender

    return "mm_payload" in inspect.signature(ServingRender._extract_mm_features).parameters


async def render_prompts(render: Any, request: Any, *, chat: bool) -> Any:
    """What vLLM's render handler renders for `request` (its `ChatCompletionRequest`
    when `chat`, else its `CompletionRequest`): per prompt, a dict of its
    `token_ids` and multimodal `features` (vLLM's `MultiModalFeatures`, None
    for text), or the handler's `ErrorResponse`.

    The steps and refusals of `ServingRender.render_chat_request` and
    `render_completion_request` (alike in 0.31 to 0.34: the model's check, the
    online renderer, one prompt for a chat, no prompt without tokens, the
    context's room for a token computed as they compute it), without what
    only the `GenerateRequest` a router forwards carries: the sampling
    parameters, the reasoning state, a request id and, from 0.32, the
    multimodal tensors.

    Raises:
        ValueError: a prompt past the model's context (vLLM's `get_max_tokens`).
        VLLMValidationError: a prompt that leaves no room for one token (what
            vLLM's `SamplingParams` refuses).
    """
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens
    from vllm.exceptions import VLLMValidationError
    from vllm.renderers.inputs.preprocess import extract_prompt_components, extract_prompt_len

    error = await render._check_model(request)
    if error is not None:
        return error
    renderer = render.online_renderer
    if chat:
        result = await renderer.render_chat(request, skip_mm_cache=True)
        if getattr(result, "error", None) is not None:
            return result
        _, inputs = result
        if len(inputs) != 1:
            return render.create_error_response(
                f"Expected exactly 1 engine prompt, got {len(inputs)}"
            )
        asked = request.max_completion_tokens
        if asked is None:  # the deprecated field's value, read without its warning
            asked = request.__dict__.get("max_tokens")
    else:
        inputs = await renderer.render_completion(request, skip_mm_cache=True)
        if getattr(inputs, "error", None) is not None:
            return inputs
        asked = request.max_tokens
    config = render.model_config
    prompts = []
    for engine_input in inputs:
        token_ids = extract_prompt_components(config, engine_input).token_ids
        if not token_ids:
            return render.create_error_response("No token_ids rendered")
        room = get_max_tokens(
            config.max_model_len,
            asked,
            extract_prompt_len(config, engine_input),
            render.default_sampling_params,
            render.override_max_tokens,
            truncate_prompt_tokens=request.truncate_prompt_tokens,
        )
        if room < 1:
            raise VLLMValidationError(
                f"max_tokens must be at least 1, got {room}.", parameter="max_tokens", value=room
            )
        if render_features_without_tensors():
            features = render._extract_mm_features(engine_input, mm_payload="none")
        else:
            features = render._extract_mm_features(engine_input)
        prompts.append({"token_ids": list(token_ids), "features": features})
    return prompts
