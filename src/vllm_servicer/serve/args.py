"""The launcher's command line: its parser, and `ServeArgs`, what it parses into.

`parse_args(argv)` is the one way in: the launcher's own flags become typed
fields of a frozen `ServeArgs`, which refuses contradictory ones; vLLM's engine
flags travel beside them, as parsed, until the engine is built from them
(`ServeArgs.engine_args()`), as `vllm serve` builds its own.

Every launcher flag is a field of a group (`flags.py`): the launcher's own
(`flag_groups.py`) and `mount()`'s (`MountOptions`). `ServeArgs` holds the
groups; the parser's groups and `ServeArgs.from_flags` are built from them.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from .. import fair_work
from ..flags import add_flag_groups, from_flags, group, not_a_flag
from ..interceptors.keyless import KeylessLimits
from ..options import SERVICES, MountOptions
from .flag_groups import (
    ADMIN_KEY_ENV,
    API_KEY_ENV,
    ROUTER_KEY_ENV,
    CallSlotFlags,
    HttpApiFlags,
    ObservabilityFlags,
    SecurityFlags,
    ServerFlags,
)

if TYPE_CHECKING:
    from vllm.engine.arg_utils import AsyncEngineArgs

__all__ = [
    "ADMIN_KEY_ENV",
    "API_KEY_ENV",
    "ROUTER_KEY_ENV",
    "ServeArgs",
    "build_parser",
    "parse_args",
]

logger = logging.getLogger("vllm_servicer.serve")

_DESCRIPTION = "Standalone launcher: `python -m vllm_servicer serve [vLLM engine flags]`."


@dataclass(frozen=True)
class ServeArgs:
    """What the launcher serves, and how: its groups of options, and vLLM's engine flags.

    Each group is a frozen dataclass whose fields are its flags, validated
    there; here only what spans two groups is checked. What `mount()` takes
    is one group of groups, `options` (`MountOptions`). Its services default
    to what is safe without credentials (no vllm.Control); `from_flags`
    widens them to every protocol when keys or client certificates are set,
    so a `ServeArgs` built by hand with keys names its services itself.
    vLLM's engine flags are one mapping, `engine`, by `AsyncEngineArgs` field.

    Raises:
        ValueError: options that contradict each other; the message names the flags.
    """

    engine: Mapping[str, Any] = not_a_flag(default_factory=lambda: MappingProxyType({}))
    """vLLM's engine flags by `AsyncEngineArgs` field name, as parsed (defaults included)."""
    server: ServerFlags = group(ServerFlags)
    slots: CallSlotFlags = group(CallSlotFlags)
    keyless: KeylessLimits = group(KeylessLimits)
    options: MountOptions = group(MountOptions)
    http: HttpApiFlags = group(HttpApiFlags)
    observability: ObservabilityFlags = group(ObservabilityFlags)
    security: SecurityFlags = group(SecurityFlags)
    services_named: bool = not_a_flag(False)
    """Whether `--services` was given (else the services follow the credentials)."""

    def __post_init__(self) -> None:
        if self.server.headless:
            _refuse_serving_flags(
                self.server.api_server_count,
                self.http.http_port,
                self.security.health_port,
                self.observability.metrics_port,
                self.server.warm_up,
            )
        http_port = self.http.http_port
        if http_port and http_port == self.server.port and self.http_address == self.server.host:
            raise ValueError("--http-port must differ from --port")

    def __reduce__(self) -> tuple[object, ...]:
        # Handed to each frontend process (--api-server-count): read-only
        # mappings do not pickle, so they travel as dicts.
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["engine"] = dict(self.engine)
        return (_unpickle_serve_args, (fields,))

    @classmethod
    def from_flags(cls, flags: argparse.Namespace) -> ServeArgs:
        """`ServeArgs` from what `build_parser()` parsed.

        Raises:
            ValueError: flags that contradict each other; the message names them.
        """
        if flags.headless:  # before each group's own checks: they would not apply
            _refuse_serving_flags(
                flags.api_server_count,
                flags.http_port,
                flags.health_port,
                flags.metrics_port,
                flags.warm_up,
            )
        args = from_flags(
            cls, flags, engine=_engine_flags(flags), services_named=flags.services is not None
        )
        if args.services_named or not args.security.authenticates():
            return args
        # Not named: with credentials, every protocol (vllm.Control for administrators).
        served = dataclasses.replace(args.options.served, services=SERVICES)
        return dataclasses.replace(args, options=dataclasses.replace(args.options, served=served))

    @property
    def http_address(self) -> str:
        """The HTTP API's host: `--http-host`, else `--host`."""
        return self.http.http_host or self.server.host

    @property
    def metrics_address(self) -> str:
        """The metrics endpoint's host: `--metrics-host`, else `--host`."""
        return self.observability.metrics_host or self.server.host

    def engine_args(self) -> AsyncEngineArgs:
        """vLLM's `AsyncEngineArgs` from the engine flags, as `from_cli_args` builds them."""
        from vllm.engine.arg_utils import AsyncEngineArgs

        # The engine's processes, started after this, read the shared step's budget here.
        os.environ[fair_work.SHARED_STEP_TOKENS_ENV] = str(self.slots.shared_step_tokens)
        return AsyncEngineArgs(**self.engine)


def _refuse_serving_flags(
    api_server_count: int,
    http_port: int | None,
    health_port: int | None,
    metrics_port: int | None,
    warm_up: bool,
) -> None:
    """Refuse, on a headless node, the flags of what it does not serve.

    Raises:
        ValueError: the first such flag given, named.
    """
    for given, option in (
        (api_server_count > 1, "--api-server-count"),
        (http_port is not None, "--http-port"),
        (health_port is not None, "--health-port"),
        (metrics_port is not None, "--metrics-port"),
        (warm_up, "--warm-up"),
    ):
        if given:
            raise ValueError(f"--headless serves nothing here: {option} has no use")


def _unpickle_serve_args(fields: dict[str, Any]) -> ServeArgs:
    fields["engine"] = MappingProxyType(fields["engine"])
    return ServeArgs(**fields)


def parse_args(argv: Sequence[str] | None = None) -> ServeArgs:
    """The launcher's command line as `ServeArgs`.

    Without `--model`, the built-in tiny model is written if missing and
    served, with its engine settings as defaults (flags given still win) and
    the CPU backend's environment defaults applied. Flags that do not parse
    or contradict each other end the process as argparse does: the message
    on stderr, exit code 2.

    Args:
        argv: the arguments after the program name (default: `sys.argv[1:]`).
    """
    from ..testing.tiny_model import TINY_ENGINE_KWARGS, default_model_dir

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        flags = parser.parse_args(argv)
        tiny = flags.model_tag is None and flags.model is None
    except ValueError as refused:
        # vLLM's parser refuses --served-model-name before a model is named. With
        # no model at all, the name is the tiny model's; anything else (a model
        # named later, a config file) stays the operator's to fix.
        if not _names_only_the_tiny_model(argv):
            parser.error(str(refused))
        argv = [*argv[:1], str(default_model_dir()), *argv[1:]]
        tiny = True
    if tiny:
        # Parsed again with the tiny model's settings as defaults, so that
        # flags the user gave still win over them.
        flags = build_parser(TINY_ENGINE_KWARGS).parse_args(argv)
    try:
        args = ServeArgs.from_flags(flags)
    except ValueError as refused:
        parser.error(str(refused))
    return _with_tiny_model(args) if tiny else args


_SERVED_NAME = re.compile(r"^--served[-_]model[-_]name(=.+)?$")


def _names_only_the_tiny_model(argv: Sequence[str]) -> bool:
    """Whether `argv` gives the served model one name and names no model: no
    config file, and the name followed by a flag or nothing (a second word
    after it would be read as a second name, though meant as the model)."""
    if any(re.match(r"^--config(=.+|$)", arg) for arg in argv):
        return False
    for index, arg in enumerate(argv):
        if named := _SERVED_NAME.match(arg):
            if named.group(1):
                return True
            name, *after = argv[index + 1 : index + 3] or ["-"]
            return not name.startswith("-") and (not after or after[0].startswith("-"))
    return False


def _with_tiny_model(args: ServeArgs) -> ServeArgs:
    """`args` serving the tiny model, written if missing, with the CPU environment it needs."""
    from ..testing.tiny_model import apply_cpu_env_defaults, ensure_tiny_model

    apply_cpu_env_defaults()
    logger.warning(
        "no --model given: serving the built-in tiny demo model (random weights, its "
        "text is noise); pass --model to serve a real one"
    )
    model = str(ensure_tiny_model())
    tokenizer = model if args.engine["tokenizer"] is None else args.engine["tokenizer"]
    engine = MappingProxyType({**args.engine, "model": model, "tokenizer": tokenizer})
    return dataclasses.replace(args, engine=engine)


def _engine_flags(flags: argparse.Namespace) -> Mapping[str, Any]:
    """The `AsyncEngineArgs` fields the command line set, with the launcher's CPU default."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform

    from .. import vllm_releases

    names = (field.name for field in dataclasses.fields(AsyncEngineArgs))
    engine = {name: getattr(flags, name) for name in names if hasattr(flags, name)}
    if flags.model_tag is not None:
        engine["model"] = flags.model_tag
    if (
        engine["enable_chunked_prefill"] is None
        and current_platform.is_cpu()
        and vllm_releases.SEEDED_DRAW_REWINDS
    ):
        # Whole prompts only, unless asked, where a split prompt's seeded draw
        # kills a CPU engine (vllm_releases.seeded_sampling_hazard: 0.31 to
        # 0.33). vLLM then raises the step's token budget to at least the
        # context length.
        engine["enable_chunked_prefill"] = False
    if engine.get("scheduling_policy", "") is None:
        # Tenants' requests run in the fair order of the work each brings
        # (fair_work.py), which vLLM applies through each request's priority; an
        # operator's --scheduling-policy fcfs keeps arrival order.
        engine["scheduling_policy"] = "priority"
    if (
        engine.get("scheduling_policy") == "priority"
        and engine.get("scheduler_cls", "") is None
        and flags.shared_step_tokens > 0
    ):
        # A light tenant's request goes before running prompts' chunks, in short steps
        # (fair_steps.py); with whole prompts only it schedules as vLLM's does.
        engine["scheduler_cls"] = fair_work.SCHEDULER_NAME
    return MappingProxyType(engine)


def build_parser(engine_defaults: Mapping[str, Any] | None = None) -> argparse.ArgumentParser:
    """The launcher's argument parser: its own flags plus every vLLM engine flag.

    Args:
        engine_defaults: engine settings that replace vLLM's defaults.
    """
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser_class: Any = FlexibleArgumentParser  # untyped in vLLM
    parser: argparse.ArgumentParser = parser_class(prog="vllm-servicer", description=_DESCRIPTION)
    # Typed as what argparse makes it anyway: a parser of the parser's own class.
    commands = parser.add_subparsers(
        dest="command", required=True, parser_class=FlexibleArgumentParser
    )
    serve = commands.add_parser("serve", help="serve a model over vLLM's gRPC protocol")
    _add_launcher_flags(serve)
    AsyncEngineArgs.add_cli_args(serve)
    # Our drain waits this long for in-flight calls (vLLM's default 0 would cut them).
    # None: the launcher's choice (`_engine_flags`), told apart from an operator's fcfs.
    defaults = {"model": None, "shutdown_timeout": 30, "scheduling_policy": None}
    serve.set_defaults(**{**defaults, **(engine_defaults or {})})
    return parser


def _add_launcher_flags(serve: argparse.ArgumentParser) -> None:
    # vLLM's parser rewrites `serve --model X` into `serve X` (its positional form).
    serve.add_argument("model_tag", nargs="?", default=None, help="the model (same as --model)")
    add_flag_groups(serve, ServeArgs)
