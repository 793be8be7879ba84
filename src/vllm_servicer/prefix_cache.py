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

A media item's `uuid` is a cache key too, and a stronger one: vLLM takes a
client's uuid (the prompt's `multi_modal_uuids`) as the item's hash in place
of hashing its content, and keys its multimodal processor cache, its encoder
cache and the item's prefix-cache blocks by it. Shared between tenants, a
uuid another tenant used runs the request on that tenant's image (the one
cached under it), and an image sent first under a uuid runs in place of
another tenant's later one. So a tenant's uuids are replaced by keys of its
own (`tenant_media_uuid`: a hash of its name and the uuid, length-prefixed
as the salt is, under a domain of their own), whatever `shared` says: a
shared prefix cache reveals timing, a shared uuid an image. A client that
reuses its own uuid still finds its own cached item. Routers' and
administrators' uuids stay as they are: a router's encoder-cache transfer
names items by their uuids. vLLM reads the uuids when it renders the prompt
(its multimodal processor), so `salted` runs before the prompt is rendered:
once rendered, the uuids are the processed item's hashes, and its processor
cache was looked up by them.

No grpc and no vLLM here: the protocols and the HTTP API call `salted`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, MutableMapping
from typing import Any

from .context import current_identity

__all__ = ["keyed_media_uuids", "salted", "tenant_media_uuid", "tenant_salt"]

_DOMAIN = b"vllm-servicer tenant cache salt v1\x00"
_MEDIA_DOMAIN = b"vllm-servicer tenant media uuid v1\x00"

# Where a prompt of vLLM's carries its items' uuids: a singleton prompt's own
# key, and each part of an encoder-decoder prompt's.
_UUIDS = "multi_modal_uuids"
_PARTS = ("encoder_prompt", "decoder_prompt")


def _hashed(domain: bytes, *parts: str) -> str:
    """SHA-256 of `domain` and `parts`, each part length-prefixed: no parts
    reach another's tuple by moving a boundary."""
    digest = hashlib.sha256(domain)
    for part in parts:
        data = part.encode("utf-8", "surrogatepass")
        digest.update(len(data).to_bytes(8, "big"))
        digest.update(data)
    return digest.hexdigest()


def tenant_salt(name: str, client_salt: str | None = None) -> str:
    """The cache salt of a request by tenant `name`, with the client's own salt.

    Each part is length-prefixed, so no name and salt reach another
    tenant's pair.
    """
    return _hashed(_DOMAIN, name, client_salt or "")


def tenant_media_uuid(name: str, uuid: str) -> str:
    """The media uuid vLLM gets for tenant `name`'s item named `uuid` by its client.

    Length-prefixed as `tenant_salt`, under a domain of its own: no tenant's
    uuid is another's, nor any cache salt.
    """
    return _hashed(_MEDIA_DOMAIN, name, uuid)


def keyed_media_uuids(prompt: Any, name: str) -> Any:
    """`prompt` (a dict as vLLM's engine takes it) with each media uuid keyed for
    tenant `name` (`tenant_media_uuid`); an item without one (None) keeps none.

    `multi_modal_uuids` maps a modality to a uuid or a list of them (None for an
    item vLLM is to hash by its content), on the prompt or on each part of an
    encoder-decoder prompt. The prompt gets a new mapping (one the caller
    holds is left as it was). Anything but a dict is returned as it is.
    """
    if not isinstance(prompt, MutableMapping):
        return prompt
    uuids = prompt.get(_UUIDS)
    if isinstance(uuids, Mapping):
        prompt[_UUIDS] = {modality: _keyed(name, given) for modality, given in uuids.items()}
    for part in _PARTS:
        inner = prompt.get(part)
        if isinstance(inner, MutableMapping):
            keyed_media_uuids(inner, name)
    return prompt


def _keyed(name: str, given: Any) -> Any:
    """One modality's uuids (a uuid, or a list of uuids and None) keyed for `name`."""
    if isinstance(given, str):
        return tenant_media_uuid(name, given)
    if isinstance(given, (list, tuple)):
        return [tenant_media_uuid(name, uuid) if isinstance(uuid, str) else uuid for uuid in given]
    return given


def keyed_tenant() -> str | None:
    """The tenant whose caches the current caller's requests are keyed for: None
    for an administrator, a router and a call without credentials (a server
    with no tenants), whose prompts and media uuids go to the engine as sent."""
    identity = current_identity.get()
    if identity is None or identity.is_router:  # admins are routers too
        return None
    return identity.name


_CONTENT_LISTS = ("content", "content_parts")
"""The lists of a body whose parts vLLM reads a media `uuid` from: a chat
message's (and a Responses item's) `content`, the scale-out routes' `content_parts`."""


def keyed_body_uuids(body: Any, name: str) -> bool:
    """Key for tenant `name` every media uuid of a parsed HTTP body, in place
    (`tenant_media_uuid`); whether any was.

    vLLM's chat routes read a content part's `uuid` when they render the chat,
    before the engine client sees the prompt, so the HTTP API keys them in the
    body: every part of a content list that names one, whatever its `type`
    (vLLM takes a part without one) and whatever the uuid's JSON type (vLLM
    makes it text). A `uuid` elsewhere (a tool's JSON schema) is left alone.
    Iterative: a deeply nested body costs no recursion.
    """
    keyed = False
    stack = [body]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, value in item.items():
                if key in _CONTENT_LISTS and isinstance(value, list):
                    for part in value:
                        if isinstance(part, dict) and part.get("uuid") is not None:
                            part["uuid"] = tenant_media_uuid(name, str(part["uuid"]))
                            keyed = True
                if isinstance(value, (dict, list)):
                    stack.append(value)
        elif isinstance(item, list):
            stack.extend(v for v in item if isinstance(v, (dict, list)))
    return keyed


def salted(prompt: Any, shared: bool = False, *, media: bool = True) -> Any:
    """`prompt` with the current caller's tenant salt and media keys, for the engine.

    A tenant's prompt (a dict as vLLM's engine takes it: a text, token or
    rendered prompt, its `cache_salt` key the client's own) gets the salt of
    `tenant_salt`; an encoder-decoder prompt salts its decoder's part, where
    vLLM reads it. A text prompt becomes a dict. Its media uuids
    (`multi_modal_uuids`) become the tenant's own keys (`keyed_media_uuids`).
    With `shared` (the operator's `--shared-prefix-cache`) a tenant's prompt
    keeps its client's salt, its uuids keyed all the same. An administrator's,
    a router's and an unauthenticated call's prompt (a server with no
    tenants) is returned as it is.

    Once per request, before the prompt is rendered (`process_for_engine`):
    vLLM's multimodal processor reads the uuids there, and a uuid keyed twice
    would be another key. Without `media` the uuids are left as they are (the
    HTTP API keys them in the body, before vLLM renders: `keyed_body_uuids`).
    """
    name = keyed_tenant()
    if name is None:
        return prompt
    # A shared prefix cache shares timing; a shared uuid would share an image.
    if media:
        prompt = keyed_media_uuids(prompt, name)
    if shared:
        return prompt
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
