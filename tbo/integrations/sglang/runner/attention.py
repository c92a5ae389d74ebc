"""Each microbatch's attention runs on its own SGLang attention backend, planned for that microbatch's batch.

SGLang's attention backends (Triton, FlashInfer, FA3, the CPU AMX one) plan per batch: ``init_forward_metadata(fb)``
computes index arrays, split counts and kernel plans for the whole ForwardBatch and keeps them on the backend
(``forward_metadata``), and every layer's ``forward`` reads them back. The runner plans the step's backend for the
step's batch before the model runs; a microbatch's attention with that plan would read the whole batch's rows. So a
split step gives microbatch k a backend of its own, made at engine start by SGLang's own builder
(``get_attention_backend``: the same backend class, pools and options as the runner's), planned for k's child batch
once per step before any layer runs, and made current in k's forward context by `MicrobatchContexts`. That is SGLang's
own two-batch overlap's contract (``TboAttnBackend``: a primary backend for the step and one child per microbatch,
each planned for its child batch), for any number of microbatches.

The backends are made for the most microbatches a step can have (the split's count, or the adaptive split's largest):
on a GPU each holds its own buffers, allocated at start and not in a step. Only the backends named in
`ATTENTION_BACKENDS` are admitted (`check_attention`).
"""

from __future__ import annotations

from typing import Any, Sequence

from tbo.integrations.sglang.errors import refuse

__all__ = ["ATTENTION_BACKENDS", "MicrobatchAttention", "check_attention"]

#: SGLang attention backends tbo runs, each microbatch on its own backend planned for its batch: ``torch_native`` and
#: ``triton`` (its kernels in Triton's interpreter) run in this project's tests on a CPU; ``intel_amx`` (CPUs with
#: AMX), ``fa3`` and ``flashinfer`` (CUDA) plan and read their metadata by the same contract and are not run there
ATTENTION_BACKENDS = ("torch_native", "triton", "intel_amx", "fa3", "flashinfer")


def check_attention(server_args: Any, runner: Any = None) -> None:
    """Refuse, by name, an attention backend tbo does not plan per microbatch: the prefill and decode backends the
    runner resolved (``--prefill-attention-backend`` / ``--decode-attention-backend`` may name others than
    ``--attention-backend``), or before there is a runner, SGLang's ``attention_backend`` where one is named (None:
    SGLang chooses per device and model, and the runner's resolved choice is checked once it is made)."""
    resolved = [(f"{attr.split('_', 1)[0]} attention backend", getattr(runner, attr, None))
                for attr in ("prefill_attention_backend_str", "decode_attention_backend_str")]
    named = [x for x in resolved if x[1] is not None] or [
        ("attention_backend", getattr(server_args, "attention_backend", None))]
    for what, backend in named:
        if backend is None and runner is None:
            continue
        if backend not in ATTENTION_BACKENDS:
            refuse(f"SGLang's {what}={backend!r}", ", ".join(map(repr, ATTENTION_BACKENDS)),
                   "tbo gives each microbatch its own attention backend planned for its batch, and this backend "
                   "is not wired to that yet (DeepSeek's MLA runs on 'triton': docs/sglang.md, 'Attention backends')")


class MicrobatchAttention:
    """The per-microbatch attention backends of one runner; ``plan`` readies them for a split step's child batches."""

    def __init__(self, runner: Any, count: int) -> None:
        from sglang.srt.model_executor.model_runner_components.attention_backend_setup import get_attention_backend

        primary = runner.attn_backend
        self.backends = [get_attention_backend(model_runner=runner) for _ in range(count)]
        made = {type(b).__name__ for b in self.backends}
        if made != {type(primary).__name__}:  # SGLang's builder resolved other options than the runner's
            raise RuntimeError(f"tbo made attention backends {sorted(made)} for the microbatches, but the runner "
                               f"runs {type(primary).__name__}")
        translator = getattr(runner, "kv_index_translator", None)
        if translator is not None:  # as the runner binds its own: layers read the translator off the current backend
            translator.bind_and_verify_backends(self.backends)
        self.name = type(primary).__name__
        self.planned = 0  #: child batches planned (proof that split steps used their own backends)

    def plan(self, batches: Sequence[Any]) -> list[Any]:
        """Plan backend k for child batch k (a batch without requests is not planned: nothing of it attends), and
        return the backends in microbatch order."""
        if len(batches) > len(self.backends):
            raise RuntimeError(f"a split step of {len(batches)} microbatches, but tbo made attention backends for "
                               f"{len(self.backends)}")
        for backend, fb in zip(self.backends, batches):
            if fb.batch_size > 0:
                backend.init_forward_metadata(fb)
                self.planned += 1
        return self.backends[:len(batches)]

    def report(self) -> dict[str, Any]:
        """For ``stats_file``: the backend's class, how many were made, and how many child batches were planned."""
        return {"backend": self.name, "microbatch_backends": len(self.backends), "planned": self.planned}
