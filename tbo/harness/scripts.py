"""Load a benchmark script from its path, as a module of its own.

Why: `benchmarks/vllm.py` is named like the package it measures, so a benchmark that builds on it (its workload,
model and link helpers) cannot import it by name: the name is vLLM's, and putting ``benchmarks/`` on ``sys.path``
would shadow vLLM for everyone. Every benchmark that builds on another loads it through here, the one way.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

__all__ = ["load_script"]


def load_script(path: Path | str) -> ModuleType:
    """Run the script at ``path`` as a module named ``tbo_bench_<its stem>`` and return it: a fresh module on every
    call (its module-level state its own), not entered in ``sys.modules``, so it never stands in for a package."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(f"tbo_bench_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} cannot be loaded as a Python script")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
