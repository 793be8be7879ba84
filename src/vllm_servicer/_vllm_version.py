"""The vLLM releases this package is tested with, checked when it is imported.

vLLM's internals (engine attributes, exception and parameter classes) change
between minor releases. A release outside the tested range fails here, with
both versions named, instead of with an AttributeError in the middle of a
request. pyproject.toml declares the same range (a test keeps them equal).
"""

from __future__ import annotations

import importlib
import os
import re

# Lower bound inclusive, upper bound exclusive, compared on (major, minor).
SUPPORTED_VLLM = ">=0.31,<0.34"

# Set to 1 to import with an untested vLLM (to try a new release).
SKIP_ENV = "VLLM_SERVICER_SKIP_VLLM_VERSION_CHECK"


class UnsupportedVllmError(ImportError):
    """The installed vLLM is outside the range this package is tested with."""


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as "0.32.0", "0.32.1+cpu", "0.33.0.dev4"."""
    match = re.match(r"\s*v?(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a release version: {version!r}")
    return int(match[1]), int(match[2])


_LOWEST, _BELOW = (release(bound.lstrip("<>=")) for bound in SUPPORTED_VLLM.split(","))


def is_supported(version: str) -> bool:
    """Whether `version` falls in `SUPPORTED_VLLM`; an unreadable version does not."""
    try:
        return _LOWEST <= release(version) < _BELOW
    except ValueError:
        return False


def installed_vllm_version() -> str | None:
    """The importable vLLM's version, None when vLLM is not installed."""
    try:
        version = importlib.import_module("vllm.version")
    except ModuleNotFoundError as exc:
        if exc.name != "vllm":
            raise
        return None
    return str(version.__version__)


def check_vllm_version(installed: str | None) -> None:
    """Raise `UnsupportedVllmError` naming both versions unless `installed` is supported.

    Args:
        installed: the installed vLLM's version, None when there is none.
    """
    if installed is not None and is_supported(installed):
        return
    if os.environ.get(SKIP_ENV) == "1":
        return
    have = "no vLLM is installed" if installed is None else f"vLLM {installed} is installed"
    raise UnsupportedVllmError(
        f"vllm-servicer supports vLLM {SUPPORTED_VLLM} (the releases it is tested with), "
        f"but {have}. Install a supported release (pip install 'vllm-servicer[vllm]', or "
        f"'vllm-servicer[cpu]' for the CPU build), or set {SKIP_ENV}=1 to try this one untested."
    )


check_vllm_version(installed_vllm_version())
