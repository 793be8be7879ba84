"""The vLLM releases this package is tested with, checked when it is imported.

vLLM's internals (engine attributes, exception and parameter classes) change
between minor releases. The policy, decided once here (docs/index.md,
"Supported vLLM versions"):

- a release in the tested range imports silently;
- a **newer minor release** of the same major imports with an
  `UntestedVllmWarning` that names the tested range and the command that
  lists what changed (`make vllm-api-check VERSION=X`): on the day vLLM
  ships, users are not locked out. The evidence: of the ~183 vLLM names
  the package uses, 0.32 changed 14 (a few incompatibly: --api-server-count
  and LoRA), 0.33 changed 11 (one moved import, behind a fallback), 0.34
  changed 5 (all compatible); what each broke was one feature, never the
  main path, while a refusal at import stopped every user;
- an **older** release, or a new major, fails here with both versions named
  (the package relies on names older releases lack; a major may change
  anything), instead of with an AttributeError in the middle of a request.

pyproject.toml declares the tested range (a test keeps them equal).
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import warnings

# Lower bound inclusive, upper bound exclusive, compared on (major, minor).
SUPPORTED_VLLM = ">=0.31,<0.35"

# Set to 1 to import with an older untested vLLM, and to silence the warning for a newer one.
SKIP_ENV = "VLLM_SERVICER_SKIP_VLLM_VERSION_CHECK"


class UnsupportedVllmError(ImportError):
    """The installed vLLM is older than the tested range, or of another major release."""


class UntestedVllmWarning(UserWarning):
    """The installed vLLM is a newer minor release than the tested range."""


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


def is_newer_minor(version: str) -> bool:
    """Whether `version` is a minor release above the range, of the same major."""
    try:
        major, minor = release(version)
    except ValueError:
        return False
    return major == _BELOW[0] and (major, minor) >= _BELOW


def check_vllm_version(installed: str | None) -> None:
    """Warn for a newer minor release; raise `UnsupportedVllmError` for any other untested one.

    Args:
        installed: the installed vLLM's version, None when there is none.
    """
    if installed is not None and is_supported(installed):
        return
    if os.environ.get(SKIP_ENV) == "1":
        return
    if installed is not None and is_newer_minor(installed):
        message = (
            f"vllm-servicer is tested with vLLM {SUPPORTED_VLLM}; vLLM {installed} is newer "
            f"and untested. It is used as is: `make vllm-api-check VERSION={installed}` lists "
            f"what the package uses that changed, and {SKIP_ENV}=1 silences this warning."
        )
        logging.getLogger("vllm_servicer").warning("%s", message)
        warnings.warn(message, UntestedVllmWarning, stacklevel=2)
        return
    have = "no vLLM is installed" if installed is None else f"vLLM {installed} is installed"
    raise UnsupportedVllmError(
        f"vllm-servicer supports vLLM {SUPPORTED_VLLM} (the releases it is tested with), "
        f"but {have}. Install a supported release (pip install 'vllm-servicer[vllm]', or "
        f"'vllm-servicer[cpu]' for the CPU build), or set {SKIP_ENV}=1 to try this one untested."
    )


check_vllm_version(installed_vllm_version())
