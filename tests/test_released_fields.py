"""A client compiled from vLLM 0.34.0's released schema, against the launcher as shipped.

The launcher on the tiny model with two tenants' keys, its own interceptor
stack in its order; the stubs are compiled from the release's own text
(protos/reference/vllm/). Each field vLLM 0.33 and 0.34 added is honoured or
refused naming it, and a field number the schema lacks is refused rather than
dropped, after authentication as every call is.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from support import bearer
from support.launcher import Launched, launched, launcher_env
from support.vllm_protocol import reference_modules

pytestmark = pytest.mark.engine

inf, inf_grpc = reference_modules("inference")
ctl, ctl_grpc = reference_modules("control")

TENANT_A = "tenant-a-0123456789abcdefABCDEF"
TENANT_B = "tenant-b-0123456789abcdefABCDEF"
PROMPT = [5, 17, 42, 99, 7, 63, 21, 88]


@pytest.fixture(scope="module")
async def launcher(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Launched]:
    env = launcher_env(Path(tmp_path_factory.mktemp("cache")))
    async with launched("--api-key", TENANT_A, "--api-key", TENANT_B, env=env) as served:
        yield served


@pytest.fixture(scope="module")
async def channel(launcher: Launched) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(launcher.address) as channel:
        yield channel


def _request(max_new_tokens: int = 8, **fields: Any) -> Any:
    message = inf.GenerateRequest(**fields)
    message.token_ids.ids.extend(PROMPT)
    message.stopping.max_new_tokens = max_new_tokens
    message.stopping.ignore_eos = True
    message.response.output_token_ids = True
    return message


async def test_bad_words_are_honoured_and_the_cached_count_filled(
    channel: grpc.aio.Channel,
) -> None:
    stub = inf_grpc.InferenceStub(channel)
    greedy = await stub.Generate(_request(), metadata=bearer(TENANT_A), timeout=120)
    first = greedy.outputs.token_ids[0]
    banned = _request()
    banned.decoding.bad_words_token_ids.add(ids=[first])
    reply = await stub.Generate(banned, metadata=bearer(TENANT_B), timeout=120)
    assert first not in reply.outputs.token_ids and len(reply.outputs.token_ids) == 8
    assert reply.outputs.finish_info.HasField("num_cached_tokens")


async def test_a_present_top_p_of_zero_is_refused_as_vllms_frontend_refuses_it(
    channel: grpc.aio.Channel,
) -> None:
    message = _request(temperature=1.0)
    message.sampling.top_p = 0.0
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await inf_grpc.InferenceStub(channel).Generate(
            message, metadata=bearer(TENANT_A), timeout=60
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "sampling.top_p: top_p must be in (0, 1], got 0"


async def test_an_unknown_field_is_refused_naming_its_number_and_the_schema(
    channel: grpc.aio.Channel,
) -> None:
    data = _request(2).SerializeToString() + b"\xfa\x06\x01x"  # field 111, 1 byte
    generate = channel.unary_unary("/vllm.Inference/Generate")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(data, metadata=bearer(TENANT_B), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = err.value.details() or ""
    assert details.startswith("request: field number 111 is not in vllm.GenerateRequest"), details
    info = await ctl_grpc.ControlStub(channel).GetServerInfo(
        ctl.GetServerInfoRequest(), metadata=bearer(TENANT_A), timeout=30
    )
    assert f'proto_version "{info.proto_version}"' in details and info.proto_version
    # Without a key it is refused for that first: nothing is read before authentication.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(data, timeout=60)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
