"""Classify, score and rerank through vllm_servicer.v1.Pooling (a pooling model's server).

    python examples/rerank.py 127.0.0.1:50051
    python examples/rerank.py HOST:PORT --api-key KEY   # default: $VLLM_API_KEY

The server runs a classification model (a cross-encoder for Score and Rerank),
e.g. `vllm-servicer serve --model BAAI/bge-reranker-base --runner pooling`.
Prints one line per call, the call's name and its results as JSON:

    classify: [{"index":0,"label":"relevant","probs":[0.51]},...]
    score: [{"index":0,"score":0.51},...]
    rerank: [{"index":2,"relevance_score":0.52,"document":"..."},...]
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import grpc

from vllm_servicer.proto import pooling_pb2, pooling_pb2_grpc

QUERY = "What is the capital of France?"
DOCUMENTS = [
    "Paris is the capital and largest city of France.",
    "The Eiffel Tower was finished in 1889.",
    "Berlin is the capital of Germany.",
    "France borders Spain, Italy and Germany.",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("address", nargs="?", default="127.0.0.1:50051", help="HOST:PORT")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("VLLM_API_KEY"),
        help="for a server with authentication (default: $VLLM_API_KEY)",
    )
    return parser.parse_args(argv)


def show(name: str, results: list[dict[str, Any]]) -> None:
    print(f"{name}:", json.dumps(results, separators=(",", ":")), flush=True)


def main(args: argparse.Namespace) -> None:
    metadata = (("authorization", f"Bearer {args.api_key}"),) if args.api_key else None
    with grpc.insecure_channel(args.address) as channel:
        stub = pooling_pb2_grpc.PoolingStub(channel)

        # One label distribution per text.
        request = pooling_pb2.ClassifyRequest(input=[QUERY, DOCUMENTS[0]])
        classified = stub.Classify(request, timeout=60, metadata=metadata)
        show(
            "classify",
            [
                {"index": r.index, "label": r.label, "probs": list(r.probs)}
                for r in classified.results
            ],
        )

        # The query scored against each text, in the texts' order.
        request = pooling_pb2.ScoreRequest(text_1=QUERY, text_2=DOCUMENTS[:3])
        scored = stub.Score(request, timeout=60, metadata=metadata)
        show("score", [{"index": r.index, "score": r.score} for r in scored.results])

        # The three most relevant documents, most relevant first, with their text.
        request = pooling_pb2.RerankRequest(
            query=QUERY, documents=DOCUMENTS, top_n=3, return_documents=True
        )
        reranked = stub.Rerank(request, timeout=60, metadata=metadata)
        show(
            "rerank",
            [
                {"index": r.index, "relevance_score": r.relevance_score, "document": r.document}
                for r in reranked.results
            ],
        )


if __name__ == "__main__":
    try:
        main(parse_args())
    except grpc.RpcError as err:
        raise SystemExit(f"{err.code().name}: {err.details()}") from None
