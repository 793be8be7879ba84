"""AuthInterceptor against a real engine: keys, hostile attempts, exemptions, permissions."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from support import bearer, collect, completes, placed, request, serving, unfinished

from vllm_servicer import SERVICE_NAME, server_options
from vllm_servicer.interceptors._base import methods_of
from vllm_servicer.interceptors.api_keys import ApiKeyVerifier, key_label
from vllm_servicer.interceptors.auth import (
    AuthInterceptor,
    Identity,
    Unauthenticated,
    current_identity,
)
from vllm_servicer.interceptors.verifiers import AllOf, CallableVerifier
from vllm_servicer.proto import vllm_engine_pb2 as pb
from vllm_servicer.proto import vllm_engine_pb2_grpc

ALICE = "alice-0123456789abcdefABCDEF"
BOB = "bob-0123456789abcdefABCDEF"
RETIRED = "retired-0123456789abcdef"
MAX_BYTES = 1 << 20


class SpyEngine:
    """The real engine, recording every call that would make it work and who made it."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.calls: list[str] = []
        self.identities: list[Identity | None] = []

    def _saw(self, name: str) -> None:
        self.calls.append(name)
        self.identities.append(current_identity.get())

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        self._saw("generate")
        return self._engine.generate(*args, **kwargs)

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        self._saw("encode")
        return self._engine.encode(*args, **kwargs)

    async def abort(self, *args: Any, **kwargs: Any) -> None:
        self._saw("abort")
        await self._engine.abort(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


class Served:
    def __init__(self, channel: grpc.aio.Channel, spy: SpyEngine, mounted: Any, engine: Any):
        self.channel = channel
        self.stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        self.spy = spy
        self.mounted = mounted
        self.engine = engine
        self.verifications = 0
        self.key_file: Path = Path()

    async def settled_snapshot(self) -> tuple[Any, ...]:
        """`snapshot()` once no request runs: one ending from an earlier test
        (the engine is the session's) would otherwise change it meanwhile."""
        servicer = self.mounted.servicer
        deadline = time.monotonic() + 30
        while (servicer.active_requests or unfinished(self.engine)) and time.monotonic() < deadline:  # noqa: ASYNC110 - no event for the engine's count
            await asyncio.sleep(0.05)
        return self.snapshot()

    def snapshot(self) -> tuple[Any, ...]:
        servicer = self.mounted.servicer
        return (
            len(self.spy.calls),
            servicer.active_requests,
            servicer._last_receive_timestamp,
            unfinished(self.engine),
        )


@pytest.fixture(scope="module")
async def served(
    placement: str, engine: Any, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Served]:
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text(f"# rotated keys\nalice: {ALICE}\n\n{BOB}\nold: {RETIRED}\n")
    keys = ApiKeyVerifier.from_file(key_file)
    holder: list[Served] = []

    async def verify(metadata: Any, auth_context: Any) -> Identity:
        holder[0].verifications += 1
        if ("x-slow", "1") in tuple(metadata):
            await asyncio.sleep(1.0)
        return await keys(metadata, auth_context)

    auth = AuthInterceptor(
        CallableVerifier(verify),
        permissions={
            "alice": lambda method: True,
            key_label(BOB): methods_of(SERVICE_NAME),
            "old": methods_of(SERVICE_NAME),
        },
    )
    spy = SpyEngine(engine)
    options = server_options(max_message_bytes=MAX_BYTES)
    async with serving(spy, **placed(placement, [auth], options=options)) as running:
        served = Served(running.channel, spy, running.mounted, engine)
        served.key_file = key_file
        holder.append(served)
        # The retired key works until the file drops it (rotation without restart).
        await served.stub.HealthCheck(pb.HealthCheckRequest(), metadata=bearer(RETIRED))
        key_file.write_text(f"alice: {ALICE}\n{BOB}\n")
        yield served


async def test_valid_key_generates_and_identity_reaches_the_engine(served: Served) -> None:
    before = len(served.spy.calls)
    messages = await collect(
        served.stub.Generate(request(max_tokens=3, ignore_eos=True), metadata=bearer(ALICE))
    )
    assert len(completes(messages)[0].output_ids) == 3
    # The servicer's handler ran with the identity in its context.
    assert served.spy.calls[before:] == ["generate"]
    identity = served.spy.identities[before]
    assert identity is not None and identity.name == "alice" and identity.kind == "api_key"
    assert current_identity.get() is None  # nothing leaked into the client's context


HOSTILE = {
    "no metadata": (),
    "basic scheme": (("authorization", "Basic YWxpY2U6c2VjcmV0"),),
    "empty token": (("authorization", "Bearer "),),
    "scheme only": (("authorization", "Bearer"),),
    "lowercase scheme": (("authorization", f"bearer {ALICE}"),),
    "uppercase scheme": (("authorization", f"BEARER {ALICE}"),),
    "two spaces": (("authorization", f"Bearer  {ALICE}"),),
    "trailing space": (("authorization", f"Bearer {ALICE} "),),
    "space inside": (("authorization", f"Bearer {ALICE[:5]} {ALICE[5:]}"),),
    "rotated-out key": bearer(RETIRED),
    "unknown key": bearer("mallory-0123456789abcdef"),
    "key prefix": bearer(ALICE[:-1]),
    "key in x-api-key": (("x-api-key", ALICE),),
    "key in api-key with scheme": (("api-key", f"Bearer {ALICE}"),),
    "very long token": bearer("a" * 4000),
    "binary metadata": (("authorization-bin", f"Bearer {ALICE}".encode()),),
    "two authorization headers": (
        ("authorization", f"Bearer {ALICE}"),
        ("authorization", "Bearer x"),
    ),
}


@pytest.mark.parametrize("metadata", list(HOSTILE.values()), ids=list(HOSTILE))
async def test_hostile_credentials_are_unauthenticated_before_any_engine_work(
    served: Served, metadata: Any
) -> None:
    before = await served.settled_snapshot()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(served.stub.Generate(request(max_tokens=3, stream=True), metadata=metadata))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value.details()
    assert ALICE not in (err.value.details() or "")
    assert served.snapshot() == before


async def test_oversized_token_never_reaches_the_engine(served: Served) -> None:
    # Above grpc's own metadata limit: grpc or the verifier rejects it; nothing runs.
    before = await served.settled_snapshot()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(served.stub.Generate(request(max_tokens=3), metadata=bearer("a" * 100_000)))
    assert err.value.code() != grpc.StatusCode.OK
    assert served.snapshot() == before
    await served.stub.HealthCheck(pb.HealthCheckRequest(), metadata=bearer(ALICE))


async def test_generate_embed_abort_need_credentials(served: Served) -> None:
    before = await served.settled_snapshot()
    calls = {
        "Generate": lambda: collect(served.stub.Generate(request(max_tokens=2))),
        "Embed": lambda: served.stub.Embed(
            pb.EmbedRequest(request_id="e", tokenized=pb.TokenizedInput(input_ids=[1, 2]))
        ),
        "Abort": lambda: served.stub.Abort(pb.AbortRequest(request_ids=["x"])),
        "HealthCheck": lambda: served.stub.HealthCheck(pb.HealthCheckRequest()),
        "GetModelInfo": lambda: served.stub.GetModelInfo(pb.GetModelInfoRequest()),
    }
    for name, call in calls.items():
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
    assert served.snapshot() == before
    # With a key, Abort is answered; "x" is no request of alice's, so the
    # engine is not even asked.
    before_abort = len(served.spy.calls)
    await served.stub.Abort(pb.AbortRequest(request_ids=["x"]), metadata=bearer(ALICE))
    assert served.spy.calls[before_abort:] == []


async def test_health_and_reflection_answer_without_credentials(served: Served) -> None:
    health = health_pb2_grpc.HealthStub(served.channel)
    reply = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    watch = health.Watch(health_pb2.HealthCheckRequest())
    assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()
    reflection = reflection_pb2_grpc.ServerReflectionStub(served.channel)
    replies = reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    listed = [s.name async for r in replies for s in r.list_services_response.service]
    assert SERVICE_NAME in listed


async def test_known_identity_without_permission_is_denied(served: Served) -> None:
    bob = bearer(BOB)
    # Bob may use the VllmEngine service, nothing else that needs credentials.
    assert (await served.stub.HealthCheck(pb.HealthCheckRequest(), metadata=bob)).healthy
    deny = AuthInterceptor(
        ApiKeyVerifier([BOB]), permissions=lambda identity, method: method.endswith("/Abort")
    )
    async with serving(
        served.spy,
        server=grpc.aio.server(interceptors=[deny]),
        health=False,
        reflection_service=False,
    ) as running:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(running.channel)
        before = len(served.spy.calls)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub.Generate(request(max_tokens=2), metadata=bob))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert key_label(BOB) in (err.value.details() or "")
        assert len(served.spy.calls) == before
        assert running.mounted.servicer.active_requests == 0
        await stub.Abort(pb.AbortRequest(request_ids=["y"]), metadata=bob)


async def test_oversized_request_is_resource_exhausted_and_server_keeps_serving(
    served: Served,
) -> None:
    before = await served.settled_snapshot()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(
            served.stub.Generate(
                request("x" * (2 * MAX_BYTES), max_tokens=2), metadata=bearer(ALICE)
            )
        )
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert served.snapshot() == before
    messages = await collect(
        served.stub.Generate(request(max_tokens=2, ignore_eos=True), metadata=bearer(ALICE))
    )
    assert len(completes(messages)[0].output_ids) == 2


async def test_slow_verifier_does_not_stall_a_concurrent_stream(served: Served) -> None:
    arrivals: list[float] = []
    stop = asyncio.Event()
    first = asyncio.Event()

    async def keep_streaming() -> None:
        while not stop.is_set():
            call = served.stub.Generate(
                request(max_tokens=400, ignore_eos=True, stream=True), metadata=bearer(ALICE)
            )
            async for _ in call:
                arrivals.append(time.monotonic())
                first.set()
                if stop.is_set():
                    call.cancel()
                    break

    streamer = asyncio.create_task(keep_streaming())
    await first.wait()
    started = time.monotonic()
    reply = await served.stub.HealthCheck(
        pb.HealthCheckRequest(), metadata=(*bearer(ALICE), ("x-slow", "1"))
    )
    ended = time.monotonic()
    stop.set()
    await streamer
    assert reply.healthy
    assert ended - started >= 1.0
    # The stream kept making progress while the verifier slept: a verification
    # that held other calls up leaves its whole second without a chunk, while a
    # free stream's longest gap is tens of ms, even on a busy machine.
    points = [started, *(t for t in arrivals if started < t < ended), ended]
    longest = max(b - a for a, b in zip(points, points[1:], strict=False))
    assert longest < 0.75, f"no chunk for {longest:.2f} s of the 1 s verification"


async def test_rejections_are_logged_without_the_secret(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    near_miss = ALICE[:-1] + "X"
    with caplog.at_level(logging.INFO, logger="vllm_servicer.interceptors.auth"):
        with pytest.raises(grpc.aio.AioRpcError):
            await served.stub.HealthCheck(pb.HealthCheckRequest(), metadata=bearer(near_miss))
    text = caplog.text
    assert "rejected /vllm.grpc.engine.VllmEngine/HealthCheck from ipv4:127.0.0.1:" in text
    assert "invalid API key" in text and "UNAUTHENTICATED" in text
    assert near_miss not in text and ALICE not in text


# ----- verifiers on their own ---------------------------------------------------


async def test_key_file_reloads_on_change(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# comment\n\nfirst: key-one   # trailing comment\nkey-two\n")
    verifier = ApiKeyVerifier.from_file(path)
    assert verifier.labels == ("first", key_label("key-two"))
    assert (await verifier(bearer("key-one"), {})).name == "first"

    path.write_text("second: key-three\n")
    assert verifier.labels == ("second",)
    with pytest.raises(Exception, match="invalid API key"):
        await verifier(bearer("key-one"), {})
    assert (await verifier(bearer("key-three"), {})).name == "second"


async def test_a_key_files_lines_give_roles_and_weights(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(
        "tenant-a: key-a\n"
        "big: key-big weight=2.5\n"
        "router: key-router role=router   # the cache-aware router\n"
        "router: key-router-next role=router\n"
        "ops: key-ops role=router,admin weight=3\n"
        "both: key-both role=router role=admin\n"
    )
    verifier = ApiKeyVerifier.from_file(path, roles={"extra"})
    found = {key: await verifier(bearer(key), {}) for key in ("key-a", "key-big", "key-router")}
    assert (found["key-a"].roles, found["key-a"].weight) == ({"extra"}, 1.0)
    assert not found["key-a"].is_router
    assert found["key-big"].weight == 2.5
    router = found["key-router"]
    # A file's roles add to the verifier's.
    assert router.roles == {"router", "extra"} and router.is_router and not router.is_admin
    assert await verifier(bearer("key-router-next"), {}) == router  # one identity
    ops = await verifier(bearer("key-ops"), {})
    assert (ops.roles, ops.weight) == ({"router", "admin", "extra"}, 3.0)
    assert (await verifier(bearer("key-both"), {})).roles == {"router", "admin", "extra"}
    # Composed, the identity keeps its weight and roles.
    composed = await AllOf(verifier, CallableVerifier(lambda md, ac: "any"))(bearer("key-ops"), {})
    assert (composed.name, composed.roles, composed.weight) == ("ops", ops.roles, 3.0)


@pytest.mark.parametrize(
    ("lines", "words"),
    [
        ("a: key-a\nb: key-b role=owner\n", ["keys:2", "unknown role 'owner'"]),
        ("a: key-a role=router,\n", ["keys:1", "unknown role ''"]),
        ("a: key-a weight=0\n", ["keys:1", "positive number", "'0'"]),
        ("a: key-a weight=-1\n", ["keys:1", "positive number"]),
        ("a: key-a weight=nan\n", ["keys:1", "positive number"]),
        ("a: key-a weight=inf\n", ["keys:1", "positive number"]),
        ("a: key-a weight=heavy\n", ["keys:1", "positive number"]),
        ("a: key-a weight=1 weight=2\n", ["keys:1", "weight given twice"]),
        ("a: key-a colour=red\n", ["keys:1", "unknown setting 'colour'"]),
        ("a: key-a router\n", ["keys:1", "'router'", "name=value"]),
        ("\n# c\nr: k1 role=router\nr: k2\n", ["keys:4", "'r'", "line 3"]),
        ("r: k1 weight=2\nr: k2 weight=3\n", ["keys:2", "'r'", "line 1"]),
    ],
)
def test_a_bad_key_file_line_is_named(tmp_path: Path, lines: str, words: list[str]) -> None:
    path = tmp_path / "keys"
    path.write_text(lines)
    with pytest.raises(ValueError) as err:
        ApiKeyVerifier.from_file(path)
    assert all(word in str(err.value) for word in words), str(err.value)


def _empty(path: Path) -> None:
    path.write_text("")


def _comments_only(path: Path) -> None:
    path.write_text("# every key revoked\n\n")


def _malformed(path: Path) -> None:
    path.write_text("good: key-three\nhas space in key\n")


def _removed(path: Path) -> None:
    path.unlink()


def _unreadable(path: Path) -> None:
    # A directory in its place: unreadable as a file even to root, who ignores modes.
    path.unlink()
    path.mkdir()


def _restore(path: Path) -> None:
    if path.is_dir():
        path.rmdir()
    path.write_text("second: key-three\n")


@pytest.mark.parametrize(
    "breakage",
    [_empty, _comments_only, _malformed, _removed, _unreadable],
    ids=["empty", "comments-only", "malformed", "removed", "unreadable"],
)
async def test_key_file_fails_closed_until_a_good_file_returns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, breakage: Any
) -> None:
    path = tmp_path / "keys"
    path.write_text("second: key-three\n")
    verifier = ApiKeyVerifier.from_file(path)
    assert (await verifier(bearer("key-three"), {})).name == "second"

    breakage(path)
    with caplog.at_level(logging.ERROR, logger="vllm_servicer.interceptors.auth"):
        for _ in range(5):
            with pytest.raises(Unauthenticated, match="invalid API key"):
                await verifier(bearer("key-three"), {})
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]  # once per state, not per call
    assert "key-three" not in caplog.text

    _restore(path)
    assert (await verifier(bearer("key-three"), {})).name == "second"
    assert verifier.labels == ("second",)


async def test_emptied_key_file_refuses_the_old_key_on_the_wire(served: Served) -> None:
    # The served fixture's verifier reads its key file at each call.
    path = served.key_file
    good = path.read_text()
    path.write_text("# revoked\n")
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await served.stub.HealthCheck(pb.HealthCheckRequest(), metadata=bearer(ALICE))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        path.write_text(good)
    assert (await served.stub.HealthCheck(pb.HealthCheckRequest(), metadata=bearer(ALICE))).healthy


def test_keys_are_validated_and_labels_hide_them(monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in ("", "with space", "tab\tkey", "a" * 2000, "comma,key"):
        with pytest.raises(ValueError):
            ApiKeyVerifier([bad])
    with pytest.raises(ValueError):
        ApiKeyVerifier([])
    monkeypatch.setenv("TEST_KEYS", "k1, k2")
    verifier = ApiKeyVerifier.from_env("TEST_KEYS")
    assert verifier.labels == (key_label("k1"), key_label("k2"))
    assert all("k1" not in label[4:] and len(label) == 12 for label in verifier.labels)
    monkeypatch.delenv("TEST_KEYS")
    with pytest.raises(ValueError):
        ApiKeyVerifier.from_env("TEST_KEYS")


async def test_values_grpc_clients_refuse_to_send_are_rejected_too() -> None:
    # grpc's own client will not send these; other clients might.
    verifier = ApiKeyVerifier([ALICE])
    for value in (
        f"Bearer\t{ALICE}",
        f" Bearer {ALICE}",
        f"Bearer {ALICE}\n",
        f"Bearer {ALICE}\x00",
    ):
        with pytest.raises(Unauthenticated):
            await verifier((("authorization", value),), {})
    with pytest.raises(Unauthenticated):
        await verifier((("authorization", f"Bearer {ALICE}".encode()),), {})
    assert (await verifier(bearer(ALICE), {})).name == key_label(ALICE)


async def test_callable_verifier_results() -> None:
    assert (await CallableVerifier(lambda md, ac: "svc")((), {})).name == "svc"

    async def none(md: Any, ac: Any) -> None:
        return None

    with pytest.raises(Exception, match="invalid credentials"):
        await CallableVerifier(none)((), {})


async def test_sync_handlers_are_refused_not_served_unauthenticated() -> None:
    def say(request: bytes, context: Any) -> bytes:  # a plain function: grpc's thread pool
        return b"served"

    server = grpc.aio.server(interceptors=[AuthInterceptor(ApiKeyVerifier([ALICE]))])
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "host.Sync", {"Say": grpc.unary_unary_rpc_method_handler(say)}
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            for metadata in ((), bearer(ALICE)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await channel.unary_unary("/host.Sync/Say")(b"x", metadata=metadata)
                assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await server.stop(None)
