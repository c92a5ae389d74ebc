"""One-GPU workloads: the reference model over a `CopyEngineLink`, single batch vs TBO, eager vs CUDA graph.

What `examples/demo.py --device cuda` and ``benchmarks/gpu.py`` measure, so their figures mean the same thing. The
model keeps a `StaticKVCache`; decode steps go through a `GraphRunner` (captured per batch-size bucket, or eager),
prefill steps are captured once per shape. Experts are local, behind a copy-engine link whose transfers carry the
bytes a real expert-parallel deployment would send (FP8 dispatch, BF16 combine at top-8 of hidden 7168 by
default), so TBO has a real transfer to hide on one GPU.

Steps are timed by CUDA events around them (on a CPU, by ``perf_counter``), with the link's per-transfer timing
events off (each transfer would record four, and TBO makes twice the transfers: a bias against it); they are on only
inside `GpuWorkload.trace`, which traces a step with ``Tracer(cuda=True)``. A *front-loaded* trace first parks the GPU
(``torch.cuda._sleep``) so the CPU queues the whole step before the GPU starts it: its op spans are then the GPU's
own time, what a replayed graph runs at, without the launch gaps of eager. Whether that worked is checked, not
assumed (`FrontLoad`): the launch queue is finite, and when the CPU cannot queue the whole step before the GPU wakes,
the spans are CPU-paced again.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from tbo.comm import CopyEngineLink, DispatchFormat, LocalBackend
from tbo.models import ModelConfig, ReferenceModel, StaticAttentionMetadata
from tbo.runtime.cuda_graph import CudaGraphCapturer, EagerCapturer
from tbo.split import ForwardMode, SplitPlan, SplitPolicy
from tbo.tools.trace import Trace, Tracer, traced

__all__ = ["GpuShape", "GpuWorkload", "Timing", "FrontLoad", "POLICY", "tolerance", "max_diff", "traced_step",
           "sleep_cycles_per_ms"]

#: Split whenever a step can be split: the workloads measure what overlap gives, not where the threshold is.
POLICY = SplitPolicy(decode_token_threshold=2, prefill_token_threshold=4)


@dataclass(frozen=True)
class GpuShape:
    """The model and link of a one-GPU run. The default is DeepSeek-shaped at hidden 4096, 8 layers, KV context
    2048; attention is 4 heads of 128 (a KV footprint per token like DeepSeek's MLA: 576 cached values), so 1024
    sequences of 2048 cached tokens fit in one GPU's memory."""

    family: str = "deepseek"
    hidden_size: int = 4096
    num_layers: int = 8
    num_heads: int = 4
    head_dim: int = 128
    num_experts: int = 16
    top_k: int = 8
    moe_intermediate: int = 512
    dense_intermediate: int = 4096
    vocab_size: int = 8192
    context: int = 2048
    dtype: str = "bfloat16"
    batch_invariant: bool = False
    dispatch_bytes_per_token: int | None = 8 * 7168  #: FP8 dispatch, top-8, hidden 7168
    combine_bytes_per_token: int | None = 8 * 7168 * 2  #: BF16 combine back
    seed: int = 0

    @classmethod
    def tiny(cls, **overrides: Any) -> "GpuShape":
        """A small model: the CPU smoke run, and a quick demo."""
        return cls(**{"hidden_size": 64, "num_layers": 2, "num_heads": 2, "head_dim": 16, "num_experts": 8,
                      "top_k": 2, "moe_intermediate": 64, "dense_intermediate": 128, "vocab_size": 256,
                      "context": 64, "dtype": "float32", "dispatch_bytes_per_token": None,
                      "combine_bytes_per_token": None, **overrides})

    def config(self) -> ModelConfig:
        make = {"deepseek": ModelConfig.deepseek_v3_tiny, "qwen3_moe": ModelConfig.qwen3_moe_tiny}[self.family]
        return make(hidden_size=self.hidden_size, num_layers=self.num_layers, num_heads=self.num_heads,
                    head_dim=self.head_dim, num_experts=self.num_experts, top_k=self.top_k,
                    moe_intermediate=self.moe_intermediate, dense_intermediate=self.dense_intermediate,
                    vocab_size=self.vocab_size, dtype=self.dtype, batch_invariant=self.batch_invariant,
                    seed=self.seed)

    def describe(self) -> str:
        c = self.config()
        return (f"{self.family}: hidden {c.hidden_size}, {c.num_layers} layers ({c.first_k_dense} dense), "
                f"{c.num_heads}x{c.head_dim} attention, {c.num_experts} experts top-{c.top_k} of width "
                f"{c.moe_intermediate}, {c.dtype}, KV context {self.context}; copy-engine link "
                f"{self.dispatch_bytes_per_token or 'payload'} B/token out, "
                f"{self.combine_bytes_per_token or 'payload'} B/token back")


def tolerance(dtype: str | torch.dtype) -> float:
    """The stated tolerance of a result against eager single batch, relative to the reference's largest magnitude:
    2% in bf16/fp16 (TBO runs every GEMM on half the rows, rounding differently), 1e-4 in fp32 (fast mode)."""
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return 2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4


def max_diff(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """``(max |got - want|, max |want|)``, in float32; NaN when either holds a non-finite value."""
    got, want = got.float(), want.float()
    if not (torch.isfinite(got).all() and torch.isfinite(want).all()):
        return float("nan"), float("nan")
    return float((got - want).abs().max()), float(want.abs().max())


@dataclass(frozen=True)
class FrontLoad:
    """Did a front-loaded trace work: was the whole step queued (``queued_s``, host) before the parked GPU woke and
    started it (``woke_s``, an event after the sleep)? Both on the trace's clock. If not, the CPU was still
    launching, or was blocked on a full launch queue, while the GPU ran: the "GPU" spans are CPU-paced."""

    woke_s: float
    queued_s: float

    @property
    def ok(self) -> bool:
        return self.queued_s < self.woke_s

    def __str__(self) -> str:
        gap = abs(self.woke_s - self.queued_s) * 1e3
        return (f"front-loaded: the step was queued {gap:.1f} ms before the GPU woke" if self.ok else
                f"NOT front-loaded: the CPU was still queuing the step {gap:.1f} ms after the GPU woke (launch queue "
                "full, or too short a sleep): its spans are CPU-paced")

    @classmethod
    def of(cls, trace: Trace) -> "FrontLoad | None":
        """The verdict a front-loaded trace carries (None: the trace was not front-loaded, e.g. without a GPU)."""
        if "gpu_woke" not in trace.marks or "queued" not in trace.marks:
            return None
        return cls(trace.marks["gpu_woke"], trace.marks["queued"])


_SLEEP_CYCLES_PER_MS: dict[int, float] = {}


def sleep_cycles_per_ms() -> float:
    """How many ``torch.cuda._sleep`` cycles make a millisecond on the current GPU (measured once per device)."""
    device = torch.cuda.current_device()
    if device not in _SLEEP_CYCLES_PER_MS:
        cycles = 10_000_000
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _SLEEP_CYCLES_PER_MS[device] = cycles / max(start.elapsed_time(end), 1e-3)
    return _SLEEP_CYCLES_PER_MS[device]


def traced_step(tracer: Tracer, run: Callable[[Tracer], Any], label: str, tokens: Sequence[int],
                front_load_ms: float = 0.0) -> Trace:
    """Trace one eager step, ``run(observer)``, with ``tracer`` (a new trace, the origin taken again).

    ``front_load_ms`` on a CUDA tracer: park the GPU that long first (``torch.cuda._sleep``) so the CPU queues the
    whole step ahead of it; the trace then carries the check (`FrontLoad.of`): an event right after the sleep (when
    the GPU woke) and the host time once the step was queued.
    """
    parked = front_load_ms > 0 and tracer.cuda
    cycles = int(sleep_cycles_per_ms() * front_load_ms) if parked else 0  # calibrated once, before the trace
    tracer.begin(label + (", front-loaded" if parked else ""), tokens)  # synchronises on a GPU
    if parked:
        torch.cuda._sleep(cycles)
        tracer.mark("gpu_woke")
    run(tracer)
    if parked:
        tracer.mark("queued", time.perf_counter())
    return tracer.finish()


@dataclass
class Timing:
    """Step times in milliseconds of one mode, and its traced steps."""

    ms: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.ms)


@dataclass
class _Prefill:
    ids: torch.Tensor
    meta: StaticAttentionMetadata
    plan: SplitPlan | None
    graphs: dict[bool, Any]


class GpuWorkload:
    """The model, its link, its static cache and its graph runners on one device.

    ``decode_sizes``: the decode buckets (requests per step); ``prefill``: ``(sequences, length)`` shapes.
    ``capture``: use CUDA graphs (False: every "graph" mode runs eager). On a CPU the graphs are `EagerCapturer`'s
    (the smoke run): the same buffers, padding and plans, re-run instead of replayed.
    """

    def __init__(self, shape: GpuShape, device: str | torch.device, decode_sizes: Sequence[int],
                 prefill: Sequence[tuple[int, int]] = (), capture: bool = True) -> None:
        self.shape, self.device = shape, torch.device(device)
        self.cuda = self.device.type == "cuda"
        config = shape.config()
        self.strategy = {"decode": f"{shape.family}_decode", "prefill": f"{shape.family}_prefill"}
        max_tokens = max([*decode_sizes, *(s * n for s, n in prefill)])
        slots = max([*decode_sizes, *(s for s, _ in prefill)])
        # a capacity of the step's tokens never overflows (top-k picks distinct experts): capture-safe, no host read
        self.local = LocalBackend(config.num_experts, DispatchFormat.MASKED, masked_capacity=max_tokens)
        # timing events only inside trace(): timed steps must not record four events per transfer
        self.link = CopyEngineLink(self.local, dispatch_bytes_per_token=shape.dispatch_bytes_per_token,
                                   combine_bytes_per_token=shape.combine_bytes_per_token, timing=False)
        self.model = ReferenceModel(config, self.link, self.device)
        if any(n > shape.context for _, n in prefill):
            raise ValueError(f"prefill lengths {[n for _, n in prefill]} exceed the KV context {shape.context}")
        self.cache = self.model.static_cache(slots, shape.context)
        self.tracer = Tracer(cuda=self.cuda)
        self.capturer: Any = (CudaGraphCapturer() if self.cuda else EagerCapturer()) if capture else None
        # decode request t sits in slot t (decode_inputs): attention reads the cache by a view, not a gathered copy
        runner = dict(policy=POLICY, capture=capture, capturer=self.capturer, slots_in_order=True)
        self.graphs = self.model.graph_runner(self.cache, self.strategy["decode"], decode_sizes, **runner)
        self.eager = self.model.graph_runner(self.cache, self.strategy["decode"], decode_sizes, policy=POLICY,
                                             capture=False, slots_in_order=True)
        self.decode_sizes = sorted(decode_sizes)
        self._prefill: dict[tuple[int, int], _Prefill] = {}

    # ---- batches --------------------------------------------------------------------------------------------------
    def decode_inputs(self, n: int, seed: int = 0) -> dict[str, torch.Tensor]:
        """``n`` requests, each one new token in its own slot at a position in the second half of the context."""
        g = torch.Generator().manual_seed(seed)
        ctx = self.shape.context
        return {"ids": torch.randint(0, self.shape.vocab_size, (n,), generator=g).to(self.device),
                "positions": torch.randint(ctx // 2, ctx, (n,), generator=g).to(self.device),
                "slots": torch.arange(n).to(self.device)}

    def prefill_batch(self, num_seqs: int, length: int, seed: int = 0) -> _Prefill:
        key = (num_seqs, length)
        if key not in self._prefill:
            g = torch.Generator().manual_seed(seed)
            ids = torch.randint(0, self.shape.vocab_size, (num_seqs * length,), generator=g).to(self.device)
            lens = [length] * num_seqs
            meta = StaticAttentionMetadata.build(range(num_seqs), lens, [0] * num_seqs, self.cache.scratch_slot,
                                                 self.device)
            plan = POLICY.plan(ForwardMode.EXTEND, num_seqs * length, lens)
            self._prefill[key] = _Prefill(ids, meta, plan, {})
        return self._prefill[key]

    def plan(self, mode: str, n: int, length: int = 1) -> SplitPlan | None:
        if mode == "decode":
            return POLICY.plan(ForwardMode.DECODE, n)
        return self.prefill_batch(n, length).plan

    # ---- steps ------------------------------------------------------------------------------------------------
    def step(self, mode: str, n: int, tbo: bool, graph: bool, length: int = 1) -> Callable[[], torch.Tensor]:
        """A step function: decode of ``n`` requests, or prefill of ``n`` sequences of ``length`` tokens."""
        if mode == "decode":
            inputs = self.decode_inputs(n)
            runner = self.graphs if graph else self.eager
            return lambda: runner.run(inputs, tbo=tbo)
        batch = self.prefill_batch(n, length)
        plan = batch.plan if tbo else None

        def eager() -> torch.Tensor:
            return self.model.forward_tbo(batch.ids, batch.meta, self.cache, self.strategy["prefill"], plan)

        if not graph or self.capturer is None:
            return eager
        if tbo not in batch.graphs:
            batch.graphs[tbo] = self.capturer.capture(eager)
        replay, out = batch.graphs[tbo]

        def replayed() -> torch.Tensor:
            replay()
            return out

        return replayed

    def time(self, fns: dict[str, Callable[[], Any]], repeats: int, warmup: int = 2) -> dict[str, Timing]:
        """Milliseconds per step of each function, measured round-robin (a slow spell hits every mode alike)."""
        for fn in fns.values():
            for _ in range(warmup):
                fn()
        out = {name: Timing([]) for name in fns}
        for _ in range(repeats):
            for name, fn in fns.items():
                out[name].ms.append(self._timed(fn))
        return out

    def _timed(self, fn: Callable[[], Any]) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    # ---- traces -----------------------------------------------------------------------------------------------
    def trace(self, mode: str, n: int, tbo: bool, length: int = 1, front_load: bool = False,
              sleep_ms: float = 200.0) -> Trace:
        """One eager step traced with CUDA events (ops, transfers, waits on one clock); the link's timing events
        are on for this step only.

        ``front_load``: park the GPU for ``sleep_ms`` first so the CPU queues the whole step ahead of it; the op
        spans are then the GPU's own time (what a replayed graph runs at), not the CPU's launch rate. The trace
        carries the check (`FrontLoad.of`); without a GPU there is nothing to park and it carries none.
        """
        plan = self.plan(mode, n, length) if tbo else None
        if mode == "decode":
            inputs = self.decode_inputs(n)
            meta = StaticAttentionMetadata.decode(inputs["positions"], inputs["slots"], self.cache.scratch_slot,
                                                  slot_offset=0)
            ids = inputs["ids"]
        else:
            batch = self.prefill_batch(n, length)
            ids, meta = batch.ids, batch.meta
        tokens = [mb.tokens_len for mb in plan.microbatches] if plan else [ids.shape[0]]
        label = f"{mode} {ids.shape[0]} tokens, {'TBO' if tbo else 'single'}"
        previous = self.model.use_backend(traced(self.link, self.tracer))
        self.link.timing = True
        try:
            return traced_step(self.tracer, lambda observer: self.model.forward_tbo(
                ids, meta, self.cache, self.strategy[mode], plan, observer=observer), label, tokens,
                sleep_ms if front_load else 0.0)
        finally:
            self.link.timing = False
            self.model.use_backend(previous)
