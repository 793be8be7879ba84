"""The launcher of the Kubernetes recipe (examples/kubernetes/inference-gateway), run here.

`recipe_launcher` (a session fixture, offered by conftest.py) starts one
launcher with the recipe Deployment's own arguments, as far as they apply on
a CPU machine, for every test that reads what such a pod serves: the series
llm-d's endpoint picker scrapes (tests/test_kubernetes_recipe.py) and the
Grafana dashboard's queries (tests/test_grafana_dashboard.py). One start for
both: a launcher costs ~45 s.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from vllm_servicer.testing.tiny_model import apply_cpu_env_defaults, tiny_engine_flags

from .launcher import EXAMPLES, Launched, launched, launcher_env

RECIPE = EXAMPLES / "kubernetes" / "inference-gateway"
API_KEY = "recipe-inference-key-0123456789abcdef"

LOCAL = {"--host": "127.0.0.1", "--port": None, "--metrics-port": "0"}
"""Flags whose values are the cluster's: on loopback here, on ports the kernel
picks (`launched` adds `--port 0`; None drops the flag)."""


def manifests(name: str) -> list[dict[str, Any]]:
    """The objects of one of the recipe's files."""
    return [doc for doc in yaml.safe_load_all((RECIPE / name).read_text()) if doc]


def server_container() -> dict[str, Any]:
    """The launcher's container in the recipe's Deployment."""
    [deployment] = manifests("deployment.yaml")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    return dict(container)


def flag_value(args: list[str], flag: str) -> str | None:
    """The value of `--flag=value` in `args` (the recipe spells every flag so)."""
    for arg in args:
        name, sep, value = arg.partition("=")
        if name == flag:
            return value if sep else ""
    return None


def cpu_args(args: list[str], *, model_dir: Path, key_file: Path) -> list[str]:
    """The Deployment's `args` as a launcher on this machine takes them.

    The model is the tiny one, with its settings (the recipe's is a GPU's);
    the addresses are local (`LOCAL`); the key file is `key_file`. Every other
    flag is passed as the recipe has it.
    """
    assert args[0] == "serve"
    local = {**LOCAL, "--api-key-file": str(key_file)}
    out = ["--model", str(model_dir), *tiny_engine_flags()]
    for arg in args[1:]:
        name, sep, _ = arg.partition("=")
        if name == "--model":
            continue
        if name in local:
            value = local[name]
            if value is not None:
                out += [name, value]  # apart, as `launched` looks for what to wait for
            continue
        out.append(arg)
    return out


@dataclass(frozen=True)
class RecipeLauncher:
    """A launcher serving as a pod of the recipe does: its addresses, key, model name."""

    served: Launched
    args: tuple[str, ...]
    api_key: str
    model_name: str

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """gRPC metadata with the inference key."""
        return (("authorization", f"Bearer {self.api_key}"),)


@pytest.fixture(scope="session")
async def recipe_launcher(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[RecipeLauncher]:
    """The recipe's launcher on the tiny model, for the session (read-only use)."""
    home = tmp_path_factory.mktemp("recipe")
    key_file = home / "keys"
    key_file.write_text(API_KEY + "\n")
    container = server_container()
    args = cpu_args(container["args"], model_dir=tiny_model_dir, key_file=key_file)
    model_name = flag_value(container["args"], "--served-model-name")
    assert model_name, "the recipe names its served model"
    env = launcher_env(home / "cache", **apply_cpu_env_defaults())
    async with launched(*args, env=env) as served:
        yield RecipeLauncher(served, tuple(args), API_KEY, model_name)
