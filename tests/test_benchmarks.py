"""The benchmark tools work: the load generator, the interceptor costs, the protocol costs.

Their numbers are for `make bench`; these tests check that the tools run and
that they check what they claim to (token counts, finish reasons).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest

# Brief runs of the benchmarks (make test-bench), so that they cannot rot.
pytestmark = [pytest.mark.bench, pytest.mark.engine]

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


async def _loadgen(*args: str) -> dict[str, Any]:
    # A child process, awaited without blocking the loop that serves the session's server.
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(BENCHMARKS / "loadgen.py"),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=180)
    assert process.returncode == 0, err.decode()[-2000:]
    return json.loads(out)  # type: ignore[no-any-return]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
async def test_load_generator_counts_every_token_of_every_request(
    server: Any, stream: bool
) -> None:
    args = ["--target", server.address, "-c", "3", "-n", "5", "--max-tokens", "6", "--cpu", "-1"]
    result = await _loadgen(*args, *([] if stream else ["--no-stream"]))
    assert result["errors"] == 0, result["error_samples"]
    assert result["output_tokens"] == 5 * 6
    assert result["tokens_per_s"] > 0
    assert result["ttft_p50_ms"] is not None and result["latency_p50_ms"] is not None
    if stream:
        # Each request's tokens arrive in one or more chunks: between 1 and 6 per request.
        assert 5 <= result["messages"] <= 5 * 6 + 5
        assert result["itl_p50_ms"] is not None


async def test_load_generator_reports_a_wrong_token_count(server: Any) -> None:
    # max_tokens beyond the context: the engine stops at the context's end, short
    # of the count asked for, and the burst says so.
    args = ["--target", server.address, "-c", "1", "-n", "1", "--max-tokens", "100000"]
    result = await _loadgen(*args, "--cpu", "-1")
    assert result["errors"] == 1
    assert 0 < result["output_tokens"] < 100000
    assert str(result["output_tokens"]) in result["error_samples"][0]


def test_interceptor_benchmark_runs_every_configuration_through_a_real_server() -> None:
    import subprocess

    done = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "interceptor_overhead.py"),
            "--micro",
            *("--rounds", "2", "--streams", "3", "--tokens", "5", "--waves", "1", "--core", "-1"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("configuration"))
    measured = {line.split()[0]: line.split() for line in lines[header + 1 :] if line.strip()}
    configs = ("bare", "bare-again", "metrics", "inflight", "auth", "tracing", "stack", "full")
    assert set(measured) == set(configs)
    for name in configs:
        tokens_per_s, loop_us_per_message = float(measured[name][1]), float(measured[name][2])
        assert tokens_per_s > 0 and loop_us_per_message > 0


def test_protocols_benchmark_measures_three_cells_on_one_server(tmp_path: Path) -> None:
    import subprocess

    out = tmp_path / "protocols.json"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "protocols.py"), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    data = json.loads(out.read_text())
    # Every request's output token count was checked, none was wrong.
    assert data["token_counts_checked"] is True
    # --quick: 16 in flight, 32 requests per burst, each cell twice in its one round.
    assert data["requests_checked"] == 3 * 2 * 32
    assert data["bad_requests"] == 0 and data["problems"] == []
    cells = data["summary"]["c16"]
    assert set(cells) == {"engine", "inference-ids", "inference-text"}
    for cell in cells.values():
        assert cell["tokens_per_s"]["median"] > 0
        assert cell["cpu_us_per_token"]["median"] > 0
    for name in ("inference-ids", "inference-text"):
        assert cells[name]["ratio_cpu_us_per_token"]["median"] > 0


@pytest.mark.timeout(900)
def test_orca_balance_benchmark_measures_the_split_and_the_cost(tmp_path: Path) -> None:
    import subprocess

    out = tmp_path / "orca.json"
    command = [sys.executable, str(BENCHMARKS / "orca_balance.py"), "--quick", "--core", "-1"]
    done = subprocess.run(
        [*command, "--json", str(out)], capture_output=True, text=True, timeout=840
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    data = json.loads(out.read_text())
    assert [row["policy"] for row in data["split"]] == [
        "round_robin",
        "weighted_round_robin (per call)",
        "weighted_round_robin (out of band)",
    ]
    for row in data["split"]:
        # Every counted call was served by one of the two launchers, and printed.
        assert row["busy"] + row["idle"] == 100
        assert f"busy {row['busy']:>4}  idle {row['idle']:>4}" in done.stdout
    assert [row["load_reports"] for row in data["cost"]] == ["off", "on"]
    for row in data["cost"]:
        assert row["calls_per_s"] > 0 and row["loop_us_per_call"] > 0
    assert "extra_loop_us_per_call" in data["cost"][1]


HYBRID_VENV = BENCHMARKS.parent / "build" / "venv-vllm-0.33.0-over-cpu-0.32.0"


@pytest.mark.skipif(
    not (HYBRID_VENV / ".setup-done").exists(),
    reason=f"needs the vLLM 0.33 hybrid venv ({HYBRID_VENV}), whose vLLM ships vllm-rs: "
    "`make test-engine ENGINE=vllm==0.33.0` or `make test-engine-hybrid VLLM=0.33.0` builds it",
)
def test_rust_frontend_benchmark_counts_each_serving_process_alone(tmp_path: Path) -> None:
    import subprocess

    out = tmp_path / "rust.json"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "rust_frontend.py"), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    data = json.loads(out.read_text())
    # Both gave the same greedy tokens, and every request its count and finish reason.
    assert data["problems"] == []
    # --quick: 16 in flight, 32 requests per burst, A B B A in its one round.
    assert data["requests_checked"] == 4 * 32
    # The serving processes counted: vllm-rs's own, the launcher's; engine cores apart.
    assert "vllm-rs frontend" in data["counted"]["vllm-rs"]
    assert "vllm_servicer serve" in data["counted"]["ours"]
    for counted in data["counted"].values():
        assert "excluded engine processes" in counted and "VLLM::EngineCore" in counted
    for name in ("ours", "vllm-rs"):
        figures = data["summary"][name]
        assert figures["tokens_per_s"] > 0 and figures["serving_cpu_us_per_token"] > 0
        assert figures["itl_p90_ms"] is not None and figures["ttft_p99_ms"] is not None
    assert data["summary"]["ratios"]["serving_cpu_us_per_token"]["median"] > 0


@pytest.mark.timeout(600)
def test_pooling_vs_http_benchmark_measures_every_pair_on_both_protocols(tmp_path: Path) -> None:
    import subprocess

    out = tmp_path / "pooling-vs-http.json"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "pooling_vs_http.py"), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    data = json.loads(out.read_text())
    pairs = ["classify-1", "classify-8", "score-8", "rerank-8", "render-chat", "render-completion"]
    # Each pair's gRPC and HTTP answers were compared before timing, and agreed.
    assert sorted(data["agreement"]) == sorted(pairs)
    assert data["all_agree"] is True and data["problems"] == []
    for name in pairs:
        assert data["agreement"][name]["grpc"] == data["agreement"][name]["http"]
        assert data["agreement"][name]["grpc"], name  # something was compared
    assert set(data["summary"]) == set(pairs)
    for name in pairs:
        assert set(data["summary"][name]) == {"c1", "c16"}
        for entry in data["summary"][name].values():
            for side in ("grpc", "http"):
                figures = entry[side]
                assert figures["calls_per_s"]["median"] > 0
                assert figures["launcher_cpu_us_per_call"]["median"] > 0
                assert figures["latency_p50_ms_all"] > 0 and figures["latency_p99_ms_all"] > 0
            for ratio in entry["ratio_grpc_over_http"].values():
                assert ratio["median"] > 0
    # Every burst's calls all answered: 1 round of A B B A per pair and concurrency.
    assert len(data["bursts"]) == len(pairs) * 2 * 4
    assert all(b["errors"] == 0 for b in data["bursts"])


@pytest.mark.timeout(600)
def test_derender_vs_http_benchmark_measures_both_protocols_on_one_launcher(
    tmp_path: Path,
) -> None:
    import subprocess

    out = tmp_path / "derender-vs-http.json"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "derender_vs_http.py"), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    data = json.loads(out.read_text())
    # Both answers were compared before timing, and agreed: the reasoning, the
    # content and the parsed tool call.
    agreement = data["agreement"]["derender-chat"]
    assert data["all_agree"] is True and data["problems"] == []
    reasoning, _, calls = agreement["grpc"]
    assert reasoning and calls == [["get_weather", {"city": "Paris"}]]
    assert agreement["grpc"] == agreement["http"]
    assert set(data["summary"]) == {"c16"}
    entry = data["summary"]["c16"]
    for side in ("grpc", "http"):
        assert entry[side]["calls_per_s"]["median"] > 0
        assert entry[side]["launcher_cpu_us_per_call"]["median"] > 0
        assert entry[side]["latency_p50_ms_all"] > 0
    assert entry["ratio_grpc_over_http"]["launcher_cpu_us_per_call"]["median"] > 0
    # One round of A B B A, every call answered.
    assert len(data["bursts"]) == 4 and all(b["errors"] == 0 for b in data["bursts"])


@pytest.mark.timeout(600)
def test_batched_outputs_prototype_counts_both_paths_on_one_engine(tmp_path: Path) -> None:
    import subprocess

    out = tmp_path / "batched.json"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "batched_outputs.py"), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["same_tokens"] is True  # the same greedy tokens on both paths
    # --quick: one round of A B B A; every request's 16 tokens were checked.
    for path in ("per-request", "batched"):
        assert len(data["runs"][path]) == 2
        assert all(run["cpu_us_per_token"] > 0 for run in data["runs"][path])
    assert "batched / per-request per round" in done.stdout


@pytest.mark.timeout(600)
def test_render_split_prices_every_configuration_of_both_rpcs(tmp_path: Path) -> None:
    import subprocess

    out = tmp_path / "render-split.json"
    command = [sys.executable, str(BENCHMARKS / "render_split.py"), "--rounds", "1"]
    done = subprocess.run(
        [*command, "--calls", "32", "--cpu", "-1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    data = json.loads(out.read_text())
    configs = {"floor", "floor-stream-read", "mount", "stack", "handler", "launcher", "direct"}
    assert configs <= set(data), data
    for config in configs:
        assert set(data[config]) == {"chat", "completion"}, config
        assert all(v > 0 for figures in data[config].values() for v in figures), config


def test_call_slots_benchmark_prices_a_unary_call_through_both_trees_stacks() -> None:
    import subprocess

    root = BENCHMARKS.parent
    done = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "call_slots.py"),
            *("--against-src", str(root), "--rounds", "2", "--calls", "200", "--callers", "4"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    # Both sides announce the stack they serve behind: this tree's has the call slots.
    assert done.stderr.count("CallSlotsInterceptor") == 2, done.stderr[-2000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["this_us_per_call"] > 0 and result["against_us_per_call"] > 0
    assert len(result["ratios"]) == 2


@pytest.mark.timeout(600)
def test_fairness_benchmark_measures_every_phase_on_the_launcher() -> None:
    import subprocess

    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "fairness.py"), "--seconds", "3", "--json"],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-2000:]
    rows = json.loads(done.stdout.splitlines()[-1])["this tree"]
    assert list(rows) == ["B alone", "B + A", "B + C", "A alone"]
    assert all(not row["failed"] for row in rows.values()), rows
    assert rows["B alone"]["b_requests"] > 0 and rows["B + A"]["b_requests"] > 0
    assert rows["B + A"]["heavy_prompt_tokens_per_s"] > 0
    assert rows["A alone"]["heavy_prompt_tokens_per_s"] > 0
    assert rows["B + C"]["b_ttft_p50_ratio"] > 0


@pytest.mark.timeout(900)
def test_gateway_benchmark_gets_every_token_through_smg_on_both_sides(tmp_path: Path) -> None:
    import subprocess

    script = str(BENCHMARKS / "gateway.py")
    # The gateway lives in a venv of its own (build/venv-smg), installed on first use.
    check = subprocess.run(
        [sys.executable, script, "--check-smg"], capture_output=True, text=True, timeout=900
    )
    if check.returncode != 0:
        pytest.skip(f"the SMG gateway (PyPI smg) cannot be installed or run here: {check.stdout}")
    out = tmp_path / "gateway.json"
    done = subprocess.run(
        [sys.executable, script, "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["problems"] == []
    # --quick: one round of A B B A, 32 requests of 32 tokens per burst, each checked
    # (HTTP 200, finish_reason length, usage.completion_tokens) through the gateway.
    for name in ("ours", "vllm-grpc"):
        figures = data["summary"]["servers"][name]
        assert figures["requests"] == figures["requests_ok"] == 2 * 32
        assert figures["tokens_per_s"] > 0 and figures["ttft_p50_ms"] is not None
        assert figures["gateway_cpu_us_per_token"] > 0
    bursts = data["bursts"]
    assert len(bursts) == 4
    assert all(b["output_tokens"] == 32 * 32 and b["errors"] == 0 for b in bursts)
    ratios = data["summary"]["ratios"]["ours/vllm-grpc"]
    assert ratios["tokens_per_s"]["median"] > 0
    # The gateway's own CPU per output token, ours over vLLM's, per round.
    assert ratios["gateway_cpu_per_token"]["median"] > 0
    assert all(b["gateway_cpu_s"] > 0 for b in bursts)
    assert "gateway CPU/token ratio" in done.stdout
