"""Expert compute for each dispatch format, in plain torch: the reference runner every backend's output feeds.

An expert is ``fn(local_expert, rows) -> rows``. The runners group rows by local expert and call it once per expert
with that expert's rows, in arrival order, so every backend feeds every expert the very same matrix.

MASKED off the CPU is capture-safe: no count is read on the host. Three ways, by what the caller can give
(`masked_path` says which one a step takes):

* ``"grouped"``: the experts' weights stacked (`StackedSwiGLU`), bf16, on a Hopper-or-newer GPU (or ``meta``): the
  routed rows are packed expert after expert and run through ``torch.nn.functional.grouped_mm`` with the counts as
  device-side group ends, so the GEMMs do the routed rows' work only, three kernels per layer, as a masked grouped
  GEMM does.
* ``"batched"``: stacked weights otherwise (fp32, an older GPU or torch): one batched GEMM chain over every
  expert's whole ``[slab, H]``, rows beyond its count zeroed. Three kernels, but every expert computes every slab row:
  ``num_experts / top_k`` times the routed rows when slabs hold the step's tokens (2x at top-8 of 16).
* ``"per-expert"``: only ``fn``: each expert on its whole slab, one GEMM chain per expert, rows beyond its count
  zeroed.

On the CPU, where reading the counts costs no device sync, each expert runs on exactly its rows; for a
batch-invariant expert every way gives the same rows. Inside a step that must not read the host
(`tbo.comm.devices.host_reads_forbidden`) the CPU takes the fixed-shape ways too, and NORMAL rows run every local
expert on every received row, the rows that do not name it zeroed (`_run_normal_static`): fixed shapes at
``num_local_experts`` times the routed work, which a decode step of a few rows per rank affords.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from tbo.comm import devices
from tbo.comm.fp8 import dequantize_per_token_group
from tbo.comm.types import DispatchFormat, DispatchOutput

__all__ = ["ExpertFn", "StackedSwiGLU", "masked_path", "run_experts"]

ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class StackedSwiGLU:
    """The local experts' SwiGLU weights, stacked expert-major: ``gate`` and ``up`` ``[E, H, I]``, ``down``
    ``[E, I, H]``, so that expert ``e`` of rows ``x`` is ``(silu(x @ gate[e]) * (x @ up[e])) @ down[e]``.

    What lets the MASKED runner compute all experts in one GEMM chain (or one grouped GEMM) instead of one chain per
    expert. Give it only when ``fn`` computes exactly that (not for batch-invariant experts, whose rows must not
    depend on the GEMM shape).
    """

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor

    def matches(self, hidden: torch.Tensor) -> bool:
        """Whether these weights can take ``hidden``'s rows (same dtype and device, same number of experts)."""
        return (self.gate.dtype == hidden.dtype and self.gate.device == hidden.device
                and self.gate.shape[0] == hidden.shape[0])


#: per (device, dtype): did a probe of grouped_mm run there (decided once, outside any capture)
_GROUPED_OK: dict[tuple[torch.device, torch.dtype], bool] = {}


def _grouped_mm() -> Callable[..., torch.Tensor] | None:
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _grouped_available(hidden: torch.Tensor, w: StackedSwiGLU) -> bool:
    """bf16 with 16-byte-aligned rows, a torch that has grouped_mm, and a device whose kernel reads the group ends
    on the device (Hopper or newer; ``meta`` for the capture-safety proof); probed once per device and dtype."""
    fn = _grouped_mm()
    if fn is None or hidden.dtype != torch.bfloat16 or hidden.shape[-1] % 8 or w.gate.shape[-1] % 8:
        return False
    dev = hidden.device
    if dev.type == "cuda":
        if torch.cuda.get_device_capability(dev) < (9, 0):  # older GPUs: a fallback that reads the ends on the host
            return False
    elif dev.type != "meta":
        return False
    key = (devices.device_key(dev), hidden.dtype)
    if key not in _GROUPED_OK:
        if devices.capturing(dev):  # never probe inside a capture; the warm-up before it decides
            return False
        try:
            a = torch.zeros(16, 16, dtype=hidden.dtype, device=dev)
            fn(a, torch.zeros(2, 16, 16, dtype=hidden.dtype, device=dev),
               offs=torch.tensor([8, 16], dtype=torch.int32, device=dev))
            _GROUPED_OK[key] = True
        except (RuntimeError, NotImplementedError, TypeError):
            _GROUPED_OK[key] = False
    return _GROUPED_OK[key]


def masked_path(hidden: torch.Tensor, stacked: StackedSwiGLU | None = None) -> str:
    """Which way `run_experts` computes MASKED rows ``hidden[E, slab, H]``: ``"counted"`` (the CPU: exactly each
    expert's rows), ``"grouped"``, ``"batched"`` or ``"per-expert"`` (see the module docstring)."""
    if hidden.device.type == "cpu" and not devices.host_reads_forbidden(hidden.device):
        return "counted"
    if stacked is None or not stacked.matches(hidden):
        return "per-expert"
    return "grouped" if _grouped_available(hidden, stacked) else "batched"


def _run_grouped(rows: torch.Tensor, counts: Sequence[int], fn: ExpertFn) -> torch.Tensor:
    out = torch.empty_like(rows)
    offset = 0
    for e, n in enumerate(counts):
        if n:
            out[offset : offset + n] = fn(e, rows[offset : offset + n])
        offset += n
    return out


def _run_masked(hidden: torch.Tensor, counts: Sequence[int], fn: ExpertFn) -> torch.Tensor:
    out = torch.zeros_like(hidden)
    for e, n in enumerate(counts):
        if n:
            out[e, :n] = fn(e, hidden[e, :n])
    return out


def _valid_rows(hidden: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``[E, slab, 1]``: which slab rows hold a routed row (those before the expert's count)."""
    slab = hidden.shape[1]
    return (torch.arange(slab, device=hidden.device) < counts.to(hidden.device).unsqueeze(1)).unsqueeze(-1)


def _run_masked_static(hidden: torch.Tensor, counts: torch.Tensor, fn: ExpertFn) -> torch.Tensor:
    """Every expert on its whole slab, rows at or beyond its count zeroed: fixed shapes, no host read."""
    valid, zero = _valid_rows(hidden, counts), hidden.new_zeros(())
    return torch.stack([torch.where(valid[e], fn(e, hidden[e]).to(hidden.dtype), zero)
                        for e in range(hidden.shape[0])])


def _run_masked_batched(hidden: torch.Tensor, counts: torch.Tensor, w: StackedSwiGLU) -> torch.Tensor:
    """One GEMM chain over every expert's whole slab (``bmm``), rows at or beyond its count zeroed."""
    act = F.silu(torch.bmm(hidden, w.gate)) * torch.bmm(hidden, w.up)
    return torch.where(_valid_rows(hidden, counts), torch.bmm(act, w.down), hidden.new_zeros(()))


def _run_masked_grouped(hidden: torch.Tensor, counts: torch.Tensor, w: StackedSwiGLU) -> torch.Tensor:
    """The routed rows only: packed expert after expert, one grouped GEMM per projection, unpacked into the slabs.

    Fixed shapes and no host read: the packing is a gather by indices computed on the device, and the counts reach
    grouped_mm as device-side group ends. Packed rows beyond the last end are never computed (their values are
    garbage, and are never selected back).
    """
    num_experts, slab, h = hidden.shape
    if num_experts * slab == 0:
        return torch.zeros_like(hidden)
    grouped = _grouped_mm()
    assert grouped is not None
    dev = hidden.device
    counts = counts.to(dev).long().clamp(max=slab)
    ends = torch.cumsum(counts, 0)
    starts = ends - counts
    rows = torch.arange(num_experts * slab, device=dev)
    owner = torch.searchsorted(ends, rows, right=True).clamp(max=num_experts - 1)  # the expert of packed row r
    source = torch.where(rows < ends[-1], owner * slab + rows - starts[owner], torch.zeros_like(rows))
    packed = hidden.reshape(num_experts * slab, h).index_select(0, source)
    offs = ends.to(torch.int32)
    act = F.silu(grouped(packed, w.gate, offs=offs)) * grouped(packed, w.up, offs=offs)
    out = grouped(act, w.down, offs=offs)
    back = (starts.unsqueeze(1) + torch.arange(slab, device=dev)).clamp(max=num_experts * slab - 1)
    return torch.where(_valid_rows(hidden, counts), out[back], hidden.new_zeros(()))


def _run_normal(d: DispatchOutput, fn: ExpertFn) -> torch.Tensor:
    assert d.topk_idx is not None and d.topk_weights is not None
    out = torch.zeros(d.hidden.shape, dtype=torch.float32, device=d.hidden.device)
    for e in range(d.num_local_experts):
        token, slot = torch.nonzero(d.topk_idx == e, as_tuple=True)
        if token.numel():
            y = fn(e, d.hidden[token]).float() * d.topk_weights[token, slot].float().unsqueeze(1)
            out.index_add_(0, token, y)
    return out.to(d.hidden.dtype)


def _run_normal_static(d: DispatchOutput, fn: ExpertFn) -> torch.Tensor:
    """`_run_normal` with fixed shapes and no host read: each local expert on every row, kept (weighted) where the
    row names it. Rows add in expert order, as `_run_normal`'s ``index_add_`` does (a token names an expert once), so
    for a batch-invariant ``fn`` the result is bit for bit `_run_normal`'s; a row naming no local expert is zero."""
    assert d.topk_idx is not None and d.topk_weights is not None
    out = torch.zeros(d.hidden.shape, dtype=torch.float32, device=d.hidden.device)
    zero = out.new_zeros(())
    for e in range(d.num_local_experts):
        mine = d.topk_idx == e  # [rows, top_k]: at most one slot per row
        weight = torch.where(mine, d.topk_weights.float(), zero).sum(dim=1, keepdim=True)
        y = fn(e, d.hidden).float() * weight
        out = out + torch.where(mine.any(dim=1, keepdim=True), y, zero)
    return out.to(d.hidden.dtype)


def run_experts(dispatched: DispatchOutput, fn: ExpertFn, stacked: StackedSwiGLU | None = None) -> torch.Tensor:
    """Apply each local expert to its rows; the result has the layout ``combine_a`` expects for that format.

    NORMAL output is already weighted by ``topk_weights`` (DeepEP normal combine only adds); EXPANDED and MASKED
    outputs are not (their combine applies the weights). ``stacked``: the same experts as stacked SwiGLU weights,
    which lets MASKED rows off the CPU run in one GEMM chain, or as a grouped GEMM (see `masked_path`).
    """
    if dispatched.scales is not None:  # FP8 rows: the plain-torch runner computes in float32
        dispatched = replace(dispatched, hidden=dequantize_per_token_group(dispatched.hidden, dispatched.scales),
                             scales=None)
    if dispatched.format is DispatchFormat.MASKED:
        hidden, counts = dispatched.hidden, dispatched.tokens_per_expert
        path = masked_path(hidden, stacked)
        if path == "grouped":
            return _run_masked_grouped(hidden, counts, stacked)  # type: ignore[arg-type]
        if path == "batched":
            return _run_masked_batched(hidden, counts, stacked)  # type: ignore[arg-type]
        if path == "per-expert":
            return _run_masked_static(hidden, counts, fn)
        return _run_masked(hidden, counts.tolist(), fn)
    if dispatched.format is DispatchFormat.EXPANDED:
        return _run_grouped(dispatched.hidden, dispatched.tokens_per_expert.tolist(), fn)
    if devices.host_reads_forbidden(dispatched.hidden.device):
        return _run_normal_static(dispatched, fn)
    return _run_normal(dispatched, fn)
