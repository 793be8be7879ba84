"""GetTokenizer: the model's tokenizer files as one zip, streamed in bounded chunks.

The zip is built once per directory in a worker thread (reading and deflating
files would otherwise stall every stream on the event loop) and then served
from memory; callers that arrive during the build share it.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import zipfile
from collections.abc import Iterator
from pathlib import Path

from ..errors import UnsupportedError
from ..proto import common_pb2

# Well under grpc's default 4 MiB receive limit on any client.
CHUNK_SIZE = 512 * 1024

# What a client needs to rebuild the tokenizer (and its chat template).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "tiktoken.model",
    "chat_template.json",
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "preprocessor_config.json",
    "processor_config.json",
)
TOKENIZER_GLOBS = ("*.tiktoken", "*.jinja", "*.model")


def tokenizer_dir(tokenizer: str | None, revision: str | None = None) -> Path:
    """The local directory holding the tokenizer files.

    A hub id (``org/name``) resolves to its snapshot in this server's Hugging
    Face cache, where the engine downloaded it at start-up; nothing is fetched.

    Raises:
        UnsupportedError: the tokenizer is neither a local directory nor a
            model in the cache, so there is nothing to send.
    """
    if not tokenizer:
        raise UnsupportedError("this server has no tokenizer configured")
    path = Path(tokenizer)
    if path.is_dir():
        return path
    cached = _cached_snapshot(tokenizer, revision)
    if cached is None:
        raise UnsupportedError(
            f"the tokenizer {tokenizer!r} is neither a local directory nor a model in this "
            "server's Hugging Face cache; start the engine with a local --tokenizer (or model) "
            "path to serve GetTokenizer"
        )
    return cached


def _cached_snapshot(repo_id: str, revision: str | None) -> Path | None:
    """The cached snapshot folder of a hub model, None when there is none."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    except ImportError:
        return None
    try:
        folder = snapshot_download(repo_id, revision=revision, local_files_only=True)
    except (HFValidationError, LocalEntryNotFoundError, OSError):
        return None
    path = Path(str(folder))
    return path if path.is_dir() else None


def build_zip(directory: Path) -> tuple[bytes, str]:
    """The zip of `directory`'s tokenizer files and its sha256 hex digest.

    Raises:
        UnsupportedError: the directory holds no tokenizer file.
    """
    names: list[str] = [n for n in TOKENIZER_FILES if (directory / n).is_file()]
    for pattern in TOKENIZER_GLOBS:
        names.extend(
            p.name for p in sorted(directory.glob(pattern)) if p.is_file() and p.name not in names
        )
    if not names:
        raise UnsupportedError(f"no tokenizer files in {str(directory)!r} on this server")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in names:
            archive.write(directory / name, name)
    data = buffer.getvalue()
    return data, hashlib.sha256(data).hexdigest()


class TokenizerBundle:
    """One directory's zip, built off the event loop once and kept in memory.

    Args:
        directory: the tokenizer directory (fixed for the engine's lifetime).
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._archive: tuple[bytes, str] | None = None
        self._build: asyncio.Task[tuple[bytes, str]] | None = None

    async def archive(self) -> tuple[bytes, str]:
        """The zip's bytes and sha256; a failed build is not kept, so the next call retries."""
        if self._archive is not None:
            return self._archive
        if self._build is None:
            self._build = asyncio.get_running_loop().create_task(self._build_once())
        # shield: a caller that goes away must not cancel the build for the others.
        return await asyncio.shield(self._build)

    async def _build_once(self) -> tuple[bytes, str]:
        try:
            self._archive = await asyncio.to_thread(build_zip, self.directory)
            return self._archive
        finally:
            self._build = None


def chunks(data: bytes, sha256: str) -> Iterator[common_pb2.GetTokenizerChunk]:
    """`data` in chunks of at most CHUNK_SIZE bytes; the sha256 rides on the last only."""
    view = memoryview(data)
    total = len(data)
    for start in range(0, total, CHUNK_SIZE):
        end = min(start + CHUNK_SIZE, total)
        yield common_pb2.GetTokenizerChunk(
            data=bytes(view[start:end]), sha256=sha256 if end == total else ""
        )
