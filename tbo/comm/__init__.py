"""Expert-parallel communication: dispatch_a/b and combine_a/b over local, torch.distributed, emulated, copy-engine
and DeepEP transports (DeepEP V1 and V2, chosen by `deepep_backend`); the tensor-parallel all-reduce as a transfer
(`TPAllReduce`: reduce_a/b); and timeout-bounded waits. (The expert runners
for each layout are in `tbo.experts`.)"""

from tbo.comm.allreduce import AllReduceState, TPAllReduce, ring_allreduce_bytes
from tbo.comm.alltoall import AllToAllBackend, LocalBackend, TorchDistributedBackend
from tbo.comm.copy_engine import CopyEngineLink
from tbo.comm.deepep_select import deepep_backend
from tbo.comm.types import CombineState, DispatchFormat, DispatchOutput, DispatchState, EPBackend
from tbo.comm.wait import DEFAULT_TIMEOUT_S, wait_work

__all__ = [
    "AllReduceState",
    "AllToAllBackend",
    "CombineState",
    "CopyEngineLink",
    "DEFAULT_TIMEOUT_S",
    "DispatchFormat",
    "DispatchOutput",
    "DispatchState",
    "EPBackend",
    "LocalBackend",
    "TPAllReduce",
    "TorchDistributedBackend",
    "deepep_backend",
    "ring_allreduce_bytes",
    "wait_work",
]
