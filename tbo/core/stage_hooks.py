"""`StageHooks`: what an engine runs around each microbatch's stage (its forward context), apart from `Observer`.

Why not an `Observer`: an observer is a diagnostic, and the executor pays for one on every op (a call before and one
after each). Correctness needs less. An engine whose layers read per-microbatch state outside their arguments (vLLM's
and SGLang's forward context, say) must make microbatch k's current while k's stage runs and the step's again
between stages: two calls a stage, none per op. So with hooks and no observer the executor keeps its fast path (one
call per op, nothing else) and adds only these two around each stage; with an observer as well, the hooks enclose
the observer's stage callbacks (the observer sees the stage inside the microbatch's context).

``leave_stage`` is called whatever the stage did, also when an op raised (before the failure is reported), so a hook
that entered a context always leaves it and needs no ``close``.
"""

from __future__ import annotations

__all__ = ["StageHooks"]


class StageHooks:
    """Base class with no-op hooks; override both. Called in schedule order: ``enter_stage(mb, stage)`` before the
    stage's first op, ``leave_stage(mb, stage)`` after its last (or after the op that raised)."""

    def enter_stage(self, mb: int, stage: int) -> None:
        pass

    def leave_stage(self, mb: int, stage: int) -> None:
        pass
