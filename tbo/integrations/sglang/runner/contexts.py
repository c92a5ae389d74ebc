"""Each microbatch's ops run under that microbatch's own SGLang forward context.

SGLang's layers find per-step state outside their arguments: the ForwardContext (the attention backend and the MoE
runner's ``moe_num_token_non_padded``) and the current ForwardBatch (`set_forward_batch`, read by eager regions of
the attention). `MicrobatchContexts`, the executor's `StageHooks`, enters microbatch k's (its own child ForwardBatch
in both, and its own attention backend, planned for that batch: `tbo.integrations.sglang.runner.attention`) when one
of its stages starts and leaves it when the stage ends (also when an op raised), so the step's own
context is current between stages. Being stage hooks and not an `Observer`, it keeps a split step on the
executor's fast path.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any, Sequence

from tbo.core.stage_hooks import StageHooks

__all__ = ["MicrobatchContexts"]


class MicrobatchContexts(StageHooks):
    """Makes microbatch k's forward context (with ``backends[k]``, its attention backend) and batch current for the
    duration of each of its stages."""

    def __init__(self, batches: Sequence[Any], backends: Sequence[Any]) -> None:
        from dataclasses import replace

        from sglang.srt.model_executor.forward_context import forward_context, get_forward_context
        from sglang.srt.model_executor.runner_utils.forward_batch import set_forward_batch

        self._ctx, self._set_batch = forward_context, set_forward_batch
        step = get_forward_context()  # the step's, which the runner entered
        self.batches = list(batches)
        #: each microbatch's context: the step's, with microbatch k's own attention backend
        self._contexts = [replace(step, attn_backend=backend) for backend in backends]
        self._active: ExitStack | None = None

    def enter_stage(self, mb: int, stage: int) -> None:
        with ExitStack() as stack:  # the first context left again if the second cannot be entered
            stack.enter_context(self._ctx(self._contexts[mb], forward_batch=self.batches[mb]))
            stack.enter_context(self._set_batch(self.batches[mb]))
            self._active = stack.pop_all()

    def leave_stage(self, mb: int, stage: int) -> None:
        active, self._active = self._active, None
        if active is not None:
            active.close()
