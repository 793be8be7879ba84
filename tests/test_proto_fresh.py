"""The checked-in generated modules are what `make proto` produces from protos/."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ROOT / "src" / "vllm_servicer" / "proto"


def _generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(
        "generate_protos", ROOT / "protos" / "generate.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    written = _generator().generate(tmp_path)
    assert {p.relative_to(tmp_path).as_posix() for p in written} == {
        "common_pb2.py",
        "common_pb2.pyi",
        "common_pb2_grpc.py",
        "vllm_engine_pb2.py",
        "vllm_engine_pb2.pyi",
        "vllm_engine_pb2_grpc.py",
        "inference_pb2.py",
        "inference_pb2.pyi",
        "inference_pb2_grpc.py",
        "control_pb2.py",
        "control_pb2.pyi",
        "control_pb2_grpc.py",
        "common.proto",
        "vllm_engine.proto",
        "inference.proto",
        "control.proto",
        # ORCA's, from cncf/xds: modules beside the others, the files in their folders.
        "orca_load_report_pb2.py",
        "orca_load_report_pb2.pyi",
        "orca_load_report_pb2_grpc.py",
        "orca_pb2.py",
        "orca_pb2.pyi",
        "orca_pb2_grpc.py",
        "xds/data/orca/v3/orca_load_report.proto",
        "xds/service/orca/v3/orca.proto",
        # This package's own services, the files in their folders too.
        "pooling_pb2.py",
        "pooling_pb2.pyi",
        "pooling_pb2_grpc.py",
        "render_pb2.py",
        "render_pb2.pyi",
        "render_pb2_grpc.py",
        "vllm_servicer/v1/pooling.proto",
        "vllm_servicer/v1/render.proto",
    }
    stale = [
        name
        for p in written
        if p.read_text() != (GENERATED / (name := p.relative_to(tmp_path).as_posix())).read_text()
    ]
    assert not stale, f"run `make proto`: {stale} differ from protos/"
