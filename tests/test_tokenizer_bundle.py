"""Where GetTokenizer finds the files: a local folder, or a hub id's cached snapshot."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_servicer.errors import UnsupportedError
from vllm_servicer.servicer.tokenizer_bundle import build_zip, tokenizer_dir

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A Hugging Face cache holding `acme/tiny` at `main`, laid out as the hub client writes it."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / "tokenizer.json").write_text('{"version": "1.0"}')
    (snapshot / "tokenizer_config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return snapshot


def test_a_local_folder_is_used_as_it_is(tmp_path: Path) -> None:
    assert tokenizer_dir(str(tmp_path)) == tmp_path


def test_a_hub_id_resolves_to_its_cached_snapshot(hub_cache: Path) -> None:
    assert tokenizer_dir("acme/tiny") == hub_cache
    assert tokenizer_dir("acme/tiny", revision=COMMIT) == hub_cache
    data, digest = build_zip(tokenizer_dir("acme/tiny"))
    assert data and len(digest) == 64


@pytest.mark.parametrize(
    ("tokenizer", "revision"),
    [
        ("acme/absent", None),  # not in the cache: never downloaded here
        ("acme/tiny", "v2"),  # a revision the cache does not hold
        ("not a repo id!", None),
        ("/no/such/folder", None),
    ],
)
def test_what_is_not_on_this_server_is_refused_by_name(
    hub_cache: Path, tokenizer: str, revision: str | None
) -> None:
    with pytest.raises(UnsupportedError, match="neither a local directory") as err:
        tokenizer_dir(tokenizer, revision)
    assert repr(tokenizer) in str(err.value)


def test_no_tokenizer_at_all() -> None:
    with pytest.raises(UnsupportedError, match="no tokenizer"):
        tokenizer_dir(None)
