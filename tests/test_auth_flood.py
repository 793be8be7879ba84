"""The launcher as shipped, on the wire: clients with no key flooding it with
gzip requests that inflate to near the receive limit do not stall an
authenticated stream, with tracing on or off.

The flood is `benchmarks/auth_flood.py --gzip`: each request compressed once
and sent over raw HTTP/2 from a process of its own, four connections at once.
The untraced floods share one launcher, started with the benchmark's flags; with
tracing, the benchmark starts its own (with OTEL_* set).
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from support.launcher import START_TIMEOUT, Launched, launched, launcher_env

pytestmark = [pytest.mark.engine, pytest.mark.timeout(START_TIMEOUT + 300)]

FLOOD = Path(__file__).resolve().parent.parent / "benchmarks" / "auth_flood.py"
# On these machines a quiet stream's longest gap is ~50 ms, about as much on a
# busy machine; an inflating flood stretched it past 1.7 s (2.5 s with tracing).
# Ten times the quiet gap: only a stall like that one breaks it.
LONGEST_GAP_MS = 500
# A stalled stream's 300 tokens came in 2 to 18 chunks; a busy machine merges a
# slow reader's outputs (239 chunks seen), so the floor is a tenth of a token a chunk.
FEWEST_CHUNKS = 30
KEY = "flood-bench-key"  # the benchmark's (auth_flood.KEY)


@pytest.fixture(scope="module")
async def launcher(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Launched]:
    """The launcher as the benchmark starts it (auth_flood.start_launcher), without tracing."""
    env = launcher_env(tmp_path_factory.mktemp("cache"), VLLM_ALLOW_LONG_MAX_MODEL_LEN="1")
    async with launched("--api-key", KEY, "--max-model-len", "4096", env=env) as served:
        yield served


async def _flood(*flags: str) -> dict[str, Any]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(FLOOD),
        "--gzip",
        "--flooders",
        "4",
        "--rate",
        "40",
        "--seconds",
        "10",
        "--json",
        *flags,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=600)
    assert process.returncode == 0, err.decode()[-3000:]
    [figures] = json.loads(out.decode().strip().splitlines()[-1])
    return figures  # type: ignore[no-any-return]


def _not_stalled(figures: dict[str, Any]) -> None:
    codes = figures["flood_codes"]
    assert figures["flood_calls"] >= 40, figures  # the flood ran all along
    assert "OK" not in codes, figures  # every flood call refused
    assert figures["flooded_tokens"] == 300, figures  # the stream ran to its end
    # ...a step at a time, not in a few large chunks. How many it takes is the
    # engine's pacing (benchmarks/auth_flood.py prints it); only a stall breaks these.
    assert figures["flooded_chunks"] >= FEWEST_CHUNKS, figures
    assert figures["flooded_max_gap_ms"] < LONGEST_GAP_MS, figures


# Health takes no key: only the launcher's refusal of compression guards it.
@pytest.mark.parametrize("method", ["generate", "health"])
async def test_an_unauthenticated_gzip_flood_does_not_stall_a_stream(
    launcher: Launched, method: str
) -> None:
    server = ("--server", launcher.address, "--server-pid", str(launcher.proc.pid))
    _not_stalled(await _flood("--method", method, *server))


async def test_with_tracing_an_unauthenticated_gzip_flood_does_not_stall_a_stream() -> None:
    _not_stalled(await _flood("--method", "generate", "--tracing"))
