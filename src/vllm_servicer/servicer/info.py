"""GetServerInfo and GetModelInfo, read off the engine's real configuration."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from ..engine import EngineClient, served_model_name
from ..multimodal import model_media as mm_model_media
from ..multimodal.media import MediaResolver
from ..proto import vllm_engine_pb2 as pb

logger = logging.getLogger("vllm_servicer")

SERVER_TYPE = "vllm-grpc"
# The generation-config defaults GetModelInfo advertises for the router to apply.
_ADVERTISED_SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

# The grammar's start on a prompt that ends inside the model's thought, as
# routers read GetServerInfo.constrained_decoding_start.
_AFTER_REASONING, _FROM_FIRST_TOKEN = "after_reasoning", "first_token"


def _engine_facts(config: Any) -> dict[str, Any]:
    """GetServerInfo's fields read off the engine's configuration beyond the basics.

    The attention backend is the one asked for (`--attention-backend`); on
    the automatic choice the worker picks it, and it is left empty (unknown).
    """
    model = getattr(config, "model_config", None)
    dtype = str(getattr(model, "dtype", "") or "").removeprefix("torch.")
    multimodal = getattr(model, "multimodal_config", None)
    backend = getattr(getattr(config, "attention_config", None), "backend", None)
    structured = getattr(config, "structured_outputs_config", None)
    parser = str(getattr(structured, "reasoning_parser", "") or "")
    # vLLM holds a grammar back until the thought ends, unless told to run it inside.
    held_back = parser and not getattr(structured, "enable_in_reasoning", False)
    return {
        "multimodal_encoder_dtype": dtype if dtype in ("float32", "float16", "bfloat16") else "",
        # Such an engine takes raw pixels and would normalise others twice.
        "mm_device_do_normalize": bool(getattr(multimodal, "mm_device_do_normalize", False)),
        "attention_backend": "" if backend is None else str(getattr(backend, "name", backend)),
        "engine_reasoning_parser": parser,
        "constrained_decoding_start": ""
        if structured is None
        else (_AFTER_REASONING if held_back else _FROM_FIRST_TOKEN),
    }


async def server_info(
    engine: EngineClient,
    *,
    active_requests: int,
    last_receive_timestamp: float,
    uptime_seconds: float,
    model_media: mm_model_media.ModelMedia,
    media: MediaResolver | None,
) -> pb.GetServerInfoResponse:
    """GetServerInfo: the engine's configuration and this server's state.

    Args:
        engine: the engine served.
        active_requests: the calls in flight now.
        last_receive_timestamp: when the last Generate or Embed arrived, or before
            the first one when the servicer was built (epoch seconds).
        uptime_seconds: since the servicer was built.
        model_media: the preprocessed tensors the model takes.
        media: the resolver of images named by URL, None when they are off.
    """
    config = engine.vllm_config
    parallel = getattr(config, "parallel_config", None)
    cache = getattr(config, "cache_config", None)
    scheduler = getattr(config, "scheduler_config", None)
    kv_transfer = getattr(config, "kv_transfer_config", None)
    is_paused = await engine.is_paused()
    takes_images = media is not None and media.takes_images
    # Worked out once, from the model's largest item: off the event loop.
    budget = (
        model_media.encoder_budget(config)
        if model_media.encoder_budget_known
        else await asyncio.to_thread(model_media.encoder_budget, config)
    )
    return pb.GetServerInfoResponse(
        active_requests=active_requests,
        is_paused=is_paused,
        last_receive_timestamp=last_receive_timestamp,
        uptime_seconds=uptime_seconds,
        server_type=SERVER_TYPE,
        kv_connector=getattr(kv_transfer, "kv_connector", None) or "",
        kv_role=getattr(kv_transfer, "kv_role", None) or "",
        kv_engine_id=getattr(kv_transfer, "engine_id", None) or "",
        data_parallel_size=getattr(parallel, "data_parallel_size", 1) or 1,
        kv_cache_dtype=str(getattr(cache, "cache_dtype", "") or ""),
        block_size=getattr(cache, "block_size", 0) or 0,
        model_dtype=str(getattr(engine.model_config, "dtype", "") or ""),
        max_num_seqs=getattr(scheduler, "max_num_seqs", 0) or 0,
        # What a router reads to send media_refs here rather than tensors.
        mm_processor="inprocess" if takes_images else "",
        mm_media_ref_schemes=",".join(media.schemes) if media is not None and takes_images else "",
        # What a router reads to send tensors, and through shared memory.
        mm_item_limits=model_media.item_limits,
        shm_namespace_id=mm_model_media.shm_namespace()
        if model_media.shm and model_media.limits
        else "",
        mm_encoder_budget=budget,
        **_engine_facts(config),
    )


def model_info(engine: EngineClient, *, supports_vision: bool) -> pb.GetModelInfoResponse:
    """GetModelInfo: the model and its tokenizer as the engine loaded them.

    Args:
        engine: the engine served.
        supports_vision: whether a request can carry an image that reaches the
            model (preprocessed tensors, or media_refs when turned on).
    """
    mc = engine.model_config
    hf = getattr(mc, "hf_config", None)
    max_len = int(getattr(mc, "max_model_len", 0) or 0)
    eos = getattr(hf, "eos_token_id", None)
    eos_ids = [eos] if isinstance(eos, int) else list(eos or ())
    return pb.GetModelInfoResponse(
        model_path=str(getattr(mc, "model", "")),
        is_generation=getattr(mc, "runner_type", "generate") == "generate",
        max_context_length=max_len,
        vocab_size=int(mc.get_vocab_size()),
        supports_vision=supports_vision,
        served_model_name=served_model_name(engine),
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
