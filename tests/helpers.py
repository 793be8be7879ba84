"""The request helpers' former home, kept for test files that import them from here.

They live in the `support` package (`support.calls`, `support.probes`); import them from there.
"""

from support.calls import collect, completes, request, streamed_tokens
from support.probes import unfinished, wait_until_idle

from vllm_servicer.testing.tiny_model import build_tiny_engine as build_engine

__all__ = [
    "build_engine",
    "collect",
    "completes",
    "request",
    "streamed_tokens",
    "unfinished",
    "wait_until_idle",
]
