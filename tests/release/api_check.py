"""The next vLLM release seen before a user sees it: what vllm_servicer uses of vLLM, compared.

    python tests/release/api_check.py 0.33.0 [--against 0.32.0] [--import-venv PATH]
                                     [--json] [--strict] [--update-allowlist]

Fetches the `vllm==RELEASE` wheel without dependencies (`pip download --no-deps`,
cached under `build/release-cache/wheels/`) and compares it with the installed
vLLM (the running interpreter's, else the project's `.venv`), or with `--against
VERSION` (the installed one when its version matches, else that wheel too).
Nothing is imported: both releases are read as source with `ast`.

What is compared, all found statically in `src/vllm_servicer/`:

- every `import vllm...` / `from vllm... import name` (inside functions too) and
  `importlib.import_module("vllm...")`: the module or name must still be there,
  else it is reported as moved (to where the new release defines it) or missing;
- attribute chains on those names (`ZmqEventPublisher.END_SEQ`,
  `getattr(vllm, "__version__")`), and on parameters annotated with, or narrowed
  by `isinstance` to, an imported vLLM class (`output.num_cached_tokens`);
- the signature (parameter names, kinds, defaults; not annotations) of every
  imported function and class: a class's constructor, or its fields when it is
  a dataclass / msgspec Struct / NamedTuple / TypedDict / pydantic model, with
  the keywords the package passes at each call checked against the new one;
- methods the package overrides in a subclass of a vLLM class, and the members
  of the package's engine Protocols (`engine.EngineClient` and friends, mapped
  to the vLLM classes they stand for in PROTOCOL_TARGETS below);
- the exception classes of every module the package takes exceptions from: new
  classes, and places on the engine's path (not vllm/entrypoints/) that newly
  build one (a class the package maps now raised somewhere new, or one it does
  not map now raised at all).

With `--import-venv PATH` (e.g. the venv of `hybrid_env.py`) each used module and
name is also imported there, in one subprocess, with the variables of
`PATH/hybrid.env` set; failures are reported.

Every difference has a key. `tests/release/handled.toml` lists keys the package
already handles, each with a one-line `reason`; an entry with an empty reason does
not count. `--strict` exits 1 when a difference is not handled (0 otherwise,
always 0 without it). `--update-allowlist` appends the unlisted differences to
the file with empty reasons. Standard library only.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR = ROOT / "src" / "vllm_servicer"
PACKAGE = "vllm_servicer"
CACHE = ROOT / "build" / "release-cache" / "wheels"
ALLOWLIST = Path(__file__).resolve().parent / "handled.toml"

# The package's Protocols (module.class) and the vLLM class each one stands for.
PROTOCOL_TARGETS = {
    "vllm_servicer.engine.EngineClient": "vllm.v1.engine.async_llm.AsyncLLM",
    "vllm_servicer.engine.Renderer": "vllm.renderers.base.BaseRenderer",
    "vllm_servicer.engine.EngineCoreClient": "vllm.v1.engine.core_client.AsyncMPClient",
}
# Where a newly raised exception reaches the servicer: everything but vLLM's own
# servers and tools.
OFF_ENGINE_PATH = ("vllm/entrypoints/", "vllm/benchmarks/", "vllm/third_party/", "vllm/collect_env")
FIELD_BASES = {"Struct", "NamedTuple", "TypedDict", "BaseModel"}
# Attributes (of the engine, a processor context...) holding vLLM's configs, and
# parameters of these names: their own attributes are checked on these classes.
CONFIG_ATTRS = {
    "model_config": "vllm.config.model.ModelConfig",
    "vllm_config": "vllm.config.vllm.VllmConfig",
}
BUILTIN_EXCEPTIONS = {
    n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)
}


# ----- reading a release's source ------------------------------------------------------------


class Tree:
    """The `vllm/` sources of one release: a site-packages folder or a wheel."""

    def __init__(
        self, label: str, version: str, *, folder: Path | None = None, wheel: Path | None = None
    ):
        self.label, self.version = label, version
        self._folder, self._zip = folder, zipfile.ZipFile(wheel) if wheel else None
        if self._zip is not None:
            names = self._zip.namelist()
        else:
            assert folder is not None
            names = [
                str(p.relative_to(folder))
                for p in (folder / "vllm").rglob("*.py")
                if "__pycache__" not in p.parts
            ]
        self.files = sorted(n for n in names if n.startswith("vllm/") and n.endswith(".py"))
        self._set = set(self.files)
        self._text: dict[str, str] = {}

    def has(self, rel: str) -> bool:
        return rel in self._set

    def read(self, rel: str) -> str:
        if rel not in self._text:
            if self._zip is not None:
                data = self._zip.read(rel)
            else:
                assert self._folder is not None
                data = (self._folder / rel).read_bytes()
            self._text[rel] = data.decode("utf-8", "replace")
        return self._text[rel]


def module_of(rel: str) -> str:
    mod = rel[:-3].replace("/", ".")
    return mod[: -len(".__init__")] if mod.endswith(".__init__") else mod


def dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([target] if target else []))


@dataclasses.dataclass
class Def:
    kind: str  # class | function | value | reexport
    module: str
    name: str
    node: ast.AST | None = None
    target: str = ""  # reexport: the qualified name it stands for


@dataclasses.dataclass
class Obj:
    """A resolved name: what it is and where it is defined."""

    kind: str  # module | class | function | value | member
    qual: str  # where it is defined (module.Class.member)
    module: str
    node: ast.AST | None = None
    owner: Obj | None = None  # a member's class
    member_kind: str = ""  # method | property | classattr | instattr | nested


def toplevel(stmts: Iterable[ast.stmt]) -> Iterator[ast.stmt]:
    """A module's or class's statements, looking into if/try/with blocks."""
    for stmt in stmts:
        if isinstance(stmt, ast.If):
            yield from toplevel(stmt.body)
            yield from toplevel(stmt.orelse)
        elif isinstance(stmt, ast.Try) or type(stmt).__name__ == "TryStar":
            yield from toplevel(stmt.body)  # type: ignore[attr-defined]
            for handler in stmt.handlers:  # type: ignore[attr-defined]
                yield from toplevel(handler.body)
            yield from toplevel(stmt.orelse)  # type: ignore[attr-defined]
            yield from toplevel(stmt.finalbody)  # type: ignore[attr-defined]
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            yield from toplevel(stmt.body)
        else:
            yield stmt


class Index:
    """Static look-ups in one Tree: modules, their names, classes' members, signatures."""

    def __init__(self, tree: Tree):
        self.tree = tree
        self._ast: dict[str, ast.Module | None] = {}
        self._defs: dict[str, tuple[dict[str, Def], list[str]]] = {}
        self._members: dict[str, dict[str, Obj]] = {}
        self.unparsable: list[str] = []

    # modules
    def module_rel(self, mod: str) -> str | None:
        path = mod.replace(".", "/")
        for rel in (f"{path}.py", f"{path}/__init__.py"):
            if self.tree.has(rel):
                return rel
        return None

    def is_module(self, mod: str) -> bool:
        return self.module_rel(mod) is not None

    def parse(self, rel: str) -> ast.Module | None:
        if rel not in self._ast:
            try:
                self._ast[rel] = ast.parse(self.tree.read(rel), filename=rel)
            except SyntaxError:
                self._ast[rel] = None
                self.unparsable.append(rel)
        return self._ast[rel]

    def module_ast(self, mod: str) -> ast.Module | None:
        rel = self.module_rel(mod)
        return self.parse(rel) if rel else None

    def defs(self, mod: str) -> tuple[dict[str, Def], list[str]]:
        """A module's top-level names, and the modules it star-imports."""
        if mod in self._defs:
            return self._defs[mod]
        rel = self.module_rel(mod)
        tree = self.parse(rel) if rel else None
        defs: dict[str, Def] = {}
        stars: list[str] = []
        self._defs[mod] = (defs, stars)
        if tree is None or rel is None:
            return defs, stars
        is_pkg = rel.endswith("__init__.py")
        lazy: dict[str, str] = {}
        for stmt in toplevel(tree.body):
            if isinstance(stmt, ast.ClassDef):
                defs[stmt.name] = Def("class", mod, stmt.name, stmt)
            elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defs[stmt.name] = Def("function", mod, stmt.name, stmt)
            elif isinstance(stmt, ast.Assign):
                for target in stmt.targets:
                    if isinstance(target, ast.Name):
                        defs.setdefault(target.id, Def("value", mod, target.id, stmt.value))
                if isinstance(stmt.value, ast.Dict):
                    lazy.update(self._lazy_table(stmt.value, mod, is_pkg))
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                defs.setdefault(stmt.target.id, Def("value", mod, stmt.target.id, stmt.value))
            elif isinstance(stmt, ast.ImportFrom):
                source = resolve_relative(mod, is_pkg, stmt.level, stmt.module)
                for alias in stmt.names:
                    if alias.name == "*":
                        stars.append(source)
                    else:
                        name = alias.asname or alias.name
                        defs[name] = Def("reexport", mod, name, stmt, f"{source}.{alias.name}")
            elif isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if alias.asname:
                        defs[alias.asname] = Def("reexport", mod, alias.asname, stmt, alias.name)
                    else:
                        top = alias.name.split(".")[0]
                        defs.setdefault(top, Def("reexport", mod, top, stmt, top))
        for name, target in lazy.items():
            defs.setdefault(name, Def("reexport", mod, name, None, target))
        return defs, stars

    @staticmethod
    def _lazy_table(node: ast.Dict, mod: str, is_pkg: bool) -> dict[str, str]:
        # vllm/__init__.py's MODULE_ATTRS = {"SamplingParams": ".sampling_params:SamplingParams"}.
        out: dict[str, str] = {}
        for key, value in zip(node.keys, node.values, strict=True):
            if not (isinstance(key, ast.Constant) and isinstance(value, ast.Constant)):
                return {}
            if not (isinstance(key.value, str) and isinstance(value.value, str)):
                return {}
            if ":" not in value.value:
                return {}
            where, attr = value.value.split(":", 1)
            level = len(where) - len(where.lstrip("."))
            source = resolve_relative(mod, is_pkg, level, where.lstrip(".") or None)
            out[key.value] = f"{source}.{attr}"
        return out

    # names
    def resolve(self, qual: str, depth: int = 0) -> Obj | None:
        if depth > 25 or not qual.startswith("vllm"):
            return None
        parts = qual.split(".")
        for i in range(len(parts), 0, -1):
            mod = ".".join(parts[:i])
            if self.is_module(mod):
                break
        else:
            return None
        rest = parts[i:]
        if not rest:
            return Obj("module", mod, mod)
        return self._in_module(mod, rest, depth)

    def _in_module(self, mod: str, rest: list[str], depth: int) -> Obj | None:
        defs, stars = self.defs(mod)
        d = defs.get(rest[0])
        if d is None:
            for star in stars:
                found = self.resolve(".".join([star, *rest]), depth + 1)
                if found:
                    return found
            return None
        if d.kind == "reexport":
            return self.resolve(".".join([d.target, *rest[1:]]), depth + 1)
        obj = Obj(d.kind, f"{mod}.{d.name}", mod, d.node)
        if len(rest) == 1:
            return obj
        if d.kind == "class":
            return self.member(obj, rest[1:], depth)
        if d.kind == "value" and isinstance(d.node, ast.Call):
            # A module-level instance (`global_http_connection = HTTPConnection()`).
            cls = self.resolve_in(mod, d.node.func, depth)
            if cls is not None and cls.kind == "class":
                return self.member(cls, rest[1:], depth)
        return None

    def resolve_in(self, mod: str, expr: ast.AST, depth: int = 0) -> Obj | None:
        """What an expression in module `mod` (a name or dotted name) refers to."""
        name = dotted(expr)
        if name is None:
            return None
        first, _, tail = name.partition(".")
        defs, _ = self.defs(mod)
        d = defs.get(first)
        if d is None:
            return None
        base = d.target if d.kind == "reexport" else f"{mod}.{first}"
        return self.resolve(f"{base}.{tail}" if tail else base, depth + 1)

    def member(self, cls: Obj, rest: list[str], depth: int = 0) -> Obj | None:
        members = self.members(cls)
        found = members.get(rest[0])
        if found is None or len(rest) == 1:
            return found
        if found.member_kind == "nested":
            return self.member(Obj("class", found.qual, found.module, found.node), rest[1:], depth)
        return found  # an attribute's own attributes are not followed

    def bases(self, cls: Obj) -> tuple[list[Obj], list[str]]:
        """A class's bases in vLLM, and the names of the others."""
        inside, outside = [], []
        assert isinstance(cls.node, ast.ClassDef)
        for base in cls.node.bases:
            if isinstance(base, ast.Subscript):  # Generic[T], BaseRenderer[_T]
                base = base.value
            found = self.resolve_in(cls.module, base)
            if found is not None and found.kind == "class":
                inside.append(found)
            else:
                name = dotted(base) or ast.unparse(base)
                defs, _ = self.defs(cls.module)
                first, _, tail = name.partition(".")
                d = defs.get(first)
                if d is not None and d.kind == "reexport":
                    name = f"{d.target}.{tail}" if tail else d.target
                outside.append(name)
        return inside, outside

    def members(self, cls: Obj) -> dict[str, Obj]:
        if cls.qual in self._members:
            return self._members[cls.qual]
        out: dict[str, Obj] = {}
        self._members[cls.qual] = out
        node = cls.node
        assert isinstance(node, ast.ClassDef)
        own: dict[str, Obj] = {}

        def add(name: str, kind: str, n: ast.AST | None) -> None:
            own[name] = Obj("member", f"{cls.qual}.{name}", cls.module, n, cls, kind)

        for stmt in toplevel(node.body):
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                decorators = {dotted(d) or "" for d in stmt.decorator_list}
                is_prop = any(d.endswith(("property", "cached_property")) for d in decorators)
                if any(d.endswith(".setter") or d.endswith(".deleter") for d in decorators):
                    continue
                if "overload" in decorators or "typing.overload" in decorators:
                    continue
                add(stmt.name, "property" if is_prop else "method", stmt)
                if stmt.name == "__init__" or stmt.name.startswith(("_init", "init")):
                    for sub in ast.walk(stmt):
                        target = None
                        if isinstance(sub, ast.Assign):
                            targets = sub.targets
                        elif isinstance(sub, ast.AnnAssign):
                            targets = [sub.target]
                        else:
                            continue
                        for target in targets:
                            if (
                                isinstance(target, ast.Attribute)
                                and isinstance(target.value, ast.Name)
                                and target.value.id == "self"
                                and target.attr not in own
                            ):
                                add(target.attr, "instattr", sub)
            elif isinstance(stmt, ast.ClassDef):
                add(stmt.name, "nested", stmt)
            elif isinstance(stmt, ast.Assign):
                for target in stmt.targets:
                    if isinstance(target, ast.Name):
                        add(target.id, "classattr", stmt)
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                add(stmt.target.id, "classattr", stmt)
        # Attributes set on self in any other method count too (after the rest).
        for stmt in toplevel(node.body):
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for sub in ast.walk(stmt):
                    if isinstance(sub, (ast.Assign, ast.AnnAssign)):
                        targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target]
                        for target in targets:
                            if (
                                isinstance(target, ast.Attribute)
                                and isinstance(target.value, ast.Name)
                                and target.value.id == "self"
                                and target.attr not in own
                            ):
                                add(target.attr, "instattr", sub)
        inside, _ = self.bases(cls)
        for base in reversed(inside):
            if base.qual != cls.qual:
                out.update(self.members(base))
        out.update(own)
        return out

    def has_outside_bases(self, cls: Obj, seen: set[str] | None = None) -> list[str]:
        seen = seen if seen is not None else set()
        if cls.qual in seen:
            return []
        seen.add(cls.qual)
        inside, outside = self.bases(cls)
        outside = [
            b
            for b in outside
            if b not in ("object", "ABC", "abc.ABC", "Generic", "typing.Generic", "Protocol")
        ]
        for base in inside:
            outside += self.has_outside_bases(base, seen)
        return outside

    def is_exception(self, cls: Obj, depth: int = 0) -> bool:
        if depth > 20 or not isinstance(cls.node, ast.ClassDef):
            return False
        inside, outside = self.bases(cls)
        if any(b.split(".")[-1] in BUILTIN_EXCEPTIONS for b in outside):
            return True
        return any(self.is_exception(b, depth + 1) for b in inside)

    def base_chain(self, cls: Obj, depth: int = 0) -> list[str]:
        if depth > 20 or not isinstance(cls.node, ast.ClassDef):
            return []
        inside, outside = self.bases(cls)
        chain = [b.qual for b in inside] + outside
        for b in inside:
            chain += self.base_chain(b, depth + 1)
        return chain

    # signatures
    def signature(self, obj: Obj) -> Sig | None:
        node = obj.node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if obj.member_kind == "property":
                return None
            return Sig.of_function(node)
        if obj.kind == "member" and obj.member_kind == "nested":
            obj = Obj("class", obj.qual, obj.module, node)
        if obj.kind == "class" and isinstance(node, ast.ClassDef):
            fields = self.fields(obj)
            if fields is not None:
                return fields
            init = self.members(obj).get("__init__")
            if init is not None and isinstance(init.node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return Sig.of_function(init.node, where=init.owner.qual if init.owner else "")
            outside = self.has_outside_bases(obj)
            return Sig([], note=f"inherited from {', '.join(outside) or 'object'}")
        return None

    def fields(self, cls: Obj, depth: int = 0) -> Sig | None:
        """A field-declared class's fields, bases first; None when it is not one."""
        node = cls.node
        assert isinstance(node, ast.ClassDef)
        inside, outside = self.bases(cls)
        decorators = [
            dotted(d.func if isinstance(d, ast.Call) else d) or "" for d in node.decorator_list
        ]
        is_fields = any(d.split(".")[-1] == "dataclass" for d in decorators) or any(
            b.split(".")[-1] in FIELD_BASES for b in outside
        )
        params: list[Param] = []
        for base in inside:
            if depth < 20:
                sub = self.fields(base, depth + 1)
                if sub is not None:
                    is_fields = True
                    params += [p for p in sub.params if p.name not in {q.name for q in params}]
        if not is_fields:
            return None
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                if "ClassVar" in ast.unparse(stmt.annotation) or stmt.target.id.startswith("__"):
                    continue
                default = ast.unparse(stmt.value) if stmt.value is not None else None
                params = [p for p in params if p.name != stmt.target.id]
                params.append(Param(stmt.target.id, "field", default))
        return Sig(params, fields=True)


@dataclasses.dataclass(frozen=True)
class Param:
    name: str
    kind: str  # posonly | arg | vararg | kwonly | kwarg | field
    default: str | None

    def render(self) -> str:
        prefix = {"vararg": "*", "kwarg": "**"}.get(self.kind, "")
        default = f"={_short(self.default)}" if self.default is not None else ""
        return f"{prefix}{self.name}{default}"


def _short(text: str, limit: int = 40) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclasses.dataclass
class Sig:
    params: list[Param]
    fields: bool = False
    note: str = ""

    @classmethod
    def of_function(cls, fn: ast.FunctionDef | ast.AsyncFunctionDef, where: str = "") -> Sig:
        a = fn.args
        positional = [*a.posonlyargs, *a.args]
        defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults)) + list(
            a.defaults
        )
        params = [
            Param(
                arg.arg,
                "posonly" if i < len(a.posonlyargs) else "arg",
                ast.unparse(d) if d else None,
            )
            for i, (arg, d) in enumerate(zip(positional, defaults, strict=True))
        ]
        if a.vararg:
            params.append(Param(a.vararg.arg, "vararg", None))
        for arg, d in zip(a.kwonlyargs, a.kw_defaults, strict=True):
            params.append(Param(arg.arg, "kwonly", ast.unparse(d) if d is not None else None))
        if a.kwarg:
            params.append(Param(a.kwarg.arg, "kwarg", None))
        return cls(params, note=f"{where}.__init__" if where else "")

    def key(self) -> tuple[Any, ...]:
        return (tuple(self.params), self.fields, "" if self.params else self.note)

    def names(self) -> set[str]:
        return {p.name for p in self.params if p.kind not in ("vararg", "kwarg")}

    def takes_any_keyword(self) -> bool:
        return any(p.kind == "kwarg" for p in self.params)

    def render(self) -> str:
        if not self.params and self.note:
            return f"({self.note})"
        out: list[str] = []
        seen_kwonly = False
        for i, p in enumerate(self.params):
            if (
                p.kind == "kwonly"
                and not seen_kwonly
                and not any(q.kind == "vararg" for q in self.params)
            ):
                out.append("*")
            if p.kind == "kwonly":
                seen_kwonly = True
            out.append(p.render())
            if p.kind == "posonly" and (
                i + 1 == len(self.params) or self.params[i + 1].kind != "posonly"
            ):
                out.append("/")
        body = ", ".join(out)
        return f"fields({body})" if self.fields else f"({body})"


def compare_sigs(old: Sig, new: Sig) -> str:
    """'' when equal, else a short account: compatible additions or what breaks."""
    if old.key() == new.key():
        return ""
    old_by, new_by = {p.name: p for p in old.params}, {p.name: p for p in new.params}
    added = [p for p in new.params if p.name not in old_by]
    removed = [p for p in old.params if p.name not in new_by]
    changed = [
        n
        for n in old_by
        if n in new_by
        and (old_by[n].kind != new_by[n].kind or old_by[n].default != new_by[n].default)
    ]
    required_added = [
        p.name for p in added if p.default is None and p.kind not in ("vararg", "kwarg")
    ]
    old_order = [p.name for p in old.params if p.kind in ("posonly", "arg") and p.name in new_by]
    new_order = [p.name for p in new.params if p.kind in ("posonly", "arg") and p.name in old_by]
    parts = []
    if added:
        parts.append("added " + ", ".join(p.render() for p in added))
    if removed:
        parts.append("removed " + ", ".join(p.name for p in removed))
    if changed:
        parts.append(
            "changed " + ", ".join(f"{old_by[n].render()} -> {new_by[n].render()}" for n in changed)
        )
    if old_order != new_order:
        parts.append("positional order changed")
    breaking = bool(removed or required_added or old_order != new_order) or any(
        old_by[n].kind != new_by[n].kind for n in changed
    )
    if not parts:
        parts.append(old.note + " -> " + new.note)
    return ("incompatible: " if breaking else "compatible: ") + "; ".join(parts)


# ----- what the package uses ------------------------------------------------------------------


@dataclasses.dataclass
class Use:
    qual: str
    kind: str  # module | name | attr | override | protocol
    where: str  # file:line
    guarded: bool = False  # the import sits in try/except ImportError
    call: tuple[int, tuple[str, ...], bool] | None = None  # positional count, keywords, *args/**kw
    declared: Sig | None = None  # an override's or a Protocol member's own signature
    via: str = ""  # the Protocol or subclass it comes from


def _is_vllm(name: str) -> bool:
    return name == "vllm" or name.startswith("vllm.")


class UseFinder(ast.NodeVisitor):
    """Collects the vLLM names one module of the package uses."""

    def __init__(self, rel: str, tree: ast.Module):
        self.rel, self.tree = rel, tree
        self.bound: dict[str, str] = {}  # local name -> vllm qualified name
        self.uses: list[Use] = []
        self._guarded: set[int] = set()
        self._typed: list[dict[str, str]] = [{}]  # parameter/narrowed name -> class qual

    def at(self, node: ast.AST) -> str:
        return f"{self.rel}:{getattr(node, 'lineno', 0)}"

    def run(self) -> list[Use]:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Try):
                if any(
                    h.type is not None and "ImportError" in ast.unparse(h.type)
                    for h in node.handlers
                ):
                    # The attempt and its fallback both: one of them fits each release.
                    fallbacks = [
                        h.body
                        for h in node.handlers
                        if "ImportError" in ast.unparse(h.type or ast.Name("_"))
                    ]
                    for stmt in [*node.body, *(s for body in fallbacks for s in body)]:
                        for sub in ast.walk(stmt):
                            self._guarded.add(id(sub))
        # Bindings first (imports anywhere in the file), then uses.
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if _is_vllm(alias.name):
                        self.uses.append(
                            Use(alias.name, "module", self.at(node), id(node) in self._guarded)
                        )
                        if alias.asname:
                            self.bound[alias.asname] = alias.name
                        else:
                            self.bound[alias.name.split(".")[0]] = alias.name.split(".")[0]
            elif (
                isinstance(node, ast.ImportFrom)
                and node.level == 0
                and node.module
                and _is_vllm(node.module)
            ):
                self.uses.append(
                    Use(node.module, "module", self.at(node), id(node) in self._guarded)
                )
                for alias in node.names:
                    qual = f"{node.module}.{alias.name}"
                    self.uses.append(Use(qual, "name", self.at(node), id(node) in self._guarded))
                    self.bound[alias.asname or alias.name] = qual
            elif (
                isinstance(node, ast.Call)
                and dotted(node.func) in ("importlib.import_module", "import_module")
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
                and _is_vllm(node.args[0].value)
            ):
                self.uses.append(Use(node.args[0].value, "module", self.at(node)))
        self.visit(self.tree)
        return self.uses

    # names typed as vLLM classes
    def _class_of(self, annotation: ast.AST | None) -> str | None:
        if annotation is None:
            return None
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
            try:
                annotation = ast.parse(annotation.value, mode="eval").body
            except SyntaxError:
                return None
        if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
            return self._class_of(annotation.left) or self._class_of(annotation.right)
        if isinstance(annotation, ast.Subscript) and dotted(annotation.value) in (
            "Optional",
            "typing.Optional",
        ):
            return self._class_of(annotation.slice)
        name = dotted(annotation)
        return self._qual_of(name) if name else None

    def _qual_of(self, name: str) -> str | None:
        parts = name.split(".")
        # `<anything>.model_config.X`: the engine's configs, whatever holds them.
        for j in range(len(parts) - 2, 0, -1):
            if parts[j] in CONFIG_ATTRS:
                return ".".join([CONFIG_ATTRS[parts[j]], *parts[j + 1 :]])
        first, _, tail = name.partition(".")
        if first in self._typed[-1]:
            base = self._typed[-1][first]
        elif first in self.bound:
            base = self.bound[first]
        else:
            return None
        return f"{base}.{tail}" if tail else base

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        typed = dict(self._typed[-1])
        args = node.args
        for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
            cls = self._class_of(arg.annotation) or CONFIG_ATTRS.get(arg.arg)
            if cls:
                typed[arg.arg] = cls
            else:
                typed.pop(arg.arg, None)
        self._typed.append(typed)
        self.generic_visit(node)
        self._typed.pop()

    visit_FunctionDef = _visit_function
    visit_AsyncFunctionDef = _visit_function

    def visit_Assign(self, node: ast.Assign) -> None:
        # `config = engine.vllm_config`, `engine = AsyncLLM.from_engine_args(...)`, `x = Cls(...)`.
        self.generic_visit(node)
        if len(node.targets) != 1 or not isinstance(node.targets[0], ast.Name):
            return
        target, value = node.targets[0].id, node.value
        cls = None
        if isinstance(value, ast.Attribute) and value.attr in CONFIG_ATTRS:
            cls = CONFIG_ATTRS[value.attr]
        elif isinstance(value, ast.Call):
            func = dotted(value.func)
            qual = self._qual_of(func) if func else None
            if qual and func and "." not in func and func[:1].isupper():
                cls = qual  # Cls(...)
            elif qual and func and func.rsplit(".", 1)[-1].startswith("from_"):
                cls = qual.rsplit(".", 1)[0]  # Cls.from_xxx(...)
        if cls:
            self._typed[-1][target] = cls
        else:
            self._typed[-1].pop(target, None)

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        narrowed = None
        if (
            isinstance(test, ast.Call)
            and dotted(test.func) == "isinstance"
            and len(test.args) == 2
            and isinstance(test.args[0], ast.Name)
        ):
            cls = self._class_of(test.args[1])
            if cls:
                narrowed = (test.args[0].id, cls)
        self.visit(node.test)
        if narrowed:
            self._typed.append({**self._typed[-1], narrowed[0]: narrowed[1]})
        for stmt in node.body:
            self.visit(stmt)
        if narrowed:
            self._typed.pop()
        for stmt in node.orelse:
            self.visit(stmt)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for base in node.bases:
            name = dotted(base.value if isinstance(base, ast.Subscript) else base)
            qual = self._qual_of(name) if name else None
            if not qual:
                continue
            for stmt in node.body:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self.uses.append(
                        Use(
                            f"{qual}.{stmt.name}",
                            "override",
                            self.at(stmt),
                            declared=Sig.of_function(stmt),
                            via=f"{PACKAGE}.{module_of_package(self.rel)}.{node.name}",
                        )
                    )
        self.generic_visit(node)

    def _chain(self, node: ast.AST) -> str | None:
        name = dotted(node)
        return self._qual_of(name) if name else None

    def visit_Attribute(self, node: ast.Attribute) -> None:
        qual = self._chain(node)
        if qual and "." in qual:
            self.uses.append(Use(qual, "attr", self.at(node)))
            return  # the chain's prefixes are implied
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if (
            dotted(func) == "getattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
        ):
            base = self._chain(node.args[0])
            if base and isinstance(node.args[1].value, str):
                self.uses.append(Use(f"{base}.{node.args[1].value}", "attr", self.at(node)))
        qual = self._chain(func)
        if qual:
            keywords = tuple(k.arg for k in node.keywords if k.arg)
            star = any(k.arg is None for k in node.keywords) or any(
                isinstance(a, ast.Starred) for a in node.args
            )
            self.uses.append(
                Use(qual, "attr", self.at(node), call=(len(node.args), keywords, star))
            )
            for arg in [*node.args, *node.keywords]:
                self.visit(arg)
            if isinstance(func, ast.Attribute):
                self.visit(func.value) if not self._chain(func.value) else None
            return
        self.generic_visit(node)


def module_of_package(rel: str) -> str:
    mod = rel[:-3].replace("/", ".")
    return mod[: -len(".__init__")] if mod.endswith(".__init__") else mod


def protocol_uses() -> list[Use]:
    """Every member of the package's engine Protocols, as a use of the vLLM class behind it."""
    uses = []
    for proto, target in PROTOCOL_TARGETS.items():
        mod, _, cls_name = proto.rpartition(".")
        rel = mod.removeprefix(PACKAGE + ".").replace(".", "/") + ".py"
        tree = ast.parse((PACKAGE_DIR / rel).read_text())
        for node in tree.body:
            if not (isinstance(node, ast.ClassDef) and node.name == cls_name):
                continue
            for stmt in node.body:
                where = f"{rel}:{stmt.lineno}"
                if isinstance(
                    stmt, (ast.FunctionDef, ast.AsyncFunctionDef)
                ) and not stmt.name.startswith("_"):
                    is_prop = any(
                        (dotted(d) or "").endswith("property") for d in stmt.decorator_list
                    )
                    uses.append(
                        Use(
                            f"{target}.{stmt.name}",
                            "protocol",
                            where,
                            declared=None if is_prop else Sig.of_function(stmt),
                            via=proto,
                        )
                    )
                elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    uses.append(Use(f"{target}.{stmt.target.id}", "protocol", where, via=proto))
    return uses


def package_uses() -> list[Use]:
    uses: list[Use] = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        if "_pb2" in path.name:
            continue
        rel = str(path.relative_to(PACKAGE_DIR))
        uses += UseFinder(rel, ast.parse(path.read_text(), filename=rel)).run()
    return uses + protocol_uses()


# ----- comparing ------------------------------------------------------------------------------


@dataclasses.dataclass
class Entry:
    name: str
    # same | moved | missing | signature | raised | new-exception | new-class | import
    # | unresolved | new | fallback (new, but imported under try/except ImportError)
    # | import-caught (fails to import, under try/except ImportError)
    status: str
    detail: str = ""
    used_at: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    handled: bool = False
    reason: str = ""

    @property
    def key(self) -> str:
        return f"{self.name}|{self.status}"

    @property
    def is_difference(self) -> bool:
        return self.status not in ("same", "unresolved", "fallback", "import-caught")


class Comparison:
    def __init__(self, old: Index, new: Index):
        self.old, self.new = old, new
        self._name_files: dict[str, list[str]] = {}

    def where_defined(self, index: Index, name: str) -> list[str]:
        """Modules of `index` that define `name` at top level (class, function or assignment)."""
        pattern = re.compile(
            rf"^(?:class|def|async def)\s+{re.escape(name)}\b|^{re.escape(name)}\s*[:=]", re.M
        )
        found = []
        for rel in index.tree.files:
            if pattern.search(index.tree.read(rel)):
                mod = module_of(rel)
                d = index.defs(mod)[0].get(name)
                if d is not None and d.kind != "reexport":
                    found.append(mod)
        return found

    def moved_module(self, old_mod: str) -> list[str]:
        old_names = {
            n for n, d in self.old.defs(old_mod)[0].items() if d.kind in ("class", "function")
        }
        base = old_mod.rsplit(".", 1)[-1]
        scored = []
        for rel in self.new.tree.files:
            mod = module_of(rel)
            if mod.rsplit(".", 1)[-1] != base:
                continue
            names = {n for n, d in self.new.defs(mod)[0].items() if d.kind in ("class", "function")}
            overlap = len(old_names & names)
            if overlap:
                scored.append((-overlap, mod))
        return [mod for _, mod in sorted(scored)]

    def moved_name(self, old_obj: Obj, name: str) -> list[str]:
        candidates = self.where_defined(self.new, name)
        old_base = old_obj.module.rsplit(".", 1)[-1]
        candidates.sort(key=lambda m: (m.rsplit(".", 1)[-1] != old_base, len(m)))
        return [f"{m}.{name}" for m in candidates]

    def entry(self, qual: str, uses: list[Use]) -> Entry | None:
        where = sorted({u.where for u in uses}, key=_where_key)
        old, new = self.old.resolve(qual), self.new.resolve(qual)
        e = Entry(qual, "same", used_at=where)
        if old is None and new is None and all(u.kind == "override" for u in uses):
            return None  # the subclass's own method, not an override
        if any(u.guarded for u in uses):
            e.notes.append("imported under try/except ImportError")
        if old is None and new is None:
            e.status = "unresolved"
            e.detail = "not found statically in either release (dynamic, or defined outside vllm)"
            return e
        if old is None:
            e.detail = f"not in {self.old.tree.version}, present in {self.new.tree.version}"
            # Imported under try/except ImportError: the package's own fallback for the older one.
            e.status = "fallback" if all(u.guarded for u in uses) else "new"
            if e.status == "fallback":
                e.notes.remove("imported under try/except ImportError")
            return e
        if new is None:
            return self._gone(e, qual, old, uses)
        self._compare(e, old, new, uses)
        if old.qual != new.qual and e.status == "same":
            e.notes.append(f"now defined in {new.qual} (was {old.qual})")
        return e

    def _gone(self, e: Entry, qual: str, old: Obj, uses: list[Use]) -> Entry:
        if old.kind == "module":
            places = self.moved_module(old.qual)
            if places:
                e.status, e.detail = "moved", f"moved to {places[0]}"
                if len(places) > 1:
                    e.notes.append("also like it: " + ", ".join(places[1:4]))
            else:
                e.status, e.detail = "missing", "module no longer exists"
            return e
        if old.kind == "member":
            owner = old.owner.qual if old.owner else qual.rsplit(".", 1)[0]
            e.status = "missing"
            e.detail = f"{old.member_kind} {qual.rsplit('.', 1)[-1]!r} no longer on {owner}"
            return e
        name = qual.rsplit(".", 1)[-1]
        places = self.moved_name(old, name)
        parent = qual.rsplit(".", 1)[0]
        gone_module = self.new.resolve(parent) is None
        if places:
            e.status, e.detail = "moved", f"moved to {places[0]}"
            if gone_module:
                e.detail += f" ({parent} no longer exists)"
            if len(places) > 1:
                e.notes.append("also defined in: " + ", ".join(places[1:4]))
            target = self.new.resolve(places[0])
            if target is not None:
                probe = Entry(qual, "same")
                self._compare(probe, old, target, uses)
                if probe.status == "signature":
                    e.detail += f"; signature changed: {probe.detail}"
                    e.notes += probe.notes
        else:
            e.status, e.detail = "missing", f"no module of {self.new.tree.label} defines {name}"
        return e

    def _compare(self, e: Entry, old: Obj, new: Obj, uses: list[Use]) -> None:
        if old.kind != new.kind and not (old.kind == "member" or new.kind == "member"):
            e.notes.append(f"was a {old.kind}, now a {new.kind}")
        old_sig, new_sig = self.old.signature(old), self.new.signature(new)
        if old_sig is not None and new_sig is not None:
            diff = compare_sigs(old_sig, new_sig)
            if diff:
                e.status = "signature"
                before, after = old_sig.render(), new_sig.render()
                if len(before) + len(after) > 240:
                    kind = "fields" if new_sig.fields else "parameters"
                    e.detail = f"{len(old_sig.params)} {kind} -> {len(new_sig.params)} {kind}"
                else:
                    e.detail = f"{before} -> {after}"
                e.notes.insert(0, diff)
        if new_sig is None or (not new_sig.params and new_sig.note):
            return  # a signature this tool cannot see (a builtin's or a library's)
        names, any_kw = new_sig.names(), new_sig.takes_any_keyword()
        for use in uses:
            if use.call and not any_kw:
                bad = [k for k in use.call[1] if k not in names]
                if bad:
                    e.status = "signature" if e.status == "same" else e.status
                    e.notes.append(
                        f"the call at {use.where} passes {', '.join(bad)}, which it no longer takes"
                    )
            if use.declared is not None and not any_kw:
                declared = [
                    p.name for p in use.declared.params if p.kind not in ("vararg", "kwarg")
                ]
                bad = [n for n in declared if n not in names and n != "self"]
                if bad:
                    e.status = "signature" if e.status == "same" else e.status
                    e.notes.append(
                        f"{use.via} (at {use.where}) declares {', '.join(bad)}, "
                        "which it no longer takes"
                    )

    # exceptions
    def exception_entries(self, used: dict[str, list[Use]]) -> list[Entry]:
        modules: set[str] = set()
        imported: set[str] = set()
        for qual in used:
            obj = self.old.resolve(qual) or self.new.resolve(qual)
            if (
                obj is not None
                and obj.kind == "class"
                and (self.old.is_exception(obj) or self.new.is_exception(obj))
            ):
                modules.add(obj.module)
                imported.add(obj.qual)
        out: list[Entry] = []
        for mod in sorted(modules):
            old_classes = self._exception_classes(self.old, mod)
            new_classes = self._exception_classes(self.new, mod)
            old_sites = self._construction_sites(self.old, old_classes)
            new_sites = self._construction_sites(self.new, new_classes)
            for name, obj in new_classes.items():
                qual = f"{mod}.{name}"
                chain = self.new.base_chain(obj)
                mapped_bases = [b for b in chain if b in imported]
                base_note = f"a {' / '.join(c.rsplit('.', 1)[-1] for c in chain[:3])}" + (
                    f"; the package imports its base {mapped_bases[0].rsplit('.', 1)[-1]}"
                    if mapped_bases
                    else "; the package imports neither it nor any of its bases"
                )
                if name not in old_classes:
                    e = Entry(qual, "new-class", base_note)
                    e.notes.append(_sites_text(new_sites.get(name, set())))
                    out.append(e)
                    continue
                fresh = new_sites.get(name, set()) - old_sites.get(name, set())
                if not fresh:
                    continue
                was = old_sites.get(name, set())
                if qual in imported:
                    e = Entry(
                        qual, "raised", f"{len(fresh)} new place(s) on the engine path build it"
                    )
                else:
                    e = Entry(
                        qual,
                        "new-exception",
                        (
                            "built nowhere on it before"
                            if not was
                            else f"{len(fresh)} more place(s) build it"
                        )
                        + f"; {base_note}",
                    )
                e.used_at = [u.where for u in used.get(qual, [])]
                e.notes.append(_sites_text(fresh))
                out.append(e)
        return out

    @staticmethod
    def _exception_classes(index: Index, mod: str) -> dict[str, Obj]:
        out = {}
        for name, d in index.defs(mod)[0].items():
            if d.kind == "class":
                obj = Obj("class", f"{mod}.{name}", mod, d.node)
                if index.is_exception(obj):
                    out[name] = obj
        return out

    @staticmethod
    def _construction_sites(index: Index, classes: dict[str, Obj]) -> dict[str, set[str]]:
        """Per class name: the module.function places on the engine path that call it."""
        sites: dict[str, set[str]] = {name: set() for name in classes}
        if not classes:
            return sites
        pattern = re.compile(r"\b(" + "|".join(map(re.escape, classes)) + r")\s*\(")
        for rel in index.tree.files:
            if rel.startswith(OFF_ENGINE_PATH):
                continue
            text = index.tree.read(rel)
            if not pattern.search(text):
                continue
            tree = index.parse(rel)
            if tree is None:
                continue
            mod = module_of(rel)
            for scope, call in _calls_with_scope(tree):
                func = call.func
                name = (
                    func.id
                    if isinstance(func, ast.Name)
                    else func.attr
                    if isinstance(func, ast.Attribute)
                    else None
                )
                if name in sites and not (
                    scope == "" and name in classes and classes[name].module == mod
                ):
                    sites[name].add(f"{mod}:{scope or '<module>'}")
        return sites


def _calls_with_scope(tree: ast.Module) -> Iterator[tuple[str, ast.Call]]:
    stack: list[tuple[ast.AST, str]] = [(tree, "")]
    while stack:
        node, scope = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                stack.append((child, f"{scope}.{child.name}" if scope else child.name))
            else:
                if isinstance(child, ast.Call):
                    yield scope, child
                stack.append((child, scope))


# Shown first: where a request from the servicer goes.
_SITE_ORDER = (
    "vllm.v1.",
    "vllm.outputs",
    "vllm.sampling_params",
    "vllm.pooling_params",
    "vllm.inputs",
)


def _sites_text(sites: set[str], limit: int = 8) -> str:
    """Sites ("module:function") grouped by module, the engine's own modules first."""
    if not sites:
        return "built nowhere on the engine path"
    by_module: dict[str, list[str]] = {}
    for site in sites:
        module, _, scope = site.partition(":")
        by_module.setdefault(module, []).append(scope)

    def order(module: str) -> tuple[int, str]:
        rank = next(
            (i for i, p in enumerate(_SITE_ORDER) if module.startswith(p)), len(_SITE_ORDER)
        )
        return rank, module

    modules = sorted(by_module, key=order)
    shown = [f"{m} ({', '.join(sorted(by_module[m]))})" for m in modules[:limit]]
    more = f"; +{len(modules) - limit} more modules" if len(modules) > limit else ""
    return "in " + "; ".join(shown) + more


def _where_key(where: str) -> tuple[str, int]:
    path, _, line = where.rpartition(":")
    return path, int(line or 0)


# ----- the releases' sources ------------------------------------------------------------------


def version_of(text: str) -> str:
    match = re.search(r"__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]", text)
    return match[1] if match else "?"


def installed_tree() -> Tree | None:
    """The installed vLLM: this interpreter's, else the project's .venv."""
    candidates = []
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.submodule_search_locations:
        candidates.append(Path(list(spec.submodule_search_locations)[0]).parent)
    candidates += sorted((ROOT / ".venv" / "lib").glob("python*/site-packages"))
    for site in candidates:
        version_file = site / "vllm" / "_version.py"
        if version_file.exists():
            version = version_of(version_file.read_text())
            dists = sorted(
                p.name
                for p in site.glob("vllm*.dist-info")
                if not p.name.startswith("vllm_servicer")
            )
            where = site.relative_to(ROOT) if site.is_relative_to(ROOT) else site
            label = f"{version} (installed: {where}{', ' + dists[0] if dists else ''})"
            return Tree(label, version, folder=site)
    return None


def wheel_tree(version: str) -> Tree:
    found = sorted(CACHE.glob(f"vllm-{version}-*.whl"))
    if not found:
        CACHE.mkdir(parents=True, exist_ok=True)
        pip = [sys.executable, "-m", "pip"]
        if subprocess.run([*pip, "--version"], capture_output=True).returncode != 0:
            pip = [str(ROOT / ".venv" / "bin" / "python"), "-m", "pip"]
        print(
            f"downloading vllm=={version} (no dependencies) into {CACHE.relative_to(ROOT)}",
            file=sys.stderr,
        )
        subprocess.run(
            [*pip, "download", "--quiet", "--no-deps", "-d", str(CACHE), f"vllm=={version}"],
            check=True,
            stdout=sys.stderr,
        )
        found = sorted(CACHE.glob(f"vllm-{version}-*.whl"))
        if not found:
            raise SystemExit(f"pip download left no vllm-{version}-*.whl in {CACHE}")
    wheel = found[-1]
    return Tree(f"{version} (wheel: {wheel.relative_to(ROOT)})", version, wheel=wheel)


def same_release(a: str, b: str) -> bool:
    return re.split(r"[+]", a)[0] == re.split(r"[+]", b)[0]


# ----- importing in a venv --------------------------------------------------------------------

IMPORT_PROBE = r"""
import importlib, json, sys
results = {}
for qual in json.load(sys.stdin):
    parts = qual.split(".")
    obj, error, not_a_module = None, None, None
    for i in range(len(parts), 0, -1):
        mod = ".".join(parts[:i])
        try:
            obj = importlib.import_module(mod)
            break
        except ModuleNotFoundError as exc:
            if exc.name and (exc.name == mod or mod.startswith(exc.name + ".")):
                not_a_module = f"{type(exc).__name__}: {exc}"
                continue  # that prefix is no module: try a shorter one
            error = f"import {mod}: {type(exc).__name__}: {exc}"
            break
        except Exception as exc:
            error = f"import {mod}: {type(exc).__name__}: {exc}"
            break
    if error is None and obj is None:
        error = f"no module {parts[0]}"
    if error is None:
        for n, part in enumerate(parts[i:]):
            try:
                obj = getattr(obj, part)
            except Exception as exc:
                # A missing submodule reads better as the import that failed.
                error = not_a_module if n == 0 and not_a_module else f"{type(exc).__name__}: {exc}"
                break
    results[qual] = error
print("IMPORT-PROBE " + json.dumps(results))
"""


def import_check(venv: Path, names: list[str]) -> dict[str, str | None]:
    venv = venv.resolve()
    if not (venv / "bin" / "python").exists():
        raise SystemExit(f"{venv} has no bin/python (build it with tests/release/hybrid_env.py)")
    env = dict(os.environ)
    env_file = venv / "hybrid.env"
    if env_file.exists():
        for line in env_file.read_text().splitlines():
            if "=" in line:
                key, _, value = line.partition("=")
                env[key.strip()] = value.strip()
    env.setdefault("VLLM_SERVICER_SKIP_VLLM_VERSION_CHECK", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    proc = subprocess.run(
        [str(venv / "bin" / "python"), "-c", IMPORT_PROBE],
        input=json.dumps(names),
        capture_output=True,
        text=True,
        env=env,
        cwd="/",
    )
    for line in proc.stdout.splitlines():
        if line.startswith("IMPORT-PROBE "):
            return json.loads(line[len("IMPORT-PROBE ") :])  # type: ignore[no-any-return]
    raise SystemExit(
        f"the import check in {venv} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )


# ----- the allowlist --------------------------------------------------------------------------


def load_allowlist(path: Path) -> dict[str, str]:
    """key -> reason (possibly empty) for every listed difference."""
    if not path.exists():
        return {}
    if path.suffix == ".json":
        data = json.loads(path.read_text())
    else:
        import tomllib

        data = tomllib.loads(path.read_text())
    return {item["key"]: str(item.get("reason", "")).strip() for item in data.get("difference", [])}


def toml_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # a JSON string is a valid TOML basic string


def append_allowlist(path: Path, entries: list[Entry], release: str, against: str) -> int:
    listed = load_allowlist(path)
    fresh = [e for e in entries if e.is_difference and e.key not in listed]
    if not fresh:
        return 0
    if path.suffix == ".json":
        data = json.loads(path.read_text()) if path.exists() else {"difference": []}
        for e in fresh:
            data["difference"].append(
                {"key": e.key, "release": release, "found": _found(e), "reason": ""}
            )
        path.write_text(json.dumps(data, indent=2) + "\n")
        return len(fresh)
    header = "" if path.exists() else ALLOWLIST_HEADER
    with path.open("a") as out:
        out.write(header)
        for e in fresh:
            out.write(
                f"\n[[difference]]\nkey = {toml_string(e.key)}\nrelease = {toml_string(release)}  "
                f'# against {toml_string(against)}\nfound = {toml_string(_found(e))}\nreason = ""\n'
            )
    return len(fresh)


def _found(e: Entry) -> str:
    text = status_line(e) + (f" ({e.notes[0]})" if e.notes else "")
    return _short(text, 400)


ALLOWLIST_HEADER = """\
# Differences between vLLM releases that vllm_servicer already handles, read by
# `python tests/release/api_check.py RELEASE --strict`.
#
# One [[difference]] per difference, `key` as the report prints it ("name|status").
# A difference counts as handled only when `reason` says, in one line, how the
# package handles it (e.g. "http_api imports make_arg_parser from either module").
# `found` and `release` are what api_check saw when it listed the entry.
# `api_check.py RELEASE --update-allowlist` appends new differences with empty reasons.
"""


# ----- report ---------------------------------------------------------------------------------

STATUS_TEXT = {
    "same": "same",
    "moved": "",
    "missing": "missing",
    "signature": "signature changed",
    "raised": "raised from new places",
    "new-exception": "now raised on the engine path",
    "new-class": "new exception class",
    "import": "fails to import",
    "unresolved": "unresolved",
    "new": "new",
    "fallback": "new, imported under try/except ImportError",
    "import-caught": "fails to import, under try/except ImportError",
}


def status_line(e: Entry) -> str:
    if e.status == "moved":
        return e.detail
    label = STATUS_TEXT[e.status]
    return f"{label}: {e.detail}" if e.detail else label


def render(entries: list[Entry], old: Tree, new: Tree, venv: Path | None) -> str:
    lines = [
        f"vLLM API used by {PACKAGE}: {new.label}",
        f"  compared with {old.label}",
    ]
    if venv is not None:
        lines.append(f"  imports tried in {venv}")
    lines.append(f"  (places used: files under src/{PACKAGE}/)")
    diffs = [e for e in entries if e.is_difference]
    rest = [e for e in entries if not e.is_difference]
    width = min(max((len(e.name) for e in entries), default=20), 72)
    lines.append("")
    lines.append(f"{'NAME':<{width}}  STATUS")
    for group in (diffs, rest):
        for e in group:
            mark = "" if not e.is_difference else ("  [handled]" if e.handled else "  [unhandled]")
            lines.append(f"{e.name:<{width}}  {status_line(e)}{mark}")
            pad = " " * (width + 2)
            for note in e.notes:
                lines.append(f"{pad}- {note}")
            if e.is_difference:
                if e.used_at:
                    more = f" (+{len(e.used_at) - 4})" if len(e.used_at) > 4 else ""
                    lines.append(f"{pad}- used at {', '.join(e.used_at[:4])}{more}")
                lines.append(
                    f"{pad}- key: {e.key}" + (f"; handled: {e.reason}" if e.handled else "")
                )
        if group is diffs and diffs:
            lines.append("")
    unhandled = sum(1 for e in diffs if not e.handled)
    lines.append("")
    lines.append(
        f"{len(entries)} names checked: {len(rest)} unchanged, {len(diffs)} differences "
        f"({len(diffs) - unhandled} handled, {unhandled} unhandled)"
    )
    return "\n".join(lines)


def _on_the_class(obj: Obj | None) -> bool:
    """Whether getattr finds `obj` without an instance (not a field or self.X)."""
    if obj is None:
        return False
    if obj.member_kind == "instattr":
        return False
    if obj.member_kind == "classattr" and isinstance(obj.node, ast.AnnAssign):
        return False  # an annotation: a dataclass/Struct field is no class attribute
    return True


def check(release: str, against: str | None, venv: Path | None) -> tuple[list[Entry], Tree, Tree]:
    new_tree = wheel_tree(release)
    installed = installed_tree()
    if against is None:
        if installed is None:
            raise SystemExit("no installed vLLM found (give --against VERSION)")
        old_tree = installed
    elif installed is not None and same_release(installed.version, against):
        old_tree = installed
    else:
        old_tree = wheel_tree(against)
    old, new = Index(old_tree), Index(new_tree)
    comparison = Comparison(old, new)

    by_qual: dict[str, list[Use]] = {}
    for use in package_uses():
        by_qual.setdefault(use.qual, []).append(use)
    # An attribute chain on a module is checked as that name; keep the longest useful chain.
    entries = [e for qual, uses in sorted(by_qual.items()) if (e := comparison.entry(qual, uses))]
    raised = comparison.exception_entries(by_qual)
    for extra in raised:
        # One line per name: the exception entry replaces an unchanged one.
        same = next((e for e in entries if e.name == extra.name and e.status == "same"), None)
        if same is not None:
            entries.remove(same)
            extra.used_at = same.used_at
            extra.notes.insert(0, "the name and its signature are unchanged")
    entries += raised

    if venv is not None:
        names = sorted(
            q
            for q, uses in by_qual.items()
            if any(u.kind in ("module", "name") for u in uses)
            or (any(u.kind == "attr" for u in uses) and _on_the_class(new.resolve(q)))
        )
        failures = {q: err for q, err in import_check(venv, names).items() if err}
        by_name = {e.name: e for e in entries}
        for qual, error in sorted(failures.items()):
            # An import the package wraps in try/except ImportError may fail: its fallback runs.
            imports = [u for u in by_qual[qual] if u.kind in ("module", "name")]
            caught = bool(imports) and all(u.guarded for u in imports)
            status = "import-caught" if caught else "import"
            used_at = by_name[qual].used_at if qual in by_name else []
            entries.append(Entry(qual, status, error, used_at=used_at))
    return entries, old_tree, new_tree


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("release", help="the vLLM release to look at, e.g. 0.33.0")
    parser.add_argument(
        "--against", help="the release to compare with (default: the installed one)"
    )
    parser.add_argument("--import-venv", type=Path, help="also import every used name in this venv")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--strict", action="store_true", help="exit 1 on any unhandled difference")
    parser.add_argument(
        "--allowlist", type=Path, default=ALLOWLIST, help="handled differences (.toml/.json)"
    )
    parser.add_argument(
        "--update-allowlist", action="store_true", help="append unlisted differences"
    )
    args = parser.parse_args(argv)

    entries, old_tree, new_tree = check(args.release, args.against, args.import_venv)
    handled = load_allowlist(args.allowlist)
    for e in entries:
        reason = handled.get(e.key, "")
        e.handled, e.reason = bool(reason), reason
    if args.update_allowlist:
        added = append_allowlist(args.allowlist, entries, args.release, old_tree.version)
        print(f"{added} difference(s) added to {args.allowlist}", file=sys.stderr)
    unhandled = [e for e in entries if e.is_difference and not e.handled]
    if args.json:
        print(
            json.dumps(
                {
                    "release": new_tree.label,
                    "against": old_tree.label,
                    "import_venv": str(args.import_venv) if args.import_venv else None,
                    "entries": [
                        {**dataclasses.asdict(e), "key": e.key, "difference": e.is_difference}
                        for e in entries
                    ],
                    "differences": sum(1 for e in entries if e.is_difference),
                    "unhandled": len(unhandled),
                },
                indent=2,
            )
        )
    else:
        print(render(entries, old_tree, new_tree, args.import_venv))
    return 1 if args.strict and unhandled else 0


if __name__ == "__main__":
    sys.exit(main())
