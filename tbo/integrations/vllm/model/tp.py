"""Tensor parallelism's all-reduces as tbo's transfers: where a vLLM decoder layer reduces, how tbo defers it, and
the ops that run the deferred reductions (`TensorParallelOps`, which `VllmDecoderLayer` inherits).

Under tensor parallelism every attention block ends in vLLM's ``RowParallelLinear`` (``o_proj``) and every dense MLP
in another (``down_proj``), each with ``reduce_results=True``: the projection computes this rank's partial sum and
all-reduces it over the TP group before it returns, so the device waits for the network twice a layer. A MoE layer's
runner makes the same reduction after its experts (`tbo.integrations.vllm.model.layers.reduce_plan`).

tbo defers them: where the step's strategy runs ``attn_reduce_a/_b`` (``mlp_reduce_a/_b``), the op that calls the
attention (the MLP) runs vLLM's own module with that one projection's ``reduce_results`` off for the call
(`reduce_off`: a scoped change that puts the flag back, whatever the call raises), so that vLLM's kernels compute
the partial sum, bias on rank 0 as ever; the ``_a`` op launches the all-reduce of it through a
`tbo.comm.allreduce.TPAllReduce` over vLLM's TP group (wrapped by `tbo.comm.emulated.EmulatedLink` with ``link``)
and returns; the ``_b`` op waits, so the other microbatch's compute runs while the sum travels. The sum is
element-wise, so the rows a microbatch holds do not change a bit of it: a split step's tokens equal vLLM's.

Which projection reduces is found by structure (`reduction_sites`): the one ``RowParallelLinear`` with
``reduce_results`` inside the attention module, and inside a dense MLP; a module with none or several is refused
by name where its reduction is to be deferred, since tbo would not know which sum to move.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, ContextManager, Iterator

from tbo.core.dataflow import OpFlow, declares
from tbo.core.state import State
from tbo.integrations.vllm.errors import TboConfigError
from tbo.ops import TensorParallelOps as LibraryTensorParallelOps

__all__ = ["REDUCE_OPS", "ReductionSites", "TensorParallelOps", "deferred_by", "reduce_off", "reducing_linears",
           "reduction_sites"]

#: where -> the op that launches its reduction: a strategy that names it defers that reduction
REDUCE_OPS = {"attn": "attn_reduce_a", "mlp": "mlp_reduce_a", "moe": "moe_reduce_a"}


def reducing_linears(module: Any) -> list[tuple[str, Any]]:
    """``(name, module)`` of each of vLLM's ``RowParallelLinear`` inside ``module`` that all-reduces its output
    (``reduce_results`` set, a TP group of more than one rank)."""
    from vllm.model_executor.layers.linear import RowParallelLinear

    return [(name, m) for name, m in module.named_modules() if isinstance(m, RowParallelLinear)
            and m.reduce_results and m.tp_size > 1]


@dataclass(frozen=True)
class ReductionSites:
    """The projections whose all-reduce a layer defers (None: nothing there to defer, TP = 1)."""

    attn: Any  #: the attention's output projection (``o_proj``)
    mlp: Any  #: a dense layer's MLP down projection (``down_proj``); None for a MoE layer (its runner reduces)


def _one(module: Any, what: str, layer_idx: int, layer: Any) -> Any:
    found = reducing_linears(module)
    if len(found) > 1:
        raise TboConfigError(f"layer {layer_idx} ({type(layer).__name__}): tbo cannot defer its {what}'s "
                             f"tensor-parallel reduction: it holds {len(found)} all-reducing row-parallel projections "
                             f"({', '.join(n for n, _ in found)}), and tbo moves one sum per {what}")
    return found[0][1] if found else None


def reduction_sites(layer: Any, attn: Any, ffn: Any, dense: bool, layer_idx: int) -> ReductionSites:
    """Where ``layer`` (its attention module ``attn`` and feed-forward module ``ffn``) all-reduces over TP."""
    return ReductionSites(_one(attn, "attention", layer_idx, layer),
                          _one(ffn, "MLP", layer_idx, layer) if dense else None)


@contextmanager
def reduce_off(linear: Any) -> Iterator[None]:
    """Run vLLM's row-parallel ``linear`` without its all-reduce for the block (its partial sum comes out); the
    flag is put back whatever the block raises, so vLLM's own forward (unsplit steps) reduces as ever."""
    saved = linear.reduce_results
    linear.reduce_results = False
    try:
        yield
    finally:
        linear.reduce_results = saved


def deferred_by(strategy: Any) -> frozenset[str]:
    """The reductions (``"attn"``, ``"mlp"``) ``strategy``'s op list runs as transfers."""
    names = {getattr(op, "__name__", op) for op in strategy.operations}
    return frozenset(where for where, op in REDUCE_OPS.items() if op in names)


def _moe_flow(layer: Any, pair: str, half: str) -> OpFlow:
    """The flow of a MoE layer's ``moe_reduce``/``shared_reduce`` op (``pair``, ``half`` "a" or "b") under vLLM's
    rule: one reduction of the layer's output, launched by the last of the two pairs whose inputs are there (the
    shared pair where the layer has a shared expert, the routed one otherwise); the other pair does nothing."""
    if "moe" not in getattr(layer, "deferred", ()) or pair != ("shared" if layer.has_shared_experts else "moe"):
        return OpFlow()
    if half == "b":
        return OpFlow(takes=f"{pair}_reduce", writes="layer_out")
    return OpFlow(takes=("routed_out", "shared_out") if layer.has_shared_experts else "routed_out",
                  writes=f"{pair}_reduce")


class TensorParallelOps(LibraryTensorParallelOps):
    """The library's reduction ops (`tbo.ops.TensorParallelOps`: attention's and a dense MLP's
    partial sums), counted into the engine's stats, and a MoE layer's output reduced as vLLM's MoE runner reduces
    it: once, the routed part scaled and the shared part added first (``moe_reduce`` and ``shared_reduce`` then
    make one all-reduce between them, `_moe_flow`; the ``output`` op has nothing left to do). Reducing the two
    parts apart would round otherwise than vLLM. The engine sets `reducer` and `deferred` before it binds the
    strategies (the ops' declared flows read `deferred`)."""

    #: the reductions this layer's strategy runs as transfers (`deferred_by`); the others stay inside vLLM's modules
    deferred: frozenset[str] = frozenset()
    sites: ReductionSites = ReductionSites(None, None)
    stats: Any = None
    kind: str = "dense"
    has_shared_experts: bool = False

    def deferring(self, where: str) -> ContextManager[None]:
        """The scope a module of ``where`` runs in: its projection's reduction off where this layer defers it."""
        linear = getattr(self.sites, where)
        return reduce_off(linear) if where in self.deferred and linear is not None else nullcontext()

    def _reducer(self, op: str) -> Any:
        if op.endswith("_a") and self.stats is not None:
            self.stats.tp_reductions += 1
        return super()._reducer(op)

    def _moe_output(self, state: State) -> Any:  # provided by the layer: vLLM's scaled routed + shared output
        raise NotImplementedError

    def _launch_output(self, state: State, pair: str) -> None:
        if _moe_flow(self, pair, "a").writes:
            state.update(**{f"{pair}_reduce": self._reducer(f"{pair}_reduce_a").reduce_a(self._moe_output(state),
                                                                                            f"{pair}_reduce")})

    def _wait_output(self, state: State, pair: str) -> None:
        if _moe_flow(self, pair, "b").writes:
            state.layer_out = self._reducer(f"{pair}_reduce_b").reduce_b(state.pop(f"{pair}_reduce"))

    @declares(lambda layer: _moe_flow(layer, "moe", "a"))
    def op_moe_reduce_a(self, state: State) -> None:
        self._launch_output(state, "moe")

    @declares(lambda layer: _moe_flow(layer, "moe", "b"))
    def op_moe_reduce_b(self, state: State) -> None:
        self._wait_output(state, "moe")

    @declares(lambda layer: _moe_flow(layer, "shared", "a"))
    def op_shared_reduce_a(self, state: State) -> None:
        self._launch_output(state, "shared")

    @declares(lambda layer: _moe_flow(layer, "shared", "b"))
    def op_shared_reduce_b(self, state: State) -> None:
        self._wait_output(state, "shared")
