"""`VllmEngineServicer`: the `vllm.grpc.engine.VllmEngine` service over a vLLM engine."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from vllm.inputs import TokensPrompt
from vllm.pooling_params import PoolingParams

from . import convert
from .engine import EngineClient
from .errors import InvalidRequestError, UnsupportedError, abort_for_exception
from .proto import common_pb2, vllm_engine_pb2_grpc
from .proto import vllm_engine_pb2 as pb

if TYPE_CHECKING:
    import grpc.aio

    Context = grpc.aio.ServicerContext[Any, Any]

logger = logging.getLogger("vllm_servicer")

SERVER_TYPE = "vllm-grpc"
# The generation-config defaults GetModelInfo advertises for the router to apply.
_ADVERTISED_SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _request_id(given: str, prefix: str) -> str:
    # vLLM needs an id; a client that sent none cannot Abort by id anyway.
    return given or f"{prefix}-{uuid.uuid4().hex}"


class VllmEngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    """Serves vLLM's gRPC engine protocol from an `AsyncLLM` (or anything shaped like it).

    Args:
        engine: the host's engine client, usually `vllm.v1.engine.async_llm.AsyncLLM`.
    """

    def __init__(self, engine: EngineClient) -> None:
        self._engine = engine
        self._started_monotonic = time.monotonic()
        self._active_requests = 0
        self._last_receive_timestamp = 0.0
        self._model_info: pb.GetModelInfoResponse | None = None
        self._supported_tasks: tuple[str, ...] | None = None

    @property
    def engine(self) -> EngineClient:
        """The engine this servicer drives."""
        return self._engine

    @property
    def active_requests(self) -> int:
        """Generate and Embed calls currently being served."""
        return self._active_requests

    def _received(self) -> None:
        self._active_requests += 1
        self._last_receive_timestamp = time.time()

    # ----- generation -------------------------------------------------------

    async def Generate(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateResponse]:
        request_id = _request_id(request.request_id, "generate")
        self._received()
        try:
            params = request.sampling_params
            stream = request.stream
            sampling = convert.sampling_params_from_proto(params, stream=stream)
            prompt = convert.prompt_from_request(request)
            kwargs: dict[str, Any] = {}
            tokenization = convert.tokenization_kwargs(params)
            if tokenization is not None:
                kwargs["tokenization_kwargs"] = tokenization
            if request.HasField("data_parallel_rank"):
                kwargs["data_parallel_rank"] = request.data_parallel_rank
            build = convert.ResponseBuilder(params)
            chunk, complete = build.chunk, build.complete
            async for output in self._engine.generate(prompt, sampling, request_id, **kwargs):
                if stream:
                    for completion in output.outputs:
                        yield chunk(output, completion)
                        if completion.finish_reason is not None:
                            yield complete(output, completion)
                elif output.finished:
                    for completion in output.outputs:
                        yield complete(output, completion)
        except Exception as exc:
            await abort_for_exception(context, exc, method="Generate", request_id=request_id)
        finally:
            self._active_requests -= 1

    async def Embed(self, request: pb.EmbedRequest, context: Context) -> pb.EmbedResponse:
        request_id = _request_id(request.request_id, "embed")
        self._received()
        try:
            if "embed" not in await self._tasks():
                raise UnsupportedError(
                    "this server's engine does not serve embeddings; start it as a pooling "
                    "model (vLLM: --runner pooling --convert embed)"
                )
            ids = list(request.tokenized.input_ids)
            if not ids:
                raise InvalidRequestError("tokenized.input_ids", "the prompt is empty")
            final = None
            async for output in self._engine.encode(
                TokensPrompt(prompt_token_ids=ids), PoolingParams(task="embed"), request_id
            ):
                final = output
            if final is None:  # pragma: no cover - the engine always yields once
                raise RuntimeError("engine returned no embedding")
            vector = final.outputs.data.tolist()
            return pb.EmbedResponse(
                embedding=vector,
                prompt_tokens=len(final.prompt_token_ids),
                embedding_dim=len(vector),
            )
        except Exception as exc:
            await abort_for_exception(context, exc, method="Embed", request_id=request_id)
        finally:
            self._active_requests -= 1

    async def Abort(self, request: pb.AbortRequest, context: Context) -> pb.AbortResponse:
        # Idempotent: vLLM ignores ids it does not know (finished or never seen).
        ids = [i for i in request.request_ids if i]
        if ids:
            try:
                await self._engine.abort(ids)
            except Exception as exc:
                await abort_for_exception(context, exc, method="Abort", request_id=",".join(ids))
        return pb.AbortResponse()

    # ----- state ------------------------------------------------------------

    async def HealthCheck(
        self, request: pb.HealthCheckRequest, context: Context
    ) -> pb.HealthCheckResponse:
        if self._engine.errored:
            return pb.HealthCheckResponse(healthy=False, message="Engine is not alive")
        return pb.HealthCheckResponse(healthy=True, message="Health")

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: Context
    ) -> pb.GetModelInfoResponse:
        if self._model_info is None:
            self._model_info = await self._build_model_info()
        return self._model_info

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: Context
    ) -> pb.GetServerInfoResponse:
        config = self._engine.vllm_config
        parallel = getattr(config, "parallel_config", None)
        cache = getattr(config, "cache_config", None)
        scheduler = getattr(config, "scheduler_config", None)
        kv_transfer = getattr(config, "kv_transfer_config", None)
        is_paused = False
        probe = getattr(self._engine, "is_paused", None)
        if callable(probe):
            is_paused = bool(await probe())
        return pb.GetServerInfoResponse(
            active_requests=self._active_requests,
            is_paused=is_paused,
            last_receive_timestamp=self._last_receive_timestamp,
            uptime_seconds=time.monotonic() - self._started_monotonic,
            server_type=SERVER_TYPE,
            kv_connector=getattr(kv_transfer, "kv_connector", None) or "",
            kv_role=getattr(kv_transfer, "kv_role", None) or "",
            kv_engine_id=getattr(kv_transfer, "engine_id", None) or "",
            data_parallel_size=getattr(parallel, "data_parallel_size", 1) or 1,
            kv_cache_dtype=str(getattr(cache, "cache_dtype", "") or ""),
            block_size=getattr(cache, "block_size", 0) or 0,
            model_dtype=str(getattr(self._engine.model_config, "dtype", "") or ""),
            max_num_seqs=getattr(scheduler, "max_num_seqs", 0) or 0,
        )

    async def FlushCache(
        self, request: common_pb2.FlushCacheRequest, context: Context
    ) -> common_pb2.FlushCacheResponse:
        try:
            reset = getattr(self._engine, "reset_prefix_cache", None)
            if reset is None:
                raise UnsupportedError("this engine has no prefix cache to flush")
            ok = await reset()
            ok = True if ok is None else bool(ok)
            message = "prefix cache flushed" if ok else "prefix cache not flushed: requests running"
            return common_pb2.FlushCacheResponse(success=ok, message=message)
        except Exception as exc:
            await abort_for_exception(context, exc, method="FlushCache")

    # ----- helpers ----------------------------------------------------------

    async def _tasks(self) -> tuple[str, ...]:
        if self._supported_tasks is None:
            get = getattr(self._engine, "get_supported_tasks", None)
            tasks = await get() if get is not None else ("generate",)
            self._supported_tasks = tuple(tasks)
        return self._supported_tasks

    async def _build_model_info(self) -> pb.GetModelInfoResponse:
        mc = self._engine.model_config
        hf = getattr(mc, "hf_config", None)
        max_len = int(getattr(mc, "max_model_len", 0) or 0)
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = [eos] if isinstance(eos, int) else list(eos or ())
        served = getattr(mc, "served_model_name", None) or getattr(mc, "model", "")
        if isinstance(served, (list, tuple)):
            served = served[0] if served else ""
        return pb.GetModelInfoResponse(
            model_path=str(getattr(mc, "model", "")),
            is_generation=getattr(mc, "runner_type", "generate") == "generate",
            max_context_length=max_len,
            vocab_size=int(mc.get_vocab_size()),
            supports_vision=bool(getattr(mc, "is_multimodal_model", False)),
            served_model_name=str(served),
            tokenizer_path=str(getattr(mc, "tokenizer", "") or ""),
            model_type=str(getattr(hf, "model_type", "") or ""),
            architectures=list(getattr(hf, "architectures", None) or ()),
            eos_token_ids=eos_ids,
            pad_token_id=int(getattr(hf, "pad_token_id", None) or 0),
            bos_token_id=int(getattr(hf, "bos_token_id", None) or 0),
            max_req_input_len=max_len,
            default_sampling_params_json=_default_sampling_json(mc),
        )


def _default_sampling_json(model_config: Any) -> str:
    """The model's generation-config sampling defaults as compact JSON ("" if none)."""
    get_diff = getattr(model_config, "get_diff_sampling_param", None)
    if get_diff is None:
        return ""
    try:
        diff = get_diff() or {}
    except Exception:  # a malformed generation config must not break GetModelInfo
        logger.warning("could not read the model's generation config", exc_info=True)
        return ""
    chosen = {k: diff[k] for k in _ADVERTISED_SAMPLING_DEFAULTS if diff.get(k) is not None}
    return json.dumps(chosen, separators=(",", ":")) if chosen else ""


