"""Prometheus metrics for the RPCs, and for generation as seen at the RPC edge.

Two families:

- grpc-ecosystem server metrics (the names go-grpc-prometheus and
  py-grpc-prometheus export, so existing dashboards work): started, handled
  (by `grpc_code`), messages received and sent, and handling time, with labels
  `grpc_type`, `grpc_service`, `grpc_method`.
- `vllm_servicer_*` generation metrics for Generate, from what its
  responses carried as they left (`vllm_servicer.wire.usage`): time to first token, time per
  output token, request duration, prompt and generated tokens, finish
  reasons, cancellations by cause, engine requests in flight, and whether
  the server drains. Each documents the OpenTelemetry GenAI instrument it
  matches, if any, and carries a
  `model_name` label (the served model name), as vLLM's own `vllm:*` series
  do, so the two families join in a query.

The metrics live in the registry given (default: prometheus_client's global
REGISTRY), so a host that already exposes a registry gets them there; see
`start_metrics_server` for serving one on a port. docs/metrics.md lists every
series.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import os
import time
from typing import TYPE_CHECKING, Any

import grpc
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import start_http_server

from ..context import shared_usage
from ..proto import COUNTED_METHODS, GENERATION_METHODS
from ..wire import usage as generation_usage
from ._base import CallInterceptor, InflightCount, MethodFilter, MountContext, all_methods
from ._call import Call

if TYPE_CHECKING:
    import threading
    from wsgiref.simple_server import WSGIServer

    from ..load_reports.report import LoadReporter

GRPC_TYPES = {
    "unary_unary": "unary",
    "unary_stream": "server_stream",
    "stream_unary": "client_stream",
    "stream_stream": "bidi_stream",
}
"""grpc-ecosystem's `grpc_type` label value for each handler kind."""

HANDLING_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
"""grpc-ecosystem's default buckets (they stop at 10 s) extended to 10 minutes for LLM streams."""

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip
"""OTel GenAI advisory boundaries for gen_ai.server.time_to_first_token."""

TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
"""OTel GenAI advisory boundaries for gen_ai.server.time_per_output_token."""

REQUEST_DURATION_BUCKETS = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
)  # fmt: skip
"""OTel GenAI advisory boundaries for gen_ai.server.request.duration."""

FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
CANCEL_CAUSES = ("client_cancel", "deadline", "abort_rpc", "shutdown")

_GRPC_LABELS = ("grpc_type", "grpc_service", "grpc_method")
# vLLM's own label name for the served model: the series join on it.
_MODEL = ("model_name",)
# prometheus_client's multiprocess mode (`serve --api-server-count`), which it
# reads from the environment once, at import.
_MULTIPROCESS = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
_OK = grpc.StatusCode.OK
_CANCELLED = grpc.StatusCode.CANCELLED
# How stale the message and token counters of a running Generate stream may get.
_COUNT_INTERVAL_S = 1.0
_DEADLINE = grpc.StatusCode.DEADLINE_EXCEEDED


@dataclasses.dataclass(frozen=True)
class _Series:
    """One metric `MetricsInterceptor` exports: the attribute that holds it, and
    its Prometheus declaration."""

    attribute: str
    kind: type[Counter] | type[Histogram] | type[Gauge]
    name: str
    help: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] | None = None
    # With several frontend processes (prometheus multiprocess mode): how the
    # live processes' values combine.
    multiprocess_mode: str | None = None

    def create(self, registry: CollectorRegistry) -> Counter | Histogram | Gauge:
        """The metric, registered in `registry`."""
        extra: dict[str, Any] = {}
        if self.buckets is not None:
            extra["buckets"] = self.buckets
        if self.multiprocess_mode is not None:
            extra["multiprocess_mode"] = self.multiprocess_mode
        return self.kind(self.name, self.help, self.labels, registry=registry, **extra)


_SERIES = (
    # grpc-ecosystem names (go-grpc-prometheus); prometheus_client adds `_total`.
    _Series(
        "started",
        Counter,
        "grpc_server_started",
        "Total number of RPCs started on the server.",
        _GRPC_LABELS,
    ),
    _Series(
        "handled",
        Counter,
        "grpc_server_handled",
        "Total number of RPCs completed on the server, regardless of success or failure.",
        (*_GRPC_LABELS, "grpc_code"),
    ),
    _Series(
        "msg_received",
        Counter,
        "grpc_server_msg_received",
        "Total number of RPC stream messages received on the server.",
        _GRPC_LABELS,
    ),
    _Series(
        "msg_sent",
        Counter,
        "grpc_server_msg_sent",
        "Total number of gRPC stream messages sent by the server.",
        _GRPC_LABELS,
    ),
    _Series(
        "handling_seconds",
        Histogram,
        "grpc_server_handling_seconds",
        "Histogram of response latency (seconds) of gRPC that had been application-level "
        "handled by the server.",
        _GRPC_LABELS,
        buckets=HANDLING_BUCKETS,
    ),
    # Generation, measured at the RPC edge.
    _Series(
        "time_to_first_token",
        Histogram,
        "vllm_servicer_time_to_first_token_seconds",
        "Time from the start of a streaming Generate call to its first output token "
        "leaving the servicer (OTel: gen_ai.server.time_to_first_token).",
        _MODEL,
        buckets=TTFT_BUCKETS,
    ),
    _Series(
        "time_per_output_token",
        Histogram,
        "vllm_servicer_time_per_output_token_seconds",
        "Per streaming Generate call that ended OK: time from its first output token "
        "to its last, per token after the first (OTel: gen_ai.server.time_per_output_token).",
        _MODEL,
        buckets=TPOT_BUCKETS,
    ),
    _Series(
        "request_duration",
        Histogram,
        "vllm_servicer_request_duration_seconds",
        "Duration of Generate calls, however they ended (OTel: gen_ai.server.request.duration).",
        _MODEL,
        buckets=REQUEST_DURATION_BUCKETS,
    ),
    _Series(
        "prompt_tokens",
        Counter,
        "vllm_servicer_prompt_tokens",
        "Prompt tokens of Generate calls (OTel: gen_ai.client.token.usage, "
        "gen_ai.token.type=input).",
        _MODEL,
    ),
    _Series(
        "generation_tokens",
        Counter,
        "vllm_servicer_generation_tokens",
        "Output tokens sent by Generate calls (OTel: gen_ai.client.token.usage, "
        "gen_ai.token.type=output).",
        _MODEL,
    ),
    _Series(
        "request_finish",
        Counter,
        "vllm_servicer_request_finish",
        "Generate choices finished, by finish_reason "
        "(OTel attribute gen_ai.response.finish_reasons).",
        (*_MODEL, "finish_reason"),
    ),
    _Series(
        "request_cancelled",
        Counter,
        "vllm_servicer_request_cancelled",
        "Generate calls ended early, by cause: client_cancel, deadline, abort_rpc "
        "(finish_reason abort), shutdown.",
        (*_MODEL, "cause"),
    ),
    _Series(
        "requests_in_flight",
        Gauge,
        "vllm_servicer_requests_in_flight",
        "Engine calls in flight (every protocol's generation and embedding, and the "
        "HTTP API's under --http-port), as GetServerInfo's active_requests "
        "(no OTel GenAI instrument).",
        _MODEL,
        multiprocess_mode="livesum",  # the sum over the live processes
    ),
    _Series(
        "draining",
        Gauge,
        "vllm_servicer_draining",
        "1 from the start of a drain (mark_shutdown(): health NOT_SERVING, then new calls "
        "refused) to the end of the process, else 0.",
        _MODEL,
        multiprocess_mode="livemax",
    ),
    _Series(
        "orca_utilization",
        Gauge,
        "vllm_servicer_orca_application_utilization",
        "The application_utilization of the ORCA load report balancers read "
        "(the larger of KV-cache usage and running + waiting sequences over "
        "max_num_seqs), as of the last report; absent without load reports.",
        _MODEL,
        multiprocess_mode="livemax",
    ),
)
"""Every metric `MetricsInterceptor` exports, in registration order."""


class _MethodMetrics:
    """The labelled children of one method, bound once and reused by every call."""

    __slots__ = (
        "engine",
        "generate",
        "handled",
        "handling",
        "labels",
        "received",
        "sent",
        "started",
    )

    def __init__(self, owner: MetricsInterceptor, call: Call) -> None:
        self.labels = (GRPC_TYPES[call.kind], call.service, call.name)
        self.started = owner.started.labels(*self.labels)
        self.received = owner.msg_received.labels(*self.labels)
        self.sent = owner.msg_sent.labels(*self.labels)
        self.handling = owner.handling_seconds.labels(*self.labels)
        self.handled: dict[grpc.StatusCode, Counter] = {}
        self.engine = call.method in COUNTED_METHODS
        self.generate = call.method in GENERATION_METHODS


class _GenerateCall(generation_usage.UsageReader):
    """Per-call state of one Generate call: its usage (read once a second and at
    the end) and what was counted of it."""

    __slots__ = (
        "counted_messages",
        "counted_tokens",
        "method",
        "prompt_counted",
        "running",
        "started",
        "ttft_observed",
    )

    generate = True

    def __init__(self, method: _MethodMetrics, started: float, running: set[_GenerateCall]) -> None:
        self.method = method
        self.started = started
        self.running = running  # the running calls of its event loop
        super().__init__(shared_usage())
        self.counted_messages = 0
        self.counted_tokens = 0
        self.prompt_counted = False
        self.ttft_observed = False


class MetricsInterceptor(CallInterceptor):
    """Exports grpc-ecosystem RPC metrics and generation metrics to Prometheus.

    Pass the same object to `grpc.aio.server(interceptors=[...])` or to
    `mount(..., interceptors=[...])`. Metrics are created here, in
    `registry`: two instances on separate `CollectorRegistry` objects never
    collide (two on the same registry do, as with any Prometheus metric).

    Args:
        registry: where the metrics are registered. Default: prometheus_client's
            global REGISTRY (what `start_http_server` and most frameworks
            expose). Pass the registry your process already exposes to add
            these series to it, or a fresh `CollectorRegistry()` and serve it
            with `start_metrics_server(port, registry=...)`.
        methods: which methods are measured (default: every method). The
            generation metrics are always about Generate only.
        model_name: the `model_name` label of the `vllm_servicer_*` series:
            the name the engine serves, as vLLM's own series label it
            (`vllm_servicer.engine.served_model_name(engine)`). Default: empty,
            which Prometheus treats as no label.
    """

    # Created from `_SERIES`, one attribute per metric.
    started: Counter
    handled: Counter
    msg_received: Counter
    msg_sent: Counter
    handling_seconds: Histogram
    time_to_first_token: Histogram
    time_per_output_token: Histogram
    request_duration: Histogram
    prompt_tokens: Counter
    generation_tokens: Counter
    request_finish: Counter
    request_cancelled: Counter
    requests_in_flight: Gauge
    draining: Gauge
    orca_utilization: Gauge

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        methods: MethodFilter = all_methods,
        model_name: str = "",
    ) -> None:
        super().__init__(methods=methods)
        reg = REGISTRY if registry is None else registry
        self.registry = reg
        self.model_name = model_name
        self._shutting_down = False
        self._methods: dict[str, _MethodMetrics] = {}
        # Generate calls running, per event loop, each loop's counted once a
        # second by a timer of its own (see _count_running).
        self._running: dict[asyncio.AbstractEventLoop, set[_GenerateCall]] = {}

        for series in _SERIES:
            setattr(self, series.attribute, series.create(reg))
        # Bound once: the model is fixed per instance, so the hot path below
        # never calls .labels() (a lookup under a lock).
        model = model_name
        self._finish_children = {r: self.request_finish.labels(model, r) for r in FINISH_REASONS}
        self._cancel_children = {c: self.request_cancelled.labels(model, c) for c in CANCEL_CAUSES}
        self._ttft_observe = self.time_to_first_token.labels(model).observe
        self._tpot_observe = self.time_per_output_token.labels(model).observe
        self._duration_observe = self.request_duration.labels(model).observe
        self._prompt_inc = self.prompt_tokens.labels(model).inc
        self._generation_inc = self.generation_tokens.labels(model).inc
        self._in_flight = self.requests_in_flight.labels(model)
        self._counts_in_flight = True
        self._draining = self.draining.labels(model)
        self._draining.set(0)
        self._model = model
        self._orca: Gauge | None = None  # the gauge's child, once a load report is read
        self._reporter: LoadReporter | None = None

    def on_mount(self, mount: MountContext) -> None:
        """Report the mount's in-flight count, and its load reports' utilization."""
        self.read_in_flight_from(mount.inflight)
        if mount.load_reporter is not None:
            self.read_load_reports_from(mount.load_reporter)

    def read_in_flight_from(self, inflight: InflightCount) -> None:
        """Report the calls `inflight` counts as in flight instead of counting them again.

        `mount()` does this (`on_mount`) with the count it keeps, which the drain,
        GetServerInfo and the limit read too: one number everywhere.
        """
        if _MULTIPROCESS:
            return  # a function's value is never written where the scrape reads: count
        self._counts_in_flight = False
        self._in_flight.set_function(lambda: inflight.limited_total)

    def read_load_reports_from(self, reporter: LoadReporter) -> None:
        """Report `reporter`'s utilization, what balancers read, as a gauge.

        Read at each scrape; with several frontend processes, where a
        function's value never reaches the scrape, set as each engine call ends.
        """
        self._orca = self.orca_utilization.labels(self._model)
        if _MULTIPROCESS:
            self._reporter = reporter
            return
        self._orca.set_function(lambda: reporter.report().application_utilization)

    def mark_shutdown(self) -> None:
        """From now on, count cancelled and aborted Generate calls as `shutdown`.

        The call alone cannot tell a shutdown from a client cancel: the
        launcher calls this before it drains and stops the server. The
        `vllm_servicer_draining` gauge reads 1 from then on.
        """
        self._shutting_down = True
        self._draining.set(1)

    # ----- hooks ----------------------------------------------------------------

    async def on_start(self, call: Call) -> None:
        method = self._methods.get(call.method)
        if method is None:
            method = self._methods[call.method] = _MethodMetrics(self, call)
        method.started.inc()
        if method.engine and self._counts_in_flight:
            self._in_flight.inc()
        if method.generate:
            loop = asyncio.get_running_loop()
            running = self._running.get(loop)
            if running is None:
                running = self._running[loop] = set()
                self._count_later(loop)
            state = _GenerateCall(method, call.started, running)
            running.add(state)
            call.state = state
        else:
            call.state = method

    def on_request(self, call: Call, message: object) -> None:
        state = call.state
        (state.method if state.generate else state).received.inc()

    def reads_responses(self, call: Call) -> bool:
        state = call.state
        return not state.generate or state.reads_messages

    def on_response(self, call: Call, message: object) -> None:
        state = call.state
        if state.generate:
            state.read(message)
        else:
            state.sent.inc()

    def on_finish(self, call: Call) -> None:
        state = call.state
        if state is None:  # on_start never ran
            return
        now = time.perf_counter()
        method: _MethodMetrics = state.method if state.generate else state
        code = call.code
        assert code is not None
        handled = method.handled.get(code)
        if handled is None:
            handled = method.handled[code] = self.handled.labels(*method.labels, code.name)
        handled.inc()
        method.handling.observe(now - call.started)
        if method.engine:
            if self._counts_in_flight:
                self._in_flight.dec()
            if self._reporter is not None and self._orca is not None:
                self._orca.set(self._reporter.report().application_utilization)
        if not state.generate:
            return
        state.running.discard(state)
        self._count(state)
        self._duration_observe(now - call.started)
        usage = state.usage
        if code is _OK and usage.streamed and usage.tokens_after_first:
            # Once per call, as OTel's GenAI conventions define it.
            per_token = usage.last_token_at - usage.first_token_at
            self._tpot_observe(per_token / usage.tokens_after_first)
        aborted = False
        for reason in usage.finish_reasons.values():
            child = self._finish_children.get(reason)
            if child is None:
                child = self._finish_children[reason] = self.request_finish.labels(
                    self.model_name, reason
                )
            child.inc()
            aborted = aborted or reason == "abort"
        cause = None
        if code is _CANCELLED:
            cause = "shutdown" if self._shutting_down else "client_cancel"
        elif code is _DEADLINE:
            cause = "deadline"
        elif aborted:
            cause = "shutdown" if self._shutting_down else "abort_rpc"
        if cause is not None:
            self._cancel_children[cause].inc()

    # ----- Generate -------------------------------------------------------------

    def _count_later(self, loop: asyncio.AbstractEventLoop) -> None:
        # In an empty context: the timer must not keep a call's context alive.
        loop.call_later(_COUNT_INTERVAL_S, self._count_running, loop, context=contextvars.Context())

    def _count_running(self, loop: asyncio.AbstractEventLoop) -> None:
        """Brings the counters up to date with `loop`'s running Generate calls, once a second."""
        running = self._running.get(loop)
        if not running:
            self._running.pop(loop, None)  # the next call on this loop starts a timer again
            return
        for state in running:
            self._count(state)
        self._count_later(loop)

    def _count(self, state: _GenerateCall) -> None:
        """Adds what `state`'s call sent since it was last counted to the shared metrics."""
        usage = state.usage
        if not state.prompt_counted and usage.prompt_tokens >= 0:
            state.prompt_counted = True
            self._prompt_inc(usage.prompt_tokens)
        if not state.ttft_observed and usage.streamed and usage.first_token_at:
            state.ttft_observed = True
            self._ttft_observe(usage.first_token_at - state.started)
        messages = usage.messages - state.counted_messages
        if messages:
            state.counted_messages = usage.messages
            state.method.sent.inc(messages)
        tokens = usage.output_tokens - state.counted_tokens
        if tokens:
            state.counted_tokens = usage.output_tokens
            self._generation_inc(tokens)


def start_metrics_server(
    port: int, addr: str = "127.0.0.1", registry: CollectorRegistry | None = None
) -> tuple[WSGIServer, threading.Thread]:
    """Serve a registry's metrics over HTTP (`/metrics`) from a background thread.

    A thin wrapper over prometheus_client's `start_http_server` that defaults
    to loopback rather than every interface.

    Args:
        port: the TCP port; 0 picks a free one (read it from `server.server_port`).
        addr: the address to bind.
        registry: the registry to serve (default: the global REGISTRY).

    Returns:
        The HTTP server and its thread; `server.shutdown()` stops it.
    """
    server, thread = start_http_server(
        port, addr=addr, registry=REGISTRY if registry is None else registry
    )
    return server, thread
