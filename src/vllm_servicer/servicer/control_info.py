"""`vllm.Control`'s GetServerInfo, GetModelInfo and GetKvEventSources, read off the engine.

Every figure is the engine's own configuration as the frontend holds it after
start-up: vLLM's engine cores report the KV-cache size and block size back to
it (`EngineCoreReadyResponse`), summed over data-parallel ranks.
"""

from __future__ import annotations

from typing import Any

# Before vLLM is imported below: an untested vLLM release fails here, naming both versions.
from .. import _vllm_version  # noqa: F401

# isort: split
import vllm

from ..engine import EngineClient, served_model_name
from ..proto import VLLM_PROTO_VERSION
from ..proto import control_pb2 as pb
from . import kv_events

API_VERSION = "vllm"
"""`ServerInfo.api_version`, as vLLM's own server answers."""

# What GetKvEventSources says of every publisher (vLLM's ZMQ publisher's framing).
KV_EVENTS_TRANSPORT = "zmq"
KV_EVENTS_ENCODING = "msgpack"
KV_EVENTS_SCHEMA_VERSION = 1


def sleep_mode_enabled(engine: EngineClient) -> bool:
    """Whether the engine was started with `--enable-sleep-mode`."""
    return bool(getattr(engine.model_config, "enable_sleep_mode", False))


def weight_transfer_backend(engine: EngineClient) -> str:
    """The engine's `--weight-transfer-config` backend; "" without one."""
    config = getattr(engine.vllm_config, "weight_transfer_config", None)
    return "" if config is None else str(getattr(config, "backend", "") or "")


def has_draft_model(engine: EngineClient) -> bool:
    """Whether speculative decoding runs a draft model (whose weights can be updated)."""
    speculative = getattr(engine.vllm_config, "speculative_config", None)
    return getattr(speculative, "draft_model_config", None) is not None


def server_info(engine: EngineClient, *, max_loras: int) -> pb.ServerInfo:
    """GetServerInfo: the engine's version, parallelism, capacity and RL capabilities.

    Args:
        engine: the engine served.
        max_loras: adapters per batch (0 without LoRA).
    """
    config = engine.vllm_config
    cache = getattr(config, "cache_config", None)
    scheduler = getattr(config, "scheduler_config", None)
    backend = weight_transfer_backend(engine)
    info = pb.ServerInfo(
        engine_version=vllm.__version__,
        api_version=API_VERSION,
        # The schema's version as vLLM's Rust frontend reports it (its vllm-proto crate's).
        proto_version=VLLM_PROTO_VERSION,
        instance_id=str(getattr(config, "instance_id", "") or ""),
        parallelism=_parallelism(getattr(config, "parallel_config", None)),
        max_model_len=_int(engine.model_config, "max_model_len"),
        kv_block_size=_int(cache, "block_size"),
        total_kv_blocks=_int(cache, "num_gpu_blocks"),
        max_running_requests=_int(scheduler, "max_num_seqs"),
        max_batched_tokens=_int(scheduler, "max_num_batched_tokens"),
        max_loras=max_loras,
        rl_capabilities=pb.RlCapabilities(
            weight_transfer_enabled=bool(backend),
            weight_transfer_backend=backend,
            sleep_mode_enabled=sleep_mode_enabled(engine),
            draft_weight_updates_enabled=bool(backend) and has_draft_model(engine),
        ),
    )
    # Unset, not 0, when the ranks disagree or the engine does not say.
    effective = getattr(cache, "effective_attention_block_size", None)
    if effective is not None:
        info.effective_attention_block_size = int(effective)
    return info


def _parallelism(parallel: Any) -> pb.ParallelismInfo:
    return pb.ParallelismInfo(
        tensor_parallel_size=_int(parallel, "tensor_parallel_size", 1),
        pipeline_parallel_size=_int(parallel, "pipeline_parallel_size", 1),
        data_parallel_size=_int(parallel, "data_parallel_size", 1),
        data_parallel_rank=_int(parallel, "data_parallel_rank"),
        decode_context_parallel_size=_int(parallel, "decode_context_parallel_size", 1),
        world_size=_int(parallel, "world_size", 1),
        data_parallel_size_local=_int(parallel, "data_parallel_size_local", 1),
    )


def _int(config: Any, name: str, default: int = 0) -> int:
    value = getattr(config, name, None)
    return default if value is None else int(value)


def model_info(engine: EngineClient, *, supports_lora: bool) -> pb.ModelInfo:
    """GetModelInfo: the model as the engine serves it.

    `served_model_aliases` stays empty: vLLM's ModelConfig keeps only the
    first of several `--served-model-name`s, and the engine is all a mounted
    servicer has. The tool-call parser is a frontend setting, not the
    engine's: empty too.

    Args:
        engine: the engine served.
        supports_lora: whether requests may name LoRA adapters.
    """
    model = engine.model_config
    structured = getattr(engine.vllm_config, "structured_outputs_config", None)
    return pb.ModelInfo(
        model_id=str(getattr(model, "model", "") or ""),
        served_model_name=served_model_name(engine),
        # Text needs the engine's tokenizer; token ids are always taken.
        supports_text_input=not getattr(model, "skip_tokenizer_init", False),
        supports_token_ids_input=True,
        supports_lora=supports_lora,
        supports_multimodal=bool(getattr(model, "is_multimodal_model", False)),
        reasoning_parser=str(getattr(structured, "reasoning_parser", "") or ""),
    )


def kv_event_sources(engine: EngineClient) -> pb.GetKvEventSourcesResponse:
    """GetKvEventSources: every rank's ZMQ publisher; none when the engine publishes none.

    Endpoints are as a subscriber on this host connects to them (a bind to
    every interface reads 127.0.0.1), as SubscribeKvEvents uses them.
    """
    config = kv_events.publisher_config(engine)
    response = pb.GetKvEventSourcesResponse()
    if config is None:
        return response
    for source in kv_events.sources(engine, config):
        response.sources.add(
            transport=KV_EVENTS_TRANSPORT,
            endpoint=source.endpoint,
            topic=str(config.topic or ""),
            replay_endpoint=source.replay or "",
            data_parallel_rank=source.rank,
            encoding=KV_EVENTS_ENCODING,
            schema_version=KV_EVENTS_SCHEMA_VERSION,
            buffer_steps=int(config.buffer_steps),
            hwm=int(config.hwm),
            max_queue_size=int(config.max_queue_size),
        )
    return response
