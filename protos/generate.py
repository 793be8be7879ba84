"""Generate the Python modules for protos/*.proto into src/vllm_servicer/proto/.

Usage: python protos/generate.py [OUT_DIR]

The generated modules register their files in a descriptor pool of this
package's own (vllm_servicer.proto._pool.POOL) instead of protobuf's default
pool. The reference stubs (smg-grpc-proto, installed with vLLM's gRPC extra)
register the same full names in the default pool; two registrations of one
name from different files fail at import, so a private pool is what lets both
live in one process. Imports between the generated modules are made relative.
The .proto files are copied beside them, so that the wheel carries the
protocol for clients in other languages.

ORCA's files (`xds/...`, copied from cncf/xds) and this package's own
(`vllm_servicer/v1/...`) keep their folders, so their descriptors have the
names their clients know; their modules are written beside the others
(`orca_pb2`, `pooling_pb2`, ...), imported relatively.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

import grpc_tools
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
DEFAULT_OUT = ROOT / "src" / "vllm_servicer" / "proto"
PROTOS = (
    "common.proto",
    "vllm_engine.proto",
    "inference.proto",
    "control.proto",
    # Load reports (ORCA) for balancers: gRPC's weighted_round_robin, Envoy.
    "xds/data/orca/v3/orca_load_report.proto",
    "xds/service/orca/v3/orca.proto",
    # This package's own services (vllm_servicer.v1): pooling and rendering.
    "vllm_servicer/v1/pooling.proto",
    "vllm_servicer/v1/render.proto",
)


def _rewrite(text: str) -> str:
    # Sibling imports: `import common_pb2 as x` -> `from . import common_pb2 as x`.
    text = re.sub(r"^import (\w+_pb2(?:_grpc)?) as ", r"from . import \1 as ", text, flags=re.M)
    text = re.sub(r"^import (\w+_pb2)$", r"from . import \1", text, flags=re.M)
    # ORCA's modules, generated in their packages' folders, are written flat beside these.
    text = re.sub(
        r"^from (?:xds|vllm_servicer)(?:\.\w+)+ import (\w+_pb2) as ",
        r"from . import \1 as ",
        text,
        flags=re.M,
    )
    text = re.sub(r"(DESCRIPTOR, )'(?:xds|vllm_servicer)(?:\.\w+)+\.(\w+_pb2)'", r"\1'\2'", text)
    text = text.replace(
        "_descriptor_pool.Default().AddSerializedFile(",
        "_pool.POOL.AddSerializedFile(",
    )
    if "_pool.POOL" in text:
        text = text.replace(
            "from google.protobuf import descriptor_pool as _descriptor_pool\n",
            "from google.protobuf import descriptor_pool as _descriptor_pool\n"
            "from . import _pool\n",
        )
    return text


def generate(out_dir: Path) -> list[Path]:
    """Run protoc and write the rewritten modules to out_dir; return the paths written."""
    written: list[Path] = []
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_DIR}",
            # The well-known types (google/protobuf/struct.proto) grpc_tools ships.
            f"-I{Path(grpc_tools.__file__).parent / '_proto'}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(str(PROTO_DIR / p) for p in PROTOS),
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        out_dir.mkdir(parents=True, exist_ok=True)
        for src in sorted(p for p in Path(tmp).rglob("*") if p.is_file()):
            dest = out_dir / src.name
            dest.write_text(_rewrite(src.read_text()))
            written.append(dest)
    for name in PROTOS:
        dest = out_dir / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text((PROTO_DIR / name).read_text())
        written.append(dest)
    return written


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT
    for path in generate(target):
        print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
