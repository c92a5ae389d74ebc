"""Tensor parallelism for the reference decoder: each rank holds a slice of every layer, and the row-parallel
outputs are summed over the group by a `tbo.comm.allreduce.TPAllReduce`.

The split is Megatron's: attention heads are divided among the ranks (``wq``/``wk``/``wv`` column-parallel by head,
``o_proj`` row-parallel), and every FFN's intermediate width (the dense MLP, each routed expert, the shared expert:
gate and up column-parallel, down row-parallel). The router, the norms, the embedding and the head are replicated.
Each rank's attention output, MLP output, routed output and shared output is then a partial sum; the layer's
``forward`` sums each over the group at once (blocking), its ops through ``attn_reduce_a``/``_b``, ... as
transfers (`tbo.ops.TensorParallelOps`), so one microbatch's reduction overlaps the other's compute.

Weights are generated whole from the seeded generators and then sliced, so the ranks' slices are exactly the
one-rank model's weights. Forward and ops sum the same partial sums in the same groups, and an element-wise sum
over two ranks does not depend on which rows travel together: the overlapped run equals ``forward()`` bit for bit at
TP = 2. (Over more ranks it depends on the reduction's order per element: see docs/strategies.md.)
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["shard_layer", "tp_reduced", "tp_required_ops"]


def _cols(w: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    n = w.shape[-1] // tp
    return w[..., rank * n:(rank + 1) * n].contiguous()


def _rows(w: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    n = w.shape[-2] // tp
    return w[..., rank * n:(rank + 1) * n, :].contiguous()


def _swiglu_slice(ws: tuple[torch.Tensor, ...], rank: int, tp: int) -> tuple[torch.Tensor, ...]:
    gate, up, down = ws
    return _cols(gate, rank, tp), _cols(up, rank, tp), _rows(down, rank, tp)


def tp_required_ops(layer: Any) -> tuple[str, ...]:
    """The reduce ops a sharded layer cannot run without (its outputs would be one rank's part)."""
    ops = ["attn_reduce_a", "attn_reduce_b"]
    if layer.kind == "dense":
        ops += ["mlp_reduce_a", "mlp_reduce_b"]
    else:
        ops += ["moe_reduce_a", "moe_reduce_b"]
        if layer.has_shared_experts:
            ops += ["shared_reduce_a", "shared_reduce_b"]
    return tuple(ops)


def shard_layer(layer: Any, reducer: Any) -> None:
    """Keep ``layer``'s slice for ``reducer``'s rank (see the module docstring), in place, and set its ``reducer``,
    ``num_local_heads`` and ``required_ops``. A reducer over one rank slices nothing (its reductions are the
    identity). Widths that do not divide by the group's size are a ValueError naming them."""
    c = layer.config
    layer.reducer = reducer
    layer.num_local_heads = c.num_heads
    tp = 1 if reducer is None else reducer.num_ranks
    if tp == 1:
        return
    rank = reducer.rank
    widths = {"num_heads": c.num_heads,
              "dense_intermediate" if layer.kind == "dense" else "moe_intermediate":
                  c.dense_intermediate if layer.kind == "dense" else c.moe_intermediate}
    bad = [f"{name}={value}" for name, value in widths.items() if value % tp]
    if bad:
        raise ValueError(f"tensor parallel {tp}: {', '.join(bad)} not divisible by the group's {tp} ranks")
    if layer.kind == "moe" and layer.backend.num_ranks > 1:
        raise ValueError(f"{layer!r}: tensor-parallel experts need a one-rank expert backend (dispatch and combine "
                         f"local); got {layer.backend!r} over {layer.backend.num_ranks} ranks")
    layer.num_local_heads = c.num_heads // tp
    layer.wq, layer.wk, layer.wv = (_cols(w, rank, tp) for w in (layer.wq, layer.wk, layer.wv))
    layer.wo = _rows(layer.wo, rank, tp)
    if layer.kind == "dense":
        layer.mlp_w = _swiglu_slice(layer.mlp_w, rank, tp)
    else:
        layer.experts_w = _swiglu_slice(layer.experts_w, rank, tp)
        if layer.shared_w is not None:
            layer.shared_w = _swiglu_slice(layer.shared_w, rank, tp)
    layer.required_ops = tp_required_ops(layer)


def tp_reduced(layer: Any, x: torch.Tensor, what: str) -> torch.Tensor:
    """``x`` summed over ``layer``'s TP group now (the plain forward's blocking reduction; the ops' is a transfer);
    ``x`` itself without a reducer."""
    reducer = getattr(layer, "reducer", None)
    return x if reducer is None else reducer.reduce_b(reducer.reduce_a(x, what))
