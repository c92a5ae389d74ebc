"""tbo: two-batch overlap for LLM inference, as declarative operation lists and a small compiled executor.

A layer is a list of ops with `Yield` between stages; `execute_overlapped_operations` runs two (or more) microbatches
through it so that one microbatch's communication overlaps another's compute.
"""

from .errors import CommTimeoutError, HangError, OperationError, StrategyError
from .executors import execute_operations, execute_overlapped_operations
from .forward import model_forward_maybe_tbo
from .lint import Finding, lint
from .observer import Observer
from .operations import Operation, Yield, op_name
from .schedule import Schedule, interleave
from .sm_budget import deep_gemm_num_sms
from .split import ForwardMode, SplitPlan, SplitPolicy, agree_to_split, merge_outputs, split_inputs
from .state import State
from .strategy import OperationsStrategy

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
