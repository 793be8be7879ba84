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
from .auth import AuthInterceptor
from .inflight import ENGINE_REQUESTS, InflightInterceptor
from .metrics import MetricsInterceptor, start_metrics_server

# Tracing needs the `otel` extra only when used: importing it here is safe.
from .tracing import TracingInterceptor, configure_tracing_from_env, served_model_name

__all__ = [
    "ENGINE_REQUESTS",
    "AuthInterceptor",
    "Call",
    "CallInterceptor",
    "InflightInterceptor",
    "MethodFilter",
    "MetricsInterceptor",
    "TracingInterceptor",
    "all_methods",
    "configure_tracing_from_env",
    "except_methods_of",
    "methods_of",
    "only_methods",
    "served_model_name",
    "start_metrics_server",
]
