"""Lazy imports of the GPU-only libraries, with an error that says how to get them.

``deep_ep`` and ``deep_gemm`` build from source against CUDA (their PyPI sdists do not build), so they are never
install requirements. Importing `tbo` never touches them; only the code path that needs one imports it, here.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require", "try_import", "INSTALL_HINTS", "DISTRIBUTION", "extra_hint"]

#: The distribution's name (pyproject.toml). The import name is `tbo`; `tbo` on PyPI is an unrelated project, so
#: a hint never names `tbo` as a requirement.
DISTRIBUTION = "tbo-overlap"

INSTALL_HINTS = {
    "deep_ep": "build it from source on a CUDA machine: git clone https://github.com/deepseek-ai/DeepEP && "
    "cd DeepEP && python setup.py install (needs NVSHMEM for the low-latency mode)",
    "deep_gemm": "build it from source on a CUDA machine (SM90 or newer): git clone --recursive "
    "https://github.com/deepseek-ai/DeepGEMM && cd DeepGEMM && ./install.sh",
}


def try_import(name: str) -> ModuleType | None:
    """The module, or None when it is not installed. Errors other than a missing module propagate."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        return None


def extra_hint(extra: str) -> str:
    """How to install one of tbo's extras: from a clone (editable, as `make` does) or by the distribution's name."""
    return f"pip install -e '.[{extra}]' in tbo's clone (or pip install '{DISTRIBUTION}[{extra}]')"


def require(name: str, purpose: str) -> ModuleType:
    """The module, or an ImportError naming what needed it and how to install it."""
    module = try_import(name)
    if module is None:
        hint = INSTALL_HINTS.get(name, f"pip install {name}")
        raise ImportError(f"{purpose} needs the optional package {name!r}, which is not installed; {hint}")
    return module
