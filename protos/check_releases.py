"""Hold the vendored schemas to the releases they name, and say what the newest moved.

Usage: python protos/check_releases.py [--index-url URL ...]

- vLLM (`vllm.Inference`, `vllm.Control`): the release named in
  protos/reference/vllm/RELEASE is fetched again from the registry (as
  `make vllm-protos` fetches it) and its text must equal the reference copy:
  a difference fails. When the registry has a newer release, its schema is
  fetched too and the difference printed (a notice: the copy is updated with
  `make vllm-protos VERSION=X`).
- `vllm.grpc.engine.VllmEngine`: the tests hold the package's copy to the
  `smg-grpc-proto` release pinned in pyproject.toml (tests/test_conformance.py).
  When the registry has a newer `smg-grpc-proto`, its descriptors are compared
  with the package's and the messages that differ printed (a notice).

Exit status 1 only when the reference copy is not the release it names.
"""

from __future__ import annotations

import argparse
import difflib
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.version import InvalidVersion, Version

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import fetch_vllm  # noqa: E402

REFERENCE = fetch_vllm.DEFAULT_DEST


def released_versions(index: str, project: str) -> list[Version]:
    """The final releases of `project` on one simple index (sdists and wheels)."""
    stem = project.replace("-", "[-_]")
    found = set()
    for name in fetch_vllm.project_files(index, project):
        match = re.match(rf"{stem}-([^-]+?)(?:\.tar\.gz|-.*\.whl)$", name, re.I)
        if match:
            try:
                version = Version(match[1])
            except InvalidVersion:
                continue
            if not version.is_prerelease and not version.is_devrelease:
                found.add(version)
    return sorted(found)


def fetch_schema(indexes: list[str], version: str, dest: Path) -> Path:
    url = next((u for u in (fetch_vllm.sdist_url(i, version) for i in indexes) if u), None)
    if url is None:
        raise SystemExit(f"vllm-{version}.tar.gz is on none of these indexes: {indexes}")
    with tempfile.TemporaryDirectory() as tmp:
        fetch_vllm.extract(fetch_vllm.download(url, Path(tmp)), dest, version)
    return dest


def differences(a: Path, b: Path, a_name: str, b_name: str) -> list[str]:
    lines: list[str] = []
    for name in (*fetch_vllm.PROTOS, "PROTO_VERSION"):
        left = (a / name).read_text().splitlines() if (a / name).exists() else []
        right = (b / name).read_text().splitlines() if (b / name).exists() else []
        lines += difflib.unified_diff(
            left, right, f"{a_name}/{name}", f"{b_name}/{name}", lineterm=""
        )
    return lines


def check_vllm(indexes: list[str], work: Path) -> bool:
    named = (REFERENCE / "RELEASE").read_text().strip()
    fetched = fetch_schema(indexes, named, work / named)
    moved = differences(REFERENCE, fetched, "protos/reference/vllm", f"vllm-{named}")
    if moved:
        print(f"FAIL: protos/reference/vllm is not vLLM {named}'s released schema:")
        print("\n".join(moved))
        return False
    print(f"vLLM {named}: the reference copy is the release's text")
    newest = max((v for i in indexes for v in released_versions(i, "vllm")), default=None)
    if newest is None or newest <= Version(named):
        print(f"vLLM {named} is the newest release on the indexes")
        return True
    later = fetch_schema(indexes, str(newest), work / str(newest))
    moved = differences(REFERENCE, later, f"vllm-{named}", f"vllm-{newest}")
    print(f"NOTICE: vLLM {newest} is released; its schema against {named}'s:")
    print("\n".join(moved) if moved else "(the same)")
    if moved:
        print(f"update with: make vllm-protos VERSION={newest}")
    return True


def pinned_smg() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    found = re.search(r'"smg-grpc-proto==([^"]+)"', text)
    if found is None:
        raise SystemExit("pyproject.toml pins no smg-grpc-proto")
    return found[1]


# Run in a child so that the newest release's generated modules do not meet the
# pinned ones in one descriptor pool.
_COMPARE = """
import sys
from google.protobuf import descriptor_pb2
sys.path.insert(0, sys.argv[1])
from smg_grpc_proto.generated import vllm_engine_pb2 as theirs
sys.path.pop(0)
sys.path.insert(0, sys.argv[2])
from vllm_servicer.proto import vllm_engine_pb2 as ours
def messages(module):
    proto = descriptor_pb2.FileDescriptorProto()
    module.DESCRIPTOR.CopyToProto(proto)
    return {m.name: m for m in proto.message_type}
a, b = messages(ours), messages(theirs)
for name in sorted(set(a) | set(b)):
    if a.get(name) != b.get(name):
        print(f"  message {name}: " + ("only in the release" if name not in a
              else "only here" if name not in b else "differs"))
"""


def check_smg(indexes: list[str], work: Path) -> None:
    pinned = Version(pinned_smg())
    newest = max((v for i in indexes for v in released_versions(i, "smg-grpc-proto")), default=None)
    if newest is None or newest <= pinned:
        print(f"smg-grpc-proto {pinned} is the newest release on the indexes")
        return
    where = work / "smg"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
         f"smg-grpc-proto=={newest}", "-d", str(where), "-q"],
        check=True,
    )  # fmt: skip
    wheel = next(where.glob("*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(where / "unpacked")
    done = subprocess.run(
        [sys.executable, "-c", _COMPARE, str(where / "unpacked"), str(ROOT / "src")],
        capture_output=True,
        text=True,
        check=True,
    )
    print(f"NOTICE: smg-grpc-proto {newest} is released (pinned: {pinned}); VllmEngine against it:")
    print(done.stdout or "  (the same messages)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--index-url", action="append", help="default: pip's configured ones")
    args = parser.parse_args(argv)
    indexes = [u.rstrip("/") for u in args.index_url or fetch_vllm.configured_indexes()]
    with tempfile.TemporaryDirectory() as tmp:
        ok = check_vllm(indexes, Path(tmp))
        check_smg(indexes, Path(tmp))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
