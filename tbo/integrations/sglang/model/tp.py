"""Tensor parallelism's all-reduces inside SGLang as tbo's transfers: where an SGLang layer's sums are completed, and
the ops that launch them (``*_reduce_a``) and wait for them (``*_reduce_b``), so that the other microbatch's compute
runs while a sum travels.

SGLang 0.5.23 builds its layers from stage boundaries (``attn_boundary``, ``ffn_boundary``): the attention's
``o_proj`` and the FFN (a dense MLP's ``down_proj``, a MoE block's experts) leave partial sums, and the boundaries
complete them over the TP group. Where is fixed when the model is built, not per call:

* the attention's output always owes its sum, and the FFN stage's input step, bound at construction, completes it
  inside ``ffn_boundary.prepare`` with SGLang's TP ``GroupCoordinator.all_reduce`` before the residual add and the
  norm. There is no way to hand that step a sum already made, so tbo's ops launch the all-reduce of a copy of the
  partial sum (``attn_reduce_a``), wait for it (``attn_reduce_b``), and run ``ffn_boundary.prepare`` under
  `summed_by`: for that call only, SGLang's all-reduce of exactly that partial tensor (the object, never an equal
  one) returns the sum tbo made; every other all-reduce is SGLang's. If SGLang's step does not call it (a fused
  all-reduce + norm kernel on a GPU took the partial itself), the partial was summed by SGLang, the tokens are
  still SGLang's, and the miss is counted (``tp.attn_sums_by_sglang`` in ``stats_file``), never hidden;
* the FFN's output is summed in the exit (``ffn_boundary.finish``), or carried to the next layer's input; SGLang's
  own contract for an output whose sum a kernel already made is ``ffn_boundary.complete_now(..., already_reduced=
  True)`` (its own two-batch overlap's postprocess op uses ``complete_now``), so tbo sums the FFN's output itself
  (``moe_reduce_a/_b``, ``mlp_reduce_a/_b``) and hands it over that way: the residual add and the norm that follow
  are SGLang's, in the same order as when the next layer completes the sum.

Every rank runs the same ops in the same order on the same batch (SGLang hands each TP rank the same
ForwardBatch, and the split is a function of that batch: `tbo.integrations.sglang.step.batch.decide_batch`), so
the collectives match. The sum of two ranks' partials is one rounding whatever the all-reduce's algorithm, so at
TP = 2 the tokens equal SGLang's bit for bit; over more ranks the order of the additions is the collective's
(tbo's NCCL or gloo all-reduce, where SGLang may run its custom all-reduce).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from tbo.core.dataflow import OpFlow, declares
from tbo.core.state import State
from tbo.ops import TensorParallelOps as LibraryTensorParallelOps

__all__ = ["ReducedPartial", "TensorParallelOps", "deferred_by", "summed_by", "tp_coordinators", "tp_reducer"]

logger = logging.getLogger("sglang.tbo")

#: where -> the op that launches its reduction: a strategy that names it defers that reduction
REDUCE_OPS = {"attn": "attn_reduce_a", "mlp": "mlp_reduce_a", "moe": "moe_reduce_a"}


def deferred_by(strategy: Any) -> frozenset[str]:
    """The reductions (``"attn"``, ``"mlp"``, ``"moe"``) ``strategy``'s op list runs as tbo's transfers."""
    names = {getattr(op, "__name__", op) for op in strategy.operations}
    return frozenset(where for where, op in REDUCE_OPS.items() if op in names)


def tp_coordinators() -> tuple[Any, ...]:
    """SGLang's GroupCoordinators an attention output's sum may be completed over: the TP group and the attention
    TP group (the same ranks without attention DP, which tbo refuses)."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    out = [parallel.tp_group]
    attn = getattr(parallel, "attn_tp_group", None)
    if attn is not None and attn is not parallel.tp_group:
        out.append(attn)
    return tuple(out)


def tp_reducer(comm_timeout_s: float, link: str | None) -> tuple[Any, Any]:
    """``(reducer, raw)``: tbo's `TPAllReduce` over SGLang's TP group, with the deadline ``comm_timeout_s``, inside
    an `EmulatedLink` where ``link`` is set; ``raw`` is the `TPAllReduce` itself (its ``launched`` count).

    The group is the one SGLang's own all-reduce of a layer's sum uses: the TP GroupCoordinator's device group
    (gloo on a CPU, where SGLang reduces CPU tensors over it when its shared-memory kernel is not there; NCCL on
    GPUs). Not its CPU group: SGLang's scheduler broadcasts requests over that one, from another thread where the
    overlap scheduler runs, and two threads' collectives on one group could meet in another order on each rank."""
    from sglang.srt.distributed import get_tp_group

    from tbo.comm.allreduce import TPAllReduce
    from tbo.comm.emulated import EmulatedLink

    raw = TPAllReduce(get_tp_group().device_group, timeout_s=comm_timeout_s)
    return (raw if link is None else EmulatedLink.from_spec(raw, link)), raw


@contextmanager
def summed_by(coordinators: tuple[Any, ...], partial: torch.Tensor, total: torch.Tensor) -> Iterator[list[int]]:
    """Within the block, ``coordinator.all_reduce(partial)`` (that tensor object only) returns ``total`` on each of
    ``coordinators``; any other all-reduce is the coordinator's own. An instance attribute, removed on exit whatever
    the block raises, so SGLang's class is never changed. Yields a list that gets one entry per intercepted call."""
    used: list[int] = []
    saved = []
    for group in coordinators:
        own = group.__dict__.get("all_reduce")  # an instance attribute already there (none in SGLang 0.5.23)
        original = group.all_reduce

        def all_reduce(x: torch.Tensor, *args: Any, _original: Any = original, **kwargs: Any) -> torch.Tensor:
            if x is partial and not args and not kwargs:
                used.append(1)
                return total
            return _original(x, *args, **kwargs)

        saved.append((group, own))
        group.all_reduce = all_reduce
    try:
        yield used
    finally:
        for group, own in saved:
            if own is None:
                del group.all_reduce
            else:
                group.all_reduce = own


class ReducedPartial:
    """An attention output whose sum tbo made: the partial sum SGLang's boundary is handed (``partial``) and the
    sum it stands for (``total``)."""

    __slots__ = ("partial", "total")

    def __init__(self, partial: torch.Tensor, total: torch.Tensor) -> None:
        self.partial, self.total = partial, total


class TensorParallelOps(LibraryTensorParallelOps):
    """The reduction ops of an SGLang layer: the library's pairs (an FFN output summed in place), the attention's
    pair on a copy of the partial sum (see the module docstring), and ``routed_experts``: dispatch, SGLang's experts
    and combine in one op, for experts sharded over the TP ranks (each computes every expert's slice: no row crosses
    ranks, nothing to overlap there; under expert parallelism the rows do cross, without overlap). The engine sets
    `reducer`, `deferred` and `coordinators` before it binds the strategies (the ops' flows read `deferred`)."""

    #: the reductions this layer's strategy runs as transfers (`deferred_by`); the others stay SGLang's
    deferred: frozenset[str] = frozenset()
    #: SGLang's GroupCoordinators `summed_by` answers for (`tp_coordinators`)
    coordinators: tuple[Any, ...] = ()
    #: attention sums SGLang made itself though tbo had made them (a fused kernel took the partial): see `summed_by`
    attn_sums_by_sglang: int = 0
    stats: Any = None

    def _reducer(self, op: str) -> Any:
        if op.endswith("_a") and self.stats is not None:
            self.stats.tp_reductions += 1
        return super()._reducer(op)

    @declares(takes="attn_out", writes="attn_reduce")
    def op_attn_reduce_a(self, state: State) -> None:
        partial = state.pop("attn_out")
        # a copy: SGLang's boundary is handed the partial, which a fused kernel may still sum itself
        state.attn_reduce = (partial, self._reducer("attn_reduce_a").reduce_a(partial.clone(), "attn_reduce"))

    @declares(takes="attn_reduce", writes="attn_out")
    def op_attn_reduce_b(self, state: State) -> None:
        partial, flight = state.pop("attn_reduce")
        state.attn_out = ReducedPartial(partial, self._reducer("attn_reduce_b").reduce_b(flight))

    def prepare_ffn_input(self, attn_out: Any, fb: Any) -> Any:
        """The FFN's input from the attention's output (a tensor SGLang sums, or a `ReducedPartial` tbo summed):
        SGLang's ``attn_boundary.finish`` and ``ffn_boundary.prepare``."""
        layer = self.layer  # type: ignore[attr-defined]
        if not isinstance(attn_out, ReducedPartial):
            return layer.ffn_boundary.prepare(layer.attn_boundary.finish(attn_out, fb), fb)
        handle = layer.attn_boundary.finish(attn_out.partial, fb)
        with summed_by(self.coordinators, attn_out.partial, attn_out.total) as used:
            out = layer.ffn_boundary.prepare(handle, fb)
        if not used and attn_out.partial.numel():
            self.attn_sums_by_sglang += 1
            if self.attn_sums_by_sglang == 1:
                logger.warning("tbo: %r: SGLang completed the attention's tensor-parallel sum itself (a fused "
                               "kernel?): tokens are SGLang's, but that reduction was not overlapped", self)
        return out

    def finish_ffn_output(self, out: torch.Tensor, fb: Any) -> Any:
        """The FFN's output handed to SGLang: summed by tbo (``complete_now``, already reduced) where this layer's
        strategy reduces it, else left to SGLang's exit (``finish``)."""
        boundary = self.layer.ffn_boundary  # type: ignore[attr-defined]
        if self.deferred & {"mlp", "moe"}:
            return boundary.complete_now(out, fb, already_reduced=True)
        return boundary.finish(out, fb)

    @declares(lambda layer: OpFlow() if layer.kind != "moe" else
              OpFlow(reads="mlp_in", takes="topk", writes=("routed_out", "mlp_shape")) if layer.has_shared_experts
              else OpFlow(takes=("mlp_in", "topk"), writes=("routed_out", "mlp_shape")))
    def op_routed_experts(self, state: State) -> None:
        """Dispatch, the experts and combine, nothing yielded between: each TP rank computes every expert's slice,
        so the routed output is a partial sum (``moe_reduce_a``/``_b`` sum it). A layer's shared expert reads the
        MLP input after it."""
        shared = self.has_shared_experts
        x = state.mlp_in if shared else state.pop("mlp_in")
        state.mlp_shape = x.shape
        backend = self.backend  # type: ignore[attr-defined]
        dispatched = backend.dispatch_b(self._dispatch_a(x, state.pop("topk")))  # type: ignore[attr-defined]
        out, handle = self.run_experts(dispatched, x if shared else None)  # type: ignore[attr-defined]
        state.routed_out = self._routed(backend.combine_b(backend.combine_a(out, handle)),  # type: ignore
                                        x.shape)
