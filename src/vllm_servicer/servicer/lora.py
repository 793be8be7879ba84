"""LoRA adapters by name: the registry behind `vllm.Control`'s LoadLora/UnloadLora/ListLoras.

vLLM's engine knows adapters by integer id only (`AsyncLLM.list_loras()`
returns ids), while clients name them: this registry keeps the names, hands
out ids that are never reused (a reloaded adapter is a new one to the
engine), and builds the `LoRARequest` a generation call passes.

A request naming an adapter the engine cannot load kills the EngineCore
(measured with vLLM 0.32: a bad path in `generate(lora_request=...)` is
`EngineDeadError` for every client), so no name is handed out before its
adapter has been checked: loaded ones by the engine itself (`add_lora`),
adapters given at start (`--lora-modules`) by vLLM's own validation of the
adapter's config when the registry is built; those the engine then loads at
first use, or all at once on `start()`.

The same holds for an adapter the engine no longer has: a call that named it
before an UnloadLora would load it again from its directory, or, with the
directory deleted, kill the engine. So every call holds its adapter until its
engine requests end (`hold`), and `unload` stops handing the name out at once
but drops the adapter from the engine only once no call holds it, or every
call holding it has its request in the engine and the engine has finished
them all (a stream's client slow to read holds nothing then).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
from collections.abc import Mapping
from typing import Any

# Before vLLM is imported below: an untested vLLM release fails here, naming both versions.
from .. import _vllm_version  # noqa: F401

# isort: split
from vllm.lora.peft_helper import PEFTHelper
from vllm.lora.request import LoRARequest
from vllm.v1.engine.exceptions import EngineDeadError

from .. import vllm_releases
from ..engine import EngineClient, served_model_name
from ..errors import AlreadyExistsError, InvalidRequestError, NotFoundError, UnsupportedError

logger = logging.getLogger("vllm_servicer")

ENABLE_HINT = "LoRA is not enabled on this engine; start the engine with --enable-lora"

# The first id handed out. vLLM's HTTP API (`--http-port`) numbers the adapters
# it loads at run time (VLLM_ALLOW_RUNTIME_LORA_UPDATING=1) from 1 up, one at a
# time (OpenAIServingModels.lora_id_counter); ids from 2**30 up are out of its
# reach, so an adapter loaded over HTTP never shares an id with one of ours
# (the engine would run the first one's weights for both). Below 2**31, so
# an id fits wherever a signed 32-bit integer holds it.
FIRST_LORA_ID = 1 << 30

# One sequence for the process: an engine loads nothing under an id it already
# holds, so two registries on one engine must never hand out the same id.
_ids = itertools.count(FIRST_LORA_ID)

# How often an unload waiting for an adapter's calls asks whether the engine is done with them.
_DONE_POLL_S = 0.25


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One adapter the registry knows.

    Attributes:
        name: the name clients use (`lora_name`).
        lora_id: the engine's id for it (positive, never reused).
        path: its directory on this host, as given.
    """

    name: str
    lora_id: int
    path: str

    def request(self) -> LoRARequest:
        """The `LoRARequest` that names this adapter in an engine call."""
        return LoRARequest(self.name, self.lora_id, _engine_path(self.path))


class AdapterHold:
    """One call's hold on the adapter it names, from its lookup to its end.

    Attributes:
        request: the `LoRARequest` the call's engine requests pass; None for
            the base model.
    """

    __slots__ = ("_entering", "_registry", "request")

    def __init__(self, registry: LoraRegistry | None, request: LoRARequest | None) -> None:
        self._registry = registry
        self.request = request
        self._entering = registry is not None

    def in_engine(self) -> None:
        """The call's request is in the engine (its first output came): from now
        the engine's own records tell whether it still runs on the adapter, so
        a client slow to read a stream the engine has finished holds up no unload."""
        if self._entering:
            self._entering = False
            assert self._registry is not None and self.request is not None
            self._registry._entered(self.request.lora_int_id)

    def release(self) -> None:
        """Let go of the adapter (once; again is nothing): the call's engine requests ended."""
        registry, self._registry = self._registry, None
        if registry is not None and self.request is not None:
            registry._release(self.request.lora_int_id, entering=self._entering)

    def __enter__(self) -> LoRARequest | None:
        return self.request

    def __exit__(self, *exc_info: object) -> None:
        self.release()


BASE_MODEL = AdapterHold(None, None)
"""The hold of a call on the base model: nothing is held."""


def _engine_path(path: str) -> str:
    # vLLM treats a path that is not a local directory as a hub id to download.
    return os.path.abspath(os.path.expanduser(path))


class LoraRegistry:
    """The LoRA adapters an engine serves, by name.

    Args:
        engine: the engine (`AsyncLLM`: `add_lora`, `remove_lora`).
        preloaded: adapters to serve from the start, name to path on this
            host (vLLM's `--lora-modules`); listed at once, loaded into the
            engine at first use or on `start()`.
        fixed: refuse `load` and `unload`, as with several frontend processes
            on one engine (`--api-server-count`): each numbers its adapters,
            so only the preloaded ones, numbered alike in each, agree.

    Raises:
        ValueError: `preloaded` is given but LoRA is not enabled on the
            engine, or one of them is unnamed, takes the base model's name,
            or is not an adapter this engine can load.
    """

    def __init__(
        self, engine: EngineClient, preloaded: Mapping[str, str], *, fixed: bool = False
    ) -> None:
        self._engine: Any = engine
        self._fixed = fixed  # add_lora/remove_lora are AsyncLLM's, not EngineClient's
        self._config = getattr(engine.vllm_config, "lora_config", None)
        self._base_name = served_model_name(engine)
        max_positions = getattr(
            getattr(engine.model_config, "hf_config", None), "max_position_embeddings", None
        )
        self._max_positions = max_positions if isinstance(max_positions, int) else None
        self._adapters: dict[str, Adapter] = {}
        # Names whose add_lora is under way: a second load of one fails at once.
        self._loading: set[str] = set()
        # Preloaded names the engine has not been asked to load yet.
        self._pending: set[str] = set()
        # Calls holding each adapter (by id), those of them whose request is not
        # in the engine yet, and what waits for the last to end.
        self._holders: dict[int, int] = {}
        self._entering: dict[int, int] = {}
        self._released: dict[int, asyncio.Event] = {}
        # Unloads waiting for an adapter's calls, by name: they go on if their caller goes.
        self._unloading: dict[str, tuple[Adapter, asyncio.Task[None]]] = {}
        for name, path in preloaded.items():
            self._preload(name, path)

    @property
    def enabled(self) -> bool:
        """Whether the engine was started with LoRA (`--enable-lora`)."""
        return self._config is not None

    @property
    def max_loras(self) -> int:
        """Adapters the engine runs in one batch (`--max-loras`); 0 without LoRA."""
        return int(getattr(self._config, "max_loras", 0) or 0)

    def list(self) -> list[Adapter]:
        """Every adapter served, preloaded ones included, sorted by name."""
        return [self._adapters[name] for name in sorted(self._adapters)]

    def __contains__(self, name: object) -> bool:
        """Whether an adapter of this name is served."""
        return name in self._adapters

    def hold(self, name: str) -> AdapterHold:
        """The adapter `name`, held for one call until `release()` (its engine requests ended).

        Args:
            name: the request's `lora_name`; "" means the base model.

        Returns:
            The hold; for the base model, `BASE_MODEL` (nothing held).

        Raises:
            UnsupportedError: a name is given and LoRA is not enabled.
            NotFoundError: no adapter of that name is loaded.
        """
        if not name:
            return BASE_MODEL
        self._require_enabled()
        adapter = self._adapters.get(name)
        if adapter is None:
            raise NotFoundError("lora_name", f"no LoRA adapter named {name!r} is loaded")
        # A preloaded adapter is loaded by the engine with this, its first request.
        self._pending.discard(name)
        lora_id = adapter.lora_id
        self._holders[lora_id] = self._holders.get(lora_id, 0) + 1
        self._entering[lora_id] = self._entering.get(lora_id, 0) + 1
        return AdapterHold(self, adapter.request())

    def holders(self, name: str) -> int:
        """How many calls hold adapter `name` now (0 for a name not served)."""
        adapter = self._adapters.get(name)
        return self._holders.get(adapter.lora_id, 0) if adapter is not None else 0

    async def start(self) -> None:
        """Load every preloaded adapter into the engine now, rather than at first use.

        Raises:
            InvalidRequestError: the engine could not load one; it is no
                longer served (the others are loaded all the same).
        """
        failures: list[InvalidRequestError] = []
        for name in sorted(self._pending):
            adapter = self._adapters.get(name)
            if adapter is None or name not in self._pending:
                continue  # unloaded while an earlier one loaded
            self._pending.discard(name)
            try:
                await self._add_to_engine(adapter)
            except InvalidRequestError as exc:
                self._adapters.pop(name, None)
                logger.error("preloaded LoRA adapter %r not served: %s", name, exc.reason)
                failures.append(exc)
        if failures:
            raise failures[0]

    async def load(self, name: str, path: str) -> Adapter:
        """Load the adapter at `path` (a directory on this host) under `name`.

        Raises:
            UnsupportedError: LoRA is not enabled on the engine.
            InvalidRequestError: `name` or `path` is empty, or the engine
                cannot load the adapter there (no such directory, not a PEFT
                adapter, a rank above `--max-lora-rank`...).
            AlreadyExistsError: an adapter of that name is loaded or being
                loaded, or it is the base model's name.
        """
        self._require_enabled()
        self._require_changeable()
        self._check_name(name)
        if not path:
            raise InvalidRequestError("source_path", "required: the adapter's directory")
        if name in self._adapters or name in self._loading:
            raise AlreadyExistsError("lora_name", f"a LoRA adapter named {name!r} is loaded")
        self._loading.add(name)  # before any await: a concurrent load of `name` fails above
        try:
            self._check_adapter(path)
            adapter = Adapter(name, next(_ids), path)
            await self._add_to_engine(adapter)
            self._adapters[name] = adapter
        finally:
            self._loading.discard(name)
        logger.info("LoRA adapter %r loaded as id %d", name, adapter.lora_id)
        return adapter

    async def unload(self, name: str) -> Adapter:
        """Stop serving adapter `name` and drop it from the engine.

        No call can name it from the start of the unload; the engine drops it
        when the last call holding it ends, or once the engine has finished the
        requests of all of them (a stream's client may still be reading), which
        the unload waits for. If the unload's caller goes first, the adapter is
        dropped all the same; an unload of it meanwhile waits for the same.

        Raises:
            UnsupportedError: LoRA is not enabled on the engine.
            InvalidRequestError: `name` is empty.
            NotFoundError: no adapter of that name is loaded.
        """
        self._require_enabled()
        self._require_changeable()
        if not name:
            raise InvalidRequestError("lora_name", "required: the adapter to unload")
        adapter = self._adapters.pop(name, None)  # before the await: one unload wins
        if adapter is None:
            unloading = self._unloading.get(name)
            if unloading is None:
                raise NotFoundError("lora_name", f"no LoRA adapter named {name!r} is loaded")
            # Unloaded already, still waiting for its calls: this caller waits too.
            adapter, removal = unloading
        else:
            self._pending.discard(name)
            removal = asyncio.ensure_future(self._remove(adapter))
            self._unloading[name] = (adapter, removal)
            removal.add_done_callback(lambda done: self._unloaded(name, done))
        await asyncio.shield(removal)
        return adapter

    # ----- helpers ----------------------------------------------------------

    def _entered(self, lora_id: int) -> None:
        self._entering[lora_id] = left = self._entering.get(lora_id, 0) - 1
        if left <= 0:
            self._entering.pop(lora_id, None)

    def _release(self, lora_id: int, *, entering: bool) -> None:
        if entering:
            self._entered(lora_id)
        left = self._holders.get(lora_id, 0) - 1
        if left > 0:
            self._holders[lora_id] = left
            return
        self._holders.pop(lora_id, None)
        released = self._released.pop(lora_id, None)
        if released is not None:
            released.set()

    async def _engine_done_with(self, lora_id: int) -> bool:
        """Whether every call holding the adapter has its request in the engine
        and the engine has finished them all (their clients may still be reading).

        Asked twice, a loop turn apart: vLLM's frontend forgets a request it
        stopped itself (a stop string) a turn before it tells the engine core
        to abort it, and the drop must not reach the core first.
        """
        for turn in range(2):
            if turn:
                await asyncio.sleep(0)
                await asyncio.sleep(0)
            if self._entering.get(lora_id):
                return False
            if vllm_releases.runs_adapter(self._engine, lora_id) is not False:
                return False
        return True

    async def _remove(self, adapter: Adapter) -> None:
        """Drop `adapter` from the engine once no call holds it or the engine is done with it."""
        lora_id = adapter.lora_id
        holders = self._holders.get(lora_id, 0)
        if holders:
            logger.info(
                "LoRA adapter %r unloading: waiting for the %d call(s) using it",
                adapter.name,
                holders,
            )
            released = self._released.setdefault(lora_id, asyncio.Event())
            while not released.is_set() and not await self._engine_done_with(lora_id):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(released.wait(), _DONE_POLL_S)
            self._released.pop(lora_id, None)
        # False when the engine never loaded it (preloaded, unused): nothing to drop.
        await self._engine.remove_lora(lora_id)
        logger.info("LoRA adapter %r (id %d) unloaded", adapter.name, lora_id)

    def _unloaded(self, name: str, removal: asyncio.Task[None]) -> None:
        if self._unloading.get(name, (None, None))[1] is removal:
            del self._unloading[name]
        if not removal.cancelled() and removal.exception() is not None:
            # Its caller may be gone: said here, or nowhere.
            logger.error("LoRA adapter %r not dropped: %s", name, removal.exception())

    def _require_enabled(self) -> None:
        if self._config is None:
            raise UnsupportedError(ENABLE_HINT, field="lora_name")

    def _require_changeable(self) -> None:
        if self._fixed:
            raise UnsupportedError(
                "the adapters are fixed at start with --api-server-count above 1 (as with "
                "vLLM's HTTP server): serve them with --lora-modules",
                field="lora_name",
            )

    def _check_name(self, name: str) -> None:
        if not name:
            raise InvalidRequestError("lora_name", "required: the name requests will use")
        if name == self._base_name:
            raise AlreadyExistsError(
                "lora_name", f"{name!r} is the base model's name; choose another"
            )

    def _check_adapter(self, path: str) -> None:
        """vLLM's own checks of an adapter's config, before the engine sees it."""
        assert self._config is not None  # callers check LoRA is enabled first
        if not os.path.isdir(_engine_path(path)):
            raise InvalidRequestError("source_path", "no adapter directory there on this server")
        try:
            helper = PEFTHelper.from_local_dir(_engine_path(path), self._max_positions)
            helper.validate_legal(self._config)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise InvalidRequestError(
                "source_path", f"not a LoRA adapter this engine can load: {exc}"
            ) from None

    def _preload(self, name: str, path: str) -> None:
        if self._config is None:
            raise ValueError(f"LoRA adapter {name!r} given, but {ENABLE_HINT}")
        try:
            self._check_name(name)
            self._check_adapter(path)
        except (InvalidRequestError, AlreadyExistsError) as exc:
            raise ValueError(f"LoRA adapter {name!r} at {path}: {exc.reason}") from None
        self._adapters[name] = Adapter(name, next(_ids), path)
        self._pending.add(name)

    async def _add_to_engine(self, adapter: Adapter) -> None:
        try:
            loaded = await self._engine.add_lora(adapter.request())
        except EngineDeadError:
            raise
        except Exception as exc:
            # The engine core's refusal, in its words (missing files, rank, modules).
            raise InvalidRequestError(
                "source_path", f"the engine could not load it: {exc}"
            ) from None
        if loaded is False:
            raise InvalidRequestError("source_path", "the engine did not load the adapter")
