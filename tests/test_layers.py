"""The package's layers, as its imports draw them: the import contract.

Read from the source (every import that runs: at module level or inside a
function, but not under `if TYPE_CHECKING:`):

1. `LAYERS`: a module imports only modules of its own part or of a part in a
   layer below; parts of one layer do not import each other (the servicer and
   the interceptors share `context`, they never import one another);
2. no module outside the launcher (`serve/`, `__main__`) imports it;
3. the interceptors import no vLLM, followed through every module they reach;
4. `wire/` and `context` import no grpc, likewise;
5. no circle: no module imports, through any chain, a module that imports it
   back (a module's own packages aside: Python runs them before it, so they
   close no circle).

A failure names the import, or the chain of imports, that breaks the rule.
Subprocess checks confirm rule 3 (and that the package itself imports no
vLLM) at run time.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "vllm_servicer"
PACKAGE_DIR = ROOT / "src" / PACKAGE


class Module:
    """One module of the package: its file and what importing it imports."""

    def __init__(self, name: str, path: Path, is_package: bool) -> None:
        self.name = name
        self.path = path
        self.is_package = is_package
        self.imports: list[str] = []  # module names, of the package and outside it, in order

    @property
    def package(self) -> str:
        """The package that relative imports in this module start from."""
        return self.name if self.is_package else self.name.rpartition(".")[0]


Graph = dict[str, Module]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of `tree` but those under `if TYPE_CHECKING:` (its `else` runs)."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(reversed(node.orelse))
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


def _with_parents(name: str) -> list[str]:
    """`a.b.c` -> `a`, `a.b`, `a.b.c`: importing a module runs its packages first."""
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _resolve(module: Module, name: str, level: int) -> str:
    """The absolute name of a (possibly relative) import in `module`."""
    if level == 0:
        return name
    base = module.package.split(".")
    if level > 1:
        base = base[: -(level - 1)]
    return ".".join([*base, name] if name else base)


def _import_module_call(module: Module, node: ast.Call) -> str | None:
    """The module of `importlib.import_module("...")` or `__import__("...")`, when literal."""
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if called not in ("import_module", "__import__") or not node.args:
        return None
    first = node.args[0]
    if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
        return None  # a computed name: it is a lazy lookup, not an import on load
    name: str = first.value
    if not name.startswith("."):
        return name
    anchor = node.args[1] if len(node.args) > 1 else None
    if anchor is None:
        anchor = next((k.value for k in node.keywords if k.arg == "package"), None)
    if isinstance(anchor, ast.Name) and anchor.id == "__name__":
        package = module.name
    elif isinstance(anchor, ast.Name) and anchor.id == "__package__":
        package = module.package
    elif isinstance(anchor, ast.Constant) and isinstance(anchor.value, str):
        package = anchor.value
    else:
        return None
    level = len(name) - len(name.lstrip("."))
    parts = package.split(".")
    if level > 1:
        parts = parts[: -(level - 1)]
    rest = name[level:]
    return ".".join([*parts, rest] if rest else parts)


def import_graph(package_dir: Path, package: str) -> Graph:
    """Every module under `package_dir` (the package `package`) and what it imports.

    An import lists the module and its packages (importing `a.b` runs
    `a/__init__.py` first); `from .x import y` also lists `x.y` when that is a
    module. Each module also imports its own package, which Python runs first.
    """
    graph: Graph = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = [package, *path.relative_to(package_dir).with_suffix("").parts]
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        graph[".".join(parts)] = Module(".".join(parts), path, is_package)

    for module in graph.values():
        found: list[str] = []
        parent = module.name.rpartition(".")[0]
        if parent:
            found.append(parent)
        tree = ast.parse(module.path.read_text(), filename=str(module.path))
        for node in _runtime_nodes(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    found.extend(_with_parents(alias.name))
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(module, node.module or "", node.level)
                found.extend(_with_parents(target))
                for alias in node.names:
                    if f"{target}.{alias.name}" in graph:
                        found.append(f"{target}.{alias.name}")
            elif isinstance(node, ast.Call):
                called = _import_module_call(module, node)
                if called is not None:
                    found.extend(_with_parents(called))
        for name in found:
            if name != module.name and name not in module.imports:
                module.imports.append(name)
    return graph


def import_chain(graph: Graph, start: str, forbidden: Callable[[str], bool]) -> list[str] | None:
    """The shortest chain of imports from `start` to a module `forbidden` accepts, or None."""
    came_from: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        name = queue.popleft()
        if forbidden(name):
            chain = [name]
            while (previous := came_from[chain[-1]]) is not None:
                chain.append(previous)
            return chain[::-1]
        if name not in graph:
            continue  # outside the package: its own imports are not this package's
        for imported in graph[name].imports:
            if imported not in came_from:
                came_from[imported] = name
                queue.append(imported)
    return None


def _shown(graph: Graph, chain: list[str], package_dir: Path) -> str:
    """`a.b` -> `b.py`: the package's modules by file, the others by name."""
    return " -> ".join(
        graph[name].path.relative_to(package_dir).as_posix() if name in graph else name
        for name in chain
    )


def _violations(
    graph: Graph,
    package_dir: Path,
    starts: list[str],
    forbidden: Callable[[str], bool],
) -> list[str]:
    chains = (import_chain(graph, start, forbidden) for start in starts)
    return [_shown(graph, chain, package_dir) for chain in chains if chain is not None]


def _is_under(name: str, top: str) -> bool:
    return name == top or name.startswith(f"{top}.")


def _is_vllm(name: str) -> bool:
    return _is_under(name, "vllm")


def _is_grpc(name: str) -> bool:
    return _is_under(name, "grpc") or name.startswith("grpc_")


# Lowest first; each layer's parts (a module, or a package with everything under it).
LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "errors",
        "context",
        "options",
        "proto",
        "engine",
        "tls",
        "wire",
        "_vllm_version",
        "vllm_releases",
        "_registration",
        "frontends",
        "budgets",
        "load_reports",
        "ranks",
        "shares",
        "fair_work",
        "fair_steps",
        "prefix_cache",
        "flags",
    ),
    ("multimodal", "status", "health", "reflection"),
    # Side by side: they share `context`, never import one another.
    ("servicer", "interceptors"),
    # The HTTP API's way onto the engine: its in-flight slot and its id (the one claim path).
    # Per-tenant work for Prometheus reads the mount's tenant-aware engine.
    ("guard", "tenant_metrics"),
    ("mounting", "drain"),
    # Tiny models, stand-in engines and a test server, for users' tests too.
    ("testing",),
    ("serve",),
    ("__main__",),
)
# The foundations share one layer and may use each other.
_FOUNDATIONS = 0


def _part_of(
    name: str, package: str, layers: tuple[tuple[str, ...], ...]
) -> tuple[int, str] | None:
    """The layer and part of the package's module `name`; None for the package itself."""
    rest = name.removeprefix(f"{package}.")
    if rest == name or rest == package:
        return None
    top = rest.split(".")[0]
    for level, parts in enumerate(layers):
        if top in parts:
            return level, top
    raise AssertionError(f"{name} belongs to no layer of LAYERS: add it to one")


def layer_violations(
    package_dir: Path, package: str, layers: tuple[tuple[str, ...], ...] = LAYERS
) -> list[str]:
    """Rule 1: imports of a part in a higher layer, or of a sibling part of one layer."""
    graph = import_graph(package_dir, package)
    found = []
    for module in graph.values():
        source = _part_of(module.name, package, layers)
        if source is None:
            continue
        for imported in module.imports:
            if imported not in graph:
                continue
            target = _part_of(imported, package, layers)
            if target is None or target[1] == source[1]:
                continue
            upward = target[0] > source[0]
            sideways = target[0] == source[0] != _FOUNDATIONS
            if upward or sideways:
                found.append(_shown(graph, [module.name, imported], package_dir))
    return found


def cli_violations(package_dir: Path, package: str) -> list[str]:
    """Rule 2: chains from a module outside the launcher to the launcher."""
    graph = import_graph(package_dir, package)

    def launcher(name: str) -> bool:
        return _is_under(name, f"{package}.__main__") or _is_under(name, f"{package}.serve")

    starts = [name for name in graph if not launcher(name)]
    return _violations(graph, package_dir, starts, launcher)


def interceptor_vllm_violations(package_dir: Path, package: str) -> list[str]:
    """Rule 2: chains from a module of `interceptors` to vLLM."""
    graph = import_graph(package_dir, package)
    starts = [name for name in graph if _is_under(name, f"{package}.interceptors")]
    assert starts, "no interceptors package"
    return _violations(graph, package_dir, starts, _is_vllm)


def grpc_free_violations(package_dir: Path, package: str, parts: tuple[str, ...]) -> list[str]:
    """Rule 4: chains from a module of `parts` to grpc."""
    graph = import_graph(package_dir, package)
    starts = [n for n in graph for part in parts if _is_under(n, f"{package}.{part}")]
    assert starts, f"no module of {parts}"
    return _violations(graph, package_dir, starts, _is_grpc)


def import_cycles(package_dir: Path, package: str) -> list[str]:
    """Rule 5: each circle of imports between the package's modules, once, shortest first."""
    graph = import_graph(package_dir, package)
    # A module's own packages have started running before it: importing them closes no circle.
    edges = {
        name: [i for i in module.imports if i in graph and not _is_under(name, i)]
        for name, module in graph.items()
    }
    found: dict[tuple[str, ...], list[str]] = {}
    for start in sorted(graph):
        came_from: dict[str, str] = {}
        queue = deque([start])
        while queue:
            name = queue.popleft()
            if start in edges[name]:  # back to the start: a circle
                chain = [name]
                while chain[-1] != start:
                    chain.append(came_from[chain[-1]])
                circle = chain[::-1]
                first = circle.index(min(circle))  # one circle, whichever module it starts at
                found.setdefault(tuple(circle[first:] + circle[:first]), circle)
                break
            for imported in edges[name]:
                if imported not in came_from and imported != start:
                    came_from[imported] = name
                    queue.append(imported)
    circles = sorted(found, key=lambda circle: (len(circle), circle))
    return [_shown(graph, [*circle, circle[0]], package_dir) for circle in circles]


def convert_grpc_violations(package_dir: Path, package: str) -> list[str]:
    return grpc_free_violations(package_dir, package, ("convert",))


# ----- the rules, on this package ---------------------------------------------------


def test_each_layer_imports_only_the_layers_below() -> None:
    violations = layer_violations(PACKAGE_DIR, PACKAGE)
    assert not violations, "an import across the layers:\n" + "\n".join(violations)


def test_only_the_launcher_imports_the_launcher() -> None:
    violations = cli_violations(PACKAGE_DIR, PACKAGE)
    assert not violations, "the library imports the CLI:\n" + "\n".join(violations)


def test_the_interceptors_import_no_vllm() -> None:
    violations = interceptor_vllm_violations(PACKAGE_DIR, PACKAGE)
    assert not violations, "an interceptor imports vLLM:\n" + "\n".join(violations)


def test_the_wire_and_the_call_context_import_no_grpc() -> None:
    violations = grpc_free_violations(PACKAGE_DIR, PACKAGE, ("wire", "context"))
    assert not violations, "grpc imported:\n" + "\n".join(violations)


def test_no_module_imports_itself_through_others() -> None:
    circles = import_cycles(PACKAGE_DIR, PACKAGE)
    assert not circles, "a circle of imports:\n" + "\n".join(circles)


def test_the_type_checking_imports_name_the_public_api() -> None:
    # __init__ loads its names lazily; type checkers see them through these imports.
    tree = ast.parse((PACKAGE_DIR / "__init__.py").read_text())
    typed = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and _is_type_checking(node.test)
        for inner in node.body
        if isinstance(inner, ast.ImportFrom)
        for alias in inner.names
    }
    import vllm_servicer

    assert typed == set(vllm_servicer.__all__) - {"__version__"}


# ----- the checker itself, on a small package -----------------------------------------


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root / "pkg"


_CLEAN = {
    "__init__.py": """
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from .convert import to_wire  # for type checkers only: never runs
        def __getattr__(name):
            import importlib
            return importlib.import_module(f".{name}", __name__)  # computed: lazy
    """,
    "__main__.py": "from .convert import to_wire\nimport vllm\n",
    "errors.py": "",
    "convert.py": "import vllm.inputs\nfrom .errors import *\nfrom . import proto\n",
    "proto/__init__.py": "from . import messages\n",
    "proto/messages.py": "import google.protobuf\n",
    "proto/stubs.py": "import grpc\n",
    "interceptors/__init__.py": "from .auth import Auth\n",
    "interceptors/auth.py": """
        import grpc
        from ..proto import messages
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            import vllm
        else:
            import os
    """,
}


def test_the_checker_passes_a_clean_package(tmp_path: Path) -> None:
    root = _write(tmp_path, _CLEAN)
    assert cli_violations(root, "pkg") == []
    assert interceptor_vllm_violations(root, "pkg") == []
    assert convert_grpc_violations(root, "pkg") == []


def test_the_checker_passes_packages_importing_their_modules(tmp_path: Path) -> None:
    # interceptors/__init__.py imports auth.py, which runs its package first: no circle.
    assert import_cycles(_write(tmp_path, _CLEAN), "pkg") == []


def test_the_checker_finds_circles_of_imports(tmp_path: Path) -> None:
    # Inside a function still closes a circle: both modules are each other's to load.
    files = {
        **_CLEAN,
        "errors.py": "def f():\n    from .convert import to_wire\n",
        "proto/stubs.py": "from ..interceptors import auth\n",
        "interceptors/auth.py": "from ..proto import stubs\n",
    }
    assert import_cycles(_write(tmp_path, files), "pkg") == [
        "convert.py -> errors.py -> convert.py",
        "interceptors/auth.py -> proto/stubs.py -> interceptors/auth.py",
        "interceptors/__init__.py -> interceptors/auth.py -> proto/stubs.py"
        " -> interceptors/__init__.py",
    ]


def test_the_checker_resolves_imports(tmp_path: Path) -> None:
    root = _write(tmp_path, _CLEAN)
    graph = import_graph(root, "pkg")
    # `from . import proto` imports the package; `from .proto import messages` the module.
    assert graph["pkg.convert"].imports == ["pkg", "vllm", "vllm.inputs", "pkg.errors", "pkg.proto"]
    assert graph["pkg.interceptors.auth"].imports == [
        "pkg.interceptors",
        "grpc",
        "pkg",
        "pkg.proto",
        "pkg.proto.messages",
        "typing",
        "os",
    ]
    assert graph["pkg.proto.messages"].imports == ["pkg.proto", "google", "google.protobuf"]
    assert graph["pkg"].imports == ["typing", "importlib"]


def test_the_checker_finds_the_launcher_imported(tmp_path: Path) -> None:
    # Inside a function, and relative: still an import of the launcher.
    files = {**_CLEAN, "errors.py": "def f():\n    from .__main__ import main\n"}
    root = _write(tmp_path, files)
    assert sorted(cli_violations(root, "pkg")) == [
        "convert.py -> errors.py -> __main__.py",
        "errors.py -> __main__.py",
    ]


def test_the_checker_finds_the_launcher_imported_from_its_package(tmp_path: Path) -> None:
    files = {**_CLEAN, "proto/stubs.py": "from .. import __main__\n"}
    root = _write(tmp_path, files)
    assert cli_violations(root, "pkg") == ["proto/stubs.py -> __main__.py"]


def test_the_checker_finds_vllm_behind_an_interceptor(tmp_path: Path) -> None:
    files = {
        **_CLEAN,
        "engine.py": "def load():\n    import vllm.v1.engine\n",
        "interceptors/tracing.py": "from ..engine import load\n",
        "interceptors/__init__.py": "from .auth import Auth\nfrom . import tracing\n",
    }
    root = _write(tmp_path, files)
    assert sorted(interceptor_vllm_violations(root, "pkg")) == [
        "interceptors/__init__.py -> interceptors/tracing.py -> engine.py -> vllm",
        # auth.py runs its package's __init__ first, which imports tracing.py.
        "interceptors/auth.py -> interceptors/__init__.py -> interceptors/tracing.py"
        " -> engine.py -> vllm",
        "interceptors/tracing.py -> engine.py -> vllm",
    ]


def test_the_checker_finds_vllm_loaded_by_name(tmp_path: Path) -> None:
    files = {
        **_CLEAN,
        "version.py": 'import importlib\nimportlib.import_module("vllm.version")\n',
        "interceptors/auth.py": "from .. import version\n",
    }
    root = _write(tmp_path, files)
    assert sorted(interceptor_vllm_violations(root, "pkg")) == [
        "interceptors/__init__.py -> interceptors/auth.py -> version.py -> vllm",
        "interceptors/auth.py -> version.py -> vllm",
    ]


def test_the_checker_finds_imports_across_layers(tmp_path: Path) -> None:
    layers = (("errors", "context"), ("interceptors", "multimodal"), ("servicer",))
    files = {
        "__init__.py": "",
        "errors.py": "",
        "context.py": "from .errors import *\n",  # foundations use each other
        "interceptors/__init__.py": "from ..context import x\n",
        "interceptors/auth.py": "from ..servicer import service\n",  # up a layer
        "multimodal.py": "from . import interceptors\n",  # a sibling part
        "servicer/__init__.py": "",
        "servicer/service.py": "from ..interceptors import auth\nfrom . import rpcs\n",
        "servicer/rpcs.py": "",
    }
    root = _write(tmp_path, files)
    assert sorted(layer_violations(root, "pkg", layers)) == [
        "interceptors/auth.py -> servicer/__init__.py",
        "interceptors/auth.py -> servicer/service.py",
        "multimodal.py -> interceptors/__init__.py",
    ]
    files["notalayer.py"] = ""
    with pytest.raises(AssertionError, match="no layer"):
        layer_violations(_write(tmp_path / "again", files), "pkg", layers)


def test_the_checker_finds_grpc_behind_conversion(tmp_path: Path) -> None:
    files = {**_CLEAN, "proto/__init__.py": "from . import messages, stubs\n"}
    root = _write(tmp_path, files)
    assert convert_grpc_violations(root, "pkg") == [
        "convert.py -> proto/__init__.py -> proto/stubs.py -> grpc"
    ]
    files["proto/__init__.py"] = "from . import messages\n"
    files["errors.py"] = "from grpc_status import rpc_status\n"
    root = _write(tmp_path, files)
    assert convert_grpc_violations(root, "pkg") == ["convert.py -> errors.py -> grpc_status"]


# ----- the same, at run time ----------------------------------------------------------


def _run(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


_LOADED_VLLM = """
import sys
{imports}
loaded = sorted(name for name in sys.modules if name == "vllm" or name.startswith("vllm."))
assert not loaded, loaded
"""


@pytest.mark.parametrize(
    "imports",
    [
        "import vllm_servicer",
        "import vllm_servicer.interceptors",
        "import vllm_servicer.interceptors.auth, vllm_servicer.interceptors.metrics, "
        "vllm_servicer.interceptors.inflight",
    ],
    ids=["package", "interceptors", "interceptor-modules"],
)
def test_imports_that_load_no_vllm(imports: str) -> None:
    _run(_LOADED_VLLM.format(imports=imports))


def test_the_messages_load_no_grpc() -> None:
    _run(
        """
        import sys
        from vllm_servicer.proto import vllm_engine_pb2, SERVICE_NAME
        loaded = [name for name in sys.modules if name.partition(".")[0] == "grpc"]
        assert not loaded, loaded
        from vllm_servicer.proto import vllm_engine_pb2_grpc
        assert "grpc" in sys.modules
        """
    )


@pytest.mark.parametrize(
    "first",
    ["vllm_servicer.mount", "__import__('vllm_servicer.mounting')"],
    ids=["attribute-first", "submodule-first"],
)
def test_the_public_names_load_on_use(first: str) -> None:
    _run(
        f"""
        import inspect
        import vllm_servicer
        assert "__version__" in vars(vllm_servicer)
        {first}
        from vllm_servicer.mounting import mount as defined
        assert inspect.isfunction(defined)
        assert vllm_servicer.mount is defined, vllm_servicer.mount
        from vllm_servicer import mount
        assert mount is defined
        for name in vllm_servicer.__all__:
            getattr(vllm_servicer, name)
        assert set(vllm_servicer.__all__) <= set(dir(vllm_servicer))
        namespace = {{}}
        exec("from vllm_servicer import *", namespace)
        assert namespace["mount"] is defined
        try:
            vllm_servicer.no_such_name
        except AttributeError:
            pass
        else:
            raise AssertionError("an unknown name resolved")
        """
    )


ARCHITECTURE = ROOT / "docs" / "architecture.md"


def _table_rows(text: str) -> list[list[str]]:
    """Every row of every table in `text`, as its cells."""
    return [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith("| ") and not line.startswith("|---")
    ]


def test_the_architecture_names_every_module() -> None:
    """docs/architecture.md's module table names each module of the package: by
    its path, or by its file name in a row that begins with its folder."""
    rows = [row for row in _table_rows(ARCHITECTURE.read_text()) if not row[0].isdigit()]
    missing = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        relative = path.relative_to(PACKAGE_DIR).as_posix()
        generated = "_pb2" in path.name or relative.startswith("proto/vllm_servicer/")
        if generated or (path.name == "__init__.py" and "/" in relative):
            continue
        folder = relative.rsplit("/", 1)[0] + "/" if "/" in relative else None
        named = any(
            f"`{relative}`" in " ".join(row)
            or (folder and row[0].startswith(f"`{folder}") and f"`{path.name}`" in " ".join(row))
            for row in rows
        )
        if not named:
            missing.append(relative)
    assert not missing, f"docs/architecture.md names no row for {missing}"


def test_the_architectures_layers_are_the_ones_the_imports_keep() -> None:
    """Its table of layers lists the parts of `LAYERS`, layer by layer."""
    documented: dict[int, set[str]] = {}
    for row in _table_rows(ARCHITECTURE.read_text()):
        if len(row) == 3 and row[0].isdigit():
            parts = re.findall(r"`([^`]+)`", row[1])
            documented[int(row[0])] = {p.removesuffix(".py").rstrip("/") for p in parts}
    expected = {level: set(parts) for level, parts in enumerate(LAYERS)}
    assert documented == expected


MODULE_LINES = 500
"""A module past this many lines is read as holding more than one job."""
MODULES_PAST_IT = 10
"""How many may still run past it (the call wrapper, the field table, ...)."""


def test_few_modules_run_past_500_lines() -> None:
    """Hand-written modules longer than MODULE_LINES stay at most MODULES_PAST_IT:
    a module that grows past it is split where it holds two jobs."""
    long = sorted(
        (len(path.read_text().splitlines()), path.relative_to(PACKAGE_DIR).as_posix())
        for path in PACKAGE_DIR.rglob("*.py")
        if "_pb2" not in path.name
    )
    past = [(lines, name) for lines, name in long if lines > MODULE_LINES]
    assert len(past) <= MODULES_PAST_IT, past


def _hand_written() -> Iterator[tuple[str, ast.Module]]:
    """Each hand-written module of the package (generated `_pb2` code left out),
    by its path in the package, parsed."""
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        if "_pb2" not in path.name:
            yield path.relative_to(PACKAGE_DIR).as_posix(), ast.parse(path.read_text())


ANY_IN_ANNOTATIONS = 550
"""How many `Any` the package's annotations may still hold, all modules together."""


def _annotations(tree: ast.Module) -> Iterator[ast.expr]:
    """Every parameter, return and annotated-assignment annotation of `tree`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            arguments = node.args
            params = (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)
            for arg in (*params, arguments.vararg, arguments.kwarg):
                if arg is not None and arg.annotation is not None:
                    yield arg.annotation
            if node.returns is not None:
                yield node.returns
        elif isinstance(node, ast.AnnAssign):
            yield node.annotation


def _anys(annotation: ast.expr) -> int:
    """How often `Any` (or `typing.Any`) appears in `annotation`, strings read as annotations."""
    found = 0
    for node in ast.walk(annotation):
        if (isinstance(node, ast.Name) and node.id == "Any") or (
            isinstance(node, ast.Attribute) and node.attr == "Any"
        ):
            found += 1
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                found += _anys(ast.parse(node.value, mode="eval").body)
            except SyntaxError:
                pass  # a string that is no expression (a Literal value of two words, say)
    return found


def test_any_in_annotations_stays_at_most_550() -> None:
    """`Any` in the annotations of the hand-written modules, counted over the
    whole package, stays at most ANY_IN_ANNOTATIONS: a value is typed as what
    it is (grpc's, protobuf's, a Protocol, `object` when only passed on)."""
    counts = {name: sum(_anys(a) for a in _annotations(tree)) for name, tree in _hand_written()}
    total = sum(counts.values())
    worst = sorted(counts.items(), key=lambda item: -item[1])[:10]
    assert total <= ANY_IN_ANNOTATIONS, (
        f"{total} Any in annotations, past {ANY_IN_ANNOTATIONS}; the most in "
        + ", ".join(f"{name} ({count})" for name, count in worst)
    )


FUNCTION_LINES = 80
"""A function past this many lines, its docstring included, holds more than one job."""


def _lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The lines of `function`, from its `def` (not its decorators) to its last."""
    return (function.end_lineno or function.lineno) - function.lineno + 1


def test_no_function_runs_past_80_lines() -> None:
    """Every function of the hand-written modules, nested ones included, runs at
    most FUNCTION_LINES lines from its `def` to its last line."""
    functions = [
        (_lines(node), f"{name}::{node.name}")
        for name, tree in _hand_written()
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    ]
    long = sorted(function for function in functions if function[0] > FUNCTION_LINES)
    assert not long, f"past {FUNCTION_LINES} lines: " + ", ".join(
        f"{where} ({lines})" for lines, where in reversed(long)
    )
