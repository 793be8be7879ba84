"""The launcher's command line, and the Kubernetes manifests that use it (no engine needed)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from types import UnionType
from typing import Any

import pytest
import yaml

from vllm_servicer import SERVICE_NAME
from vllm_servicer.budgets import RequestBudgets
from vllm_servicer.fair_work import SCHEDULER_NAME, SHARED_STEP_TOKENS_ENV
from vllm_servicer.flags import add_flag_groups, flag, flag_groups, from_flags, group, held_groups
from vllm_servicer.health import LIVENESS_SERVICE
from vllm_servicer.multimodal.media import MediaRefOptions
from vllm_servicer.options import MountOptions
from vllm_servicer.serve.args import ADMIN_KEY_ENV, API_KEY_ENV, ServeArgs, build_parser, parse_args
from vllm_servicer.serve.http_api import frontend_args
from vllm_servicer.vllm_releases import make_arg_parser

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "examples" / "kubernetes"


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_SERVICER_CACHE", str(tmp_path))


def test_model_flag_and_positional_both_work() -> None:
    assert parse_args(["serve", "--model", "/models/x"]).engine["model"] == "/models/x"
    assert parse_args(["serve", "/models/y"]).engine["model"] == "/models/y"


def test_without_model_the_tiny_model_settings_apply_and_user_flags_win() -> None:
    args = parse_args(["serve", "--max-model-len", "256"])
    assert Path(args.engine["model"], "config.json").exists()
    assert args.engine["load_format"] == "dummy" and args.engine["gpu_memory_utilization"] == 0.2
    assert args.engine["max_model_len"] == 256


@pytest.mark.parametrize("form", [["--served-model-name", "demo"], ["--served_model_name=demo"]])
def test_the_tiny_model_takes_a_served_name(form: list[str]) -> None:
    # vLLM's own parser refuses --served-model-name before a model is named.
    args = parse_args(["serve", *form, "--max-model-len", "256"])
    assert args.engine["served_model_name"] == ["demo"]
    assert (
        Path(args.engine["model"], "config.json").exists() and args.engine["load_format"] == "dummy"
    )
    assert args.engine["max_model_len"] == 256


@pytest.mark.parametrize(
    "argv",
    [
        # A model after the name: vLLM would take it for a second name.
        ["--served-model-name", "prod", "/models/llama"],
        ["--port", "1", "--served-model-name", "prod", "--port", "2", "/models/llama"],
        # A config file names the model, or here fails to.
        ["--config", "{config}", "--served-model-name", "prod"],
    ],
)
def test_a_model_named_after_its_served_name_is_refused_not_replaced(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("max-model-len: 256\n")
    with pytest.raises(SystemExit) as ended:
        parse_args(["serve", *(arg.format(config=config) for arg in argv)])
    assert ended.value.code == 2
    assert "tiny" not in capsys.readouterr().err


def test_vllm_tls_flag_names_are_accepted() -> None:
    tls = ["--ssl-certfile", "c.pem", "--ssl-keyfile", "k.pem", "--enable-ssl-refresh"]
    args = parse_args(["serve", "--model", "m", *tls])
    assert (args.security.tls_cert, args.security.tls_key, args.security.client_ca) == (
        "c.pem",
        "k.pem",
        None,
    )
    required = ["--ssl-ca-certs", "ca.pem", "--ssl-cert-reqs", "2"]
    args = parse_args(["serve", "--model", "m", *tls, *required])
    assert args.security.client_ca == "ca.pem"  # client certificates required, as in vLLM
    with pytest.raises(SystemExit):  # a CA file alone would verify nothing
        parse_args(["serve", "--model", "m", *tls, "--ssl-ca-certs", "ca.pem"])


def test_the_launcher_serves_every_protocol_unless_told(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_SERVICER_ADMIN_API_KEY", raising=False)
    # vllm.Control only with credentials (or when named): without them anyone could call it.
    ours = ("vllm_servicer.v1.Pooling", "vllm_servicer.v1.Render")
    args = parse_args(["serve", "--model", "m"])
    assert args.options.served.services == (SERVICE_NAME, "vllm.Inference", *ours)
    assert not args.services_named
    args = parse_args(["serve", "--model", "m", "--api-key", "k"])
    assert args.options.served.services == (SERVICE_NAME, "vllm.Inference", "vllm.Control", *ours)
    args = parse_args(["serve", "--model", "m", "--services", "pooling", "render"])
    assert args.options.served.services == ours
    args = parse_args(["serve", "--model", "m", "--services", "vllm-engine", "control"])
    assert args.options.served.services == (SERVICE_NAME, "vllm.Control")
    assert args.services_named
    assert args.options.served.lora_modules == {}
    args = parse_args(["serve", "--model", "m", "--services", "inference"])
    assert args.options.served.services == ("vllm.Inference",)
    lora = ["--lora-modules", "sql=/adapters/sql", "chat=/adapters/chat"]
    args = parse_args(["serve", "--model", "m", *lora])
    assert args.options.served.lora_modules == {"sql": "/adapters/sql", "chat": "/adapters/chat"}
    for bad, says in (
        (["--lora-modules", "sql"], "name=path"),
        (["--lora-modules", "a=/x", "a=/y"], "twice"),
        (["--services", "vllm-engine", "--lora-modules", "a=/x"], "vllm.Inference"),
    ):
        with pytest.raises(SystemExit) as exit_:
            parse_args(["serve", "--model", "m", *bad])
        assert exit_.value.code == 2
        assert says in capsys.readouterr().err


@pytest.mark.parametrize(
    "serving",
    [
        ["--http-port", "8000"],
        ["--metrics-port", "9000"],
        ["--api-server-count", "2"],
        # Refused for --headless before the security group's own check (it needs TLS).
        ["--health-port", "9001"],
    ],
)
def test_a_headless_node_takes_no_serving_flags(serving: list[str], capsys: Any) -> None:
    assert parse_args(["serve", "--model", "m", "--headless"]).server.headless
    with pytest.raises(SystemExit) as exit_:
        parse_args(["serve", "--model", "m", "--headless", *serving])
    assert exit_.value.code == 2
    assert f"--headless serves nothing here: {serving[0]} has no use" in capsys.readouterr().err


def test_safe_defaults() -> None:
    args = parse_args(["serve", "--model", "m"])
    assert args.server.host == "127.0.0.1"
    assert args.server.max_message_bytes == 32 * 1024 * 1024
    assert args.engine["shutdown_timeout"] == 30
    # Engine calls, calls of every kind (refused ones too) and KV-event
    # subscribers are bounded by default.
    assert args.slots.max_inflight == 1024
    assert args.slots.max_concurrent_rpcs == 2048
    assert args.options.streaming.max_kv_subscribers == 16


def test_each_flag_s_default_is_its_field_s(monkeypatch: pytest.MonkeyPatch) -> None:
    # Parsed with no launcher flag, every field is what ServeArgs declares as
    # its default: a flag whose parser default or conversion disagrees shows here.
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)
    parsed = parse_args(["serve", "--model", "m"])
    declared = ServeArgs(engine=parsed.engine)
    names = [field.name for field in dataclasses.fields(ServeArgs)]
    assert {name: getattr(parsed, name) for name in names} == {
        name: getattr(declared, name) for name in names
    }


def test_the_launcher_s_flags_are_its_groups_fields_and_nothing_else() -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs

    # ServeArgs holds groups and two values set otherwise (flag_groups refuses
    # an unmarked field); every launcher flag the parser has is a group's field.
    fields = {field.name for field in dataclasses.fields(ServeArgs)}
    assert fields - set(held_groups(ServeArgs)) == {"engine", "services_named"}
    parsed = vars(build_parser().parse_args(["serve", "--model", "m"]))
    engine = {field.name for field in dataclasses.fields(AsyncEngineArgs)}
    declared = [
        declared.dest(name)
        for _, flags in flag_groups(ServeArgs)
        for name, declared in flags.items()
    ]
    assert len(declared) == len(set(declared))  # no two fields share a flag
    assert set(parsed) - engine == {"command", "model_tag", *declared}


def test_each_group_is_an_argparse_group_titled_and_described_by_its_class() -> None:
    parser = build_parser()
    serve = next(
        action for action in parser._actions if isinstance(action, argparse._SubParsersAction)
    ).choices["serve"]
    shown = {group.title: group for group in serve._action_groups}
    for group_class, flags in flag_groups(ServeArgs):
        arguments = shown[group_class.FLAG_TITLE]
        assert arguments.description and arguments.description in " ".join(
            (group_class.__doc__ or "").split()
        )
        assert {action.dest for action in arguments._group_actions} == {
            declared.dest(name) for name, declared in flags.items()
        }


# A value other than the default for each kind of launcher flag, and the flags
# whose value is no plain number, text or switch.
_GIVEN = {
    "services": ["control"],
    "lora_modules": ["a=/x"],
    "event_loop": ["asyncio"],
    "ssl_cert_reqs": ["2"],
    "min_tenant_priority": ["-7"],
}
_GIVEN_BY_TYPE = {int: ["7"], float: ["2.5"], str: ["x"], bool: [], tuple: ["x"]}


def test_each_flag_reaches_its_field_with_the_field_s_type() -> None:
    parser = build_parser()
    for group_class, flags in flag_groups(ServeArgs):
        defaults = group_class()
        hints = typing.get_type_hints(group_class, localns={"MediaRefOptions": MediaRefOptions})
        for name, declared in flags.items():
            hint = hints[name]
            if isinstance(hint, UnionType):  # X | None
                [hint] = [arg for arg in typing.get_args(hint) if arg is not type(None)]
            kind = typing.get_origin(hint) or hint
            given = _GIVEN.get(name) or _GIVEN_BY_TYPE.get(kind, [])
            argv = [declared.spelling(name), *given]
            value = declared.value(parser.parse_args(["serve", "--model", "m", *argv]), name)
            assert value != getattr(defaults, name), argv
            assert isinstance(value, Mapping if kind is Mapping else kind), (argv, value)


def test_each_group_is_read_back_from_its_own_flags() -> None:
    # from_flags builds every group from the namespace, so each validates itself.
    flags = build_parser().parse_args(["serve", "--model", "m", "--grpc-stream-interval", "4"])
    args = from_flags(ServeArgs, flags, engine={})
    assert args.options.streaming.stream_interval == 4
    assert args.options == MountOptions.of(stream_interval=4)
    with pytest.raises(ValueError, match="--http-host needs --http-port"):
        from_flags(ServeArgs, build_parser().parse_args(["serve", "--http-host", "::"]))


# A flag that sets each mount() option to other than its default.
_OPTION_ARGV = {
    "services": (["--services", "control"], ("vllm.Control",)),
    "reflection_service": (["--no-reflection"], False),
    "load_reports": (["--no-load-reports"], False),
    "max_kv_subscribers": (["--max-kv-subscribers", "3"], 3),
    "media_refs": (["--enable-media-refs"], MediaRefOptions()),
    "shm_tensors": (["--enable-shm-tensors"], True),
    "lora_modules": (["--lora-modules", "a=/x"], {"a": "/x"}),
    "stream_interval": (["--grpc-stream-interval", "4"], 4),
    "stream_interval_min_inflight": (["--grpc-stream-interval-min-inflight", "2"], 2),
    "chat_template": (["--chat-template", "x"], "x"),
    "tool_call_parser": (["--tool-call-parser", "pythonic"], "pythonic"),
    "enable_auto_tool_choice": (
        ["--enable-auto-tool-choice", "--tool-call-parser", "pythonic"],
        True,
    ),
    "routing_data_for_every_key": (["--routing-data-for-every-key"], True),
    "shared_prefix_cache": (["--shared-prefix-cache"], True),
    "max_queued_prompt_tokens": (["--max-queued-prompt-tokens", "4096"], 4096),
}


def _mount_option_flags() -> dict[str, tuple[str, Any]]:
    """Each flag of `MountOptions`' groups but the budgets': (its group's field, its Flag)."""
    where = {of: name for name, of in held_groups(MountOptions).items()}
    return {
        name: (where[group_class], declared)
        for group_class, flags in flag_groups(MountOptions)
        if group_class is not RequestBudgets
        for name, declared in flags.items()
    }


def test_each_mount_option_s_flag_sets_its_field_and_shows_its_help() -> None:
    # The flags are built from the groups' fields: each has its flag, with the
    # field's help (a switch on by default: "do not" and it).
    parser = build_parser()
    serve = next(
        action for action in parser._actions if isinstance(action, argparse._SubParsersAction)
    ).choices["serve"]
    helps = {option: action.help for action in serve._actions for option in action.option_strings}
    option_flags = _mount_option_flags()
    assert set(option_flags) == set(_OPTION_ARGV)
    defaults = MountOptions()
    for name, (argv, value) in _OPTION_ARGV.items():
        group_name, declared = option_flags[name]
        assert argv[0] == declared.spelling(name)
        assert declared.help in str(helps[argv[0]])
        args = parse_args(["serve", "--model", "m", *argv])
        assert getattr(getattr(args.options, group_name), name) == value, name
        default = getattr(getattr(defaults, group_name), name)
        if name != "services":  # the launcher's follow the credentials
            assert (
                getattr(getattr(parse_args(["serve", "--model", "m"]).options, group_name), name)
                == default
            )


# What mount() took as keywords before MountOptions: each is a field of that name.
_KEYWORDS_BEFORE_OPTIONS = {
    *("services", "health", "reflection_service", "load_reports", "max_kv_subscribers"),
    *("media_refs", "shm_tensors", "lora_modules", "budgets", "stream_interval"),
    *("stream_interval_min_inflight", "chat_template", "routing_data_for_every_key"),
    "shared_prefix_cache",
}


def test_the_api_docs_migration_table_names_every_old_keyword_and_its_flag() -> None:
    # docs/api.md: each old mount() keyword, where it is in MountOptions, its flag.
    text = (Path(__file__).parents[1] / "docs" / "api.md").read_text()
    rows = [
        line.split("|")[1:4]
        for line in text.splitlines()
        if line.startswith("| `") and "=`" in line
    ]
    table = {
        keyword.strip(" `="): (field.strip(" `"), flag.strip()) for keyword, field, flag in rows
    }
    assert set(table) == _KEYWORDS_BEFORE_OPTIONS
    for name, (group_name, declared) in _mount_option_flags().items():
        if name in table:
            assert table[name][0] == f"{group_name}.{name}", name
            if name != "services":
                assert table[name][1] == f"`{declared.spelling(name)}`", name
    # Every old keyword still builds the same options through MountOptions.of.
    assert MountOptions.of(health=False).served.health is False


def test_a_field_that_is_not_marked_is_refused() -> None:
    @dataclasses.dataclass(frozen=True)
    class Options:
        FLAG_TITLE: typing.ClassVar[str] = "g"
        port: int = flag(1, help="the port")
        forgotten: int = 0

    with pytest.raises(TypeError, match="forgotten"):
        list(flag_groups(Options))


def test_a_group_must_describe_itself_and_take_flags_of_its_own() -> None:
    @dataclasses.dataclass(frozen=True)
    class Undescribed:
        FLAG_TITLE: typing.ClassVar[str] = "g"
        port: int = flag(1, help="the port")

    @dataclasses.dataclass(frozen=True)
    class Taking:
        """Takes a flag another group has."""

        FLAG_TITLE: typing.ClassVar[str] = "g"
        port: int = flag(1, help="the port", spelled="--max-n")

    @dataclasses.dataclass(frozen=True)
    class Holding:
        taking: Taking = group(Taking)
        budgets: RequestBudgets = group(RequestBudgets)

    with pytest.raises(TypeError, match="docstring"):
        add_flag_groups(argparse.ArgumentParser(), Undescribed)
    with pytest.raises(TypeError, match="max_n is taken"):
        add_flag_groups(argparse.ArgumentParser(), Holding)


def test_a_switch_s_parsed_default_follows_its_field_s() -> None:
    @dataclasses.dataclass(frozen=True)
    class Inverted:
        """A switch on by default, with a parsed default that would invert it."""

        FLAG_TITLE: typing.ClassVar[str] = "g"
        reports: bool = flag(
            True, help="send reports", spelled="--no-reports", parsed_default=False
        )

    with pytest.raises(TypeError, match="parsed default"):
        list(flag_groups(Inverted))


@pytest.mark.parametrize(
    "argv",
    [
        ["--api-key", "a", "--api-key-file", "f"],
        ["--tls-cert", "c.pem"],
        ["--tls-client-ca", "ca.pem"],
        ["--grpc-stream-interval", "0"],
        ["--grpc-stream-interval-min-inflight", "-1"],
        ["--max-connection-age", "0"],
    ],
    ids=[
        "two-key-sources",
        "cert-without-key",
        "client-ca-without-cert",
        "no-stream-interval",
        "negative-threshold",
        "no-connection-age",
    ],
)
def test_contradictory_flags_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["serve", "--model", "m", *argv])


# Launcher flags that vLLM's own serve parser defines too; the launcher serves them itself.
LAUNCHER_ONLY = [
    *("--host", "0.0.0.0", "--port", "7000", "--api-key", "k", "--metrics-port", "9000"),
    *("--tls-cert", "c.pem", "--tls-key", "k.pem", "--enable-ssl-refresh"),
    *("--ssl-ca-certs", "ca.pem", "--ssl-cert-reqs", "2"),
]


@pytest.mark.parametrize(
    ("argv", "handed_over"),
    [
        ([], {}),
        (["--http-port", "0", "--chat-template", "x"], {"chat_template": "x"}),
        (["--http-port", "0", "--chat-template", "x", *LAUNCHER_ONLY], {"chat_template": "x"}),
    ],
    ids=["defaults", "chat-template", "launcher-only-flags"],
)
def test_vllm_s_http_app_gets_the_engine_settings_and_only_the_flags_it_reads(
    argv: list[str], handed_over: dict[str, Any]
) -> None:
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    vllm_defaults = vars(make_arg_parser(FlexibleArgumentParser()).parse_args([]))
    engine = ["--max-model-len", "256", "--no-enable-chunked-prefill"]
    served = vars(frontend_args(parse_args(["serve", "m", *engine, *argv]), "127.0.0.1", 8001))
    changed = {name: value for name, value in served.items() if value != vllm_defaults.get(name)}
    assert changed == {
        "model": "m",
        "max_model_len": 256,
        "enable_chunked_prefill": False,
        "shutdown_timeout": 30,  # the launcher's default for vLLM's flag
        # The launcher's default: tenants' requests in the fair order (fair_work.py),
        # a light tenant's into the next step (fair_steps.py).
        "scheduling_policy": "priority",
        "scheduler_cls": "vllm_servicer.fair_steps.FairStepScheduler",
        "host": "127.0.0.1",
        "port": 8001,
        **handed_over,
    }


def _load(name: str) -> Any:
    return yaml.safe_load((K8S / name).read_text())


def test_deployment_probes_drain_budget_and_flags() -> None:
    deployment = _load("deployment.yaml")
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    args = parse_args(container["args"])  # every flag the manifest passes exists
    grpc_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
    assert args.server.port == grpc_port and args.server.host == "0.0.0.0"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == grpc_port
    assert container["readinessProbe"]["grpc"]["service"] == SERVICE_NAME
    # Liveness stays SERVING through a drain: the pod is not restarted mid-drain.
    assert container["livenessProbe"]["grpc"]["service"] == LIVENESS_SERVICE
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    budget = pre_stop + args.server.drain_grace + args.engine["shutdown_timeout"]
    assert pod["terminationGracePeriodSeconds"] > budget
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == args.observability.metrics_port


def test_container_recipe_runs_the_launcher_on_its_exposed_ports() -> None:
    dockerfile = (K8S.parent / "container" / "Dockerfile").read_text()
    lines = [line.split(maxsplit=1) for line in dockerfile.splitlines() if line[:1].isupper()]
    instructions = {word: rest for word, rest in lines}
    assert instructions["FROM"] == "${VLLM_IMAGE}"
    assert instructions["ARG"].startswith("VLLM_IMAGE=vllm/vllm-openai:v0.33")
    assert json.loads(instructions["ENTRYPOINT"]) == ["vllm-servicer"]
    args = parse_args(json.loads(instructions["CMD"]))  # every flag exists
    assert {args.server.port, args.observability.metrics_port} == {
        int(p) for p in instructions["EXPOSE"].split()
    }
    # The Kubernetes example runs this image: its args replace CMD.
    [container] = _load("deployment.yaml")["spec"]["template"]["spec"]["containers"]
    assert container["args"][0] == "serve" and "command" not in container


def test_service_is_headless_and_monitor_matches() -> None:
    service = _load("service.yaml")
    assert service["spec"]["clusterIP"] == "None"
    names = {p["name"] for p in service["spec"]["ports"]}
    monitor = _load("servicemonitor.yaml")
    assert monitor["spec"]["endpoints"][0]["port"] in names
    assert monitor["spec"]["selector"]["matchLabels"] == service["metadata"]["labels"]


def test_launcher_process_reads_vllm_env_once_and_freezes_start_up_heap() -> None:
    # In a child process: both effects are process-wide and must not leak into this one.
    probe = "\n".join(
        [
            "import gc, os",
            "import vllm.envs as envs",
            "from vllm_servicer.serve.launcher import settle_process_for_serving",
            "os.environ['VLLM_COMPUTE_NANS_IN_LOGITS'] = '0'",
            "assert envs.VLLM_COMPUTE_NANS_IN_LOGITS is False",
            "os.environ['VLLM_COMPUTE_NANS_IN_LOGITS'] = '1'",
            "assert envs.VLLM_COMPUTE_NANS_IN_LOGITS is True  # re-read per access",
            "settle_process_for_serving()",
            "os.environ['VLLM_COMPUTE_NANS_IN_LOGITS'] = '0'",
            "assert envs.VLLM_COMPUTE_NANS_IN_LOGITS is True  # now read once",
            "assert gc.get_freeze_count() > 0",
            "print('ok')",
        ]
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("ok")


def test_the_engine_takes_a_servers_batch_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM sizes max_num_seqs and max_num_batched_tokens by usage context: its
    # servers get up to 1024 sequences on a large GPU, an engine context 128.
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    from vllm_servicer.serve import launcher

    seen: dict[str, Any] = {}

    def from_engine_args(engine_args: Any, **kwargs: Any) -> str:
        seen.update(kwargs, model=engine_args.model)
        return "engine"

    monkeypatch.setattr(AsyncLLM, "from_engine_args", from_engine_args)
    assert launcher._start_engine(parse_args(["serve", "--model", "m"])) == "engine"
    assert seen == {"usage_context": UsageContext.OPENAI_API_SERVER, "model": "m"}


@pytest.mark.parametrize(("flags", "held_to_a_share"), [((), True), (("--no-fair-shares",), False)])
def test_the_launchers_slots_are_shared_fairly_unless_no_fair_shares(
    flags: tuple[str, ...], held_to_a_share: bool
) -> None:
    """The launcher's in-flight count holds a tenant to its share once another
    was refused a slot; `--no-fair-shares` serves them first come."""
    from vllm_servicer.context import Identity
    from vllm_servicer.interceptors import InflightInterceptor
    from vllm_servicer.serve.stack import build_interceptors

    argv = ["serve", "--model", "m", "--api-key", "k" * 32, "--max-inflight", "2", *flags]
    stack, _ = build_interceptors(parse_args(argv))
    (inflight,) = [i for i in stack if isinstance(i, InflightInterceptor)]
    a, b = Identity("tenant-a"), Identity("tenant-b")
    assert inflight.enter(a) is None and inflight.enter(a) is None
    assert "server busy" in (inflight.enter(b) or "")  # b now wants a slot
    inflight.leave(a)
    refusal = inflight.enter(a)
    assert (refusal is not None) == held_to_a_share, refusal
    if held_to_a_share:
        assert "its share while 2 tenants want them is 1" in (refusal or "")
        assert inflight.enter(b) is None


def _loop_run_by(choice: str) -> str:
    """The top-level module of the event loop `run_until_done` runs for `--event-loop choice`."""
    from vllm_servicer.serve.process import run_until_done

    seen: list[str] = []

    async def note_loop() -> int:
        seen.append(type(asyncio.get_running_loop()).__module__.split(".")[0])
        return 0

    assert run_until_done(note_loop(), choice) == 0
    return seen[0]


@pytest.mark.parametrize(
    ("choice", "loop_module"), [("auto", "uvloop"), ("uvloop", "uvloop"), ("asyncio", "asyncio")]
)
def test_the_event_loop_is_the_one_asked_for(choice: str, loop_module: str) -> None:
    assert parse_args(["serve", "--event-loop", choice]).server.event_loop == choice
    assert _loop_run_by(choice) == loop_module


def test_an_event_loop_that_is_not_installed_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_servicer.serve.process import run_until_done

    async def never_run() -> int:
        return 0

    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now fails
    serving = never_run()
    with pytest.raises(SystemExit, match="--event-loop uvloop: uvloop is not installed"):
        run_until_done(serving, "uvloop")
    serving.close()
    assert _loop_run_by("auto") == "asyncio"


def test_the_engine_runs_the_fair_order_unless_the_operator_chose_a_policy() -> None:
    assert parse_args(["serve", "m"]).engine["scheduling_policy"] == "priority"
    chosen = parse_args(["serve", "m", "--scheduling-policy", "fcfs"])
    assert chosen.engine["scheduling_policy"] == "fcfs"
    assert chosen.engine["scheduler_cls"] is None


def test_the_fair_steps_scheduler_is_the_default_unless_the_operator_names_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert parse_args(["serve", "m"]).engine["scheduler_cls"] == SCHEDULER_NAME
    assert parse_args(["serve", "m", "--shared-step-tokens", "0"]).engine["scheduler_cls"] is None
    own = parse_args(["serve", "m", "--scheduler-cls", "my.Scheduler"])
    assert own.engine["scheduler_cls"] == "my.Scheduler"
    with pytest.raises(SystemExit):
        parse_args(["serve", "m", "--shared-step-tokens", "-1"])
    monkeypatch.setenv(SHARED_STEP_TOKENS_ENV, "")  # put back as it was after the test
    args = parse_args(["serve", "m", "--shared-step-tokens", "64"])
    args.engine_args()  # what the engine's processes will read
    assert os.environ[SHARED_STEP_TOKENS_ENV] == "64"
