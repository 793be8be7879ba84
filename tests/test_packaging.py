"""The wheel as users install it: the protocol's .proto files, typing marker, one version."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

import vllm_servicer

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    # Built from a copy, so that the build leaves nothing in the source tree.
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(
        ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(source),
        ],
        check=True,
        timeout=240,
    )
    (built,) = out.glob("vllm_servicer-*.whl")
    return zipfile.ZipFile(built)


def test_the_wheel_carries_the_protocol(wheel: zipfile.ZipFile) -> None:
    for name in (
        "common.proto",
        "vllm_engine.proto",
        # ORCA's, in the folders their imports name.
        "xds/data/orca/v3/orca_load_report.proto",
        "xds/service/orca/v3/orca.proto",
        "vllm_servicer/v1/pooling.proto",
        "vllm_servicer/v1/render.proto",
    ):
        shipped = wheel.read(f"vllm_servicer/proto/{name}").decode()
        assert shipped == (ROOT / "protos" / name).read_text(), f"{name} differs from protos/"
    names = set(wheel.namelist())
    assert {"vllm_servicer/py.typed", "vllm_servicer/proto/vllm_engine_pb2.py"} <= names


def test_one_version_and_the_metadata_users_read(wheel: zipfile.ZipFile) -> None:
    (metadata_name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    metadata = Parser().parsestr(wheel.read(metadata_name).decode())
    assert metadata["Version"] == vllm_servicer.__version__
    assert metadata["License-Expression"] == "Apache-2.0"
    assert "Typing :: Typed" in metadata.get_all("Classifier")
    assert metadata["Requires-Python"]
