"""Client stubs for vLLM's own protocol (`vllm.Inference`, `vllm.Control`), made from the reference.

The reference copy of vLLM's schema (`/work/shared/protocols/vllm/`, see its
README) is compiled with grpc_tools once per test process, into a temporary
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

REFERENCE_DIR = Path("/work/shared/protocols/vllm")
"""Where the reference `.proto` files are."""


@functools.cache
def reference_modules(name: str) -> tuple[types.ModuleType, types.ModuleType]:
    """`(name_pb2, name_pb2_grpc)` compiled from the reference's `name.proto` ("control"...)."""
    import grpc_tools
    from grpc_tools import protoc

    out = Path(tempfile.mkdtemp(prefix="vllm-reference-stubs-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/struct.proto
    code = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{REFERENCE_DIR}",
            f"-I{well_known}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            str(REFERENCE_DIR / f"{name}.proto"),
        ]
    )
    if code != 0:
        raise RuntimeError(f"protoc failed ({code}) on {REFERENCE_DIR / f'{name}.proto'}")
    # The generated grpc module imports its messages as a top-level module.
    sys.path.insert(0, str(out))
    try:
        return importlib.import_module(f"{name}_pb2"), importlib.import_module(f"{name}_pb2_grpc")
    finally:
        sys.path.remove(str(out))
