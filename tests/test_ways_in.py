"""Every way in has its row in tests/support/ways_in.py, and every row says how each
tenant-isolation promise holds there.

The table is held to what the launcher serves: each RPC of every service it can
mount (read from the proto descriptors) and each route of vLLM's HTTP app as
the launcher builds it, with every switch that adds routes on (listed in a
process of its own: building the app imports much of vLLM, and starts no
engine). A new RPC or route fails here, named, until its row says how each
promise holds for it. Each test a cell cites must exist; the rows' ways in are
those of docs/security.md's "Every way in, every promise"; and the gaps are
exactly the short list below, printed.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pool
from support.ways_in import WAYS_IN, Gap, Keyless, NotApplicable, Via, cited

from vllm_servicer.mounting import HEALTH_SERVICE_NAME, REFLECTION_SERVICE_NAME
from vllm_servicer.options import SERVICES
from vllm_servicer.proto import ORCA_SERVICE, POOL

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "security.md"
DOC_SECTION = "## Every way in, every promise"

KNOWN_GAPS = {
    ("hold", "a deadline between messages: an idle realtime session keeps its call slot"),
}
"""(harm, what is missing): the promises known not to hold, or unproved, somewhere."""

HTTP_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "WS", "MOUNT")

# vLLM's app as the launcher builds it (its own arguments, `frontend_args`), with every
# switch that adds routes on: runtime LoRA, vLLM's dev and RL routes (environment),
# the profiler, fault tolerance and scale-out (launcher flags), every task vLLM names,
# and a stand-in model config that enables the pooling and scoring routes.
_LIST_ROUTES = """
import json, sys, types
from vllm.entrypoints.launchers.app import build_app
from vllm.tasks import FRONTEND_TASKS, GENERATION_TASKS, POOLING_TASKS
from vllm_servicer.serve.args import parse_args
from vllm_servicer.serve.http_api import frontend_args

argv = ["serve", "--model", "m", "--http-port", "0", "--enable-scale-out",
        "--enable-fault-tolerance", "--profiler-config", sys.argv[1]]
served = frontend_args(parse_args(argv), "127.0.0.1", 0)

class EveryPoolingRoute:
    hf_config = types.SimpleNamespace(num_labels=1)
    io_processor_plugin = None
    def get_pooling_task(self, tasks):
        return "embed"

tasks = (*GENERATION_TASKS, *POOLING_TASKS, *FRONTEND_TASKS)
app = build_app(served, tasks, EveryPoolingRoute())
names = []
for route in app.routes:
    kind, path = type(route).__name__, route.path
    if "WebSocket" in kind:
        names.append(f"WS {path}")
    elif kind == "Mount":
        names.append(f"MOUNT {path}")
    elif getattr(route, "methods", None):
        names.extend(f"{m} {path}" for m in sorted(set(route.methods) - {"HEAD"}))
    else:
        names.append(f"{kind} {path}")
print("ROUTES " + json.dumps(names))
"""


def _kind(name: str) -> str:
    if name.startswith("/"):
        return "grpc"
    if name.split(" ", 1)[0] in HTTP_METHODS and " /" in name:
        return "http"
    return "other"


def _rows(kind: str) -> list[str]:
    return [row.name for row in WAYS_IN if _kind(row.name) == kind]


def _one_row_each(served: set[str], rows: list[str], what: str) -> None:
    missing = sorted(served - set(rows))
    assert not missing, f"{what} without a row in tests/support/ways_in.py: {missing}"
    stale = sorted(set(rows) - served)
    assert not stale, f"rows of tests/support/ways_in.py for no {what}: {stale}"
    twice = sorted({name for name in rows if rows.count(name) > 1})
    assert not twice, f"{what} with more than one row: {twice}"


def _served_rpcs() -> set[str]:
    """Every RPC of every service the launcher can serve, from the descriptors."""
    rpcs: set[str] = set()
    for name in (*SERVICES, ORCA_SERVICE, HEALTH_SERVICE_NAME, REFLECTION_SERVICE_NAME):
        pool = POOL if name in (*SERVICES, ORCA_SERVICE) else descriptor_pool.Default()
        service = pool.FindServiceByName(name)
        rpcs.update(f"/{service.full_name}/{method.name}" for method in service.methods)
    return rpcs


@pytest.fixture(scope="module")
def http_routes(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """Every route of vLLM's HTTP app as the launcher builds it, switches on."""
    profiler = {"profiler": "torch", "torch_profiler_dir": str(tmp_path_factory.mktemp("p"))}
    env = {
        **os.environ,
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_LOGGING_LEVEL": "ERROR",
    }
    listed = subprocess.run(
        [sys.executable, "-c", _LIST_ROUTES, json.dumps(profiler)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    lines = [line for line in listed.stdout.splitlines() if line.startswith("ROUTES ")]
    assert listed.returncode == 0 and lines, listed.stderr[-4000:]
    return set(json.loads(lines[-1].removeprefix("ROUTES ")))


def test_every_rpc_the_launcher_serves_has_one_row() -> None:
    _one_row_each(_served_rpcs(), _rows("grpc"), "RPCs")


def test_every_http_route_has_one_row(http_routes: set[str]) -> None:
    _one_row_each(http_routes, _rows("http"), "HTTP routes")


def test_every_cell_says_how_its_promise_holds() -> None:
    for row in WAYS_IN:
        for harm, cell in row.cells().items():
            where = f"{row.name} {harm}"
            if isinstance(cell, tuple):
                assert cell and all(isinstance(p, str | Via) for p in cell), where
                continue
            assert isinstance(cell, str | Via | NotApplicable | Keyless | Gap), where
            for text in (getattr(cell, f, "x") for f in ("note", "reason", "missing")):
                assert text.strip() and "\n" not in text, f"{where}: one line, please"


@functools.cache
def _test_functions(path: str) -> frozenset[str]:
    tree = ast.parse((ROOT / path).read_text(), filename=path)
    return frozenset(
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.name.startswith("test_")
    )


def test_every_cited_test_exists() -> None:
    unknown = set()
    for row in WAYS_IN:
        for cell in row.cells().values():
            for node_id in cited(cell):
                match = re.fullmatch(r"(tests/test_\w+\.py)::(test_\w+)(\[[^\]]+\])?", node_id)
                if match is None:
                    unknown.add(f"{node_id} (not a node id)")
                elif not (ROOT / match[1]).is_file():
                    unknown.add(f"{node_id} (no such file)")
                elif match[2] not in _test_functions(match[1]):
                    unknown.add(f"{node_id} (no such test)")
    assert not unknown, "\n".join(sorted(unknown))


def _doc_ways_in() -> set[str]:
    """The bold names of the rows of docs/security.md's "Every way in, every promise"."""
    text = DOC.read_text()
    assert DOC_SECTION in text, f"{DOC} has no section {DOC_SECTION!r}"
    section = text.split(DOC_SECTION, 1)[1].split("\n## ", 1)[0]
    return {m[1] for m in re.finditer(r"^\| \*\*(.+?)\*\*", section, re.MULTILINE)}


def test_the_rows_are_the_ways_in_docs_security_names() -> None:
    documented, tabled = _doc_ways_in(), {row.doc for row in WAYS_IN}
    assert documented, "no ways in found in the doc's table"
    assert not documented - tabled, f"ways in of the doc without rows: {documented - tabled}"
    assert not tabled - documented, f"rows of ways in the doc does not name: {tabled - documented}"


def test_the_gaps_are_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    marked: dict[tuple[str, str], list[str]] = {}
    for row in WAYS_IN:
        for harm, cell in row.cells().items():
            if isinstance(cell, Gap):
                marked.setdefault((harm, cell.missing), []).append(row.name)
    with capsys.disabled():
        print(f"\n{len(marked)} known gaps in tests/support/ways_in.py:")
        for (harm, missing), ways in sorted(marked.items()):
            print(f"  {harm}: {missing}\n    {', '.join(ways)}")
    assert set(marked) == KNOWN_GAPS, (
        f"new gaps: {set(marked) - KNOWN_GAPS}; closed gaps: {KNOWN_GAPS - set(marked)}"
    )
