"""The tiny Llama with real weights on disk, and PEFT LoRA adapters for it: no download.

vLLM's dummy loader fills every parameter near zero, and on such a base an
adapter leaves the greedy tokens as they were. This model instead carries
transformers' own random initialisation (seeded, about 1.5 MB of
safetensors), the config and tokenizer of
:mod:`vllm_servicer.testing.tiny_model`; an adapter written by
:func:`write_tiny_lora_adapter` (rank 8 on ``q_proj`` and ``v_proj``) then changes
what the model says.

Typical use::

    from vllm_servicer.testing.tiny_lora import (
        TINY_LORA_ENGINE_KWARGS, write_tiny_lora_adapter, write_tiny_weighted_model)
    from vllm_servicer.testing.tiny_model import build_tiny_engine

    engine = build_tiny_engine(write_tiny_weighted_model(dir_a), **TINY_LORA_ENGINE_KWARGS)
    adapter = write_tiny_lora_adapter(dir_b)  # then LoRARequest("name", 1, str(adapter))
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Final

from .tiny_model import (
    _CLASSIFIER_CONFIG,
    TINY_ENGINE_KWARGS,
    _finish,
    _generation_config,
    _hf_tokenizer,
    _Kind,
    _text_config,
    _write,
    _write_json,
)

__all__ = [
    "LORA_RANK",
    "TINY_LORA_ENGINE_KWARGS",
    "write_tiny_lora_adapter",
    "write_tiny_weighted_classifier_model",
    "write_tiny_weighted_model",
]

LORA_RANK: Final = 8
"""The rank of the adapters written here, and the engine's `max_lora_rank`."""

TINY_LORA_ENGINE_KWARGS: Final[dict[str, Any]] = {
    **TINY_ENGINE_KWARGS,
    # The weights are on disk (see the module docstring).
    "load_format": "safetensors",
    "enable_lora": True,
    "max_lora_rank": LORA_RANK,
    "max_loras": 2,
}
"""``AsyncEngineArgs`` keyword arguments that start the weighted tiny model with LoRA on."""

_TARGETS: Final = ("q_proj", "v_proj")
_ADAPTER_CONFIG: Final = "adapter_config.json"
_ADAPTER_WEIGHTS: Final = "adapter_model.safetensors"
# Large enough that a rank-8 update moves the tiny model's greedy choices.
_ADAPTER_STD: Final = 0.3


def write_tiny_weighted_model(path: str | os.PathLike[str]) -> Path:
    """Writes the tiny Llama with seeded random weights saved as safetensors.

    The config and tokenizer are those of
    :func:`vllm_servicer.testing.tiny_model.write_tiny_model`; serve it with
    ``load_format="safetensors"`` (:data:`TINY_LORA_ENGINE_KWARGS` does).
    Deterministic, cached and written atomically like that function.

    Returns:
        ``path`` as an absolute :class:`~pathlib.Path`.

    Raises:
        FileExistsError: ``path`` exists, is not empty and was not written by
            this package.
    """
    return _write(Path(path), "weighted", _populate)


def write_tiny_weighted_classifier_model(path: str | os.PathLike[str]) -> Path:
    """Writes the tiny cross-encoder with seeded random weights saved as safetensors.

    :func:`vllm_servicer.testing.tiny_model.write_tiny_classifier_model`'s model
    (``LlamaForSequenceClassification``, one label) with the weights of
    :func:`write_tiny_weighted_model`'s layers and a seeded score head, so that an
    adapter written by :func:`write_tiny_lora_adapter` changes its scores. Serve
    it with :data:`TINY_LORA_ENGINE_KWARGS` and ``runner="pooling"``.

    Returns:
        ``path`` as an absolute :class:`~pathlib.Path`.
    """
    return _write(Path(path), "weighted-classify", _populate)


def write_tiny_lora_adapter(
    path: str | os.PathLike[str], *, seed: int = 0, rank: int = LORA_RANK
) -> Path:
    """Writes a PEFT-format LoRA adapter for the weighted tiny model.

    ``adapter_config.json`` (``peft_type`` LORA, ``r`` = `rank`, ``lora_alpha``
    twice that, ``q_proj`` and ``v_proj`` targeted) and
    ``adapter_model.safetensors`` with every layer's ``lora_A`` and ``lora_B``
    drawn from N(0, 0.3) by a generator seeded with `seed`: different seeds
    make different adapters, the same seed the same one. Existing files of
    that name are replaced, each atomically.

    Args:
        path: the adapter directory, created if needed.
        seed: seeds the adapter's weights.
        rank: the LoRA rank (an engine refuses one above its `max_lora_rank`).

    Returns:
        ``path`` as an absolute :class:`~pathlib.Path`.
    """
    import torch
    from safetensors.torch import save_file

    directory = Path(path).expanduser().absolute()
    directory.mkdir(parents=True, exist_ok=True)
    config = _text_config(_hf_tokenizer())
    generator = torch.Generator().manual_seed(seed)
    weights = {
        f"base_model.model.model.layers.{layer}.self_attn.{module}.lora_{part}.weight": (
            torch.randn(shape, generator=generator) * _ADAPTER_STD
        )
        for layer in range(config["num_hidden_layers"])
        for module in _TARGETS
        for part, shape in (
            ("A", (rank, config["hidden_size"])),
            ("B", (_out_features(config, module), rank)),
        )
    }
    weights_tmp = directory / f".{_ADAPTER_WEIGHTS}.tmp"
    save_file(weights, str(weights_tmp), metadata={"format": "pt"})
    os.replace(weights_tmp, directory / _ADAPTER_WEIGHTS)
    config_tmp = directory / f".{_ADAPTER_CONFIG}.tmp"
    config_tmp.write_text(json.dumps(_adapter_config(rank), indent=2) + "\n", encoding="utf-8")
    os.replace(config_tmp, directory / _ADAPTER_CONFIG)
    return directory


def _out_features(config: dict[str, Any], module: str) -> int:
    heads = config["num_attention_heads"] if module == "q_proj" else config["num_key_value_heads"]
    return int(heads * config["head_dim"])


def _adapter_config(rank: int) -> dict[str, Any]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(_TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "base_model_name_or_path": "tiny-llama",
    }


def _populate(directory: Path, kind: _Kind) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    tokenizer = _hf_tokenizer()
    tokenizer.save_pretrained(str(directory))
    config = _text_config(tokenizer)
    if kind == "weighted-classify":
        config.update(_CLASSIFIER_CONFIG)
    torch.manual_seed(0)
    # Typed as Any: transformers' constructors are untyped in some versions.
    model_cls: Any = (
        LlamaForSequenceClassification if kind == "weighted-classify" else LlamaForCausalLM
    )
    model = model_cls(LlamaConfig(**config))
    weights = {key: value.contiguous() for key, value in model.state_dict().items()}
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    _write_json(directory / "config.json", config)
    _write_json(directory / "generation_config.json", _generation_config(config))
    _finish(directory, kind)
