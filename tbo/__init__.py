"""tbo: two-batch overlap for LLM inference, as declarative operation lists and a small compiled executor.

A layer is a list of ops with `Yield` between stages; `execute_overlapped_operations` runs two (or more) microbatches
through it so that one microbatch's communication overlaps another's compute.

The package is layered (see the README's "Architecture"): `tbo.core` (no torch), the library (`comm`; `split`, `experts`;
`ops`; `strategies`; `runtime`; `models`; `afd`, `integrations`, each importing only those before it), `tbo.tools` and
`tbo.harness`. `import tbo` needs no
torch; the names below that do are imported on first use.
"""

from tbo.core import (CommTimeoutError, HangError, Observer, Operation, OperationError, OperationsStrategy, Schedule,
                      State, StrategyError, Yield, execute_operations, execute_overlapped_operations, interleave,
                      op_name)
from tbo.split import ForwardMode, SplitPlan, SplitPolicy
from tbo.tools.lint import Finding, lint
from tbo.util.lazy import lazy_attributes

__getattr__ = lazy_attributes(__name__, {
    "agree_to_split": "tbo.split.agree",
    "deep_gemm_num_sms": "tbo.comm.sm_budget",
    "merge_outputs": "tbo.split.tensors",
    "split_inputs": "tbo.split.tensors",
    "model_forward_maybe_tbo": "tbo.runtime.forward",
}, submodules=["afd", "comm", "core", "experts", "harness", "integrations", "models", "ops", "runtime", "split",
               "strategies", "testing", "tools", "util"])

__version__ = "0.1.0"

__all__ = [
    "agree_to_split",
    "CommTimeoutError",
    "deep_gemm_num_sms",
    "execute_operations",
    "execute_overlapped_operations",
    "Finding",
    "ForwardMode",
    "HangError",
    "interleave",
    "lint",
    "merge_outputs",
    "model_forward_maybe_tbo",
    "Observer",
    "op_name",
    "Operation",
    "OperationError",
    "OperationsStrategy",
    "Schedule",
    "split_inputs",
    "SplitPlan",
    "SplitPolicy",
    "State",
    "StrategyError",
    "Yield",
]
