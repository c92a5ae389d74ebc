"""The SGLang room's tests run only where SGLang is installed: `make test-sglang` (.venv-sglang, sglang 0.5.23 on
CPU). Under `make test` (no sglang) nothing here is collected, so nothing of SGLang is imported there."""

from __future__ import annotations

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("sglang") is not None else ["test_*.py", "helpers.py"]
