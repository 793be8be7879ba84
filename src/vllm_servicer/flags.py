"""Options in groups, each group a frozen dataclass that is also its flags.

A group is a dataclass with a `FLAG_TITLE`: the title of its argparse group,
whose description is the first paragraph of its docstring. Each field made
with `flag()` is one flag (`max_inflight` is `--max-inflight`), its help and
what argparse needs beyond the field's annotation and default in its
metadata; a field made with `group()` holds a group of its own; a field made
with `not_a_flag()` is set by the caller. `add_flag_groups` turns every group
a class holds into an argparse group in one loop, and `from_flags` reads the
parsed namespace back into the same classes, so each group validates its
values in its own `__post_init__`, once. The idea of vLLM's
`EngineArgs.add_cli_args`, where each config dataclass is its own group.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import sys
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from operator import not_
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = [
    "Flag",
    "add_flag_groups",
    "flag",
    "flag_groups",
    "flag_name",
    "from_flags",
    "group",
    "held_groups",
    "not_a_flag",
]

_FLAG = "vllm_servicer.flag"
_GROUP = "vllm_servicer.group"
_NOT_A_FLAG = "vllm_servicer.not_a_flag"

T = TypeVar("T")


class FlagGroup(Protocol):
    """A frozen dataclass whose fields are the flags of one argparse group."""

    FLAG_TITLE: ClassVar[str]
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[object]]]


class _FieldDefault:
    def __repr__(self) -> str:
        return "<the field's default>"


_FIELD_DEFAULT: Any = _FieldDefault()


def flag_name(field: str) -> str:
    """The flag of a field that names none of its own (`max_n`: `--max-n`)."""
    return "--" + field.replace("_", "-")


@dataclass(frozen=True)
class Flag:
    """One command-line flag: its spelling, its help, and how argparse reads it.

    Attributes:
        help: its `--help` text.
        spelled: its name on the command line, when not the field's
            (`--no-reflection` for `reflection_service`).
        aliases: other spellings of it (vLLM's `--ssl-certfile` for `--tls-cert`).
        type: as `add_argument` takes it; `int` and `float` follow from the
            field's annotation (`int | None` too).
        action: as `add_argument` takes it; a `bool` field off by default is
            `store_true`, one on by default is turned off by its `--no-` flag.
        nargs, choices, metavar: as `add_argument` takes them.
        default: what argparse gives when the flag is absent; the field's
            default unless its parsed form differs (`[]` for `append`).
        convert: what turns the parsed value into the field's (`tuple` for
            `append`'s list); may raise ValueError, naming the flag.
    """

    help: str
    spelled: str | None = None
    aliases: tuple[str, ...] = ()
    type: Callable[[str], object] | None = None
    action: str | None = None
    nargs: str | None = None
    choices: tuple[object, ...] | None = None
    metavar: str | None = None
    default: Any = _FIELD_DEFAULT
    convert: Callable[[Any], object] | None = None

    def spelling(self, field: str) -> str:
        """Its name on the command line, for the field `field`."""
        return self.spelled or flag_name(field)

    def dest(self, field: str) -> str:
        """Its argparse destination: its spelling, in underscores."""
        return self.spelling(field)[2:].replace("-", "_")

    def add_to(self, group: argparse._ArgumentGroup, field: str) -> None:
        """Add this flag, for the field `field`, to an argparse group."""
        specifics = {
            key: value
            for key in ("type", "action", "nargs", "choices", "metavar")
            if (value := getattr(self, key)) is not None
        }
        group.add_argument(
            self.spelling(field),
            *self.aliases,
            dest=self.dest(field),
            default=self.default,
            help=self.help,
            **specifics,
        )

    def value(self, parsed: argparse.Namespace, field: str) -> object:
        """The field's value from what argparse parsed for this flag."""
        value = getattr(parsed, self.dest(field))
        return self.convert(value) if self.convert else value


def flag(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    default_factory: Callable[[], object] | Any = dataclasses.MISSING,
    spelled: str | None = None,
    aliases: tuple[str, ...] = (),
    type: Callable[[str], object] | None = None,
    action: str | None = None,
    nargs: str | None = None,
    choices: tuple[object, ...] | None = None,
    metavar: str | None = None,
    parsed_default: Any = _FIELD_DEFAULT,
    convert: Callable[[Any], object] | None = None,
) -> Any:
    """A dataclass field that is also a command-line flag (see `Flag` for each argument).

    `default` and `default_factory` are the field's, as in `dataclasses.field`;
    `parsed_default` is argparse's default when the parsed form differs. The
    other names are argparse's own, `help` and `type` included.
    """
    declared = Flag(
        help=help,
        spelled=spelled,
        aliases=aliases,
        type=type,
        action=action,
        nargs=nargs,
        choices=choices,
        metavar=metavar,
        default=parsed_default,
        convert=convert,
    )
    return dataclasses.field(
        default=default, default_factory=default_factory, metadata={_FLAG: declared}
    )


def group(of: Callable[[], T]) -> T:
    """A dataclass field holding a group of flags, `of` by default."""
    field: T = dataclasses.field(default_factory=of, metadata={_GROUP: of})
    return field


def held_groups(cls: type) -> dict[str, type[DataclassInstance]]:
    """The groups `cls` holds (its `group()` fields), by field name."""
    return {f.name: f.metadata[_GROUP] for f in dataclasses.fields(cls) if _GROUP in f.metadata}


def not_a_flag(
    default: Any = dataclasses.MISSING,
    *,
    default_factory: Callable[[], object] | Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field that no flag of its own sets: the caller gives it."""
    return dataclasses.field(
        default=default, default_factory=default_factory, metadata={_NOT_A_FLAG: True}
    )


def flag_groups(cls: type) -> Iterator[tuple[type[FlagGroup], dict[str, Flag]]]:
    """Each group `cls` is or holds, depth first, with its flags by field name, completed.

    Completed: the default is the field's unless the flag gives its own, and
    the type or action follows from the annotation unless the flag gives one.

    Raises:
        TypeError: a field that is none of `flag()`, `group()` and
            `not_a_flag()`, or a flag whose annotation says nothing argparse can use.
    """
    own: dict[str, Flag] = {}
    held: list[type] = []
    for field in dataclasses.fields(cls):
        if (declared := field.metadata.get(_FLAG)) is not None:
            own[field.name] = _completed(declared, field, cls)
        elif (of := field.metadata.get(_GROUP)) is not None:
            held.append(of)
        elif not field.metadata.get(_NOT_A_FLAG):
            raise TypeError(
                f"{cls.__name__}.{field.name}: declare it with flag(), group() or not_a_flag()"
            )
    if own:
        if not hasattr(cls, "FLAG_TITLE"):
            raise TypeError(f"{cls.__name__} declares flags: give it a FLAG_TITLE")
        yield cls, own
    for of in held:
        yield from flag_groups(of)


def add_flag_groups(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add an argparse group to `parser` for each group `cls` is or holds, with its flags."""
    taken = {action.dest for action in parser._actions}
    for group_class, flags in flag_groups(cls):
        docstring = vars(group_class).get("__doc__") or ""
        if not docstring or docstring.startswith(f"{group_class.__name__}("):  # dataclass' own
            raise TypeError(f"{group_class.__name__}: its docstring describes its flags' group")
        description = inspect.cleandoc(docstring).split("\n\n")[0].replace("\n", " ")
        arguments = parser.add_argument_group(group_class.FLAG_TITLE, description)
        for name, declared in flags.items():
            if declared.dest(name) in taken:
                raise TypeError(f"{group_class.__name__}.{name}: {declared.dest(name)} is taken")
            taken.add(declared.dest(name))
            declared.add_to(arguments, name)


def from_flags(cls: Callable[..., T], parsed: argparse.Namespace, **given: object) -> T:
    """`cls` from a namespace `add_flag_groups` parsed: each flag's field converted,
    each group built (and so validated) from its own, `given` for the rest.

    Raises:
        ValueError: a value a flag's `convert` or a group refuses.
    """
    assert isinstance(cls, type)
    values: dict[str, object] = {}
    for field in dataclasses.fields(cls):
        if (declared := field.metadata.get(_FLAG)) is not None:
            values[field.name] = _completed(declared, field, cls).value(parsed, field.name)
        elif (of := field.metadata.get(_GROUP)) is not None:
            values[field.name] = from_flags(of, parsed)
    built: T = cls(**values, **given)
    return built


def _completed(declared: Flag, field: dataclasses.Field[Any], cls: type) -> Flag:
    default = declared.default
    if default is _FIELD_DEFAULT:
        factory = field.default_factory
        default = field.default if factory is dataclasses.MISSING else factory()
    if declared.type or declared.action or declared.convert:
        return dataclasses.replace(declared, default=default)
    hint = _annotation(field, cls)
    if hint is bool and declared.default is not _FIELD_DEFAULT:
        raise TypeError(f"{field.name}: a switch's parsed default follows from its field's")
    if hint is bool and default is False:
        return dataclasses.replace(declared, default=False, action="store_true")
    if hint is bool and default is True:
        if not (declared.spelled or "").startswith("--no-"):
            raise TypeError(f"{field.name}: a switch on by default needs a --no- spelling")
        return dataclasses.replace(
            declared,
            help=f"do not {declared.help}",
            default=False,
            action="store_true",
            convert=not_,
        )
    scalar = _optional_of(hint)
    if scalar in (int, float):
        return dataclasses.replace(declared, default=default, type=scalar)
    if scalar is str:
        return dataclasses.replace(declared, default=default)
    raise TypeError(
        f"{field.name}: argparse cannot read {hint}: give the flag a type, action or convert"
    )


def _annotation(field: dataclasses.Field[Any], cls: type) -> object:
    """The field's annotation, evaluated where it was written (the class of
    `cls`'s bases that declares it): only those of plain flags need be
    importable at run time (a type named for type checkers alone stays a name).

    Raises:
        TypeError: an annotation that names what its module does not have.
    """
    if not isinstance(field.type, str):
        return field.type
    declaring = next(c for c in cls.__mro__ if field.name in vars(c).get("__annotations__", {}))
    try:
        return eval(field.type, vars(sys.modules[declaring.__module__]))  # the module's own text
    except NameError as unknown:
        raise TypeError(
            f"{cls.__name__}.{field.name}: {unknown}; give the flag a type, action or convert"
        ) from None


def _optional_of(hint: object) -> object:
    """`X` of `X | None`, else `hint` itself."""
    if isinstance(hint, types.UnionType):
        members = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if len(members) == 1:
            return members[0]
    return hint
