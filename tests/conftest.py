"""Shared fixtures: real vLLM engines, each built once per session; a real grpc.aio server.

Each engine is vLLM's `AsyncLLM` on a tiny model written here (random weights,
seeded, so greedy output is deterministic): `engine` (the text model, served on
loopback by `server`), `vlm_engine` (the vision model), `embedding_engine` (the
text model as an embedding model) and `kv_echo_engine` (the text model with a
KV connector and speculative decoding); `recipe_launcher` is the launcher of
the Kubernetes recipe, with its arguments (support/recipe.py). Building one
takes ~15 s on these machines, so each is built when a test first needs it and
shut down when the session ends (each holds about 1.3 GiB, 256 MiB of it its
KV cache). A test that needs an engine with other settings builds its own and
says why.

The helpers the test files share are in the `support` package (tests/support/).

Tiers (markers set at collection): `engine` marks a test that runs a
real engine (one of these fixtures, an engine of its own, or a launcher
process); `bench` marks the benchmarks' brief runs. `make test-fast` runs
neither, `make test` all but `bench` (on two workers, pytest-xdist's
`--dist loadfile`: a module's tests on one worker, so that a launcher the
module shares starts once; support/schedule.py hands the heaviest out first
and keeps a rarely used session engine's modules on one worker), `make
test-bench` the rest.
"""

from __future__ import annotations

import contextlib
import os
import types
import warnings
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from support.recipe import recipe_launcher as recipe_launcher  # a fixture: the recipe's pod
from support.schedule import SHARED_ENGINES
from support.servers import ENGINE_STOP_SECONDS, Serving, serving
from support.servers import placement as placement  # a fixture: each placement in turn

from vllm_servicer.proto import vllm_engine_pb2_grpc
from vllm_servicer.testing.tiny_model import (
    TINY_EMBED_ENGINE_KWARGS,
    build_tiny_engine,
    write_tiny_embedding_model,
    write_tiny_model,
)
from vllm_servicer.testing.tiny_vlm import TINY_VLM_ENGINE_KWARGS, write_tiny_vlm

# One engine process, not two: vLLM's CPU platform runs the model in a worker
# process of its own (for its OpenMP thread binding) unless this is 0, when the
# engine core runs it in-process, as vLLM does for one GPU. Each engine then
# starts in about half the CPU time, and the suite starts dozens. The benchmarks
# and the data-parallel layouts set it to 1: they measure the layout as CPU users run it.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

ENGINE_FIXTURES = frozenset(
    {"engine", "vlm_engine", "embedding_engine", "kv_echo_engine", "recipe_launcher"}
)
"""The session's real engines (and the launcher of the Kubernetes recipe): a test that
uses one (or a fixture built on one) runs an engine."""

ENGINE_STARTERS = ("build_tiny_engine", "spawn", "launch", "launched", "serve_to_end")
"""Names a test module imports when its tests start an engine of their own or a
launcher process (support/launcher.py); a test that starts one otherwise is
marked `engine` by hand."""


def _runs_an_engine(item: pytest.Item) -> bool:
    if ENGINE_FIXTURES.intersection(getattr(item, "fixturenames", ())):
        return True
    module = getattr(item, "module", None)
    return any(callable(getattr(module, name, None)) for name in ENGINE_STARTERS)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    unlisted: set[tuple[str, str]] = set()
    for item in items:
        if _runs_an_engine(item):
            item.add_marker(pytest.mark.engine)
        module = item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
        for fixture in SHARED_ENGINES.keys() & set(getattr(item, "fixturenames", ())):
            if module not in SHARED_ENGINES[fixture]:
                unlisted.add((module, fixture))
    for module, fixture in sorted(unlisted):
        warnings.warn(
            f"{module} uses {fixture} but is not among its modules in "
            "tests/support/schedule.py: under `make test` its worker builds that engine again",
            stacklevel=1,
        )


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile` as support/schedule.py refines it: heaviest modules first,
    the modules of a rarely used session engine on one worker."""
    if config.getvalue("dist") != "loadfile":
        return None
    from support.schedule import HeaviestFirst

    return HeaviestFirst(config, log)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny LLaVA-shaped vision model (no download)."""
    return write_tiny_vlm(tmp_path_factory.mktemp("models") / "tiny-llava")


@pytest.fixture(scope="session")
def preprocess(vlm_dir: Path) -> Callable[[tuple[int, int, int]], Any]:
    """A router's image preprocessing for that model (see support/router_side.py)."""
    from support.router_side import router_preprocessor

    return router_preprocessor(vlm_dir)


@pytest.fixture(scope="session")
def embedding_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's files for an embedding engine (TINY_EMBED_ENGINE_KWARGS)."""
    return write_tiny_embedding_model(tmp_path_factory.mktemp("models") / "tiny-embed")


@pytest.fixture(scope="session")
def kv_echo_storage(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where `kv_echo_engine`'s connector stores KV and logs what it was told (FINISHED_LOG)."""
    return tmp_path_factory.mktemp("kv-echo")


@contextlib.asynccontextmanager
async def _running(model_dir: Path, **settings: Any) -> AsyncIterator[Any]:
    """An engine on `model_dir` with `settings` over the tiny ones; shut down on exit."""
    llm = build_tiny_engine(model_dir, **settings)
    try:
        yield llm
    finally:
        llm.shutdown(timeout=ENGINE_STOP_SECONDS)


@pytest.fixture(scope="session")
async def engine(tiny_model_dir: Path) -> AsyncIterator[Any]:
    async with _running(tiny_model_dir) as llm:
        yield llm


@pytest.fixture(scope="session")
async def vlm_engine(vlm_dir: Path) -> AsyncIterator[Any]:
    """The tiny LLaVA: images reach it as URLs (media_refs) or as tensors (mm_inputs)."""
    async with _running(vlm_dir, **TINY_VLM_ENGINE_KWARGS) as llm:
        yield llm


@pytest.fixture(scope="session")
async def embedding_engine(embedding_model_dir: Path) -> AsyncIterator[Any]:
    """A pooling engine: Embed's."""
    async with _running(embedding_model_dir, **TINY_EMBED_ENGINE_KWARGS) as llm:
        yield llm


@pytest.fixture(scope="session")
async def kv_echo_engine(tiny_model_dir: Path, kv_echo_storage: Path) -> AsyncIterator[Any]:
    """The text model with the KV connector that echoes its params back
    (support/kv_echo_connector.py) and n-gram speculative decoding.

    Prefix caching is off, so each request is computed, none read from another's
    cached blocks; the tests' prompts are shorter than one KV block (128 tokens
    on CPU), so the connector stores and loads nothing and no request depends
    on another's.
    """
    from support.kv_echo_connector import echo_transfer_config

    async with _running(
        tiny_model_dir,
        enable_prefix_caching=False,
        kv_transfer_config=echo_transfer_config(kv_echo_storage),
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_max": 3,
            "prompt_lookup_min": 1,
        },
        per_request_spec_decode_metrics="summary",
    ) as llm:
        yield llm


@pytest.fixture(scope="session")
async def server(engine: Any) -> AsyncIterator[Serving]:
    """The session's text engine, mounted on a server of its own."""
    async with serving(engine) as served:
        yield served


@pytest.fixture(scope="session")
async def channel(server: Serving) -> grpc.aio.Channel:
    return server.channel


@pytest.fixture
def stub(channel: grpc.aio.Channel) -> vllm_engine_pb2_grpc.VllmEngineStub:
    return vllm_engine_pb2_grpc.VllmEngineStub(channel)


@pytest.fixture(scope="session")
def ref() -> types.ModuleType:
    """vLLM's `vllm.Inference` messages (`inference_pb2`) as the reference generates
    them, compiled once per session."""
    from support.vllm_protocol import reference_modules

    return reference_modules("inference")[0]


@pytest.fixture(scope="session")
def ref_grpc() -> types.ModuleType:
    """The reference's generated `vllm.Inference` stubs (`inference_pb2_grpc`)."""
    from support.vllm_protocol import reference_modules

    return reference_modules("inference")[1]
