"""The vendored `vllm.Inference` / `vllm.Control` schema is the vLLM release it names.

protos/reference/vllm/ holds the text of `rust/proto/` from the release's
source distribution (`make vllm-protos VERSION=X` fetches it); compiled with
grpc_tools, its descriptors must equal the package's own, field by field, as
test_conformance.py holds VllmEngine to smg-grpc-proto. No network: the fetch
itself is shown against a file-based index made here.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import tarfile
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import descriptor_pb2
from support.vllm_protocol import REFERENCE_DIR, reference_modules

from vllm_servicer.proto import (
    VLLM_PROTO_VERSION,
    VLLM_SCHEMA_RELEASE,
    control_pb2,
    inference_pb2,
)

ROOT = Path(__file__).resolve().parent.parent


def _fetcher() -> Any:
    spec = importlib.util.spec_from_file_location("fetch_vllm", ROOT / "protos" / "fetch_vllm.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _file_proto(module: Any) -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto()
    module.DESCRIPTOR.CopyToProto(proto)
    return proto


@pytest.mark.parametrize(("name", "ours"), [("inference", inference_pb2), ("control", control_pb2)])
def test_the_schema_is_the_releases_field_by_field(name: str, ours: Any) -> None:
    theirs, _ = reference_modules(name)
    mine, released = _file_proto(ours), _file_proto(theirs)
    # Message by message first, so that a failure names what moved.
    assert [m.name for m in mine.message_type] == [m.name for m in released.message_type]
    for a, b in zip(mine.message_type, released.message_type, strict=True):
        assert a == b, f"{name}.proto: message {a.name} differs from vLLM {VLLM_SCHEMA_RELEASE}'s"
    # Then the whole: package, enums, services, options, dependencies.
    assert mine == released


def test_the_release_named_is_the_one_served() -> None:
    assert (REFERENCE_DIR / "RELEASE").read_text().strip() == VLLM_SCHEMA_RELEASE
    assert (REFERENCE_DIR / "PROTO_VERSION").read_text().strip() == VLLM_PROTO_VERSION


@pytest.mark.parametrize("name", ["inference.proto", "control.proto"])
def test_the_copy_is_the_release_in_the_projects_words(name: str) -> None:
    reference = (REFERENCE_DIR / name).read_text()
    assert _fetcher().project_copy(reference, name) == (ROOT / "protos" / name).read_text()


def _sdist(version: str) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        members = {
            f"vllm-{version}/rust/proto/inference.proto": b'syntax = "proto3";\n',
            f"vllm-{version}/rust/proto/control.proto": b'syntax = "proto3";\n',
            f"vllm-{version}/rust/proto/Cargo.toml": b'[package]\nname = "vllm-proto"\n'
            b'version = "9.1.0"\n\n[dependencies]\nversion = "1"\n',
            f"vllm-{version}/vllm/__init__.py": b"",
        }
        for path, data in members.items():
            info = tarfile.TarInfo(path)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _index(root: Path, version: str, digest: str | None = None) -> str:
    """A file-based simple index (PEP 503) with vLLM's sdist and a wheel beside it."""
    data = _sdist(version)
    files = root / "files"
    files.mkdir(parents=True)
    (files / f"vllm-{version}.tar.gz").write_bytes(data)
    page = root / "simple" / "vllm"
    page.mkdir(parents=True)
    digest = digest or hashlib.sha256(data).hexdigest()
    page.joinpath("index.html").write_text(
        "<html><body>"
        f'<a href="../../files/vllm-{version}-cp38-abi3-linux_x86_64.whl">wheel</a>'
        f'<a href="../../files/vllm-{version}.tar.gz#sha256={digest}">sdist</a>'
        "</body></html>"
    )
    return (root / "simple").as_uri()


def test_the_fetch_reads_the_sdist_from_a_simple_index(tmp_path: Path) -> None:
    index = _index(tmp_path / "index", "9.9.0")
    dest, copies = tmp_path / "reference", tmp_path / "protos"
    copies.mkdir()
    fetch = _fetcher()
    assert (
        fetch.main(["9.9.0", "--index-url", index, "--dest", str(dest), "--copy-to", str(copies)])
        == 0
    )
    assert (dest / "inference.proto").read_text() == 'syntax = "proto3";\n'
    assert (dest / "RELEASE").read_text() == "9.9.0\n"
    assert (dest / "PROTO_VERSION").read_text() == "9.1.0\n"
    assert (copies / "control.proto").read_text().startswith("// vllm-servicer's copy")


def test_the_fetch_refuses_a_download_whose_hash_is_not_the_indexs(tmp_path: Path) -> None:
    index = _index(tmp_path / "index", "9.9.0", digest="0" * 64)
    with pytest.raises(SystemExit, match="sha256"):
        _fetcher().main(["9.9.0", "--index-url", index, "--dest", str(tmp_path / "r"), "--no-copy"])


def test_the_fetch_names_the_indexes_without_the_release(tmp_path: Path) -> None:
    index = _index(tmp_path / "index", "9.9.0")
    with pytest.raises(SystemExit, match="9.9.1.tar.gz is on none"):
        _fetcher().main(["9.9.1", "--index-url", index, "--no-copy"])


def _checker() -> Any:
    spec = importlib.util.spec_from_file_location(
        "check_releases", ROOT / "protos" / "check_releases.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _releases(root: Path, schemas: dict[str, bytes]) -> str:
    """A file-based simple index with one vLLM sdist per release, `inference.proto` as given."""
    files, page = root / "files", root / "simple" / "vllm"
    files.mkdir(parents=True)
    page.mkdir(parents=True)
    links = []
    for version, inference in schemas.items():
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
            for name, data in (
                ("inference.proto", inference),
                ("control.proto", (REFERENCE_DIR / "control.proto").read_bytes()),
                ("Cargo.toml", f'[package]\nversion = "{VLLM_PROTO_VERSION}"\n'.encode()),
            ):
                info = tarfile.TarInfo(f"vllm-{version}/rust/proto/{name}")
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
        (files / f"vllm-{version}.tar.gz").write_bytes(buffer.getvalue())
        links.append(f'<a href="../../files/vllm-{version}.tar.gz">vllm-{version}.tar.gz</a>')
    page.joinpath("index.html").write_text("<html><body>" + "".join(links) + "</body></html>")
    return (root / "simple").as_uri()


def test_the_release_check_passes_the_copy_and_shows_what_a_newer_release_moved(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    released = (REFERENCE_DIR / "inference.proto").read_bytes()
    newer = released + b"\nmessage Added {\n  uint32 field = 1;\n}\n"
    index = _releases(tmp_path, {VLLM_SCHEMA_RELEASE: released, "99.0.0": newer})
    assert _checker().check_vllm([index], tmp_path / "work") is True
    out = capsys.readouterr().out
    assert f"vLLM {VLLM_SCHEMA_RELEASE}: the reference copy is the release's text" in out
    assert "NOTICE: vLLM 99.0.0 is released" in out and "+message Added {" in out
    assert "make vllm-protos VERSION=99.0.0" in out


def test_the_release_check_fails_a_copy_that_is_not_the_release_it_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    released = (REFERENCE_DIR / "inference.proto").read_bytes()
    index = _releases(tmp_path, {VLLM_SCHEMA_RELEASE: released.replace(b"= 17;", b"= 19;")})
    assert _checker().check_vllm([index], tmp_path / "work") is False
    out = capsys.readouterr().out
    assert "FAIL: protos/reference/vllm is not vLLM" in out and "= 19;" in out
