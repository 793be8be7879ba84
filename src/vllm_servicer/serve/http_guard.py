"""vLLM's HTTP API behind the one engine guard: its engine client, wrapped.

vLLM's OpenAI app runs every generation and embedding through the engine
client it is handed (`generate`, `encode`) and asks `check_admission` before
it answers a stream's headers. The app gets `GuardedEngine` instead of the
launcher's `AsyncLLM`: each request's id (`cmpl-<X-Request-Id>-0` and the
like) is claimed for the HTTP caller in the registry the gRPC protocols use,
and counted against `--max-inflight`, from the engine call to its end.

Each generation's sampling parameters meet the per-request budgets the gRPC
protocols check on their own messages (the stop strings, vLLM having parsed
`stop` of completions and chat alike), before the engine sees them.

Refusals take vLLM's own error mapping: an id another caller runs is a
`GracefulHTTPError` with 409 Conflict (gRPC's ALREADY_EXISTS), the in-flight
limit a 503, as vLLM answers its own queue limit (`QueueOverflowError`, whose
fixed message cannot name the limit), a request past a budget a 400 naming
the field (`stop: ...`) and the flag.
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

from ..budgets import RequestBudgets
from ..context import Identity
from ..errors import InvalidRequestError, RequestIdInUseError, TableFullError
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
    """`--max-inflight` requests run already: 503, as vLLM's own queue limit."""

    def __init__(self, message: str) -> None:
        super().__init__(message, HTTPStatus.SERVICE_UNAVAILABLE)


class BudgetRefusalError(GracefulHTTPError):
    """The request passes a per-request budget: 400, as gRPC's INVALID_ARGUMENT."""

    def __init__(self, message: str) -> None:
        super().__init__(message, HTTPStatus.BAD_REQUEST)


@contextlib.contextmanager
def _as_http_errors() -> Iterator[None]:
    try:
        yield
    except InvalidRequestError as exc:
        raise BudgetRefusalError(str(exc)) from exc
    except RequestIdInUseError as exc:
        raise RequestIdConflictError(str(exc)) from exc
    except (ServerBusyError, TableFullError) as exc:
        raise InflightLimitError(str(exc)) from exc


class GuardedEngine:
    """The engine client handed to vLLM's HTTP app: the engine, every request guarded.

    Everything but `generate`, `encode` and `check_admission` is the engine's own.

    Args:
        engine: the launcher's `AsyncLLM`.
        guard: the mount's `EngineGuard`.
        budgets: the per-request budgets the gRPC protocols keep too.
    """

    def __init__(
        self, engine: Any, guard: EngineGuard, budgets: RequestBudgets | None = None
    ) -> None:
        self._engine = engine
        self._guard = guard
        self._budgets = budgets if budgets is not None else RequestBudgets()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        """vLLM's admission check, the in-flight limit first (503 past either).

        `n` counts sequences (a request's `n`), the limit engine requests, as
        a gRPC Generate with `n` > 1 takes one slot: one free slot admits it.
        """
        with _as_http_errors():
            self._guard.check_room()
        self._engine.check_admission(n, request_id)

    def generate(
        self, prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kwargs: Any
    ) -> AsyncGenerator[Any, None]:
        # Before the engine's output handler matches each stop string against
        # each new token, on this event loop.
        with _as_http_errors():
            self._budgets.check_stop("stop", getattr(sampling_params, "stop", None) or ())
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
