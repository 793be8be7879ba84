"""Command-line flags declared on dataclass fields, so that each is stated once.

A field made with `flag()` is the flag of its name (`max_inflight` is
`--max-inflight`): its metadata carries the help text, the argparse group,
and what argparse needs beyond the field's annotation and default. From
those, `add_flags` builds the argparse groups in one loop and `flag_values`
reads the parsed namespace back into field values: the idea of vLLM's
`FrontendArgs.add_cli_args`, with the help in the metadata rather than in
attribute docstrings. A field that no flag sets says so with `not_a_flag()`.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..budgets import flag_name

__all__ = ["Flag", "add_flags", "declared_flags", "flag", "flag_values", "not_a_flag"]

_FLAG = "vllm_servicer.flag"
_NOT_A_FLAG = "vllm_servicer.not_a_flag"


class _FieldDefault:
    def __repr__(self) -> str:
        return "<the field's default>"


_FIELD_DEFAULT: Any = _FieldDefault()


@dataclass(frozen=True)
class Flag:
    """One command-line flag: its group, its help, and how argparse reads it.

    Attributes:
        group: the title of its argparse group (groups show in order of first use).
        help: its `--help` text.
        aliases: other spellings of it (vLLM's `--ssl-certfile` for `--tls-cert`).
        type: as `add_argument` takes it; on a field, `int` and `float`
            follow from the annotation (`int | None` too).
        action: as `add_argument` takes it; on a field annotated `bool`, `store_true`.
        nargs: as `add_argument` takes it.
        choices: as `add_argument` takes it.
        metavar: as `add_argument` takes it.
        default: what argparse gives when the flag is absent; on a field, the
            field's default unless its parsed form differs (`[]` for `append`).
        convert: what turns the parsed value into the field's (`tuple` for
            `append`'s list); may raise ValueError, naming the flag.
    """

    group: str
    help: str
    aliases: tuple[str, ...] = ()
    type: Callable[[str], Any] | None = None
    action: str | None = None
    nargs: str | None = None
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None
    default: Any = _FIELD_DEFAULT
    convert: Callable[[Any], Any] | None = None

    def add_to(self, group: argparse._ArgumentGroup, name: str) -> None:
        """Add this flag, named after the field `name`, to an argparse group."""
        specifics = {
            key: value
            for key in ("type", "action", "nargs", "choices", "metavar")
            if (value := getattr(self, key)) is not None
        }
        group.add_argument(
            flag_name(name), *self.aliases, default=self.default, help=self.help, **specifics
        )


def flag(
    default: Any = dataclasses.MISSING,
    *,
    group: str,
    help: str,
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
    aliases: tuple[str, ...] = (),
    type: Callable[[str], Any] | None = None,
    action: str | None = None,
    nargs: str | None = None,
    choices: tuple[Any, ...] | None = None,
    metavar: str | None = None,
    parsed_default: Any = _FIELD_DEFAULT,
    convert: Callable[[Any], Any] | None = None,
) -> Any:
    """A dataclass field that is also a command-line flag (see `Flag` for each argument).

    `default` and `default_factory` are the field's, as in `dataclasses.field`;
    `parsed_default` is argparse's default when the parsed form differs. The
    other names are argparse's own, `help` and `type` included.
    """
    declared = Flag(
        group=group,
        help=help,
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


def not_a_flag(
    default: Any = dataclasses.MISSING,
    *,
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field that no flag of its own sets: the caller derives it."""
    return dataclasses.field(
        default=default, default_factory=default_factory, metadata={_NOT_A_FLAG: True}
    )


def declared_flags(cls: type) -> dict[str, Flag]:
    """The flags `cls`'s fields declare, by field name in field order, completed.

    Completed: the default is the field's unless the flag gives its own, and
    the type or action follows from the annotation unless the flag gives one.

    Raises:
        TypeError: a field that is neither `flag()` nor `not_a_flag()`, or a
            flag whose annotation says nothing argparse can use.
    """
    hints = typing.get_type_hints(cls)
    flags: dict[str, Flag] = {}
    for field in dataclasses.fields(cls):
        declared = field.metadata.get(_FLAG)
        if declared is not None:
            flags[field.name] = _completed(declared, field, hints[field.name])
        elif not field.metadata.get(_NOT_A_FLAG):
            raise TypeError(f"{cls.__name__}.{field.name}: declare it with flag() or not_a_flag()")
    return flags


def _completed(declared: Flag, field: dataclasses.Field[Any], hint: Any) -> Flag:
    default = declared.default
    if default is _FIELD_DEFAULT:
        factory = field.default_factory
        default = field.default if factory is dataclasses.MISSING else factory()
    if declared.type or declared.action or declared.convert:
        return dataclasses.replace(declared, default=default)
    if hint is bool and default is False:
        return dataclasses.replace(declared, default=default, action="store_true")
    scalar = _optional_of(hint)
    if scalar in (int, float):
        return dataclasses.replace(declared, default=default, type=scalar)
    if scalar is str:
        return dataclasses.replace(declared, default=default)
    raise TypeError(
        f"{field.name}: argparse cannot read {hint} (a bool flag is off by default): "
        "give the flag a type, action or convert"
    )


def _optional_of(hint: Any) -> Any:
    """`X` of `X | None`, else `hint` itself."""
    if isinstance(hint, types.UnionType):
        members = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if len(members) == 1:
            return members[0]
    return hint


def add_flags(parser: argparse.ArgumentParser, flags: Mapping[str, Flag]) -> None:
    """Add each flag to its group of `parser`, making the groups in order of first use."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name, declared in flags.items():
        if declared.group not in groups:
            groups[declared.group] = parser.add_argument_group(declared.group)
        declared.add_to(groups[declared.group], name)


def flag_values(cls: type, parsed: argparse.Namespace) -> dict[str, Any]:
    """What `cls`'s flag fields take from a namespace `add_flags` parsed, converted.

    Raises:
        ValueError: a value its flag's `convert` refuses.
    """
    values: dict[str, Any] = {}
    for name, declared in declared_flags(cls).items():
        value = getattr(parsed, name)
        values[name] = declared.convert(value) if declared.convert else value
    return values
