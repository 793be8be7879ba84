"""A router's side of image input, for tests: the model's own HF processor on a prompt and an image.

A router that preprocesses images expands the image placeholder in the token
ids and makes the pixel tensors itself; the tests send what it makes as
`mm_inputs`, to this server and to vLLM's own.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_servicer.testing.tiny_vlm import IMAGE_TOKEN

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


def router_request(routed: Routed, request_id: str, *, content_hash: bool = False) -> Any:
    """The GenerateRequest a router sends for `routed`, built with the reference's stubs.

    `content_hash`: also send the image's `mm_hashes` entry (a sha256 of its
    pixels), which vLLM's own server keys its caches by.
    """
    from smg_grpc_proto.generated import common_pb2 as ref_common
    from smg_grpc_proto.generated import vllm_engine_pb2 as ref

    return ref.GenerateRequest(
        request_id=request_id,
        tokenized=ref.TokenizedInput(input_ids=routed.ids),
        sampling_params=ref.SamplingParams(temperature=0.0, max_tokens=8),
        mm_inputs=ref.MultimodalInputs(
            pixel_values=ref.TensorData(inline=routed.pixels, shape=routed.shape, dtype="float32"),
            im_token_id=routed.image_token,
            mm_placeholders=[ref.PlaceholderRange(offset=routed.offset, length=routed.length)],
            mm_hashes=["router-sha256:" + hashlib.sha256(routed.pixels).hexdigest()]
            if content_hash
            else [],
            batched_keys=["pixel_values"],
            modality=ref_common.IMAGE,
        ),
    )


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
