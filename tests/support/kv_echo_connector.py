"""A KV connector for tests: vLLM's file-based ExampleConnector, handing back what it was given.

vLLM's connectors return params from `request_finished` for the engine to put in
`RequestOutput.kv_transfer_params` (NIXL: where the decode side fetches the
blocks). ExampleConnector returns none; this one returns the request's own
params, marked, so a test sees that what a client sent reached the connector
inside the engine process and that what a connector returns reaches the
client. It also appends each finished request's id and params to
`<shared_storage_path>/finished.jsonl`, which shows requests that never
produced output (a rejected request the connector was told about).
Loaded by the engine through `KVTransferConfig.kv_connector_module_path`.

It loads nothing for a prompt without a whole block before its last token
(ExampleConnector would load nothing either), so one engine serves short
prompts in any order: ExampleConnector keys every such prompt by the same
empty prefix, and counts a one-token prompt's match as minus one block, which
fails the engine once any short prompt has been stored (the reference
servicer's warm-up sends one-token prompts).
"""

from __future__ import annotations

import json
import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

FINISHED_LOG = "finished.jsonl"


class EchoConnector(ExampleConnector):
    """ExampleConnector whose finished requests hand their KV-transfer params back."""

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if len(request.prompt_token_ids or []) <= self._block_size + 1:
            return 0, False  # no whole block before the last token: nothing to load
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        with open(os.path.join(self._storage_path, FINISHED_LOG), "a") as log:
            log.write(json.dumps({"request_id": request.request_id, "params": params}) + "\n")
        return False, ({**params, "echoed_by": "EchoConnector"} if params else None)


def echo_transfer_config(storage: str | os.PathLike[str]) -> Any:
    """The engine setting that loads this connector, storing KV under `storage`."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector=EchoConnector.__name__,
        kv_connector_module_path=__name__,
        kv_role="kv_both",
        kv_connector_extra_config={"shared_storage_path": str(storage)},
    )
