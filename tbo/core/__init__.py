"""The core: operations, strategies, the compiled schedule, per-microbatch State, observers, stage hooks, errors and
executors.

It imports nothing outside `tbo.core` and no torch (`tests/test_layering.py` enforces this): an executor that knows
only ops, stages, a schedule and states can serve any model, framework or device.
"""

from tbo.core.errors import CommTimeoutError, HangError, OperationError, StrategyError
from tbo.core.executors import execute_operations, execute_overlapped_operations
from tbo.core.inflight import InFlightLimit
from tbo.core.observer import Observer
from tbo.core.operations import Operation, Yield, comm_role, op_name
from tbo.core.schedule import Schedule, interleave
from tbo.core.stage_hooks import StageHooks
from tbo.core.state import State
from tbo.core.strategy import OperationsStrategy

__all__ = ["CommTimeoutError", "HangError", "OperationError", "StrategyError", "execute_operations",
           "execute_overlapped_operations", "InFlightLimit", "Observer", "Operation", "Yield", "comm_role", "op_name",
           "Schedule", "interleave", "StageHooks", "State", "OperationsStrategy"]
