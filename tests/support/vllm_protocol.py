"""Client stubs for vLLM's own protocol (`vllm.Inference`, `vllm.Control`), made from the reference.

The released text of vLLM's schema (`protos/reference/vllm/`, the release named in its
RELEASE file) is compiled with grpc_tools once per test process, into a temporary
directory; its modules register in protobuf's default pool, which the package
(its own pool) never reads. A test client built from them is what a client of
vLLM's own server would send.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import shutil
import sys
import tempfile
import types
from pathlib import Path

REFERENCE_DIR = Path(__file__).resolve().parents[2] / "protos" / "reference" / "vllm"
"""Where the reference `.proto` files are."""


SHIPPED_OWN_DIR = (
    Path(__file__).resolve().parents[2] / "src" / "vllm_servicer" / "proto" / "vllm_servicer" / "v1"
)
"""Where the package ships its own services' `.proto` files (vllm_servicer.v1)."""


@functools.cache
def reference_modules(name: str) -> tuple[types.ModuleType, types.ModuleType]:
    """`(name_pb2, name_pb2_grpc)` compiled from the reference's `name.proto` ("control"...)."""
    return compiled_modules(REFERENCE_DIR, name)


@functools.cache
def shipped_modules(name: str) -> tuple[types.ModuleType, types.ModuleType]:
    """`(name_pb2, name_pb2_grpc)` compiled from the `.proto` the package ships for its
    own services ("pooling", "render"), as a client in any language would."""
    return compiled_modules(SHIPPED_OWN_DIR, name)


def compiled_modules(root: Path, name: str) -> tuple[types.ModuleType, types.ModuleType]:
    """`(name_pb2, name_pb2_grpc)` compiled by grpc_tools from `root / f"{name}.proto"`."""
    import grpc_tools
    from grpc_tools import protoc

    out = Path(tempfile.mkdtemp(prefix="vllm-reference-stubs-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/struct.proto
    code = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{root}",
            f"-I{well_known}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            str(root / f"{name}.proto"),
        ]
    )
    if code != 0:
        raise RuntimeError(f"protoc failed ({code}) on {root / f'{name}.proto'}")
    # The generated grpc module imports its messages as a top-level module.
    sys.path.insert(0, str(out))
    try:
        return importlib.import_module(f"{name}_pb2"), importlib.import_module(f"{name}_pb2_grpc")
    finally:
        sys.path.remove(str(out))
