"""Each tenant's own part of the engine's prefix cache: its requests salted.

vLLM's prefix cache is one for every request, and each response says how
many prompt tokens it found there (`cached_tokens`, `num_cached_tokens`,
the HTTP API's `prompt_tokens_details`), as does the time to the first
token. Shared between tenants, it lets one test guessed prefixes against
another's prompts and read them back block by block. vLLM keys a prompt's
first block by its `cache_salt` too, so every block after it differs for a
different salt: a tenant's requests carry a salt made from its name, and
find only their own tenant's blocks.

The salt is a hash of the tenant's name, not a secret: a caller cannot
choose another's, since the client's own `cache_salt` only joins the
tenant's part (a client salting its requests still keeps them apart from
its other requests), and to land on another tenant's salt it would need a
SHA-256 collision. Derived from the name alone, the salt is the same in
every `--api-server-count` process and every replica, so a router's
cache-aware routing finds a tenant's blocks wherever they are.

A router's requests (the router role) are not salted: a cache-aware router
computes vLLM's block hashes from token ids itself, as vLLM computes them
without a salt, and routes by them; salted, its requests' blocks would carry
hashes it cannot know. Its requests share the cache with one another, as
they would without tenants, and never with a tenant's salted blocks.

No grpc and no vLLM here: the protocols and the HTTP API call `salted`.
"""

from __future__ import annotations

import hashlib
from collections.abc import MutableMapping
from typing import Any

from .context import current_identity

__all__ = ["salted", "tenant_salt"]

_DOMAIN = b"vllm-servicer tenant cache salt v1\x00"


def tenant_salt(name: str, client_salt: str | None = None) -> str:
    """The cache salt of a request by tenant `name`, with the client's own salt.

    Each part is length-prefixed, so no name and salt reach another
    tenant's pair.
    """
    digest = hashlib.sha256(_DOMAIN)
    for part in (name, client_salt or ""):
        data = part.encode("utf-8", "surrogatepass")
        digest.update(len(data).to_bytes(8, "big"))
        digest.update(data)
    return digest.hexdigest()


def salted(prompt: Any, shared: bool = False) -> Any:
    """`prompt` with the current caller's tenant salt, for the engine.

    A tenant's prompt (a dict as vLLM's engine takes it: a text, token or
    rendered prompt, its `cache_salt` key the client's own) gets the salt of
    `tenant_salt`; an encoder-decoder prompt salts its decoder's part, where
    vLLM reads it. A text prompt becomes a dict. An administrator's, a
    router's, a call without credentials (a server with no tenants) and,
    with `shared` (the operator's `--shared-prefix-cache`), every prompt is
    returned as it is.
    """
    identity = current_identity.get()
    if shared or identity is None or identity.is_router:  # admins are routers too
        return prompt
    name = identity.name
    if isinstance(prompt, str):
        prompt = {"prompt": prompt}
    if isinstance(prompt, MutableMapping):
        target = prompt.get("decoder_prompt") if "encoder_prompt" in prompt else prompt
        if isinstance(target, str):
            target = prompt["decoder_prompt"] = {"prompt": target}
        if isinstance(target, MutableMapping):
            target["cache_salt"] = tenant_salt(name, target.get("cache_salt"))
            return prompt
    if hasattr(prompt, "cache_salt"):
        # A request vLLM already processed (`EngineCoreRequest`).
        prompt.cache_salt = tenant_salt(name, prompt.cache_salt)
        return prompt
    raise TypeError(f"cannot salt a prompt of type {type(prompt).__name__} for its tenant")
