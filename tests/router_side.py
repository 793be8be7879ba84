"""A router's side of image input, for tests: the model's own HF processor on a prompt and an image.

A router that preprocesses images expands the image placeholder in the token
ids and makes the pixel tensors itself; the tests send what it makes as
`mm_inputs`, to this server and to vLLM's own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_servicer.tiny_vlm import IMAGE_TOKEN

PROMPT = f"{IMAGE_TOKEN} What is in this picture?"
RED, BLUE = (255, 0, 0), (0, 0, 255)


@dataclasses.dataclass(frozen=True)
class Routed:
    """What a router sends for one image: expanded ids, pixels, the image's token range."""

    ids: list[int]
    pixels: bytes
    shape: list[int]
    offset: int
    length: int
    image_token: int


def solid_image(color: tuple[int, int, int]) -> Any:
    from PIL import Image

    return Image.new("RGB", (40, 50), color)


def router_preprocessor(vlm_dir: Path) -> Callable[[tuple[int, int, int]], Routed]:
    """`PROMPT` with one solid-colour image, as the model directory's processor makes it."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(vlm_dir))
    image_token = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)

    def run(color: tuple[int, int, int]) -> Routed:
        out = processor(text=PROMPT, images=solid_image(color), return_tensors="pt")
        ids = out["input_ids"][0].tolist()
        positions = [i for i, token in enumerate(ids) if token == image_token]
        assert positions == list(range(positions[0], positions[0] + len(positions)))
        pixels = out["pixel_values"].float().contiguous()
        return Routed(
            ids=ids,
            pixels=pixels.numpy().tobytes(),
            shape=list(pixels.shape),
            offset=positions[0],
            length=len(positions),
            image_token=image_token,
        )

    return run
