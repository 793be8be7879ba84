"""What the served model takes as media: the facts a router's tensors are checked against.

`ModelMedia` is read off the engine once: the items per prompt it takes for
each modality, each modality's placeholder token id and the model's dtype.
What vLLM's own processor makes of one image for this model is learnt on
first use, from two blank images of different sizes: the tensors it makes,
each dimension that did not change with the image's size, and the number of
embedding positions when that did not change either. GetServerInfo gives
routers the engine's encoder budget per item, worked out here once, and
which shared memory this process sees (`shm_namespace`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

import torch

from .tensor_payloads import SHM_DIR

logger = logging.getLogger("vllm_servicer")

# Where vLLM's model configs keep each modality's placeholder token id.
_TOKEN_ATTRS = {
    "image": ("image_token_index", "image_token_id"),
    "video": ("video_token_index", "video_token_id"),
}


@dataclasses.dataclass(frozen=True)
class ItemShape:
    """What vLLM's own processor makes of one image for this model.

    Attributes:
        dims: each tensor's per-item shape by keyword; None where a dimension
            changes with the image's size.
        embeds: embedding positions per image; None when that changes with the image.
    """

    dims: Mapping[str, tuple[int | None, ...]]
    embeds: int | None


class ModelMedia:
    """What the served model takes: items per prompt by modality, placeholder tokens, dtype.

    Attributes:
        limits: the engine's items per prompt for each modality it takes
            (vLLM's `--limit-mm-per-prompt` within the model's own limits).
        token_ids: each modality's placeholder token id, where the model has one.
        dtype: the model's dtype, that floating-point tensors are cast to.
        shm: whether tensors may come through this host's shared memory (off
            by default: a caller could name any segment the server can read).
    """

    def __init__(
        self,
        limits: Mapping[str, int],
        token_ids: Mapping[str, int],
        dtype: torch.dtype,
        processor: Any = None,
        *,
        shm: bool = False,
    ) -> None:
        self.limits = {m: n for m, n in limits.items() if n > 0}
        self.token_ids = dict(token_ids)
        self.dtype = dtype
        self.shm = shm
        self._processor = processor
        self._image_shape: ItemShape | None = None
        self._learnt = False
        self._learning = threading.Lock()
        self._encoder_budget: int | None = None

    @classmethod
    def of(cls, engine: Any, *, shm: bool = False) -> ModelMedia:
        """The facts of `engine`'s model (none for a text model); `shm` as in the attributes."""
        processor = getattr(getattr(engine, "renderer", None), "mm_processor", None)
        limits = dict(getattr(getattr(processor, "info", None), "allowed_mm_limits", None) or {})
        config = getattr(engine, "model_config", None)
        hf_config = getattr(config, "hf_config", None)
        token_ids = {}
        for modality, attrs in _TOKEN_ATTRS.items():
            found = [getattr(hf_config, attr, None) for attr in attrs]
            ids = [value for value in found if isinstance(value, int)]
            if ids:
                token_ids[modality] = ids[0]
        dtype = getattr(config, "dtype", None)
        dtype = dtype if isinstance(dtype, torch.dtype) else torch.float32
        return cls(limits, token_ids, dtype, processor, shm=shm)

    def encoder_budget(self, vllm_config: Any) -> int:
        """The most embedding positions one item may take and still be scheduled.

        vLLM's own figure (the lesser of the encoder compute budget and the
        encoder cache), as its start-up log gives it; 0 for a model that takes
        no media, or when this vLLM cannot tell. Works out the model's largest
        item on first use: call it off the event loop.
        """
        if self._encoder_budget is None:
            self._encoder_budget = _encoder_budget(vllm_config) if self.limits else 0
        return self._encoder_budget

    @property
    def encoder_budget_known(self) -> bool:
        """Whether `encoder_budget` has its answer already (no model work left)."""
        return self._encoder_budget is not None

    @property
    def item_limits(self) -> str:
        """Items per prompt as a router reads them: sorted "modality=count" pairs."""
        return ",".join(f"{m}={n}" for m, n in sorted(self.limits.items()))

    @property
    def takes_images(self) -> bool:
        """Whether preprocessed images can reach the model."""
        return self.limits.get("image", 0) > 0

    @property
    def learnt(self) -> bool:
        """Whether `item_shape` has what it needs (learning it runs the model's processor)."""
        return self._learnt

    def learn(self) -> None:
        """Learns what the model's processor makes of an image, once."""
        with self._learning:
            if not self._learnt and self._processor is not None and self.takes_images:
                self._image_shape = _learn_image_shape(self._processor)
            self._learnt = True

    def item_shape(self, modality: str) -> ItemShape | None:
        """What the model's processor makes of one item (images only), or None."""
        if modality != "image":
            return None
        self.learn()
        return self._image_shape


# Two sizes no processor keeps as they are, so what changes with the image shows.
_SAMPLE_SIZES = ((61, 47), (333, 250))


def _learn_image_shape(processor: Any) -> ItemShape | None:
    """Runs vLLM's processor on two blank images (no cache) and keeps what they share."""
    try:
        samples = [_processed_image(processor, size) for size in _SAMPLE_SIZES]
    except Exception:  # a processor that cannot: no check rather than no images
        logger.warning(
            "could not learn this model's image tensors from its processor; preprocessed "
            "images are not checked against them",
            exc_info=True,
        )
        return None
    (first, first_embeds), (second, second_embeds) = samples
    dims = {
        key: tuple(a if a == b else None for a, b in zip(shape, second[key], strict=True))
        for key, shape in first.items()
        if key in second and len(shape) == len(second[key])
    }
    return ItemShape(dims, first_embeds if first_embeds == second_embeds else None)


def _processed_image(
    processor: Any, size: tuple[int, int]
) -> tuple[dict[str, tuple[int, ...]], int]:
    from PIL import Image
    from vllm.multimodal.processing.context import TimingContext

    seq_len = processor.info.ctx.model_config.max_model_len
    inputs = processor.get_dummy_inputs(seq_len=seq_len, mm_counts={"image": 1}, mm_options={})
    items = processor.info.parse_mm_data({"image": [Image.new("RGB", size)]}, validate=False)
    inputs = dataclasses.replace(inputs, mm_data_items=items, cache=None)
    out = processor.apply(inputs, TimingContext(enabled=False))
    item = out["mm_kwargs"]["image"][0]
    shapes = {
        key: tuple(elem.data.shape)
        for key, elem in item.items()
        if isinstance(elem.data, torch.Tensor)
    }
    return shapes, out["mm_placeholders"]["image"][0].get_num_embeds()


def _encoder_budget(vllm_config: Any) -> int:
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.encoder_budget import MultiModalBudget

    try:
        budget = MultiModalBudget(vllm_config, MULTIMODAL_REGISTRY, enable_cache=False)
        return max(int(budget.get_encoder_budget()), 0)
    except Exception:  # a figure for routers: never worth failing GetServerInfo over
        logger.warning("the engine's encoder budget could not be worked out", exc_info=True)
        return 0


@functools.cache
def shm_namespace() -> str:
    """Which shared memory this process sees: "<boot id>:<device of /dev/shm>".

    A router on the same host, or in a container sharing this one's
    /dev/shm, sees the same pair and may send tensors through shared memory.
    The boot id pins the host (it is not namespaced); the device, the tmpfs
    behind /dev/shm. Empty when either cannot be read.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot_id = f.read().strip()
        return f"{boot_id}:{os.stat(SHM_DIR).st_dev}"
    except OSError:
        return ""
