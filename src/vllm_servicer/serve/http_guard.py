"""vLLM's HTTP API behind the one engine guard: its engine client, wrapped.

vLLM's OpenAI app runs every generation and embedding through the engine
client it is handed (`generate`, `encode`) and asks `check_admission` before
it answers a stream's headers. The app gets `GuardedEngine` instead of the
launcher's `AsyncLLM`: each request's id (`cmpl-<X-Request-Id>-0` and the
like) is claimed for the HTTP caller in the registry the gRPC protocols use,
and counted against `--max-inflight`, from the engine call to its end.

Refusals take vLLM's own error mapping: an id another caller runs is a
`GracefulHTTPError` with 409 Conflict (gRPC's ALREADY_EXISTS), the in-flight
limit or the caller's fair share of it a 503, as vLLM answers its own queue
limit (`QueueOverflowError`, whose fixed message cannot name the limit).
Asked before a stream starts they are the status line; a request that loses
a race between the check and the claim ends its stream with vLLM's error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncGenerator, Callable, Iterator
from http import HTTPStatus
from typing import Any

from vllm.exceptions import GracefulHTTPError

from ..context import Identity
from ..errors import RequestIdInUseError
from ..guard import EngineGuard, ServerBusyError

__all__ = ["HTTP_CALLER", "GuardedEngine"]

HTTP_CALLER = Identity(name="http-api", kind="http")
"""Who an HTTP request runs for when the HTTP API checks no keys: one caller,
apart from every gRPC one (its ids are not theirs to share or abort)."""


class RequestIdConflictError(GracefulHTTPError):
    """The request's id runs for another caller: 409, as gRPC's ALREADY_EXISTS."""

    def __init__(self, message: str) -> None:
        super().__init__(message, HTTPStatus.CONFLICT)


class InflightLimitError(GracefulHTTPError):
    """`--max-inflight` requests run already, or the caller holds its share of
    them: 503, as vLLM's own queue limit."""

    def __init__(self, message: str) -> None:
        super().__init__(message, HTTPStatus.SERVICE_UNAVAILABLE)


@contextlib.contextmanager
def _as_http_errors() -> Iterator[None]:
    try:
        yield
    except RequestIdInUseError as exc:
        raise RequestIdConflictError(str(exc)) from exc
    except ServerBusyError as exc:
        raise InflightLimitError(str(exc)) from exc


class GuardedEngine:
    """The engine client handed to vLLM's HTTP app: the engine, every request guarded.

    Everything but `generate`, `encode` and `check_admission` is the engine's own.

    Args:
        engine: the launcher's `AsyncLLM`.
        guard: the mount's `EngineGuard`.
    """

    def __init__(self, engine: Any, guard: EngineGuard) -> None:
        self._engine = engine
        self._guard = guard

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        """vLLM's admission check, the in-flight limit and the caller's share first
        (503 past any).

        `n` counts sequences (a request's `n`), the limit engine requests, as
        a gRPC Generate with `n` > 1 takes one slot: one free slot admits it.
        """
        with _as_http_errors():
            self._guard.check_room()
        self._engine.check_admission(n, request_id)

    def generate(
        self, prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kwargs: Any
    ) -> AsyncGenerator[Any, None]:
        start = functools.partial(
            self._engine.generate, prompt, sampling_params, request_id, *args, **kwargs
        )
        return self._guarded("HTTP generate", request_id, start)

    def encode(
        self, prompt: Any, pooling_params: Any, request_id: str, *args: Any, **kwargs: Any
    ) -> AsyncGenerator[Any, None]:
        start = functools.partial(
            self._engine.encode, prompt, pooling_params, request_id, *args, **kwargs
        )
        return self._guarded("HTTP encode", request_id, start)

    def _guarded(
        self, method: str, request_id: str, start: Callable[[], AsyncGenerator[Any, None]]
    ) -> AsyncGenerator[Any, None]:
        # Checked at once: vLLM calls this before it answers a stream's
        # headers, so a refusal is the status line, not an event in a 200.
        with _as_http_errors():
            self._guard.check(request_id, method)
        return self._held(method, request_id, start)

    async def _held(
        self, method: str, request_id: str, start: Callable[[], AsyncGenerator[Any, None]]
    ) -> AsyncGenerator[Any, None]:
        # Held from the first read (a generator never read holds nothing)
        # until it ends, fails or is closed (vLLM's handler closes it when
        # the client goes). The engine's stream is closed here, so that the
        # engine aborts the request before the id and slot are let go.
        with contextlib.ExitStack() as held:
            with _as_http_errors():
                held.enter_context(self._guard.hold(request_id, method))
            try:
                async with contextlib.aclosing(start()) as outputs:
                    async for output in outputs:
                        yield output
            except asyncio.CancelledError:
                await self._guard.running.abort_cancelled(self._engine, request_id)
                raise
