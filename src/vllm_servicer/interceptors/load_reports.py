"""The engine's load report in every engine call's trailer: ORCA per-call reports (gRFC A51).

A client whose channel balances with gRPC's `weighted_round_robin` (gRFC A58),
or an Envoy with client-side weighted round robin, reads the trailer
`endpoint-load-metrics-bin` of each call it sent an endpoint and weighs the
endpoint by what it says, so that new calls go to the less-loaded replica.
`LoadReportInterceptor` adds that trailer (a serialized
`xds.data.orca.v3.OrcaLoadReport`, `load_reports.report.LoadReporter`'s cached one) to
every engine call (Generate and Embed, vllm.Inference's Generate and
GenerateStream) that ends OK, and counts each engine call's end, and whether it
failed by the server's fault, for the report's `rps_fractional` and `eps`. Only an engine call's end
does any work: nothing per streamed message.

A call that fails is aborted with its status at once, before this hook runs:
it carries no report, but counts in `eps`. `mount()` places the interceptor
just outside the in-flight limit, so a call refused there (RESOURCE_EXHAUSTED)
counts as failed, and inside authentication, so a caller without a key gets no
report.
"""

from __future__ import annotations

import grpc

from ..context import caller_at_fault
from ..load_reports.report import LoadReporter
from ._base import CallInterceptor, MethodFilter
from ._call import Call
from .inflight import ENGINE_REQUESTS

__all__ = ["FAILED_CODES", "LoadReportInterceptor"]

_OK = grpc.StatusCode.OK

FAILED_CODES: frozenset[grpc.StatusCode] = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)
"""The ends that count as the server's errors in `eps`: it failed or was full.

A balancer's penalty for errors keeps a replica that fails fast from drawing
calls for its short answers. A client's mistakes (INVALID_ARGUMENT,
NOT_FOUND, ALREADY_EXISTS, PERMISSION_DENIED, UNIMPLEMENTED for a field this
server does not serve, ...), its cancels and its own deadlines (DEADLINE_EXCEEDED:
the client chose how long; a tenant sending 0.1 s deadlines would otherwise
mark a healthy replica failing; a slow replica shows in its utilization and
queue instead) are not the replica's fault, nor
is a refusal marked as the caller's own (`context.blame_caller`: a tenant
past its share, a request message never sent): one tenant's refused calls
would otherwise steer every tenant's traffic away from a healthy replica.
"""


class LoadReportInterceptor(CallInterceptor):
    """Sends `reporter`'s report in the trailer of each engine call that ends OK.

    Args:
        reporter: the engine's cached load report (`MountState.load_reporter`).
        methods: the calls that carry a report and count in its rates
            (default: the calls counted in flight, `proto.COUNTED_METHODS`).
    """

    def __init__(self, reporter: LoadReporter, *, methods: MethodFilter = ENGINE_REQUESTS) -> None:
        super().__init__(methods=methods)
        self.reporter = reporter

    def on_finish(self, call: Call) -> None:
        reporter = self.reporter
        code = call.code
        reporter.call_ended(code in FAILED_CODES and not caller_at_fault())
        if code is not _OK:
            return  # aborted: the status and its trailers are sent already
        context = call.context
        trailer = reporter.trailer()
        handlers = context.trailing_metadata()  # what the handler set, kept
        context.set_trailing_metadata((*handlers, *trailer) if handlers else trailer)
