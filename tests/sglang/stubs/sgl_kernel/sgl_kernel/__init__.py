"""Import-only stand-in for sgl_kernel (SGLang's kernel package has no build for this CPU and torch), for the
SGLang tests' venv: SGLang imports it under SGLANG_USE_CPU_ENGINE=1 (``from sgl_kernel import ...`` and
``sgl_kernel.scalar_type`` at import time). The torch-native paths the tests run (attention_backend="torch_native",
fp32 MoE) never call it, so every ``sgl_kernel.X`` module imports, every name is a `Missing` placeholder, and *calling*
one raises, naming it: a test that reached a kernel fails loudly instead of computing with a stub.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0"


class Missing:
    """A name of the stand-in: attributes are placeholders, calls raise."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> "Missing":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Missing(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} belongs to the sgl_kernel stand-in (tests/sglang/stubs): the SGLang CPU "
                           "tests run no sgl_kernel kernel")

    def __mro_entries__(self, bases):  # `class X(sgl_kernel.Something)` at import time
        return (object,)

    def __repr__(self) -> str:
        return f"<sgl_kernel stand-in {self._name}>"


def _module_getattr(module_name: str):
    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return Missing(f"{module_name}.{name}")
    return __getattr__


__getattr__ = _module_getattr("sgl_kernel")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes every ``sgl_kernel.*`` submodule importable as an empty stand-in module."""

    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("sgl_kernel."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module):
        pass


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.append(_Finder())
