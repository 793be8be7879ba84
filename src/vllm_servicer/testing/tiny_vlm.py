"""A tiny LLaVA-shaped vision-language model that a real vLLM engine runs with no download.

It is the tiny Llama of :mod:`vllm_servicer.testing.tiny_model` (its tokenizer plus an
``<image>`` token) behind a tiny CLIP vision tower (32x32 images, 16-pixel
patches) and a projector, with a ``LlavaProcessor`` saved beside it; one
``<image>`` in a prompt expands to 4 image tokens. Unlike the text model it
carries weights (random, seeded, about 2 MB of safetensors): vLLM's dummy
loader initialises every parameter near zero, which leaves the image's
contribution to the logits around 1e-11, so different images would give the
same tokens.

Typical use::

    from vllm_servicer.testing.tiny_vlm import TINY_VLM_ENGINE_KWARGS, ensure_tiny_vlm
    from vllm_servicer.testing.tiny_model import build_tiny_engine

    engine = build_tiny_engine(ensure_tiny_vlm(), **TINY_VLM_ENGINE_KWARGS)

The engine's processes need :mod:`vllm_servicer.multimodal._vision_imports` (a vLLM
plugin this package registers) where torchvision does not import.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Final

from .tiny_model import (
    TINY_ENGINE_KWARGS,
    _cache_root,
    _finish,
    _generation_config,
    _hf_tokenizer,
    _Kind,
    _text_config,
    _write,
    _write_json,
)

__all__ = [
    "IMAGE_SIZE",
    "IMAGE_TOKEN",
    "TINY_VLM_ENGINE_KWARGS",
    "default_vlm_dir",
    "ensure_tiny_vlm",
    "write_tiny_vlm",
]

IMAGE_TOKEN: Final = "<image>"
"""The placeholder a prompt carries where an image goes (once per image)."""

IMAGE_SIZE: Final = 32
"""The vision tower's input size in pixels; the processor resizes any image to it."""

_PATCH: Final = 16
_IMAGE_SEQ_LEN: Final = (IMAGE_SIZE // _PATCH) ** 2

TINY_VLM_ENGINE_KWARGS: Final[dict[str, Any]] = {
    **TINY_ENGINE_KWARGS,
    # The weights are on disk (see the module docstring).
    "load_format": "safetensors",
    "limit_mm_per_prompt": {"image": 1},
}
"""``AsyncEngineArgs`` keyword arguments that start the tiny VLM on a CPU machine."""


def default_vlm_dir() -> Path:
    """Where :func:`ensure_tiny_vlm` keeps the model (beside the tiny text model)."""
    return _cache_root() / "tiny-llava"


def ensure_tiny_vlm() -> Path:
    """Writes the tiny VLM to :func:`default_vlm_dir` if missing; returns the directory."""
    return write_tiny_vlm(default_vlm_dir())


def write_tiny_vlm(path: str | os.PathLike[str]) -> Path:
    """Writes the tiny LLaVA model directory, without any network access.

    Deterministic (seeded weights), cached and written atomically like
    :func:`vllm_servicer.testing.tiny_model.write_tiny_model`.

    Returns:
        ``path`` as an absolute :class:`~pathlib.Path`.

    Raises:
        FileExistsError: ``path`` exists, is not empty and was not written by
            this package.
    """
    return _write(Path(path), "vision", _populate)


def _populate(directory: Path, kind: _Kind) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tokenizer = _hf_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    text = _text_config(tokenizer)
    config = LlavaConfig(
        text_config=LlamaConfig(**text),
        vision_config=CLIPVisionConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=1,
            image_size=IMAGE_SIZE,
            patch_size=_PATCH,
            hidden_act="quick_gelu",
        ),
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        image_seq_length=_IMAGE_SEQ_LEN,
        # With a bias the tiny projector's output is nearly constant across images.
        multimodal_projector_bias=False,
        tie_word_embeddings=False,
        dtype="float32",
    )
    config.architectures = ["LlavaForConditionalGeneration"]
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config)
    # vLLM's CLIP tower keeps its layers under `vision_model`, as CLIP checkpoints do.
    weights = {
        key.replace("vision_tower.", "vision_tower.vision_model.", 1): value.contiguous()
        for key, value in model.state_dict().items()
    }
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(directory))
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
    )
    # Typed as Any: transformers' constructor is untyped in some versions.
    processor_cls: Any = LlavaProcessor
    processor_cls(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=_PATCH,
        vision_feature_select_strategy="default",
        image_token=IMAGE_TOKEN,
        # CLIP's class token: the tower yields one more feature than patches.
        num_additional_image_tokens=1,
    ).save_pretrained(str(directory))
    _write_json(directory / "generation_config.json", _generation_config(text))
    _finish(directory, kind)
