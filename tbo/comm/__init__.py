"""Expert-parallel communication: dispatch_a/b and combine_a/b over local, torch.distributed, emulated and DeepEP
transports, the expert runners for each layout, and timeout-bounded waits."""

from .alltoall import AllToAllBackend, LocalBackend, TorchDistributedBackend
from .experts import ExpertFn, run_experts
from .types import CombineState, DispatchFormat, DispatchOutput, DispatchState, EPBackend
from .wait import DEFAULT_TIMEOUT_S, wait_work

__all__ = [
    "AllToAllBackend",
    "CombineState",
    "DEFAULT_TIMEOUT_S",
    "DispatchFormat",
    "DispatchOutput",
    "DispatchState",
    "EPBackend",
    "ExpertFn",
    "LocalBackend",
    "TorchDistributedBackend",
    "run_experts",
    "wait_work",
]
