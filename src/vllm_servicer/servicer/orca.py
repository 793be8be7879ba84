"""ORCA's out-of-band load reports (`xds.service.orca.v3.OpenRcaService`).

`OpenRcaServicer.StreamCoreMetrics` sends the report (`load_reports.report.LoadReporter`)
every `report_interval` the client asks for, at least `MIN_REPORT_INTERVAL_SECONDS`
apart (gRFC A51 lets a server hold a client to a minimum). gRPC's
`weighted_round_robin` asks for it with `"enableOobLoadReport": true`, one
stream per connection, so that a replica's weight follows its load between
calls too: long streams end seldom, and a per-call report comes only when one does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from ..load_reports.report import LoadReporter
from ..proto import orca_load_report_pb2, orca_pb2, orca_pb2_grpc

if TYPE_CHECKING:
    import grpc.aio

    Context = grpc.aio.ServicerContext[Any, Any]

MIN_REPORT_INTERVAL_SECONDS = 1.0
"""The shortest time between two reports on one out-of-band stream."""


class OpenRcaServicer(orca_pb2_grpc.OpenRcaServiceServicer):
    """Serves `xds.service.orca.v3.OpenRcaService`: the load report on a stream.

    `request_cost_names` is ignored: the reports carry no request costs.

    Args:
        reporter: the mount's load report, shared with the per-call trailers.
        min_interval: the shortest time between two reports on one stream.
    """

    def __init__(
        self, reporter: LoadReporter, *, min_interval: float = MIN_REPORT_INTERVAL_SECONDS
    ) -> None:
        self._reporter = reporter
        self._min_interval = min_interval

    async def StreamCoreMetrics(
        self, request: orca_pb2.OrcaLoadReportRequest, context: Context
    ) -> AsyncIterator[orca_load_report_pb2.OrcaLoadReport]:
        asked = request.report_interval.ToTimedelta().total_seconds()
        interval = max(asked, self._min_interval)
        while True:
            yield await self._reporter.fresh_report()
            await asyncio.sleep(interval)
