"""grpc.aio server interceptors: pass them to `grpc.aio.server(interceptors=...)`
or to `mount(..., interceptors=...)`; they behave the same in both places.
"""

from ._base import (
    Call,
    CallInterceptor,
    MethodFilter,
    all_methods,
    except_methods_of,
    methods_of,
    only_methods,
)
from .inflight import ENGINE_REQUESTS, InflightInterceptor
from .metrics import MetricsInterceptor, start_metrics_server

__all__ = [
    "ENGINE_REQUESTS",
    "Call",
    "CallInterceptor",
    "InflightInterceptor",
    "MethodFilter",
    "MetricsInterceptor",
    "all_methods",
    "except_methods_of",
    "methods_of",
    "only_methods",
    "start_metrics_server",
]
