"""The never-split mutant: `SplitPolicy.plan` returns None in every process started with this folder on PYTHONPATH.

Python imports ``sitecustomize`` at the start of every process, so the mutant reaches pytest, the ranks `launch`
spawns, the example scripts tests run and their ranks alike. `tests/test_mutants.py` runs equivalence tests under
it and expects them to fail: a test comparing TBO with ``forward()`` must also show that TBO happened, or it passes
with the feature never running. Nothing is imported here; the class is patched when ``tbo.split.plan`` loads.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any, Sequence

TARGET = "tbo.split.plan"


def _never_split(self: Any, *args: Any, **kwargs: Any) -> None:
    return None


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds ``tbo.split.plan`` where the normal path finder would, and patches it right after it executes."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            module.SplitPolicy.plan = _never_split  # type: ignore[attr-defined]

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _PatchOnImport())
