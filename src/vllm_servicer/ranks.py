"""Data-parallel ranks: one numbering, the global one, translated for the engine here.

Every figure this package gives names a rank by its global number (0 to
`--data-parallel-size` - 1): GetLoads, ORCA, vLLM's own metrics
(`engine="2"`), KV events, GetServerInfo. Routers pin calls by those numbers
(VllmEngine's `data_parallel_rank`, vllm.Inference's `x-data-parallel-rank`,
the HTTP API's `X-data-parallel-rank`). vLLM's `AsyncLLM`, though, takes a
pinned `data_parallel_rank` as an index among this frontend's own engines
(its engine-core client keeps them in rank order from the first it serves).
The two agree only when one frontend serves every rank from 0 (the internal
layout); with a launcher per rank (external, `--data-parallel-rank R`) or per
node (hybrid, `--data-parallel-start-rank S --data-parallel-size-local L`)
they do not. Every pin is translated here, once, before the engine sees it;
a rank this server does not serve is refused, naming the ranks it does.

Which ranks a frontend serves is read from the engine's
`vllm_config.parallel_config` as vLLM's engine-core client reads it (the
same fields and rule in 0.31 to 0.34, so nothing here varies by release):
from `data_parallel_index` (the rank, before a dense model's engine resets
its own copy; `data_parallel_rank` where absent), `data_parallel_size_local`
ranks when the frontend balances only its own engines (external or hybrid:
`local_engines_only`), else `data_parallel_size`; a single rank when
`data_parallel_rank_local` is set (vLLM's offline SPMD mode).
"""

from __future__ import annotations

from typing import Any

from .errors import InvalidRequestError

__all__ = ["describe", "engine_index", "engine_index_if_served", "served_ranks"]


def served_ranks(engine: Any) -> range:
    """The global data-parallel ranks `engine`'s frontend serves, in order.

    An engine without a parallel config (a stand-in) serves rank 0 alone.
    """
    parallel = getattr(getattr(engine, "vllm_config", None), "parallel_config", None)
    if parallel is None:
        return range(1)
    first = _int(parallel, "data_parallel_index", _int(parallel, "data_parallel_rank", 0))
    if getattr(parallel, "data_parallel_rank_local", None) is not None:
        return range(first, first + 1)
    local_only = bool(
        getattr(parallel, "data_parallel_external_lb", False)
        or getattr(parallel, "data_parallel_hybrid_lb", False)
    )
    if local_only:
        count = _int(parallel, "data_parallel_size_local", 1)
    else:
        count = _int(parallel, "data_parallel_size", 1)
    return range(first, first + max(1, count))


def describe(ranks: range) -> str:
    """`ranks` as a reader would write them: "rank 1", "ranks 2-3", "ranks 0-7"."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {ranks[0]}-{ranks[-1]}"


def engine_index(engine: Any, rank: int, field: str = "data_parallel_rank") -> int:
    """The index `engine.generate(data_parallel_rank=...)` takes for global `rank`.

    Args:
        engine: the engine served.
        rank: a global data-parallel rank, as a router pins a call to it.
        field: the request field or header that named it, for the refusal.

    Raises:
        InvalidRequestError: `rank` is not one this server serves (the message
            names the ranks it serves).
    """
    ranks = served_ranks(engine)
    if rank not in ranks:
        raise InvalidRequestError(
            field, f"rank {rank} is not served here: this server serves {describe(ranks)}"
        )
    return rank - ranks.start


def engine_index_if_served(engine: Any, rank: int | None) -> int | None:
    """`engine_index` for `rank`, or None when none was named or it is not served.

    For notices that go to whichever engine is at hand when the pin was bad
    (a KV connector told of a request refused before any engine ran it).
    """
    if rank is None:  # every unpinned call: no read of the configuration
        return None
    ranks = served_ranks(engine)
    return rank - ranks.start if rank in ranks else None


def _int(config: Any, name: str, default: int) -> int:
    value = getattr(config, name, None)
    return default if value is None else int(value)
