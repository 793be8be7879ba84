"""The launcher and the README's mount sample, run as users run them, in their own processes."""

from __future__ import annotations

import ast
import asyncio
import collections
import contextlib
import os
import re
import signal
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import free_port
from support.launcher import (
    EXAMPLES,
    ROOT,
    START_TIMEOUT,
    drain_output,
    exit_code,
    spawn,
    stop,
    wait_for_line,
)
from transformers import AutoTokenizer

# A test here may wait START_TIMEOUT for a launcher; the suite's default would cut it short.
pytestmark = pytest.mark.timeout(START_TIMEOUT + 180)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {**os.environ, "VLLM_SERVICER_CACHE": str(tmp_path_factory.mktemp("cache"))}


async def test_launcher_serves_the_example_client_then_stops_cleanly_on_sigterm(
    env: dict[str, str],
) -> None:
    """One launcher, from start to stop: the stop consumes it, so no other test shares it."""
    proc = await spawn("-m", "vllm_servicer", "serve", "--port", "0", "--warm-up", env=env)
    try:
        # The warm-up generation runs before the port opens.
        await wait_for_line(proc, r"warm-up generation done in")
        match = await wait_for_line(proc, r"listening on (\S+:\d+)")
        address = match.group(1)
        output: collections.deque[str] = collections.deque(maxlen=200)
        drain = asyncio.ensure_future(drain_output(proc, output))
        client = await spawn(str(EXAMPLES / "client.py"), address, "Hello", "--ids", env=env)
        out, _ = await asyncio.wait_for(client.communicate(), 120)
        text = out.decode()
        assert client.returncode == 0, text
        assert "model:" in text
        chunks = re.findall(r"^tokens: (\[[\d, ]+\])$", text, flags=re.M)
        # The client's default 16 tokens, in as many chunks as the engine's pacing makes.
        assert chunks and sum(len(ast.literal_eval(c)) for c in chunks) == 16, text
        assert "finish_reason: length" in text

        # By default the client prints text, decoded with the tokenizer it fetched
        # through GetTokenizer: the same greedy tokens, as the model's tokenizer reads them.
        client = await spawn(str(EXAMPLES / "client.py"), address, "Hello", env=env)
        out, _ = await asyncio.wait_for(client.communicate(), 120)
        assert client.returncode == 0, out.decode()
        printed = re.search(
            r"^model: [^\n]*\n(.*)\nfinish_reason: length$", out.decode(), re.S | re.M
        )
        assert printed, out.decode()
        ids = [i for chunk in chunks for i in ast.literal_eval(chunk)]
        tokenizer = AutoTokenizer.from_pretrained(Path(env["VLLM_SERVICER_CACHE"]) / "tiny-llama")
        assert printed.group(1) == tokenizer.decode(ids, skip_special_tokens=True)

        async with grpc.aio.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(health_pb2.HealthCheckRequest())
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert await stop(proc) == 0
        await asyncio.wait_for(drain, 30)  # the rest of its output, to the end
        # A clean stop ends with the launcher's own line, not a library's exit noise.
        stop_lines = "".join(output)
        # Its own lines in vLLM's format (process, level, time, source), as vLLM's are.
        assert re.search(
            r"\(MainProcess pid=\d+\) INFO \d\d-\d\d [\d:]{8} \[launcher\.py:\d+\] stopped$",
            stop_lines,
            re.M,
        ), stop_lines
        assert "leaked" not in stop_lines, stop_lines
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_readme_mount_sample_is_the_example_file() -> None:
    readme = (ROOT / "README.md").read_text()
    sample = (EXAMPLES / "mount_quickstart.py").read_text()
    assert f"```python\n{sample}```" in readme


async def test_mount_quickstart_serves(env: dict[str, str], tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    driver = (
        "import asyncio, sys\n"
        f"sys.path.insert(0, {str(EXAMPLES)!r})\n"
        "from vllm.engine.arg_utils import AsyncEngineArgs\n"
        "from vllm_servicer.testing.tiny_model import TINY_ENGINE_KWARGS, apply_cpu_env_defaults, "
        "ensure_tiny_model\n"
        "import mount_quickstart\n"
        "if __name__ == '__main__':\n"
        "    apply_cpu_env_defaults()\n"
        "    args = AsyncEngineArgs(model=str(ensure_tiny_model()), **TINY_ENGINE_KWARGS)\n"
        f"    asyncio.run(mount_quickstart.main({address!r}, args))\n"
    )
    script = tmp_path / "drive_quickstart.py"
    script.write_text(driver)
    # A group of its own: whatever the example leaves running is stopped with it.
    proc = await spawn(str(script), env=env, new_session=True)
    try:
        await wait_for_line(proc, r"serving on")
        drain = asyncio.ensure_future(drain_output(proc))
        client = await spawn(str(EXAMPLES / "client.py"), address, "hi", env=env)
        out, _ = await asyncio.wait_for(client.communicate(), 120)
        assert client.returncode == 0, out.decode()
        assert "finish_reason: length" in out.decode()
        drain.cancel()
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGINT)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(exit_code(proc), 60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await asyncio.wait_for(proc.wait(), 60)
