"""A tenant's request priority is bounded below, on the launcher as shipped.

With `--scheduling-policy priority` vLLM runs lower priority values first, so
a tenant asking for less than 0 (every other tenant's default) jumps every
other tenant's queue. A tenant's request may ask for `--min-tenant-priority`
(0 by default) or above, a key with `min_priority=` on its line of the key
file for its own floor; a router's and an admin's are not bounded. Below the
floor: INVALID_ARGUMENT naming `priority`, the floor and how it is set.

One launcher: two tenants' keys (B's line with `min_priority=-5`) and a
router's in one key file, an admin key.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import pytest
from support import bearer
from support.launcher import START_TIMEOUT, Launched, launched, launcher_env

from vllm_servicer.budgets import RequestBudgets
from vllm_servicer.interceptors.api_keys import ApiKeyVerifier
from vllm_servicer.proto import inference_pb2, inference_pb2_grpc
from vllm_servicer.serve.args import parse_args

pytestmark = pytest.mark.timeout(START_TIMEOUT + 300)

TENANT_A = "priority-tenant-a-0123456789abcdefABCDEF"
TENANT_B = "priority-tenant-b-0123456789abcdefABCDEF"
ROUTER = "priority-router-0123456789abcdefABCDEF"
ADMIN = "priority-admin-0123456789abcdefABCDEF"
KEY_FILE = (
    f"tenant-a: {TENANT_A}\ntenant-b: {TENANT_B} min_priority=-5\nrouter: {ROUTER} role=router\n"
)
_numbers = itertools.count(1)


@pytest.fixture(scope="module")
async def launcher(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Launched]:
    work = tmp_path_factory.mktemp("priority")
    keys = work / "keys"
    keys.write_text(KEY_FILE)
    flags = [
        *("--api-key-file", str(keys), "--admin-api-key", ADMIN),
        *("--services", "vllm-engine", "inference", "--scheduling-policy", "priority"),
        *("--http-port", "0"),
    ]
    async with launched(*flags, env=launcher_env(work / "cache")) as served:
        yield served


@pytest.fixture(scope="module")
async def stub(launcher: Launched) -> AsyncIterator[inference_pb2_grpc.InferenceStub]:
    async with grpc.aio.insecure_channel(launcher.address) as channel:
        yield inference_pb2_grpc.InferenceStub(channel)


async def _generate(
    stub: inference_pb2_grpc.InferenceStub, key: str, priority: int
) -> inference_pb2.GenerateResponse:
    message = inference_pb2.GenerateRequest(request_id=f"priority-{next(_numbers)}")
    message.token_ids.ids.extend([5, 6, 7, 8])
    message.stopping.max_new_tokens = 2
    message.stopping.ignore_eos = True
    message.priority = priority
    return await stub.Generate(message, metadata=bearer(key), timeout=120)


async def _refusal(
    stub: inference_pb2_grpc.InferenceStub, key: str, priority: int
) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _generate(stub, key, priority)
    return refused.value


async def test_a_tenant_cannot_ask_to_run_ahead_of_other_tenants(
    stub: inference_pb2_grpc.InferenceStub,
) -> None:
    err = await _refusal(stub, TENANT_A, -1)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = err.details() or ""
    assert details.startswith("priority: -1 is below 0, the lowest this key may ask for"), details
    assert "--min-tenant-priority" in details and "min_priority=" in details, details
    # At the floor, or behind it (lower runs first): served.
    for priority in (0, 3):
        assert (await _generate(stub, TENANT_A, priority)).outputs.num_tokens == 2


async def test_a_key_files_floor_is_that_keys_own(stub: inference_pb2_grpc.InferenceStub) -> None:
    assert (await _generate(stub, TENANT_B, -5)).outputs.num_tokens == 2
    err = await _refusal(stub, TENANT_B, -6)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.details() or "").startswith("priority: -6 is below -5"), err.details()


async def test_routers_and_admins_ask_for_any_priority(
    stub: inference_pb2_grpc.InferenceStub,
) -> None:
    for key in (ROUTER, ADMIN):
        assert (await _generate(stub, key, -100)).outputs.num_tokens == 2, key


async def test_the_floor_holds_over_http_too(launcher: Launched) -> None:
    async with httpx.AsyncClient(base_url=launcher.http_url, timeout=120) as http:
        models = await http.get("/v1/models", headers=dict(bearer(TENANT_A)))
        model = models.json()["data"][0]["id"]

        async def complete(key: str, priority: int) -> httpx.Response:
            body = {"model": model, "prompt": "Hi", "max_tokens": 2, "priority": priority}
            return await http.post("/v1/completions", json=body, headers=dict(bearer(key)))

        refused = await complete(TENANT_A, -1)
        assert refused.status_code == 400, refused.text
        assert "--min-tenant-priority" in refused.json()["error"]["message"]
        assert (await complete(TENANT_A, 0)).status_code == 200
        assert (await complete(TENANT_B, -5)).status_code == 200
        assert (await complete(ROUTER, -100)).status_code == 200
        # vLLM's HTTP models take any integer; the engine's priority is 64 bits,
        # and a tenant's class (2**31 virtual tokens apart) must stay within it:
        # outside 32 bits the request is refused, whoever sends it, and the
        # engine keeps serving.
        for key, priority in ((TENANT_A, 2**40), (ROUTER, -(2**40))):
            refused = await complete(key, priority)
            assert refused.status_code == 400, refused.text
            assert "(32 bits)" in refused.json()["error"]["message"]
        assert (await complete(TENANT_A, 2**31 - 1)).status_code == 200


def test_the_floor_is_a_launcher_flag_and_a_key_file_setting(tmp_path: Path) -> None:
    assert RequestBudgets().min_tenant_priority == 0
    budgets = parse_args(["serve", "--min-tenant-priority", "-3"]).options.budgets
    assert budgets.min_tenant_priority == -3
    # Above 0 a request asking for none (0) would be below it.
    with pytest.raises(SystemExit) as exited:
        parse_args(["serve", "--min-tenant-priority", "1"])
    assert exited.value.code == 2
    keys = tmp_path / "keys"
    for line, words in (
        ("min_priority=1", "from -2147483648 to 0, got 1"),
        ("min_priority=low", "got 'low'"),
        ("min_priority=-1 min_priority=-2", "min_priority given twice"),
    ):
        keys.write_text(f"a: key-a {line}\n")
        with pytest.raises(ValueError) as err:
            ApiKeyVerifier.from_file(keys)
        assert "keys:1" in str(err.value) and words in str(err.value), str(err.value)


async def test_a_key_files_floor_reaches_the_identity(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(KEY_FILE)
    verifier = ApiKeyVerifier.from_file(keys)
    assert (await verifier(bearer(TENANT_B), {})).min_priority == -5
    assert (await verifier(bearer(TENANT_A), {})).min_priority is None
