"""What the servicers of one mount share, built once by `mount()`.

Every protocol runs requests on one engine, whose promises to the tenants
sharing it are kept in one place (`TenantEngine`: an id belongs to its
caller whichever protocol started it, every cache a client names is keyed by
its tenant, routing data is a router's), each engine call is
prepared by the same steps and framed the same way (`EngineCallSteps`), an
adapter Control loads is one Inference's `lora_name` names (`LoraRegistry`),
the decoded images in flight count against one budget (`DecodedMedia`),
images named by URL are fetched by one resolver (`MediaResolver`), and one
load report (`LoadReporter`) is what the calls' trailers and the out-of-band
stream send.
`MountState` holds them, with the count of calls in flight and the frontend
group, for the servicers and for what reads the mount from outside (the
drain, through `MountedServices.state`). No grpc here.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

from ..engine import EngineClient
from ..fair_work import FairOrder, QueuedPrompts
from ..frontends import FrontendGroup
from ..load_reports.engine_load import EngineLoadReader
from ..load_reports.report import CallRates, LoadReporter
from ..multimodal.decoded import DecodedMedia
from ..multimodal.media import MediaResolver
from ..shares import FairShares
from .engine_call import EngineCallSteps
from .lora import LoraRegistry
from .tenancy import RunningRequests
from .tenant_engine import TenantEngine
from .vllm_app import VllmHandlers

if TYPE_CHECKING:
    from ..options import MountOptions


class InflightTotal(Protocol):
    """What the state reads of the in-flight count (`InflightInterceptor`): its total.

    Not `guard.InflightCount`, which also admits and releases calls.
    """

    @property
    def limited_everywhere(self) -> int:
        """Engine calls in flight in every frontend process on the engine."""
        ...


@dataclasses.dataclass(frozen=True)
class MountState:
    """The state one mount's servicers share.

    Attributes:
        engine: the engine served.
        options: what the mount serves and how; the servicers read theirs here.
        running: the requests running now, by id and owner, every protocol's.
        tenant: the engine as every way in runs a tenant's requests on it,
            over `running` (the gRPC frame, vLLM's handlers, the HTTP API).
        steps: the engine call's preparation every protocol takes, over `running`.
        loras: the LoRA adapters served, by name.
        decoded_media: the decoded images the process holds for running requests.
        handlers: vLLM's own HTTP handlers on the engine (Pooling and Render
            call them), built at first use.
        inflight: the count of engine calls in flight; None: `running` counts them.
        frontends: the frontend processes sharing the engine (`serve
            --api-server-count`), or None.
        load_reporter: the engine's ORCA load report, or None when the mount
            sends none (`MountOptions.served.load_reports`).
        media: the images named by URL the servicers fetch, within the
            operator's rules (`MountOptions.media.media_refs`); None when they are off.
    """

    engine: EngineClient
    options: MountOptions
    running: RunningRequests
    tenant: TenantEngine
    steps: EngineCallSteps
    loras: LoraRegistry
    decoded_media: DecodedMedia
    handlers: VllmHandlers
    inflight: InflightTotal | None = None
    frontends: FrontendGroup | None = None
    load_reporter: LoadReporter | None = None
    media: MediaResolver | None = None

    @classmethod
    def build(
        cls,
        engine: EngineClient,
        options: MountOptions,
        *,
        inflight: InflightTotal | None = None,
        frontends: FrontendGroup | None = None,
    ) -> MountState:
        """The state of a mount of `engine` with `options`.

        Raises:
            TypeError: `engine` lacks a member of `EngineClient` (the message names it).
        """
        running = RunningRequests(frontends)
        decoded_media = DecodedMedia(options.budgets)

        def in_flight() -> int:
            return _active(inflight, running)

        tenant = TenantEngine(
            engine,
            running,
            routing_for_every_key=options.tenancy.routing_data_for_every_key,
            shared_prefix_cache=options.tenancy.shared_prefix_cache,
            order=fair_order(frontends),
            queued=queued_prompts(options.tenancy.max_queued_prompt_tokens, frontends),
        )
        # First: it checks the engine's members, which the registry reads.
        steps = EngineCallSteps(
            tenant,
            stream_interval=options.streaming.stream_interval,
            min_inflight=options.streaming.stream_interval_min_inflight,
            in_flight=in_flight,
            decoded_media=decoded_media,
        )
        several = frontends is not None and frontends.count > 1
        loras = LoraRegistry(engine, options.served.lora_modules, fixed=several)
        reporter = None
        if options.served.load_reports:
            queued = tenant.queued
            reader = EngineLoadReader(
                engine,
                lambda: _active(inflight, running),
                frontends=frontends,
                waiting_prompt_tokens=lambda: queued.total,
            )
            reporter = LoadReporter(reader, CallRates(frontends), update=reader.update)
        return cls(
            engine,
            options,
            running,
            tenant,
            steps,
            loras,
            decoded_media,
            VllmHandlers(
                tenant,
                loras,
                options.chat.chat_template,
                tool_call_parser=options.chat.tool_call_parser,
                enable_auto_tool_choice=options.chat.enable_auto_tool_choice,
            ),
            inflight,
            frontends,
            reporter,
            MediaResolver(options.media.media_refs, engine.model_config)
            if options.media.media_refs is not None
            else None,
        )

    @property
    def active_requests(self) -> int:
        """Engine calls in flight: what GetServerInfo reports and a drain waits for."""
        return _active(self.inflight, self.running)

    async def abort_running(self) -> list[str]:
        """Abort every request running in this process (their streams end with "abort").

        Returns:
            The ids aborted.
        """
        ids = self.running.ids
        if ids:
            await self.engine.abort(ids)
        return ids


def _active(inflight: InflightTotal | None, running: RunningRequests) -> int:
    """Engine calls in flight: the count's, else the running requests' (a servicer alone)."""
    return inflight.limited_everywhere if inflight is not None else len(running)


def fair_order(frontends: FrontendGroup | None) -> FairOrder:
    """The fair order's counters: the frontend processes' shared ones, else this process's."""
    if frontends is None:
        return FairOrder()
    return FairOrder(frontends.tag_book, frontends.locked)


def queued_prompts(limit: int, frontends: FrontendGroup | None) -> QueuedPrompts:
    """The prompt tokens waiting for prefill (`--max-queued-prompt-tokens`, 0:
    no limit) and each tenant's share, in the frontend processes' shared memory
    when there are several."""
    if frontends is None:
        return QueuedPrompts(limit or None, FairShares(max(1, limit)))
    shares = FairShares(max(1, limit), book=frontends.token_book)
    return QueuedPrompts(limit or None, shares, frontends.queued_prompt_tokens, frontends.locked)
