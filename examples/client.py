"""Call a vllm-servicer (or any vLLM gRPC) server: stream the text of a prompt's completion.

    python examples/client.py                       # 127.0.0.1:50051, "Hello, world"
    python examples/client.py HOST:PORT "A prompt" --max-tokens 32
    python examples/client.py --ids                  # token ids instead of text

The text is decoded here with the model's own tokenizer, fetched from the
server once through GetTokenizer. With authentication on, pass the key in
$VLLM_API_KEY (or --api-key).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import io
import os
import tempfile
import zipfile
from typing import Any

import grpc

from vllm_servicer.proto import common_pb2, vllm_engine_pb2_grpc
from vllm_servicer.proto import vllm_engine_pb2 as pb


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("address", nargs="?", default="127.0.0.1:50051", help="HOST:PORT")
    parser.add_argument("prompt", nargs="?", default="Hello, world")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--ids", action="store_true", help="print token ids, not text")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("VLLM_API_KEY"),
        help="for a server with authentication (default: $VLLM_API_KEY)",
    )
    return parser.parse_args(argv)


async def fetch_tokenizer(stub: vllm_engine_pb2_grpc.VllmEngineStub, metadata: Any) -> Any:
    """The server's tokenizer files (one zip, streamed in chunks), loaded with transformers."""
    from transformers import AutoTokenizer

    data, digest = io.BytesIO(), ""
    async for chunk in stub.GetTokenizer(common_pb2.GetTokenizerRequest(), metadata=metadata):
        data.write(chunk.data)
        digest = chunk.sha256 or digest
    if hashlib.sha256(data.getvalue()).hexdigest() != digest:
        raise SystemExit("the tokenizer arrived damaged (sha256 mismatch)")
    folder = tempfile.mkdtemp(prefix="tokenizer-")
    zipfile.ZipFile(data).extractall(folder)
    return AutoTokenizer.from_pretrained(folder)


async def main(args: argparse.Namespace) -> None:
    metadata = (("authorization", f"Bearer {args.api_key}"),) if args.api_key else None
    async with grpc.aio.insecure_channel(args.address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        info = await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata)
        print("model:", info.served_model_name, flush=True)
        tokenizer = None if args.ids else await fetch_tokenizer(stub, metadata)
        request = pb.GenerateRequest(
            request_id=f"client-{os.getpid()}",
            text=args.prompt,
            stream=True,
            sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=args.max_tokens),
        )
        ids: list[int] = []
        shown = ""
        async for response in stub.Generate(request, timeout=60, metadata=metadata):
            if not response.HasField("chunk"):
                end = "\n" if shown else ""
                print(f"{end}finish_reason:", response.complete.finish_reason, flush=True)
            elif tokenizer is None:
                print("tokens:", list(response.chunk.token_ids), flush=True)
            else:
                # Decoded as a whole each time: a character can span two tokens.
                ids.extend(response.chunk.token_ids)
                text = tokenizer.decode(ids, skip_special_tokens=True)
                print(text[len(shown) :], end="", flush=True)
                shown = text


if __name__ == "__main__":
    try:
        asyncio.run(main(parse_args()))
    except grpc.aio.AioRpcError as err:
        raise SystemExit(f"{err.code().name}: {err.details()}") from None
