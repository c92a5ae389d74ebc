"""The reference workload: batches of the reference model, stepped single-batch and overlapped, timed and compared.

The examples, `make demo` and the benchmarks all measure through here, so their figures mean the same thing:
*single* is the unsplit step through the same ops, *TBO* the split, overlapped step, and *max diff* compares TBO
against the plain `forward()` (no ops at all). Each rank has its own batch (data-parallel attention); experts are
sharded across ranks and reached through the backend, optionally behind an `EmulatedLink`.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from tbo.comm import DispatchFormat, LocalBackend, TorchDistributedBackend
from tbo.comm.emulated import EmulatedLink, WallClock
from tbo.models import AttentionMetadata, KVCache, ModelConfig, ReferenceModel
from tbo.split import ForwardMode, SplitPolicy, agree_to_split
from tbo.core.strategy import OperationsStrategy
from tbo.tools.trace import Trace, Tracer, save_chrome_json, save_png, summary, traced

__all__ = ["Case", "CaseResult", "run_case", "build_backend", "render_schedule", "example_main", "summarize",
           "Batch", "TracedModel", "make_batch"]


@dataclass(frozen=True)
class Case:
    """One workload: which model, which mode, how big a batch, over which link."""

    model: Literal["deepseek", "qwen3_moe"] = "deepseek"
    mode: Literal["decode", "prefill"] = "decode"
    num_seqs: int = 16  #: sequences per rank
    prompt_len: int = 24  #: prefill: mean prompt length; decode: context already cached
    experts_per_rank: int = 4
    hidden_size: int = 64
    num_layers: int = 4
    link: str | None = None  #: "LATENCY_US,GBPS" for an EmulatedLink, or None
    repeats: int = 5
    batch_invariant: bool = True
    seed: int = 0
    format: str = "expanded"
    trace: bool = False  #: record one traced TBO step after the timed ones

    @property
    def strategy_name(self) -> str:
        return f"{self.model}_{self.mode}"


@dataclass
class CaseResult:
    rank: int
    tokens: int
    split: bool
    max_diff: float
    single_ms: list[float] = field(default_factory=list)
    tbo_ms: list[float] = field(default_factory=list)
    comm_ms: float = 0.0
    exposed_ms: float = 0.0
    transfers: int = 0  #: transfers an `EmulatedLink` carried in one TBO step (dispatch and combine, per microbatch)
    trace: Trace | None = None

    @property
    def single(self) -> float:
        return statistics.median(self.single_ms)

    @property
    def tbo(self) -> float:
        return statistics.median(self.tbo_ms)


#: Split whenever a step can be split: the workloads measure what overlap gives, not where the threshold is.
POLICY = SplitPolicy(decode_token_threshold=2, prefill_token_threshold=4)


def model_config(case: Case, world: int) -> ModelConfig:
    return ModelConfig.scaled(case.model, case.hidden_size, case.num_layers,
                              num_experts=case.experts_per_rank * world, batch_invariant=case.batch_invariant,
                              seed=case.seed)


def build_backend(num_experts: int, world: int, link: str | None, fmt: str = "expanded") -> Any:
    """Local for one rank, torch.distributed for several; behind an EmulatedLink when ``link`` is given."""
    f = DispatchFormat(fmt)
    backend: Any = LocalBackend(num_experts, f) if world == 1 else TorchDistributedBackend(num_experts, f)
    return EmulatedLink.from_spec(backend, link) if link else backend


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def _max_over_ranks(world: int, value: float) -> float:
    if world == 1:
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _timed(world: int, fn: Any) -> float:
    """Milliseconds ``fn`` takes, between barriers so that every rank times the same step."""
    _barrier(world)
    t0 = time.perf_counter()
    fn()
    _barrier(world)
    return (time.perf_counter() - t0) * 1e3


def render_schedule(strategy: OperationsStrategy, layers: int = 1) -> str:
    """The two-microbatch schedule of ``layers`` layers of ``strategy`` (the per-layer strategy, unbound)."""
    return OperationsStrategy.concat([strategy] * layers).render_schedule(2, width=60)


def run_case(rank: int, world: int, case: Case) -> CaseResult:
    """Run one case on this rank: warm up, then time single-batch and TBO steps; compare TBO with `forward()`."""
    torch.manual_seed(case.seed)
    config = model_config(case, world)
    backend = build_backend(config.num_experts, world, case.link, case.format)
    tracer = Tracer(label=f"{case.strategy_name}, rank {rank}") if case.trace else None
    model = ReferenceModel(config, backend if tracer is None else traced(backend, tracer))
    batch = make_batch(model, case.mode, case.num_seqs, case.prompt_len, seed=case.seed * 7919 + rank,
                       policy=POLICY)
    ids, meta, cache = batch.ids, batch.meta, batch.cache
    agreed = {"link": case.link, "format": case.format, "policy": POLICY.model_dump(), "mode": case.mode}
    plan = batch.plan if agree_to_split(batch.plan, strategy=case.strategy_name, config=agreed) else None
    strategy = case.strategy_name
    reference = model.forward(ids, meta, cache.clone())
    tbo_logits = model.forward_tbo(ids, meta, cache.clone(), strategy, plan)
    diff = float((tbo_logits - reference).abs().max()) if reference.numel() else 0.0
    result = CaseResult(rank, meta.num_tokens, plan is not None, _max_over_ranks(world, diff))
    for i in range(case.repeats + 1):  # the first round warms up and is not kept
        single = _timed(world, lambda: model.forward_tbo(ids, meta, cache.clone(), strategy, None))
        if isinstance(backend, EmulatedLink):
            backend.reset_stats()
        tbo_ms = _timed(world, lambda: model.forward_tbo(ids, meta, cache.clone(), strategy, plan))
        if i:
            result.single_ms.append(single)
            result.tbo_ms.append(tbo_ms)
            if isinstance(backend, EmulatedLink):
                result.comm_ms += backend.stats.comm_s * 1e3 / case.repeats
                result.exposed_ms += backend.stats.exposed_s * 1e3 / case.repeats
                result.transfers = backend.stats.count
    if tracer is not None:
        tracer.trace.spans.clear()
        tracer.trace.tokens = [mb.tokens_len for mb in plan.microbatches] if plan else [meta.num_tokens]
        _timed(world, lambda: model.forward_tbo(ids, meta, cache.clone(), strategy, plan, observer=tracer))
        result.trace = tracer.finish()
    return result


def summarize(results: list[CaseResult]) -> dict[str, float]:
    """One row for all ranks: total tokens, max diff, slowest-rank median step times, speedup, link figures
    (``transfers``: the most any rank's link carried in one TBO step), and whether every rank's step was split."""
    single = max(r.single for r in results)
    tbo = max(r.tbo for r in results)
    comm = max(r.comm_ms for r in results)
    exposed = max(r.exposed_ms for r in results)
    return {"tokens": sum(r.tokens for r in results), "max_diff": max(r.max_diff for r in results),
            "single_ms": single, "tbo_ms": tbo, "speedup": single / tbo, "comm_ms": comm, "exposed_ms": exposed,
            "transfers": max(r.transfers for r in results), "split": all(r.split for r in results)}


def example_main(model: str, mode: str, argv: list[str] | None = None, *, default_link: str | None = None) -> dict:
    """The command line shared by the example scripts: build a Case, run it on N ranks, print what it shows."""
    import argparse

    from tbo import strategies
    from tbo.harness.launch import launch, under_torchrun

    parser = argparse.ArgumentParser(description=f"{model} {mode} through tbo: TBO vs single batch vs forward()")
    parser.add_argument("--ranks", type=int, default=1, help="local gloo processes (ignored under torchrun)")
    parser.add_argument("--link", default=default_link, help="emulated link 'LATENCY_US,GBPS', e.g. 50,0.005")
    parser.add_argument("--seqs", type=int, default=32 if mode == "decode" else 6, help="sequences per rank")
    parser.add_argument("--ctx", type=int, default=512 if mode == "decode" else 16,
                        help="prompt length (prefill) or cached context (decode)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--experts-per-rank", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fast", action="store_true", help="batch-variant kernels: faster, equal within rounding")
    parser.add_argument("--trace", metavar="OUT.json", help="trace one TBO step (rank 0) as Chrome/Perfetto JSON")
    parser.add_argument("--png", metavar="OUT.png", help="plot one traced TBO step (rank 0) as a timeline")
    args = parser.parse_args(argv)
    case = Case(model=model, mode=mode, num_seqs=args.seqs, prompt_len=args.ctx, num_layers=args.layers,
                hidden_size=args.hidden, experts_per_rank=args.experts_per_rank, link=args.link,
                repeats=args.repeats, batch_invariant=not args.fast, trace=bool(args.trace or args.png))
    results = launch(run_case, args.ranks, case, timeout_s=600)
    if under_torchrun() and results[0].rank != 0:
        return {}
    world = args.ranks if not under_torchrun() else int(__import__("os").environ["WORLD_SIZE"])
    row = summarize(results)
    strategy = strategies.get(case.strategy_name)
    print(strategy.describe())
    print(f"\nschedule, one layer, two microbatches:\n{render_schedule(strategy)}\n")
    split = "yes" if row["split"] else (
        f"no (a rank's step is below SplitPolicy's thresholds, {POLICY.decode_token_threshold} decode / "
        f"{POLICY.prefill_token_threshold} prefill tokens, or has no cut: 'TBO' below ran as one batch)")
    print(f"ranks: {world}, tokens on this host: {row['tokens']}, split: {split}, link: {case.link or 'none'}")
    tolerance = "bit-exact expected" if case.batch_invariant else "tolerance 1e-4"
    print(f"max diff: {row['max_diff']:.3g}  ({tolerance})")
    speedup = f"speedup: {row['speedup']:.2f}x" if row["split"] else "speedup: none (not split, nothing overlapped)"
    print(f"single: {row['single_ms']:.1f} ms   TBO: {row['tbo_ms']:.1f} ms   {speedup}")
    if case.link and row["transfers"]:
        print(f"link: {row['transfers']} transfers per TBO step, busy {row['comm_ms']:.1f} ms, "
              f"exposed (waited) {row['exposed_ms']:.1f} ms")
    elif case.link:
        print("link: idle (no transfer crossed it in a TBO step)")
    traced_step = results[0].trace
    if traced_step is not None:
        print(f"traced TBO step (rank 0): {summary(traced_step)}")
        if args.trace:
            print(f"wrote {save_chrome_json(traced_step, args.trace)} (open in ui.perfetto.dev)")
        if args.png:
            print(f"wrote {save_png(traced_step, args.png)}")
    return row


@dataclass
class Batch:
    """One step's batch: token ids, attention metadata, the KV cache it starts from, and its split plan."""

    ids: torch.Tensor
    meta: AttentionMetadata
    cache: KVCache
    plan: Any

    @property
    def num_tokens(self) -> int:
        return self.meta.num_tokens


def make_batch(model: ReferenceModel, mode: str, num_seqs: int, ctx: int, seed: int = 0, spread: float = 0.5,
               policy: SplitPolicy | None = None) -> Batch:
    """``num_seqs`` sequences of about ``ctx`` tokens: prompts (prefill), or cached context (decode, the cache filled
    by ``model.forward``). The plan is ``policy``'s for the step, or None without a policy."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = max(1, int(ctx * (1 - spread))), max(1, int(ctx * (1 + spread)))
    lens = torch.randint(lo, hi + 1, (num_seqs,), generator=g).tolist()
    prompt = torch.randint(0, model.config.vocab_size, (sum(lens),), generator=g)
    seqs = range(num_seqs)
    if mode == "prefill":
        meta = AttentionMetadata.build(seqs, lens, [0] * num_seqs)
        plan = policy.plan(ForwardMode.EXTEND, meta.num_tokens, lens) if policy else None
        return Batch(prompt, meta, KVCache(), plan)
    cache = KVCache()
    model.forward(prompt, AttentionMetadata.build(seqs, lens, [0] * num_seqs), cache)
    meta = AttentionMetadata.build(seqs, [1] * num_seqs, lens)
    ids = torch.arange(num_seqs) % model.config.vocab_size
    return Batch(ids, meta, cache, policy.plan(ForwardMode.DECODE, meta.num_tokens) if policy else None)


class TracedModel:
    """The reference model in one process, experts local behind an `EmulatedLink`, every step traced.

    What the overlap and simulator-accuracy benchmarks measure: with no second process, the only overlap is the one
    TBO creates between the link and this process's compute.
    """

    def __init__(self, config: ModelConfig, latency_s: float, bandwidth: float) -> None:
        self.config = config
        self.tracer = Tracer()
        # one process on its core: waits end on time (a plain sleep would end ~0.1 ms late; see WallClock)
        self.link = EmulatedLink(LocalBackend(config.num_experts), latency_s, bandwidth, WallClock(spin_s=3e-4))
        self.model = ReferenceModel(config, traced(self.link, self.tracer))
        self.policy = POLICY

    def batch(self, mode: str, num_seqs: int, ctx: int, seed: int = 0, spread: float = 0.5) -> Batch:
        return make_batch(self.model, mode, num_seqs, ctx, seed, spread, self.policy)

    def step(self, batch: Batch, strategy: str, split: bool) -> Trace:
        """One traced step, single batch or overlapped, from a copy of the batch's cache.

        The garbage collector is run before and paused during the step: a collection inside a step is a
        millisecond-scale pause that belongs to neither mode.
        """
        plan = batch.plan if split else None
        self.tracer.trace.spans.clear()
        self.tracer.trace.tokens = [mb.tokens_len for mb in plan.microbatches] if plan else [batch.num_tokens]
        cache = batch.cache.clone()
        gc.collect()
        gc.disable()
        try:
            self.model.forward_tbo(batch.ids, batch.meta, cache, strategy, plan, observer=self.tracer)
        finally:
            gc.enable()
        trace = self.tracer.finish()
        self.tracer.trace = Trace()
        return trace
