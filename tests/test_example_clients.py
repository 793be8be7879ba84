"""A client nobody here wrote the stack of: Node.js @grpc/grpc-js with this project's protos."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

NODE_DIR = Path(__file__).resolve().parent.parent / "examples" / "node"


@pytest.fixture(scope="module")
def node_client() -> Path:
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node and npm are not installed")
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").exists():
        done = subprocess.run(
            [npm, "install", "--no-audit", "--no-fund"],
            cwd=NODE_DIR,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            pytest.skip(f"npm install failed (no registry?): {done.stderr[-500:]}")
    return NODE_DIR / "client.js"


async def test_node_client_streams_tokens(node_client: Path, server: Any) -> None:
    proc = await asyncio.create_subprocess_exec(
        shutil.which("node") or "node",
        str(node_client),
        server.address,
        "6",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    text = out.decode()
    assert proc.returncode == 0, text
    streamed = [t for line in re.findall(r"^tokens: (.*)$", text, re.M) for t in json.loads(line)]
    assert len(streamed) == 6 and all(isinstance(t, int) for t in streamed)
    assert "finish_reason: length" in text
    assert "total tokens: 6" in text


async def test_python_client_tour(server: Any) -> None:
    tour = NODE_DIR.parent / "client_tour.py"
    import sys

    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(tour),
        server.address,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 180)
    text = out.decode()
    assert proc.returncode == 0, text
    assert "health: SERVING" in text
    assert re.search(r"^stream: \[(\d+, ){7}\d+\] length$", text, re.M), text
    assert "choice 0:" in text and "choice 1:" in text
    assert "aborted stream: abort" in text
    assert "embed: FAILED_PRECONDITION" in text
    assert "server: vllm-grpc" in text
