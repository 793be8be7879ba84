"""vLLM 0.34's differences, checked on whichever release is installed.

vLLM 0.34 cannot start an engine on these CPUs (its x86 CPU platform requires
Triton's CPU backend, which no package registry here has: docs/index.md), so
each 0.34 branch is tested here with stand-in engines that carry 0.34's own
signatures and behaviour, read from its wheel (`AsyncLLM.checkpoint_state`,
`sleep(..., reset_connector=)`, the engine core's `is_inference_ready`
utility), served over a real gRPC channel. In the 0.34 venv
(`make test-release-static VLLM=0.34.0`, run by CI) the same tests also see
0.34's real classes, and check the stand-ins' signatures against them; the
tests that need a class only 0.34 has run there alone.
"""

from __future__ import annotations

import enum
import importlib.util
import inspect
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import collect, error_info, request, serving

from vllm_servicer import vllm_releases
from vllm_servicer.health import LIVENESS_SERVICE
from vllm_servicer.proto import (
    CONTROL_SERVICE,
    SERVICE_NAME,
    control_pb2,
    control_pb2_grpc,
    vllm_engine_pb2_grpc,
)
from vllm_servicer.testing.stand_in import StandInEngine

IS_034 = vllm_releases.EngineFaultedError is not vllm_releases._NeverRaised
only_034 = pytest.mark.skipif(not IS_034, reason="vLLM 0.34+ only: CI runs it in the 0.34 venv")


def _checkpoint_state_class() -> Any:
    """vLLM 0.34's `CheckpointState`: the real one where installed, else its copy."""
    try:
        from vllm.v1.engine import CheckpointState  # type: ignore[attr-defined]
    except ImportError:

        class CheckpointState(enum.StrEnum):  # type: ignore[no-redef]
            RUNNING = "running"
            PREPARING = "preparing"
            PREPARED = "prepared"
            RESTORING = "restoring"
            FAILED = "failed"

    return CheckpointState


CheckpointState = _checkpoint_state_class()


def _reason(err: grpc.aio.AioRpcError) -> str:
    return str(error_info(err).reason)


# ----- seeded sampling: no rewind, no hazard, no CPU default ---------------------


def test_the_rewind_is_detected_from_the_installed_runner() -> None:
    spec = importlib.util.find_spec("vllm.v1.worker.gpu_model_runner")
    if spec is None:  # 0.34+: Model Runner V1 is gone
        assert not vllm_releases.SEEDED_DRAW_REWINDS
    else:
        assert spec.origin is not None
        with open(spec.origin, encoding="utf-8") as source:
            rewinds = ".set_offset(" in source.read()
        assert vllm_releases.SEEDED_DRAW_REWINDS == rewinds


def _splitting_config() -> Any:
    """A CPU engine's settings under which a prompt can be scheduled in parts."""
    return SimpleNamespace(
        device_config=SimpleNamespace(device_type="cpu"),
        scheduler_config=SimpleNamespace(
            long_prefill_token_threshold=0,
            enable_chunked_prefill=True,
            max_num_batched_tokens=2048,
            max_num_seqs=64,
        ),
        model_config=SimpleNamespace(max_model_len=512),
    )


def test_a_runner_that_rewinds_nothing_has_no_seeded_hazard() -> None:
    config = _splitting_config()
    assert "chunked prefill" in (vllm_releases.seeded_sampling_hazard(config, rewinds=True) or "")
    assert vllm_releases.seeded_sampling_hazard(config, rewinds=False) is None


@pytest.mark.parametrize("rewinds", [True, False])
def test_the_launcher_turns_chunked_prefill_off_only_where_seeds_rewind(
    rewinds: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.platforms import current_platform

    from vllm_servicer.serve.args import parse_args

    assert current_platform.is_cpu()
    monkeypatch.setattr(vllm_releases, "SEEDED_DRAW_REWINDS", rewinds)
    chunked = parse_args(["serve", "--model", "org/model"]).engine["enable_chunked_prefill"]
    assert chunked is (False if rewinds else None)  # None: vLLM's own default
    given = parse_args(["serve", "--model", "org/model", "--enable-chunked-prefill"])
    assert given.engine["enable_chunked_prefill"] is True


# ----- a faulted engine (--enable-fault-tolerance) --------------------------------


class _FaultedEngine(StandInEngine):
    """0.34's AsyncLLM with fault tolerance on and an unhealthy engine:
    `check_admission`, called inside `generate`, raises EngineFaultedError."""

    async def generate(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        raise vllm_releases.EngineFaultedError()
        yield  # an async generator, as AsyncLLM.generate is


@only_034
async def test_a_faulted_engine_answers_unavailable_with_a_retry_hint() -> None:
    async with serving(_FaultedEngine()) as served:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(served.channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await collect(stub.Generate(request(max_tokens=2)))
    err = caught.value
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
    assert "faulted" in (err.details() or "")
    assert _reason(err) == "ENGINE_FAULTED"
    assert dict(err.trailing_metadata() or ()).get("grpc-retry-pushback-ms") == "1000"


# ----- the process-checkpoint lifecycle -------------------------------------------


class _CheckpointingEngine(StandInEngine):
    """An engine with 0.34's checkpoint lifecycle and sleep mode; records control calls."""

    def __init__(self) -> None:
        super().__init__(model_config=SimpleNamespace(enable_sleep_mode=True))
        self.state = CheckpointState.RUNNING
        self.calls: list[str] = []
        self.resets: list[bool] = []
        self.paused = False

    async def checkpoint_state(self) -> tuple[Any, str | None]:
        return self.state, None

    async def sleep(
        self, level: int = 1, mode: str = "abort", reset_connector: bool = True
    ) -> None:
        self.calls.append("sleep")
        self.resets.append(reset_connector)
        self.paused = True

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        self.calls.append("wake_up")
        self.paused = False
        return True

    async def resume_generation(self) -> None:
        self.calls.append("resume")
        self.paused = False

    async def is_paused(self) -> bool:
        return self.paused


@only_034
def test_the_stand_in_carries_0_34_s_signatures() -> None:
    from vllm.v1.engine.async_llm import AsyncLLM

    for name in ("checkpoint_state", "sleep", "wake_up", "resume_generation"):
        ours = inspect.signature(getattr(_CheckpointingEngine, name))
        theirs = inspect.signature(getattr(AsyncLLM, name))
        assert list(ours.parameters) == list(theirs.parameters), name


@pytest.mark.parametrize(
    ("state", "refused"),
    [
        ("prepared", {"Sleep", "WakeUp", "ResumeGeneration"}),
        ("preparing", {"Sleep", "WakeUp", "ResumeGeneration"}),
        ("failed", {"Sleep", "WakeUp", "ResumeGeneration"}),
        ("restoring", {"Sleep"}),
        ("running", set()),
    ],
)
async def test_control_refuses_what_the_checkpoint_state_forbids(
    state: str, refused: set[str]
) -> None:
    engine = _CheckpointingEngine()
    engine.state = CheckpointState(state)
    calls = {
        "Sleep": control_pb2.SleepRequest(),
        "WakeUp": control_pb2.WakeUpRequest(),
        "ResumeGeneration": control_pb2.ResumeGenerationRequest(),
    }
    async with serving(engine, services=(CONTROL_SERVICE,)) as served:
        stub = control_pb2_grpc.ControlStub(served.channel)
        for method, message in calls.items():
            call = getattr(stub, method)(message, timeout=10)
            if method not in refused:
                await call
                continue
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call
            err = caught.value
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, (method, err.details())
            assert _reason(err) == "CHECKPOINT_IN_PROGRESS"
            assert f"checkpoint is {state}" in (err.details() or "")
    expected = {"Sleep": "sleep", "WakeUp": "wake_up", "ResumeGeneration": "resume"}
    assert engine.calls == [expected[m] for m in calls if m not in refused]


async def test_sleep_passes_the_requests_connector_reset_to_0_34_s_sleep() -> None:
    engine = _CheckpointingEngine()
    async with serving(engine, services=(CONTROL_SERVICE,)) as served:
        stub = control_pb2_grpc.ControlStub(served.channel)
        for message in (
            control_pb2.SleepRequest(reset_connector=False),
            control_pb2.SleepRequest(reset_connector=True),
            control_pb2.SleepRequest(),  # unset: vLLM's default (true)
        ):
            await stub.Sleep(message, timeout=10)
            await stub.WakeUp(control_pb2.WakeUpRequest(), timeout=10)
    assert engine.resets == [False, True, True]


# ----- readiness from the engine core's own answer ---------------------------------


class _CoreClient:
    """0.34's engine-core client: utility calls by name, `is_inference_ready` among them."""

    def __init__(self) -> None:
        self.engine_ranks_managed = [0]
        self.ready = True
        self.asked = 0

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        assert method == "is_inference_ready" and not args
        self.asked += 1
        return self.ready


async def test_readiness_is_the_engine_core_s_answer_where_it_gives_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if IS_034:
        from vllm.v1.engine.core import EngineCore

        assert hasattr(EngineCore, "is_inference_ready")
        assert vllm_releases.INFERENCE_READY_UTILITY
    monkeypatch.setattr(vllm_releases, "INFERENCE_READY_UTILITY", True)
    engine = StandInEngine()
    core = _CoreClient()
    engine.engine_core = core  # type: ignore[assignment]
    async with serving(engine, services=(SERVICE_NAME,)) as served:
        health = health_pb2_grpc.HealthStub(served.channel)

        async def status(service: str) -> int:
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            return int(reply.status)

        serving_ = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        assert await status("") == serving_
        core.ready = False  # paused, asleep or mid weight update, as the core says
        assert served.mounted.health is not None
        await served.mounted.health.recheck()
        assert (await status(""), await status(SERVICE_NAME)) == (not_serving, not_serving)
        assert await status(LIVENESS_SERVICE) == serving_
        # A flood of Check calls asks the engine at most once per poll interval.
        asked = core.asked
        for _ in range(50):
            await status("")
        assert core.asked - asked <= 2
        core.ready = True
        await served.mounted.health.recheck()
        assert await status("") == serving_
