"""Import-only stand-in for torchvision (no CPU build matches torch 2.13 here), for the SGLang tests' venv.

SGLang imports torchvision at import time (its multimodal configs and processors: ``torchvision.transforms``,
``InterpolationMode``), and transformers, seeing it installed, imports ``torchvision.io`` from ``image_utils``. None
of it runs for the text MoE models the tests serve. So every ``torchvision.X.Y`` module imports, every name in it is
a `Missing` placeholder (attributes of a placeholder are placeholders too, for import-time ``Mode.BICUBIC``), and
*calling* one raises, naming it: a test that reached a vision path fails loudly instead of computing with a stub.
The version must parse (transformers and SGLang compare it), hence 0.0.0.
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
        raise RuntimeError(f"{self._name} belongs to the torchvision stand-in (tests/sglang/stubs): the SGLang CPU "
                           "tests never run vision code")

    def __mro_entries__(self, bases):  # `class X(torchvision.Something)` at import time
        return (object,)

    def __repr__(self) -> str:
        return f"<torchvision stand-in {self._name}>"


def _module_getattr(module_name: str):
    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return Missing(f"{module_name}.{name}")
    return __getattr__


__getattr__ = _module_getattr("torchvision")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes every ``torchvision.*`` submodule importable as an empty stand-in module."""

    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("torchvision."):
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
