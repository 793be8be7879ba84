"""Fetch vLLM's released `vllm.Inference` / `vllm.Control` schema into protos/reference/vllm/.

Usage: python protos/fetch_vllm.py VERSION [--index-url URL ...] [--dest DIR] [--no-copy]

vLLM ships the schema its Rust frontend serves in each release's source
distribution (`vllm-X.tar.gz`, members `*/rust/proto/*.proto`). `pip download
--no-binary :all:` fetches that file but then builds vLLM's metadata, which
fails; so this reads the registry's simple index (PEP 503, the one pip reads:
the index URLs pip is configured with, `pip config list`, or --index-url),
downloads the sdist itself (checking the index's sha256 when it gives one) and
extracts the `.proto` members, the release (RELEASE) and the version of its
`vllm-proto` crate (PROTO_VERSION, what vLLM's Rust frontend reports as
`ServerInfo.proto_version`). `file://` indexes (a local mirror) work too.

Then, unless --no-copy, it rewrites protos/inference.proto and control.proto
from that text: the interface as released, vLLM's comments replaced by this
project's header. Run `make proto` after it; tests/test_vllm_protos.py then
holds the copy equal to the release, and the field-table test names every
field the release added that this server neither honours nor refuses yet.
"""

from __future__ import annotations

import argparse
import hashlib
import html.parser
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DEST = ROOT / "protos" / "reference" / "vllm"
PROTOS = ("inference.proto", "control.proto")
DEFAULT_INDEX = "https://pypi.org/simple"

_HEADER = """// vllm-servicer's copy of vLLM's first-party {what} protocol (`vllm.{service}`).
//
// The interface (package, services, messages, field names, numbers, types,
// `optional` markers and oneofs) is the schema vLLM ships in its release
// source distribution (`rust/proto/`), release named in
// protos/reference/vllm/RELEASE; `make vllm-protos VERSION=X` fetches a
// release's text there and tests/test_vllm_protos.py fails when this copy
// differs from it. docs/protocol.md says what this server does with each {unit}.
"""
_HEADERS = {
    "inference.proto": _HEADER.format(what="inference", service="Inference", unit="field"),
    "control.proto": _HEADER.format(what="control", service="Control", unit="RPC"),
}


def configured_indexes() -> list[str]:
    """The index URLs pip would read: its environment, then `pip config list`."""
    urls: list[str] = []
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        urls += os.environ.get(name, "").split()
    try:
        listed = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
    except OSError:
        listed = ""
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(("index-url", "extra-index-url")):
            urls += value.strip().strip("'\"").split()
    if not any(key.endswith(".index-url") for key in _keys(listed)) and not os.environ.get(
        "PIP_INDEX_URL"
    ):
        urls.append(DEFAULT_INDEX)  # pip's own default, unless an index-url replaces it
    return list(dict.fromkeys(url.rstrip("/") for url in urls if url))


def _keys(listed: str) -> list[str]:
    return [line.partition("=")[0] for line in listed.splitlines()]


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            href = dict(attrs).get("href")
            if href:
                self.hrefs.append(href)


def project_files(index: str, project: str) -> dict[str, str]:
    """Each file of `project` on one simple index: its name, and its address
    (with the index's `#sha256=` fragment). Empty when the index has no page."""
    page = f"{index}/{project}/"
    # A file-based index is directories with an index.html each, as pip reads them.
    address = page + "index.html" if page.startswith("file:") else page
    try:
        with urllib.request.urlopen(address, timeout=60) as response:  # noqa: S310 - pip's index
            text = response.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return {}
    links = _Links()
    links.feed(text)
    return {
        urllib.parse.unquote(href.split("#")[0].rsplit("/", 1)[-1]): urllib.parse.urljoin(
            page, href
        )
        for href in links.hrefs
    }


def sdist_url(index: str, version: str) -> str | None:
    """The address of `vllm-VERSION.tar.gz` on one simple index (None: not there)."""
    wanted = f"vllm-{version}.tar.gz"
    return next(
        (url for name, url in project_files(index, "vllm").items() if name.lower() == wanted), None
    )


def download(url: str, into: Path) -> Path:
    """Download `url` (its `#sha256=` fragment checked) into `into`."""
    address, _, fragment = url.partition("#")
    path = into / urllib.parse.unquote(address.rsplit("/", 1)[-1])
    with urllib.request.urlopen(address, timeout=600) as response:  # noqa: S310
        path.write_bytes(response.read())
    expected = dict(re.findall(r"(\w+)=(\w+)", fragment)).get("sha256")
    if expected is not None:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest != expected:
            raise SystemExit(f"{path.name}: sha256 {digest} is not the index's {expected}")
    return path


def extract(sdist: Path, dest: Path, version: str) -> list[Path]:
    """Write the sdist's `rust/proto/*.proto` (and RELEASE) into `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    crate = None
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            parts = member.name.split("/")
            if not (member.isfile() and parts[-3:-1] == ["rust", "proto"]):
                continue
            handle = archive.extractfile(member)
            assert handle is not None
            if parts[-1] in PROTOS:
                target = dest / parts[-1]
                target.write_bytes(handle.read())
                written.append(target)
            elif parts[-1] == "Cargo.toml":
                crate = crate_version(handle.read().decode())
    missing = set(PROTOS) - {p.name for p in written}
    if missing:
        raise SystemExit(f"{sdist.name} has no rust/proto/{sorted(missing)}")
    (dest / "RELEASE").write_text(version + "\n")
    if crate is not None:
        # vLLM's Rust frontend reports its vllm-proto crate's version as ServerInfo.proto_version.
        (dest / "PROTO_VERSION").write_text(crate + "\n")
    return written


def crate_version(cargo_toml: str) -> str | None:
    """The `[package]` version of the vllm-proto crate's Cargo.toml."""
    package = cargo_toml.partition("[package]")[2].split("\n[", 1)[0]
    found = re.search(r'^version\s*=\s*"([^"]+)"', package, re.M)
    return found.group(1) if found else None


def project_copy(reference: str, name: str) -> str:
    """`reference`'s interface with vLLM's comments replaced by this project's header."""
    lines = []
    for line in reference.splitlines():
        if line.lstrip().startswith("//"):
            continue
        lines.append(re.sub(r"\s*//.*$", "", line).rstrip())
    body = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip("\n")
    return _HEADERS[name] + "\n" + body + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("version", help="the vLLM release, e.g. 0.34.0")
    parser.add_argument(
        "--index-url", action="append", help="a simple index (default: pip's configured ones)"
    )
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    parser.add_argument("--copy-to", type=Path, default=ROOT / "protos")
    parser.add_argument("--no-copy", action="store_true", help="leave protos/*.proto alone")
    args = parser.parse_args(argv)
    indexes = [url.rstrip("/") for url in args.index_url or configured_indexes()]
    url = next((u for u in (sdist_url(i, args.version) for i in indexes) if u), None)
    if url is None:
        raise SystemExit(f"vllm-{args.version}.tar.gz is on none of these indexes: {indexes}")
    with tempfile.TemporaryDirectory() as tmp:
        written = extract(download(url, Path(tmp)), args.dest, args.version)
    for path in written:
        print(path)
        if not args.no_copy:
            copy = args.copy_to / path.name
            copy.write_text(project_copy(path.read_text(), path.name))
            print(copy)
    if not args.no_copy:
        print(
            "set VLLM_SCHEMA_RELEASE and VLLM_PROTO_VERSION in src/vllm_servicer/proto/methods.py "
            "to RELEASE and PROTO_VERSION"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
