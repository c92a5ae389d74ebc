"""The test suite as a package (`tests`), so that its vLLM room, `tests/vllm`, is the package `tests.vllm` and never
shadows the installed `vllm` (a folder `vllm` on sys.path would be importable as a namespace package where vLLM
is absent). Helpers are imported relatively (`from .split_witness import ...`); no test module imports another
(`tests/test_suite_imports.py`)."""
