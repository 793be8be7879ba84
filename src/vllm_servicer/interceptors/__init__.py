"""grpc.aio server interceptors: pass them to `mount(..., interceptors=...)`
or to `grpc.aio.server(interceptors=...)`; they behave the same in both places.

A stack of them runs from one wrapper per call: `mount` fuses its stack, and
`Pipeline([...])` fuses a server-wide one, the same way (`_wrapping.py`).
"""

from ._base import (
    CallInterceptor,
    MethodFilter,
    MountContext,
    all_methods,
    except_methods_of,
    methods_of,
    only_methods,
)
from ._call import Call, Refusal
from ._pipeline import Pipeline
from .api_keys import ApiKeyVerifier
from .auth import AuthInterceptor
from .inflight import ENGINE_REQUESTS, InflightInterceptor
from .keyless import KeylessLimitInterceptor, KeylessLimits
from .load_reports import LoadReportInterceptor
from .metrics import MetricsInterceptor, start_metrics_server

# Tracing needs the `otel` extra only when used: importing it here is safe.
from .tracing import TracingInterceptor, configure_tracing_from_env, served_model_name
from .verifiers import AllOf, AnyOf, CallableVerifier, MtlsVerifier, Verifier

__all__ = [
    "ENGINE_REQUESTS",
    "AllOf",
    "AnyOf",
    "ApiKeyVerifier",
    "AuthInterceptor",
    "CallableVerifier",
    "Call",
    "CallInterceptor",
    "InflightInterceptor",
    "KeylessLimitInterceptor",
    "KeylessLimits",
    "LoadReportInterceptor",
    "MethodFilter",
    "MetricsInterceptor",
    "MountContext",
    "MtlsVerifier",
    "Pipeline",
    "Refusal",
    "TracingInterceptor",
    "Verifier",
    "all_methods",
    "configure_tracing_from_env",
    "except_methods_of",
    "methods_of",
    "only_methods",
    "served_model_name",
    "start_metrics_server",
]
