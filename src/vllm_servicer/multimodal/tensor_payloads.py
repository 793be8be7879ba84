"""A wire tensor (`TensorData`) as a torch tensor: inline, or read from shared memory.

Each tensor arrives inline (bytes, shape, dtype) or as a handle to a POSIX
shared-memory segment on this host (`shm`: name, offset, nbytes), which is
read and copied, never unlinked: the segment is its sender's. A segment is
opened non-blocking and read only if it is a regular file. Unknown dtypes,
empty tensors, byte counts that do not match the shape and segments that
cannot be read are refused, each message naming the field.
"""

from __future__ import annotations

import errno
import math
import os
import stat
from collections.abc import Mapping, Sequence

import torch

from ..errors import InvalidRequestError
from ..proto import common_pb2
from ..proto import vllm_engine_pb2 as pb

# The wire's dtype names, as the reference server reads them. A name not listed
# is refused: read at the wrong width, the bytes would make plausible nonsense.
DTYPES: Mapping[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "uint8": torch.uint8,
    "int64": torch.int64,
    "uint32": torch.uint32,
}
# POSIX shared memory lives here on Linux. Read as a file, not through
# multiprocessing.shared_memory: before Python 3.13 attaching registers the
# segment with the resource tracker, which unlinks it when this process exits.
SHM_DIR = "/dev/shm"


def tensor_from(path: str, data: pb.TensorData) -> torch.Tensor:
    """The tensor a `TensorData` carries, checked against its shape and dtype.

    Args:
        path: the field's path, for messages.
        data: the wire tensor (inline or shm).

    Raises:
        InvalidRequestError: an unknown dtype, an empty tensor, a byte count
            that does not match, or a shared-memory segment that cannot be read.
    """
    dtype = DTYPES.get(data.dtype)
    if dtype is None:
        raise InvalidRequestError(
            f"{path}.dtype", f"{data.dtype!r} is not one of {', '.join(DTYPES)}"
        )
    shape = list(data.shape)
    needed = math.prod(shape) * dtype.itemsize
    if needed == 0:
        raise InvalidRequestError(f"{path}.shape", f"{shape_text(shape)} has no elements")
    kind = data.WhichOneof("payload")
    if kind not in ("inline", "shm"):
        raise InvalidRequestError(path, "carries no payload; set inline or shm")
    inline = data.inline if kind == "inline" else b""  # each read of the field copies it
    given = len(inline) if kind == "inline" else data.shm.nbytes
    if given != needed:
        raise InvalidRequestError(
            path, f"shape {shape_text(shape)} {data.dtype} needs {needed} bytes, got {given}"
        )
    # Writable, as torch wants, and independent of the message or the sender's segment.
    raw = bytearray(inline) if kind == "inline" else _read_shm(path, data.shm)
    return torch.frombuffer(raw, dtype=dtype).reshape(shape)


def shape_text(shape: Sequence[int | str]) -> str:
    return "[" + ",".join(map(str, shape)) + "]"


def _read_shm(path: str, handle: common_pb2.ShmHandle) -> bytearray:
    """A copy of the handle's bytes; the segment stays as it is (its owner unlinks it)."""
    name = handle.name.removeprefix("/")  # POSIX names start with one slash
    if not name or "/" in name or name in (".", "..") or "\0" in name:
        raise InvalidRequestError(f"{path}.shm.name", f"{handle.name!r} is not a segment name")
    try:
        # Non-blocking: a FIFO under that name would otherwise hold the event
        # loop until some writer opened it. Regular files ignore the flag.
        fd = os.open(
            os.path.join(SHM_DIR, name),
            os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
        )
    except OSError as exc:
        raise InvalidRequestError(f"{path}.shm.name", _open_failure(name, exc)) from None
    try:
        return _read_range(path, fd, handle)
    finally:
        os.close(fd)


def _open_failure(name: str, exc: OSError) -> str:
    if exc.errno == errno.ENOENT:
        return f"no shared-memory segment {name!r} on this host"
    if exc.errno == errno.ELOOP:
        return f"{name!r} is a symbolic link, not a shared-memory segment"
    return f"cannot open shared-memory segment {name!r}: {exc.strerror}"


def _read_range(path: str, fd: int, handle: common_pb2.ShmHandle) -> bytearray:
    # Named without the POSIX slash: a word starting with "/" reads as a path,
    # which error messages do not show (status.redact_paths).
    name = handle.name.removeprefix("/")
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise InvalidRequestError(f"{path}.shm.name", f"{name!r} is not a segment")
    end = handle.offset + handle.nbytes
    if end > info.st_size:
        raise InvalidRequestError(
            f"{path}.shm",
            f"offset {handle.offset} + nbytes {handle.nbytes} runs past the end of segment "
            f"{name!r} ({info.st_size} bytes)",
        )
    raw = bytearray(handle.nbytes)
    view = memoryview(raw)
    done = 0
    while done < handle.nbytes:
        read = os.preadv(fd, [view[done:]], handle.offset + done)
        if read == 0:
            raise InvalidRequestError(f"{path}.shm", f"segment {name!r} shrank while read")
        done += read
    return raw


def itemsize(dtype: str) -> int:
    known = DTYPES.get(dtype)
    return known.itemsize if known is not None else 0
