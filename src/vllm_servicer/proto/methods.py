"""The served services' names and what each method is to the layers around it.

One table (`METHOD_ROLES`), read from the proto descriptors: the in-flight
count and limit, the metrics and tracing (which calls run on the engine,
which generate) and authorization (which methods are an administrator's)
all ask it, and so do the roles (which methods are an administrator's, which
a router's), so none of them names a protocol's methods itself. A method of a
new protocol gets its role here, or has none.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType

from google.protobuf.descriptor import ServiceDescriptor

from . import control_pb2, inference_pb2, orca_pb2, pooling_pb2, render_pb2, vllm_engine_pb2

_ENGINE = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"]
_INFERENCE = inference_pb2.DESCRIPTOR.services_by_name["Inference"]
_CONTROL = control_pb2.DESCRIPTOR.services_by_name["Control"]
_ORCA = orca_pb2.DESCRIPTOR.services_by_name["OpenRcaService"]
_POOLING = pooling_pb2.DESCRIPTOR.services_by_name["Pooling"]
_RENDER = render_pb2.DESCRIPTOR.services_by_name["Render"]

VLLM_ENGINE_SERVICE: str = _ENGINE.full_name
"""vLLM's gRPC engine protocol (`vllm.grpc.engine.VllmEngine`)."""
SERVICE_NAME: str = VLLM_ENGINE_SERVICE
"""`VLLM_ENGINE_SERVICE` by its first name, from when it was the one protocol served."""
INFERENCE_SERVICE: str = _INFERENCE.full_name
CONTROL_SERVICE: str = _CONTROL.full_name
ORCA_SERVICE: str = _ORCA.full_name
"""ORCA's out-of-band load reports (`xds.service.orca.v3.OpenRcaService`), for balancers."""
POOLING_SERVICE: str = _POOLING.full_name
"""This package's Classify, Score and Rerank (`vllm_servicer.v1.Pooling`)."""
RENDER_SERVICE: str = _RENDER.full_name
"""This package's prompt rendering (`vllm_servicer.v1.Render`)."""


class MethodRole(enum.Enum):
    """What a method is to the interceptors and the in-flight count."""

    GENERATION = "generation"
    """Runs `engine.generate`; its servicer keeps the call's record (context.py)."""
    EMBEDDING = "embedding"
    """Runs `engine.encode`; its servicer keeps the call's record too."""
    RENDERING = "rendering"
    """Runs the engine's renderer (template, tokenizer, output parsers), no engine step; counted
    in flight as the engine calls are, its servicer keeps the call's record."""
    ADMIN = "admin"
    """Changes the server for everyone or exposes its internals: administrators only."""
    ROUTING = "routing"
    """Hands out what a router needs and no tenant may see (KV events carry every
    tenant's token ids): routers and administrators only."""


def _methods(service: ServiceDescriptor, role: MethodRole, *names: str) -> dict[str, MethodRole]:
    # Looked up in the descriptor: a name the proto does not define fails at import.
    return {f"/{service.full_name}/{service.methods_by_name[name].name}": role for name in names}


METHOD_ROLES: Mapping[str, MethodRole] = MappingProxyType(
    {
        **_methods(_ENGINE, MethodRole.GENERATION, "Generate"),
        **_methods(_ENGINE, MethodRole.EMBEDDING, "Embed"),
        **_methods(_ENGINE, MethodRole.ADMIN, "FlushCache", "StartProfile", "StopProfile"),
        **_methods(_ENGINE, MethodRole.ROUTING, "SubscribeKvEvents"),
        **_methods(_CONTROL, MethodRole.ROUTING, "GetKvEventSources"),
        **_methods(_INFERENCE, MethodRole.GENERATION, "Generate", "GenerateStream"),
        **_methods(_POOLING, MethodRole.EMBEDDING, "Classify", "Score", "Rerank"),
        **_methods(
            _RENDER,
            MethodRole.RENDERING,
            "RenderChat",
            "RenderCompletion",
            "DerenderChat",
            "DerenderCompletion",
            "DerenderChatStream",
            "DerenderCompletionStream",
        ),
        # vLLM's Control: everything but discovery and Abort (which touches the
        # caller's own requests only) changes the engine for everyone.
        **_methods(
            _CONTROL,
            MethodRole.ADMIN,
            "Shutdown",
            "LoadLora",
            "UnloadLora",
            "PauseGeneration",
            "ResumeGeneration",
            "Sleep",
            "WakeUp",
            "InitWeightTransferEngine",
            "StartWeightUpdate",
            "StartDraftWeightUpdate",
            "UpdateWeights",
            "FinishWeightUpdate",
            "UpdateWeightVersion",
        ),
    }
)
"""Each method with a role, by full name ("/package.Service/Method")."""


def _with(*roles: MethodRole) -> frozenset[str]:
    return frozenset(method for method, role in METHOD_ROLES.items() if role in roles)


GENERATION_METHODS: frozenset[str] = _with(MethodRole.GENERATION)
"""The generation calls of every protocol."""
COUNTED_METHODS: frozenset[str] = _with(
    MethodRole.GENERATION, MethodRole.EMBEDDING, MethodRole.RENDERING
)
"""The calls counted in flight (and limited), whose servicer keeps the call's record:
the engine calls and rendering."""
ADMIN_METHODS: frozenset[str] = _with(MethodRole.ADMIN)
"""Methods that change the server for everyone or expose its internals."""
ROUTING_METHODS: frozenset[str] = _with(MethodRole.ROUTING)
"""Methods that hand out routing data (KV events and where they are published)."""

VLLM_SCHEMA_RELEASE = "0.34.0"
"""The vLLM release whose `rust/proto/` schema `vllm.Inference` and `vllm.Control` are
(protos/reference/vllm/RELEASE; tests/test_vllm_protos.py holds the two equal)."""

VLLM_PROTO_VERSION = "0.7.0"
"""That schema's version as vLLM names it: its `vllm-proto` crate's, which vLLM 0.34.0
ships and its Rust frontend reports as `ServerInfo.proto_version`. This server
reports it too, and an unknown field's refusal names it
(protos/reference/vllm/PROTO_VERSION)."""
