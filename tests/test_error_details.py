"""Typed error details: a google.rpc.Status with ErrorInfo and BadRequest, decoded client-side."""

from __future__ import annotations

import shutil
from collections.abc import AsyncGenerator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from support import collect, request, serving
from support.calls import detail, status_of
from vllm.exceptions import VLLMValidationError
from vllm.v1.engine.exceptions import EngineDeadError

from vllm_servicer.errors import InvalidRequestError, UnsupportedError
from vllm_servicer.proto import common_pb2
from vllm_servicer.proto import vllm_engine_pb2 as pb
from vllm_servicer.status import (
    ERROR_DOMAIN,
    ERROR_TABLE,
    message_for,
    redact_paths,
    rich_status,
    rule_for,
)
from vllm_servicer.testing.stand_in import FaultEngine, StandInEngine


def _details(err: grpc.aio.AioRpcError) -> tuple[Any, Any, Any]:
    """(status, ErrorInfo, BadRequest or None) from the call's trailers."""
    status = status_of(err)
    assert status.code == err.code().value[0] and status.message == err.details()
    info = detail(status, error_details_pb2.ErrorInfo)
    bad = detail(status, error_details_pb2.BadRequest)
    assert info is not None and info.domain == ERROR_DOMAIN
    return status, info, bad


@pytest.mark.parametrize(
    ("name", "call", "field", "words"),
    [
        (
            "negative temperature",
            request(temperature=-1.0),
            "sampling_params.temperature",
            "temperature",
        ),
        ("too many logprobs", request(logprobs=50), "sampling_params.logprobs", "logprobs"),
        ("empty prompt", request(prompt=[]), "tokenized.input_ids", "empty"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_invalid_generate_carries_field_violations(
    stub: Any, name: str, call: pb.GenerateRequest, field: str, words: str, stream: bool
) -> None:
    message = pb.GenerateRequest()
    message.CopyFrom(call)
    message.stream = stream
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub.Generate(message))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    _, info, bad = _details(err.value)
    assert info.reason == "INVALID_ARGUMENT" and info.metadata["method"] == "Generate"
    assert bad is not None and len(bad.field_violations) == 1
    violation = bad.field_violations[0]
    assert violation.field == field
    assert words in violation.description


async def test_invalid_flush_timeout_names_the_field(stub: Any) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=float("nan")))
    _, info, bad = _details(err.value)
    assert info.reason == "INVALID_ARGUMENT"
    assert [v.field for v in bad.field_violations] == ["timeout_s"]


async def test_other_errors_carry_a_stable_reason_only(stub: Any) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.StartProfile(common_pb2.StartProfileRequest())
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    _, info, bad = _details(err.value)
    assert (info.reason, info.metadata["method"], bad) == ("UNSUPPORTED", "StartProfile", None)

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest()))
    _, info, bad = _details(err.value)
    assert (info.reason, bad) == ("NOT_ENABLED", None)


async def test_the_service_keeps_serving_after_errors(stub: Any) -> None:
    with pytest.raises(grpc.aio.AioRpcError):
        await collect(stub.Generate(request(top_p=2.0)))
    replies = await collect(stub.Generate(request(max_tokens=3, ignore_eos=True)))
    assert replies[-1].complete.finish_reason == "length"


def test_every_reason_is_a_stable_upper_case_token() -> None:
    for rule in ERROR_TABLE:
        assert rule.reason.isupper() and " " not in rule.reason


@pytest.mark.parametrize(
    ("exc", "code", "reason"),
    [
        (RuntimeError("boom"), grpc.StatusCode.INTERNAL, "INTERNAL"),
        (EngineDeadError(), grpc.StatusCode.UNAVAILABLE, "ENGINE_DEAD"),
    ],
)
def test_server_side_faults_have_reasons_and_no_violations(
    exc: BaseException, code: grpc.StatusCode, reason: str
) -> None:
    rule = rule_for(exc)
    status = rich_status(exc, rule, message_for(exc, rule.code, "r1"), "Generate")
    assert status.code == code.value[0] and "boom" not in status.message
    assert len(status.details) == 1
    info = detail(status, error_details_pb2.ErrorInfo)
    assert info is not None and info.reason == reason


def test_type_errors_are_server_faults_and_keep_their_text_out() -> None:
    exc = TypeError("unsupported operand type(s) for +: 'int' and 'NoneType'")
    rule = rule_for(exc)
    message = message_for(exc, rule.code, "r2")
    assert rule.code == grpc.StatusCode.INTERNAL and "NoneType" not in message


def test_messages_leave_out_this_servers_paths(tmp_path: Any) -> None:
    model = tmp_path / "models" / "tiny"
    model.mkdir(parents=True)
    exc = UnsupportedError(f"no tokenizer files in {str(model)!r} on this server")
    missing = ValueError(f"cannot read {model / 'tokenizer.json'}: not found")
    foreign = ValueError("https://example.com/a/b and org/model are the client's own")
    for given, hidden in ((exc, str(model)), (missing, str(model))):
        message = message_for(given, rule_for(given).code, "r3")
        assert hidden not in message and "<path>" in message, message
    assert message_for(foreign, rule_for(foreign).code, "r4") == str(foreign)


async def test_tokenizer_errors_on_the_wire_name_no_server_path(tmp_path: Any) -> None:
    """GetTokenizer's refusal from a real server, when its tokenizer folder holds no files."""
    from vllm_servicer.proto import vllm_engine_pb2_grpc

    empty = tmp_path / "srv" / "tokenizer"
    empty.mkdir(parents=True)

    class NoTokenizerFiles(StandInEngine):
        """A real engine with an empty tokenizer folder would not start."""

        def __init__(self) -> None:
            super().__init__(model_config=SimpleNamespace(tokenizer=str(empty)))

    async with serving(NoTokenizerFiles(), health=False, reflection_service=False) as served:  # type: ignore[arg-type]
        stub = vllm_engine_pb2_grpc.VllmEngineStub(served.channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub.GetTokenizer(common_pb2.GetTokenizerRequest()))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert str(tmp_path) not in (err.value.details() or "") and "<path>" in err.value.details()


def _told(exc: BaseException) -> tuple[str, list[str]]:
    """What a client reads of `exc`: the status message and every violation's description."""
    rule = rule_for(exc)
    status = rich_status(exc, rule, message_for(exc, rule.code, "r5"), "Generate")
    bad = detail(status, error_details_pb2.BadRequest)
    return status.message, [v.description for v in bad.field_violations] if bad else []


def _deleted_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "hub" / "tiny"
    folder.mkdir(parents=True)
    shutil.rmtree(tmp_path / "hub")
    return folder


def test_paths_of_deleted_folders_are_left_out(tmp_path: Path) -> None:
    gone = _deleted_folder(tmp_path) / "tokenizer.json"
    message, _ = _told(ValueError(f"cannot read {gone}: no such file"))
    assert str(tmp_path) not in message and "<path>" in message, message


def test_home_relative_paths_are_left_out() -> None:
    message, _ = _told(ValueError("no tokenizer files in '~/models/tiny' on this server"))
    assert "models/tiny" not in message and "<path>" in message, message


def test_relative_paths_are_left_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    message, _ = _told(ValueError("cannot read models/tiny/config.json nor ./cache/tiny"))
    assert "tiny" not in message and message.count("<path>") == 2, message


@pytest.mark.parametrize(
    "make",
    [
        lambda path: InvalidRequestError("media_refs", f"cannot read {path}"),
        lambda path: VLLMValidationError(f"no grammar file {path}", parameter="grammar"),
    ],
    ids=["servicer", "engine"],
)
def test_field_violation_descriptions_leave_out_paths(tmp_path: Path, make: Any) -> None:
    grammar = tmp_path / "grammars" / "g.ebnf"
    grammar.parent.mkdir()
    grammar.write_text("root ::= 'a'")
    message, descriptions = _told(make(grammar))
    assert len(descriptions) == 1
    for text in (message, *descriptions):
        assert str(tmp_path) not in text and "<path>" in text, text


def test_urls_words_and_client_slashes_are_kept() -> None:
    text = (
        "fetch https://huggingface.co/org/model/tree/main or http://[::1]:8000/tmp/x; "
        "and/or org/model, 1/2, Qwen/Qwen2.5-7B"
    )
    assert redact_paths(text) == text


def test_absolute_words_are_paths_whatever_exists_here() -> None:
    """Decided from the text: a client's absolute regex or route reads as a path
    too, and a folder that exists reads as one that does not."""
    text = "regex /a+b/, route /v1/models, /tmp/x, /no-such-top-folder-5b1e/x"
    assert redact_paths(text) == "regex <path>, route <path>, <path>, <path>"


async def test_field_violations_on_the_wire_name_no_server_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine's validation error naming server files, as a client decodes it."""
    from vllm_servicer.proto import vllm_engine_pb2_grpc

    (tmp_path / "grammars").mkdir()
    monkeypatch.chdir(tmp_path)
    home = Path.home()
    said = (
        f"no grammar in {_deleted_folder(tmp_path)}/g.ebnf, {home}/g.ebnf, "
        "~/grammars/g.ebnf or grammars/g.ebnf"
    )

    class RefusingEngine(FaultEngine):
        """Stand-in engine: refuses every request with `said`."""

        async def generate(self, *args: Any, **kwargs: Any) -> AsyncGenerator[Any, None]:
            raise VLLMValidationError(said, parameter="grammar")
            yield  # an async generator, as vLLM's

    async with serving(RefusingEngine(), health=False, reflection_service=False) as served:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(served.channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub.Generate(request()))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status, _, bad = _details(err.value)
    assert bad is not None and [v.field for v in bad.field_violations] == [
        "sampling_params.grammar"
    ]
    for text in (status.message, bad.field_violations[0].description):
        assert "g.ebnf" not in text and text.count("<path>") == 4, text
