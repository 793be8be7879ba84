"""Paths in error messages are redacted from the text alone, seen on the wire.

A client names a path where the server echoes it back (here `vllm.Inference`'s
`model` field, on the session's real engine): whether the path exists on the
server must not change what the client reads, or the messages answer "does
/root exist?", "is there a user alice?".
"""

from __future__ import annotations

import types
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from support import serving

from vllm_servicer import SERVICE_NAME
from vllm_servicer.proto import INFERENCE_SERVICE

# Each pair: one that exists on any Linux host the tests run on, one that does not.
PAIRS = [
    ("/root/adapters/x", "/no-such-top-folder-5b1e/adapters/x"),
    ("/tmp", "/no-such-top-folder-5b1e"),
    ("~root/x", "~no-such-user-5b1e/x"),
]


@pytest.fixture(scope="module")
async def inference(engine: Any, ref_grpc: types.ModuleType) -> AsyncIterator[Any]:
    async with serving(engine, services=(SERVICE_NAME, INFERENCE_SERVICE)) as served:
        yield ref_grpc.InferenceStub(served.channel)


async def _told(stub: Any, ref: types.ModuleType, model: str) -> str:
    message = ref.GenerateRequest(model=model)
    message.token_ids.ids.extend([5, 17, 42])
    message.stopping.max_new_tokens = 1
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Generate(message)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    return err.value.details() or ""


@pytest.mark.parametrize(("existing", "missing"), PAIRS)
async def test_an_existing_and_a_missing_path_read_the_same(
    inference: Any, ref: types.ModuleType, existing: str, missing: str
) -> None:
    """The two refusals are word for word the same (both paths hidden), so
    the message tells nothing of this host's folders and users."""
    first = await _told(inference, ref, existing)
    second = await _told(inference, ref, missing)
    assert first == second, (first, second)
    assert existing not in first and "<path>" in first, first
