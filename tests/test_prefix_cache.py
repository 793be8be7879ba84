"""`prefix_cache.salted`: which prompts get a tenant's salt, and that no client salt
reaches another tenant's (the launcher's behaviour is `test_prefix_cache_salt.py`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from vllm_servicer.context import ADMIN_ROLE, ROUTER_ROLE, Identity, current_identity
from vllm_servicer.prefix_cache import salted, tenant_salt


@contextlib.contextmanager
def calling_as(identity: Identity | None) -> Iterator[None]:
    token = current_identity.set(identity)
    try:
        yield
    finally:
        current_identity.reset(token)


A = Identity(name="tenant-a", kind="api_key")
B = Identity(name="tenant-b", kind="api_key")


@pytest.mark.parametrize(
    "prompt",
    [
        pytest.param("hello", id="text"),
        pytest.param({"prompt": "hello"}, id="text-dict"),
        pytest.param({"type": "token", "prompt_token_ids": [1, 2, 3]}, id="rendered"),
    ],
)
def test_a_tenants_prompt_carries_its_salt(prompt: Any) -> None:
    with calling_as(A):
        out = salted(prompt)
    assert out["cache_salt"] == tenant_salt("tenant-a")


def test_the_clients_own_salt_is_joined_not_replaced() -> None:
    with calling_as(A):
        out = salted({"prompt_token_ids": [1], "cache_salt": "mine"})
    assert out["cache_salt"] == tenant_salt("tenant-a", "mine") != tenant_salt("tenant-a")


def test_an_encoder_decoder_prompt_salts_its_decoder() -> None:
    with calling_as(A):
        out = salted({"encoder_prompt": "x", "decoder_prompt": "y"})
    assert out["decoder_prompt"]["cache_salt"] == tenant_salt("tenant-a")
    assert "cache_salt" not in out


@pytest.mark.parametrize(
    ("identity", "shared"),
    [
        pytest.param(None, False, id="no-credentials"),
        pytest.param(Identity(name="ops", roles=frozenset({ADMIN_ROLE})), False, id="admin"),
        # A cache-aware router hashes token ids as vLLM does without a salt.
        pytest.param(Identity(name="gw", roles=frozenset({ROUTER_ROLE})), False, id="router"),
        pytest.param(A, True, id="shared-prefix-cache"),
    ],
)
def test_unsalted_prompts(identity: Identity | None, shared: bool) -> None:
    with calling_as(identity):
        assert salted({"prompt": "x", "cache_salt": "c"}, shared) == {
            "prompt": "x",
            "cache_salt": "c",
        }


def test_no_name_and_salt_reach_another_tenants_salt() -> None:
    # A name that ends where a salt would begin, in every split.
    assert tenant_salt("tenant-a", "") != tenant_salt("tenant-", "a")
    assert tenant_salt("tenant-b", "x") != tenant_salt("tenant-a", "x")
    with calling_as(B):
        assert salted({"prompt": "x", "cache_salt": tenant_salt("tenant-a")})["cache_salt"] != (
            tenant_salt("tenant-a")
        )
