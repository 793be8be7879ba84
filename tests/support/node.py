"""The Node.js examples (examples/node): their dependencies installed once, or a skip saying why."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import pytest

NODE_DIR = Path(__file__).resolve().parents[2] / "examples" / "node"


def node_examples() -> Path:
    """examples/node with @grpc/grpc-js installed; skips the test without node or npm."""
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
    return NODE_DIR


async def run_node(script: str, *args: str, timeout: float = 120) -> tuple[int, str]:
    """`node examples/node/<script> *args`: its exit status and output (stderr with it)."""
    proc = await asyncio.create_subprocess_exec(
        shutil.which("node") or "node",
        str(node_examples() / script),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode is not None
    return proc.returncode, out.decode()
