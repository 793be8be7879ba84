"""A vLLM plugin that lets vision models start where torchvision does not import.

vLLM's model inspection imports ``transformers.models.pixtral.
image_processing_pixtral``, which needs torchvision, for every LLaVA-family
model; CPU hosts often have no working torchvision (the CUDA wheels do not
load beside a CPU torch). transformers ships the same functions without
torchvision in ``image_processing_pil_pixtral``: this module serves that one
under the first name, and only when torchvision cannot be imported.

It is registered as a ``vllm.general_plugins`` entry point, so vLLM loads it
in every one of its processes (the engine core and the workers import the
model too). Registering costs one ``sys.meta_path`` entry; nothing is
imported until the name is asked for, so text models never touch it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

_WANTED = "transformers.models.pixtral.image_processing_pixtral"
_STAND_IN = "transformers.models.pixtral.image_processing_pil_pixtral"


def _torchvision_imports() -> bool:
    try:
        importlib.import_module("torchvision")
    except Exception:  # missing, or a build that does not match this torch
        return False
    return True


class _PixtralAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _WANTED or _torchvision_imports():
            return None
        if importlib.util.find_spec(_STAND_IN) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default module object

    def exec_module(self, module: types.ModuleType) -> None:
        stand_in = importlib.import_module(_STAND_IN)
        module.__dict__.update(
            (name, value) for name, value in vars(stand_in).items() if not name.startswith("__")
        )


def register() -> None:
    """The plugin's entry point: install the alias once per process."""
    if not any(isinstance(finder, _PixtralAlias) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PixtralAlias())
