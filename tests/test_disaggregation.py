"""Prefill/decode disaggregation: two real engines hand a prompt's KV over, through gRPC.

A router sends a prompt to a prefill engine (``kv_producer``) for one token,
then the same prompt to a decode engine (``kv_consumer``) for the rest; the
decode engine must give the tokens a single engine gives, while starting from
the KV the prefill engine computed instead of its own. Both engines are served
by this project's servicer and spoken to with the reference stubs, as a router
would; the single engine is the session's plain engine on the same model.

vLLM's file-based ``ExampleConnector`` carries the KV: for each new prompt the
producer writes one safetensors file per attention layer, holding the KV of the
prompt's whole blocks (all tokens but the last, rounded down to the block size),
into a folder named by a hash of those token ids. The consumer loads that KV
whenever the folder exists; ``kv_transfer_params`` are passed through but do not
decide it. Equal tokens alone would also come from a decode engine that
recomputed the prompt, so the hand-off itself is shown three ways: the files
appear with the prefill call, the decode engine counts the loaded tokens as
cached (``cached_tokens`` on the wire and vLLM's
``vllm:external_prefix_cache_hits`` counter), and overwriting the stored
tensors changes the decode tokens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from prometheus_client import REGISTRY
from smg_grpc_proto.generated import vllm_engine_pb2 as ref
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as ref_grpc
from support import (
    ENGINE_STOP_SECONDS,
    collect,
    completes,
    request,
    serving,
    settle,
    wait_until_idle,
)

from vllm_servicer.testing.tiny_model import build_tiny_engine

DECODE_TOKENS = 16
EXTERNAL_HITS = "vllm:external_prefix_cache_hits"
_request_numbers = itertools.count(1)


@dataclasses.dataclass
class Worker:
    """One engine behind its own gRPC server, as a router sees it."""

    engine: Any
    stub: ref_grpc.VllmEngineStub


# The two sides' engines are this module's own: their connector's role (producer
# or consumer) is set when an engine is built, and no other test wants either.
@contextlib.asynccontextmanager
async def _serving(model_dir: Path, storage: Path, role: str) -> AsyncIterator[Worker]:
    from vllm.config import KVTransferConfig

    engine = build_tiny_engine(
        model_dir,
        # The connector only moves the prompt's KV; a local prefix hit would hide it.
        enable_prefix_caching=False,
        kv_transfer_config=KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role=role,
            kv_connector_extra_config={"shared_storage_path": str(storage)},
        ),
    )
    try:
        async with serving(engine, health=False, reflection_service=False) as served:
            yield Worker(engine, ref_grpc.VllmEngineStub(served.channel))
    finally:
        engine.shutdown(timeout=ENGINE_STOP_SECONDS)


@pytest.fixture(scope="module")
def kv_storage(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kv-storage")


@pytest.fixture(scope="module")
async def prefill(tiny_model_dir: Path, kv_storage: Path) -> AsyncIterator[Worker]:
    async with _serving(tiny_model_dir, kv_storage, "kv_producer") as worker:
        yield worker


@pytest.fixture(scope="module")
async def decode(
    tiny_model_dir: Path, kv_storage: Path, prefill: Worker, engine: Any
) -> AsyncIterator[Worker]:
    """Built after the other two: vLLM's Prometheus metrics are those of the last engine built."""
    async with _serving(tiny_model_dir, kv_storage, "kv_consumer") as worker:
        yield worker


def _prompt(seed: int, length: int = 160) -> list[int]:
    """Token ids (no special ones) of a prompt a little over one 128-token CPU block."""
    return [3 + (seed + 37 * i) % 250 for i in range(length)]


def _whole_blocks_before_last_token(prompt: list[int], engine: Any) -> int:
    """How many prompt tokens ExampleConnector stores and loads."""
    block_size = engine.vllm_config.cache_config.block_size
    return (len(prompt) - 2) // block_size * block_size


def _ref_request(prompt: list[int], max_tokens: int, kv_transfer: dict[str, Any]) -> Any:
    return ref.GenerateRequest(
        request_id=f"pd-{next(_request_numbers)}",
        tokenized=ref.TokenizedInput(input_ids=prompt),
        sampling_params=ref.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        kv_transfer_params_json=json.dumps(kv_transfer),
    )


async def _complete(stub: Any, req: Any) -> Any:
    return completes(await collect(stub.Generate(req, timeout=60)))[0]


async def _run_prefill(prefill: Worker, prompt: list[int]) -> Any:
    """The router's first leg: one token, the KV kept for a remote decode."""
    req = _ref_request(prompt, 1, {"do_remote_decode": True, "do_remote_prefill": False})
    return await _complete(prefill.stub, req)


async def _run_decode(decode: Worker, prompt: list[int], prefill_done: Any) -> Any:
    """The router's second leg: what the prefill side handed back, marked as a remote prefill."""
    handed_back = json.loads(prefill_done.kv_transfer_params_json or "{}")
    kv_transfer = {**handed_back, "do_remote_prefill": True, "do_remote_decode": False}
    return await _complete(decode.stub, _ref_request(prompt, DECODE_TOKENS, kv_transfer))


async def _single_engine_tokens(stub: Any, prompt: list[int]) -> list[int]:
    req = request(prompt, max_tokens=DECODE_TOKENS, ignore_eos=True)
    return list((await _complete(stub, req)).output_ids)


def _stored_files(storage: Path) -> set[Path]:
    return set(storage.glob("*/*.safetensors"))


def _overwrite_tensors(files: set[Path]) -> None:
    """Replace each stored KV tensor by other values of the same shape and dtype."""
    generator = torch.Generator().manual_seed(0)
    for path in files:
        stored = safetensors.torch.load_file(str(path))
        other = {
            name: torch.randn(t.shape, generator=generator, dtype=t.dtype)
            for name, t in stored.items()
        }
        safetensors.torch.save_file(other, str(path))


def _external_prefix_cache_hits() -> float:
    """Prompt tokens the last engine built loaded through its KV connector."""
    return sum(
        sample.value
        for metric in REGISTRY.collect()
        if metric.name == EXTERNAL_HITS
        for sample in metric.samples
        if sample.name == f"{EXTERNAL_HITS}_total"
    )


async def _hits_reaching(target: float, timeout: float = 10.0) -> float:
    # The engine records step statistics after it hands the step's outputs out.
    await settle(lambda: _external_prefix_cache_hits() >= target, timeout)
    return _external_prefix_cache_hits()


async def _assert_idle(*workers: Worker) -> None:
    for worker in workers:
        assert await wait_until_idle(worker.engine) == 0


async def test_a_router_can_tell_the_two_sides_apart(prefill: Worker, decode: Worker) -> None:
    for worker, role in ((prefill, "kv_producer"), (decode, "kv_consumer")):
        info = await worker.stub.GetServerInfo(ref.GetServerInfoRequest())
        assert (info.kv_connector, info.kv_role) == ("ExampleConnector", role)


async def test_decode_from_the_prefill_kv_gives_the_single_engine_tokens(
    prefill: Worker, decode: Worker, stub: Any, kv_storage: Path
) -> None:
    prompt = _prompt(seed=1)
    expected = await _single_engine_tokens(stub, prompt)
    handed_over = _whole_blocks_before_last_token(prompt, decode.engine)
    assert handed_over > 0

    before = _stored_files(kv_storage)
    prefill_done = await _run_prefill(prefill, prompt)
    written = _stored_files(kv_storage) - before
    assert list(prefill_done.output_ids) == expected[:1]
    assert written and len({path.parent for path in written}) == 1

    hits_before = _external_prefix_cache_hits()
    decode_done = await _run_decode(decode, prompt, prefill_done)
    assert list(decode_done.output_ids) == expected
    assert decode_done.cached_tokens == handed_over
    assert await _hits_reaching(hits_before + handed_over) == hits_before + handed_over
    await _assert_idle(prefill, decode)


async def test_decode_tokens_change_with_the_stored_kv(
    prefill: Worker, decode: Worker, stub: Any, kv_storage: Path
) -> None:
    prompt = _prompt(seed=2)
    expected = await _single_engine_tokens(stub, prompt)

    before = _stored_files(kv_storage)
    prefill_done = await _run_prefill(prefill, prompt)
    _overwrite_tensors(_stored_files(kv_storage) - before)

    decode_done = await _run_decode(decode, prompt, prefill_done)
    assert decode_done.cached_tokens == _whole_blocks_before_last_token(prompt, decode.engine)
    assert list(decode_done.output_ids) != expected
    await _assert_idle(prefill, decode)
