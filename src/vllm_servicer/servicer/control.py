"""`ControlServicer`: vLLM's own `vllm.Control` service over a vLLM engine.

Every RPC is served from the engine's `AsyncLLM` calls (vLLM's Rust server
uses the same ones): what the engine was not started for is refused with
FAILED_PRECONDITION naming the flag that would enable it, never answered OK
without effect. The calls that change the engine's state for reinforcement
learning (pause and resume, sleep and wake, weight updates) run one at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

# Before vLLM is imported below: an untested vLLM release fails here, naming both versions.
from .. import _vllm_version  # noqa: F401

# isort: split
import vllm
from vllm.distributed.weight_transfer.base import (
    WeightTransferInitRequest,
    WeightTransferUpdateRequest,
)

from .. import vllm_releases
from ..context import current_request_id
from ..errors import (
    CheckpointStateError,
    EngineRefusedError,
    InvalidRequestError,
    UnimplementedFieldError,
    UnsupportedError,
)
from ..proto import control_pb2 as pb
from ..proto import control_pb2_grpc
from . import control_info
from .lora import Adapter, LoraRegistry
from .state import MountState

if TYPE_CHECKING:
    import grpc.aio

    Context = grpc.aio.ServicerContext[Any, Any]

logger = logging.getLogger("vllm_servicer")

RESET_CONNECTOR_HINT = (
    "the installed vLLM's sleep does not reset the KV connector; send false or leave it unset"
)
SLEEP_HINT = "sleep mode is not enabled on this engine; start vLLM with --enable-sleep-mode"
WEIGHT_TRANSFER_HINT = (
    "weight transfer is not configured on this engine; start vLLM with "
    '--weight-transfer-config (e.g. \'{"backend": "nccl"}\')'
)
DRAFT_HINT = (
    "this engine runs no draft model to update; start vLLM with a draft-model "
    "--speculative-config (and --weight-transfer-config)"
)
PAUSE_FIRST = "weights change only while generation is paused: call PauseGeneration first"

# PAUSE_MODE_UNSPECIFIED is vLLM's default, abort.
_PAUSE_MODES: dict[int, str] = {
    pb.PAUSE_MODE_UNSPECIFIED: "abort",
    pb.PAUSE_MODE_ABORT: "abort",
    pb.PAUSE_MODE_WAIT: "wait",
    pb.PAUSE_MODE_KEEP: "keep",
}
_DEFAULT_SLEEP_LEVEL = 1
_SLEEP_LEVELS = (0, 1, 2)  # scheduling only; weights offloaded, KV dropped; everything dropped


def pause_mode(value: int, field: str = "mode") -> str:
    """vLLM's pause mode ("abort", "wait", "keep") for a wire `PauseMode`.

    Raises:
        InvalidRequestError: a value the enum does not define.
    """
    mode = _PAUSE_MODES.get(value)
    if mode is None:
        raise InvalidRequestError(field, f"unknown PauseMode {value}")
    return mode


def json_payload(data: bytes, field: str, *, lists: bool = False) -> Any:
    """A weight-transfer payload: a JSON object (or, with `lists`, a list of them); empty is {}.

    Raises:
        InvalidRequestError: not JSON, or not of that shape.
    """
    if not data:
        return {}
    try:
        value = json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidRequestError(field, f"not JSON: {exc}") from None
    shaped = isinstance(value, dict) or (
        lists and isinstance(value, list) and all(isinstance(item, dict) for item in value)
    )
    if not shaped:
        raise InvalidRequestError(
            field, "must be a JSON object" + (" or a list of them" if lists else "")
        )
    return value


@contextlib.contextmanager
def engine_refusals() -> Iterator[None]:
    """Turns the engine core's refusal of a control call into `EngineRefusedError`.

    vLLM's core client raises a bare `Exception` carrying the engine core's
    message when a utility call fails there (a weight update out of order,
    say); its own exception classes (a dead engine) pass through.
    """
    try:
        yield
    except Exception as exc:
        if type(exc) is Exception:
            raise EngineRefusedError(str(exc)) from None
        raise


class ControlServicer(control_pb2_grpc.ControlServicer):
    """Serves vLLM's `vllm.Control` protocol from an `AsyncLLM`.

    Args:
        state: what the mount's servicers share: the engine (vLLM's
            `AsyncLLM`), the running requests (Abort stops only the caller's
            own), the count in flight, the LoRA adapters served by name (which
            `vllm.Inference` resolves `lora_name` through), the frontend
            processes sharing the engine (with several, Shutdown stops them all).
        on_state_change: awaited after each call that may change whether the
            engine accepts requests (pause, resume, sleep, wake, weight
            updates): the health service re-reads readiness.
    """

    def __init__(
        self,
        state: MountState,
        *,
        on_state_change: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        engine = state.engine
        self._engine = engine
        self._state = state
        self._group = state.frontends
        self._on_state_change = on_state_change
        self._budgets = state.options.budgets
        # The RL and adapter calls are AsyncLLM's, beyond the EngineClient protocol.
        self._llm: Any = engine
        self._running = state.running
        self._loras = state.loras
        # One RL call at a time: a resume must not overtake the pause it follows.
        self._rl_lock = asyncio.Lock()
        self._shutdown_requested = False
        self._shutdown: asyncio.Task[None] | None = None

    @property
    def loras(self) -> LoraRegistry:
        """The LoRA adapters served, by name (what `vllm.Inference` resolves `lora_name` with)."""
        return self._loras

    @property
    def shutdown_task(self) -> asyncio.Task[None] | None:
        """The engine's shutdown, once a Shutdown call has ended; None before."""
        return self._shutdown

    # ----- state ------------------------------------------------------------

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: Context
    ) -> pb.ServerInfo:
        """The engine's version, parallelism, capacity and RL capabilities."""
        return control_info.server_info(self._engine, max_loras=self._loras.max_loras)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: Context) -> pb.ModelInfo:
        """The model served and what requests may carry."""
        return control_info.model_info(self._engine, supports_lora=self._loras.enabled)

    async def GetKvEventSources(
        self, request: pb.GetKvEventSourcesRequest, context: Context
    ) -> pb.GetKvEventSourcesResponse:
        """The engine's ZMQ KV-event publishers (none without `--kv-events-config`)."""
        return control_info.kv_event_sources(self._engine)

    async def Shutdown(self, request: pb.ShutdownRequest, context: Context) -> pb.ShutdownResponse:
        """Acknowledge, then shut the engine down once the answer has gone out.

        `AsyncLLM.shutdown()` blocks while it stops the engine processes
        (seconds), so it runs in a thread, after grpc has sent this call's
        status: the call's done callback starts it. A second Shutdown is
        acknowledged and changes nothing.
        """
        if not self._shutdown_requested:
            self._shutdown_requested = True
            # grpc's stubs type the callback as a class of their own.
            context.add_done_callback(lambda _: self._start_shutdown())  # type: ignore[arg-type]
        return pb.ShutdownResponse()

    # ----- requests ---------------------------------------------------------

    async def Abort(self, request: pb.AbortRequest, context: Context) -> pb.AbortResponse:
        """Abort running requests by id: the caller's own (any, for an administrator).

        Idempotent: empty, unknown, repeated and finished ids are successes.
        """
        self._budgets.check_abort_ids("request_ids", request.request_ids)
        ids = await self._running.abort(self._engine, request.request_ids)
        if ids:
            current_request_id.set(",".join(ids))
        return pb.AbortResponse()

    # ----- LoRA adapters ----------------------------------------------------

    async def LoadLora(self, request: pb.LoadLoraRequest, context: Context) -> pb.LoadLoraResponse:
        """Load an adapter from a directory on this host under a name."""
        adapter = await self._loras.load(request.lora_name, request.source_path)
        return pb.LoadLoraResponse(adapter=_adapter(adapter))

    async def UnloadLora(
        self, request: pb.UnloadLoraRequest, context: Context
    ) -> pb.UnloadLoraResponse:
        """Stop serving an adapter and drop it from the engine."""
        adapter = await self._loras.unload(request.lora_name)
        return pb.UnloadLoraResponse(adapter=_adapter(adapter))

    async def ListLoras(
        self, request: pb.ListLorasRequest, context: Context
    ) -> pb.ListLorasResponse:
        """Every adapter served, by name (none on an engine without LoRA)."""
        return pb.ListLorasResponse(adapters=[_adapter(a) for a in self._loras.list()])

    # ----- pause and sleep --------------------------------------------------

    async def PauseGeneration(
        self, request: pb.PauseGenerationRequest, context: Context
    ) -> pb.PauseGenerationResponse:
        """Pause the scheduler: abort, wait for or keep the running requests."""
        mode = pause_mode(request.mode)
        clear_cache = request.clear_cache if request.HasField("clear_cache") else True
        async with self._rl_lock:
            with engine_refusals():
                await self._llm.pause_generation(mode=mode, clear_cache=clear_cache)
        await self._state_changed()
        return pb.PauseGenerationResponse()

    async def ResumeGeneration(
        self, request: pb.ResumeGenerationRequest, context: Context
    ) -> pb.ResumeGenerationResponse:
        """Resume the scheduler after a pause."""
        async with self._rl_lock:
            await self._check_checkpoint("resume")
            with engine_refusals():
                await self._llm.resume_generation()
        await self._state_changed()
        return pb.ResumeGenerationResponse()

    async def IsPaused(self, request: pb.IsPausedRequest, context: Context) -> pb.IsPausedResponse:
        """Whether the scheduler is paused."""
        return pb.IsPausedResponse(paused=await self._engine.is_paused())

    async def Sleep(self, request: pb.SleepRequest, context: Context) -> pb.SleepResponse:
        """Put the engine to sleep (level 1 by default), pausing it first."""
        self._require(control_info.sleep_mode_enabled(self._engine), SLEEP_HINT)
        level = request.level if request.HasField("level") else _DEFAULT_SLEEP_LEVEL
        if level not in _SLEEP_LEVELS:
            raise InvalidRequestError("level", f"must be one of {_SLEEP_LEVELS}, got {level}")
        mode = pause_mode(request.mode)
        extra: dict[str, Any] = {}
        if vllm_releases.sleep_resets_connector(self._llm):
            if request.HasField("reset_connector"):
                extra["reset_connector"] = request.reset_connector
        elif request.reset_connector:
            raise UnimplementedFieldError("reset_connector", RESET_CONNECTOR_HINT)
        async with self._rl_lock:
            await self._check_checkpoint("sleep")
            with engine_refusals():
                await self._llm.sleep(level=level, mode=mode, **extra)
        await self._state_changed()
        return pb.SleepResponse()

    async def WakeUp(self, request: pb.WakeUpRequest, context: Context) -> pb.WakeUpResponse:
        """Wake the engine (the memory `tags` name, or all of it), resuming it once whole."""
        self._require(control_info.sleep_mode_enabled(self._engine), SLEEP_HINT)
        async with self._rl_lock:
            await self._check_checkpoint("wake up")
            with engine_refusals():
                await self._llm.wake_up(list(request.tags) or None)
        await self._state_changed()
        return pb.WakeUpResponse()

    async def IsSleeping(
        self, request: pb.IsSleepingRequest, context: Context
    ) -> pb.IsSleepingResponse:
        """vLLM's `is_sleeping()`: asleep at any level, a paused scheduler included."""
        with engine_refusals():
            sleeping = await self._llm.is_sleeping()
        return pb.IsSleepingResponse(sleeping=bool(sleeping))

    # ----- weight updates ---------------------------------------------------

    async def InitWeightTransferEngine(
        self, request: pb.InitWeightTransferEngineRequest, context: Context
    ) -> pb.InitWeightTransferEngineResponse:
        """Connect the workers to the trainer (`init_info_json`: the backend's JSON object)."""
        self._require_weight_transfer()
        info = json_payload(request.init_info_json, "init_info_json")
        await self._weights_call("init_weight_transfer_engine", WeightTransferInitRequest(info))
        return pb.InitWeightTransferEngineResponse()

    async def StartWeightUpdate(
        self, request: pb.StartWeightUpdateRequest, context: Context
    ) -> pb.StartWeightUpdateResponse:
        """Begin a weight update of the model (generation must be paused)."""
        self._require_weight_transfer()
        await self._weights_call("start_weight_update", paused=True)
        return pb.StartWeightUpdateResponse()

    async def StartDraftWeightUpdate(
        self, request: pb.StartDraftWeightUpdateRequest, context: Context
    ) -> pb.StartDraftWeightUpdateResponse:
        """Begin a weight update of the speculative draft model (paused, with one)."""
        self._require_weight_transfer()
        self._require(control_info.has_draft_model(self._engine), DRAFT_HINT)
        await self._weights_call("start_draft_weight_update", paused=True)
        return pb.StartDraftWeightUpdateResponse()

    async def UpdateWeights(
        self, request: pb.UpdateWeightsRequest, context: Context
    ) -> pb.UpdateWeightsResponse:
        """Receive one batch of weights (`update_info_json`: the backend's JSON)."""
        self._require_weight_transfer()
        info = json_payload(request.update_info_json, "update_info_json", lists=True)
        await self._weights_call("update_weights", WeightTransferUpdateRequest(info), paused=True)
        return pb.UpdateWeightsResponse()

    async def FinishWeightUpdate(
        self, request: pb.FinishWeightUpdateRequest, context: Context
    ) -> pb.FinishWeightUpdateResponse:
        """End the weight update, labelling the weights with `weight_version` when given."""
        self._require_weight_transfer()
        version = request.weight_version if request.HasField("weight_version") else None
        await self._weights_call("finish_weight_update", version, paused=True)
        return pb.FinishWeightUpdateResponse()

    async def UpdateWeightVersion(
        self, request: pb.UpdateWeightVersionRequest, context: Context
    ) -> pb.UpdateWeightVersionResponse:
        """Label the current weights (no transfer needed: the label is the engine core's)."""
        if not request.weight_version:
            raise InvalidRequestError("weight_version", "required: the new label")
        await self._weights_call("update_weight_version", request.weight_version)
        return pb.UpdateWeightVersionResponse()

    async def GetWeightVersion(
        self, request: pb.GetWeightVersionRequest, context: Context
    ) -> pb.GetWeightVersionResponse:
        """The label of the weights last committed ("default" until one is set)."""
        with engine_refusals():
            version = await self._method("get_weight_version")()
        return pb.GetWeightVersionResponse(weight_version=str(version))

    # ----- helpers ----------------------------------------------------------

    async def _check_checkpoint(self, action: str) -> None:
        refusal = await vllm_releases.checkpoint_refusal(self._llm, action)
        if refusal is not None:
            raise CheckpointStateError(refusal)

    async def _state_changed(self) -> None:
        """Readiness follows the engine: re-read it now rather than at the next poll."""
        if self._on_state_change is not None:
            await self._on_state_change()

    @staticmethod
    def _require(enabled: bool, hint: str) -> None:
        if not enabled:
            raise UnsupportedError(hint)

    def _require_weight_transfer(self) -> None:
        self._require(
            bool(control_info.weight_transfer_backend(self._engine)), WEIGHT_TRANSFER_HINT
        )

    def _method(self, name: str) -> Any:
        """The engine's `name`, which every supported vLLM's AsyncLLM has from 0.32 on."""
        method = getattr(self._llm, name, None)
        if method is None:
            raise UnsupportedError(
                f"this vLLM ({vllm.__version__}) has no AsyncLLM.{name}; vLLM 0.32 and later do"
            )
        return method

    async def _weights_call(self, name: str, *args: Any, paused: bool = False) -> None:
        """One weight-update call on the engine, under the RL lock (and a pause, if asked)."""
        method = self._method(name)
        async with self._rl_lock:
            # Checked under the lock: no Resume can slip in before the call.
            if paused and not await self._engine.is_paused():
                raise UnsupportedError(PAUSE_FIRST)
            with engine_refusals():
                await method(*args)
        await self._state_changed()

    def _start_shutdown(self) -> None:
        """The Shutdown call has ended (grpc runs this on the event loop)."""
        if self._group is not None and self._group.count > 1:
            # One of several frontends: the launcher drains them all, then stops the engine.
            logger.warning("Shutdown requested over vllm.Control: stopping every frontend")
            self._group.stop_all()
            return
        self._shutdown = asyncio.ensure_future(self._shut_down())

    async def _shut_down(self) -> None:
        logger.warning(
            "Shutdown requested over vllm.Control: shutting the engine down "
            "(%d generation calls in flight end UNAVAILABLE)",
            self._state.active_requests,
        )
        try:
            # Blocking (it waits for the engine processes): off the event loop.
            await asyncio.to_thread(self._llm.shutdown)
        except Exception:
            logger.exception("engine shutdown failed")


def _adapter(adapter: Adapter) -> pb.LoraAdapter:
    return pb.LoraAdapter(lora_id=adapter.lora_id, lora_name=adapter.name, source_path=adapter.path)
