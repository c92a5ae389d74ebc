"""`SglangEngine`: tbo on one SGLang ModelRunner, built in undoable steps at engine start.

Built when the runner has loaded its model (`tbo.integrations.sglang.plugin` hooks ``ModelRunner.initialize``), in the
process that runs the model: the config read from ``TBO_SGLANG_CONFIG`` and checked, the deployment checked (what
tbo does not run inside SGLang is refused by name), the model admitted by its structure, the layers wrapped as ops,
the expert-parallel backend made (``link``: an emulated interconnect around it), the strategies bound, and the inner
model's ``forward`` replaced, on that instance only, by tbo's `LayerLoop`. Each step that changes something records
its undo (`UndoStack`), so a refusal at any step leaves the runner as found, and `close` takes tbo off again.
With SGLang's ``--enable-metrics``, the last step starts the metrics publisher (`tbo.integrations.sglang.runner.
metrics`): tbo's figures in the server's own ``/metrics``.
"""

from __future__ import annotations

import logging
from typing import Any

from tbo import strategies
from tbo.comm.alltoall import LocalBackend
from tbo.comm.emulated import EmulatedLink
from tbo.comm.types import DispatchFormat
from tbo.core.errors import StrategyError
from tbo.integrations.engine.adaptive import AdaptiveSteps
from tbo.integrations.engine.ep import EpBackend
from tbo.integrations.engine.stats import StatsFile, StepStats, link_report, summary_line
from tbo.integrations.engine.undo import UndoStack
from tbo.integrations.sglang.config import TboSglangConfig
from tbo.integrations.sglang.errors import TboSglangError, refuse
from tbo.integrations.sglang.model.layers import SglangDecoderLayer
from tbo.integrations.sglang.model.structure import model_structure
from tbo.integrations.sglang.runner.attention import MicrobatchAttention, check_attention
from tbo.integrations.sglang.runner.loop import LayerLoop
from tbo.integrations.sglang.runner.metrics import publish_metrics
from tbo.integrations.sglang.stats import ENGINES
from tbo.split.kinds import Slot

__all__ = ["SglangEngine", "check_deployment", "check_expert_parallel", "check_graphs", "sglang_runs_unsplit",
           "sums_shared_as_routed"]

logger = logging.getLogger("sglang.tbo")


def check_deployment(server_args: Any, parallel: Any, config: TboSglangConfig | None = None) -> None:
    """Refuse, by name, what tbo does not run inside SGLang (yet)."""
    if getattr(server_args, "enable_two_batch_overlap", False):
        refuse("SGLang's --enable-two-batch-overlap", "tbo's split instead of SGLang's (one owner of the layer loop)",
               "two owners of the layer loop")
    for name, value in (("pp_size", parallel.pp_size), ("attn_dp_size", getattr(parallel, "attn_dp_size", 1))):
        if value != 1:
            refuse(f"SGLang's {name}={value}", f"{name}=1 (tensor parallelism, tp_size >= 1, runs)",
                   "pipeline and attention data parallelism inside SGLang are not wired to tbo yet "
                   "(docs/sglang.md, 'Not yet')")
    tp = int(parallel.tp_size)
    check_expert_parallel(server_args, int(parallel.moe_ep_size), tp)
    if tp > 1 and getattr(server_args, "enable_quant_communications", False):
        refuse("SGLang's --enable-quant-communications", "full-precision all-reduces",
               "tbo's tensor-parallel all-reduce sums the partial sums as they are; SGLang's quantised one would "
               "round otherwise")
    if tp > 1 and config is not None and config.split == "adaptive":
        refuse(f"split='adaptive' at SGLang's tp_size={tp}", "split 'static' at tensor parallel >= 2",
               "each rank would choose from its own measured times, and every rank must run the same split")
    spec = getattr(server_args, "speculative_algorithm", None)
    if spec not in (None, "", "NONE"):
        refuse(f"SGLang's speculative_algorithm={spec!r}", "none", "speculative decoding is not wired to tbo yet")
    check_attention(server_args)


def check_graphs(graphs_disabled: bool) -> None:
    """Refuse SGLang's graphs of the model (CUDA graphs, piecewise prefill graphs), checked as the runner is about to
    capture them (``graphs_disabled``: SGLang's resolved ``cuda_graph_config`` disables them for decode and prefill):
    captured through tbo's layer loop, a replay would rerun the capture's split and attention plans on every later
    batch of its size, with no decision and no per-microbatch planning. CUDA graphs of split steps are issue 59,
    item 7. On a CPU SGLang resolves them disabled."""
    if not graphs_disabled:
        refuse("SGLang's CUDA graphs (decode or prefill)",
               "--disable-cuda-graph (or --cuda-graph-backend-decode=disabled --cuda-graph-backend-prefill=disabled)",
               "a graph captured through tbo's layer loop would replay the capture's split and attention plans "
               "without deciding or planning the step it replays")


def check_expert_parallel(server_args: Any, ep: int, tp: int) -> None:
    """SGLang's expert parallelism as tbo runs it: experts spread whole over the TP ranks (``moe_ep_size`` equal to
    ``tp_size``), their rows carried by tbo's all-to-all over SGLang's expert-parallel group; refused by name
    otherwise."""
    if ep == 1:
        return
    if ep != tp:
        refuse(f"SGLang's moe_ep_size={ep} with tp_size={tp}", f"moe_ep_size=1 or moe_ep_size={tp} (the tp_size)",
               "tbo carries expert parallelism over the TP ranks whole: experts tensor-parallel inside an "
               "expert-parallel group are not wired")
    a2a = getattr(server_args, "moe_a2a_backend", "none")
    if a2a not in (None, "none"):
        refuse(f"SGLang's moe_a2a_backend={a2a!r}", "'none' (tbo's all-to-all carries the experts' rows)",
               "SGLang's all-to-all backends (DeepEP, ...) are not driven by tbo yet; tbo's own dispatch and combine "
               "run over SGLang's expert-parallel group instead")
    redundant = getattr(server_args, "ep_num_redundant_experts", 0) or 0
    if redundant or getattr(server_args, "enable_eplb", False):
        refuse(f"SGLang's ep_num_redundant_experts={redundant} / enable_eplb", "no redundant experts, no EPLB",
               "tbo routes each expert id to the rank that holds it in SGLang's static layout (rank r the r-th "
               "share); redundant or rebalanced experts would move")


def sums_shared_as_routed(strategy: Any) -> bool:
    """Whether ``strategy`` sums a shared expert's output (a partial sum at TP >= 2) where it sums the routed one:
    both as tbo's all-reduces (``moe_reduce_a`` and ``shared_reduce_a``), or neither (SGLang's boundary sums their
    total). One of each would leave a part unsummed or sum it twice."""
    from tbo.integrations.sglang.model.tp import deferred_by

    return ("moe" in deferred_by(strategy)) == ("shared_reduce_a" in strategy.operations)


def _backend_of(group: Any) -> str:
    """The torch.distributed backend of ``group`` (``gloo``, ``nccl``)."""
    import torch.distributed as dist

    return str(dist.get_backend(group))


def sglang_runs_unsplit(backend: Any, reducer: Any, op_times: bool) -> bool:
    """Whether SGLang's own forward computes an unsplit step as tbo's layers would, so that unsplit steps run it and
    cost what they cost without tbo (tbo's ops route and permute every token in Python-driven kernels SGLang's fused
    MoE does not need: +17% of a 32-request decode run here, 2026-12-07): tbo's plain local backend (all experts
    here, no emulated link, whose transfers are the point), no tensor-parallel sums tbo runs itself (``reducer``),
    and no ``op_times`` (which times tbo's ops)."""
    return type(backend) is LocalBackend and reducer is None and not op_times


class SglangEngine:
    """tbo on one ModelRunner (see the module docstring)."""

    def __init__(self, runner: Any, config: TboSglangConfig) -> None:
        from sglang.srt.runtime_context import get_parallel

        self.config, self.undo = config, UndoStack()
        self.stats, self.loop, self.adaptive, self.attention = StepStats(), None, None, None
        self.tp, self.ep, self.rank, self.reducer, self.raw_reducer, self.raw_backend = 1, 1, 0, None, None, None
        #: the lines `close` logged (None: still open); ``stats_file`` carries them from then on
        self.summary: list[str] | None = None
        try:
            parallel = get_parallel()
            check_deployment(runner.server_args, parallel, config)
            self._build(runner, config, int(parallel.tp_rank), int(parallel.tp_size), int(parallel.moe_ep_size))
        except BaseException:
            self.undo.close()
            raise

    def _build(self, runner: Any, config: TboSglangConfig, rank: int, tp: int, ep: int) -> None:
        structure = model_structure(runner.model, tensor_parallel=tp > 1)
        self.architecture, self.tp, self.rank = structure.architecture, tp, rank
        moe = any(s.kind == "moe" for s in structure.structures)
        self.ep = ep if moe else 1
        backend: Any = None
        if moe:
            backend = (self._ep_backend(structure.num_experts) if self.ep > 1 else
                       LocalBackend(structure.num_experts, DispatchFormat.NORMAL))
        self.raw_backend = backend
        if config.link is not None and (tp == 1 or self.ep > 1):  # TP: the link carries the all-reduces too
            backend = EmulatedLink.from_spec(backend, config.link)
        self.backend, self.reducer, self.raw_reducer = backend, None, None
        last = len(structure.layers) - 1
        ep_rows = (self.raw_backend.rank, self.ep) if self.ep > 1 else None
        self.layers = [SglangDecoderLayer(layer, s, backend, i, structure.inner.norm if i == last else None, ep_rows)
                       for i, (layer, s) in enumerate(zip(structure.layers, structure.structures))]
        for layer in self.layers:
            layer.stats = self.stats
        names = self.names = config.strategy_names(any(layer.has_shared_experts for layer in self.layers),
                                                   dense=not moe, tensor_parallel=tp > 1,
                                                   expert_parallel=self.ep > 1)
        if tp > 1:
            self._defer_reductions(moe)  # before binding: the ops' flows read which reductions are deferred
        else:
            from tbo.integrations.sglang.model.tp import deferred_by

            for name in {names.decode, names.prefill}:
                if deferred_by(strategies.get(name)):
                    refuse({"strategy": name}, "a strategy without *_reduce_a/_b ops at tp_size=1",
                           "it runs tensor-parallel all-reduces as transfers, and this engine has one rank")
        bound = {slot: self._bind(names.of(slot)) for slot in Slot}
        adaptive = None
        if config.split == "adaptive":  # one rank: only a link has transfers to hide, and its wire time to observe
            adaptive = self.adaptive = AdaptiveSteps(config, names, transfers=isinstance(backend, EmulatedLink))
            if isinstance(backend, EmulatedLink):
                adaptive.wire = lambda: backend.booked_s
            for name in adaptive.extra_strategies():  # adaptive.strategies: bound and checked now, like the two
                bound[name] = self._bind(name, key="adaptive.strategies")
        path = None if config.stats_file is None else config.stats_file.replace("{rank}", str(rank))
        self.loop = LayerLoop(structure.inner, self.layers, bound, backend, config.split_policy(), adaptive=adaptive,
                              stats=self.stats, stats_file=None if path is None else StatsFile(path, self.extra),
                              op_times=config.op_times, reducer=self.reducer)
        if self.ep > 1:
            self.stats.ep_size, self.loop.traffic = self.ep, self.raw_backend
        self.undo.push("the engine's stats in the process registry",
                       ENGINES.register(self.stats, None if adaptive is None else adaptive.report))
        if sglang_runs_unsplit(backend, self.reducer, config.op_times):
            self.loop.own_forward = type(structure.inner).forward.__get__(structure.inner)  # SGLang's, unpatched
        self.undo.set_attr(structure.inner, "forward", self.loop)  # nn.Module.__call__ finds the instance's
        publisher = publish_metrics(self)  # the scheduler's slot for SGLang's /metrics (--enable-metrics)
        if publisher is not None:
            self.undo.push("the metrics publisher", publisher.close)
        logger.info("tbo: %s runs its %d layers through tbo (strategies %s / %s, %d microbatches, TP rank %d of %d, "
                    "EP %d)", self.architecture, len(self.layers), names.decode, names.prefill,
                    config.num_microbatches, rank, tp, self.ep)

    def bind_attention(self, runner: Any) -> None:
        """Once the runner made its attention backend (after ``initialize``, where tbo is built): check the prefill
        and decode backends it resolved, and make each microbatch's own (`MicrobatchAttention`), for the most
        microbatches a step can have. A refusal takes tbo off the runner again before it raises."""
        try:
            check_attention(runner.server_args, runner)
            most = max(self.adaptive.policies) if self.adaptive is not None else self.config.num_microbatches
            self.attention = self.loop.attention = MicrobatchAttention(runner, most)
        except BaseException:
            self.undo.close()
            raise

    def _ep_backend(self, num_experts: int) -> Any:
        """tbo's all-to-all over SGLang's expert-parallel group (its device group: gloo on a CPU, NCCL on GPUs), in
        the NORMAL layout SGLang's experts take. Its experts' partition must be SGLang's (rank r holds the r-th
        share of the expert ids), or rows would reach a rank that does not hold their expert."""
        from sglang.srt.runtime_context import get_parallel


        parallel = get_parallel()
        group = parallel.moe_ep_group
        if num_experts % self.ep:
            raise TboSglangError(f"TBO_SGLANG_CONFIG at moe_ep_size={self.ep}: {self.architecture} has {num_experts} "
                                 f"experts, not a multiple of the expert-parallel ranks; accepted: a moe_ep_size "
                                 f"that divides {num_experts}")
        backend = EpBackend(num_experts, group.device_group, self.config.comm_timeout_s)
        if (backend.rank, backend.num_ranks) != (int(parallel.moe_ep_rank), self.ep):
            raise TboSglangError(f"TBO_SGLANG_CONFIG at moe_ep_size={self.ep}: SGLang's expert-parallel rank "
                                 f"{parallel.moe_ep_rank} of {self.ep} is rank {backend.rank} of "
                                 f"{backend.num_ranks} in its group; tbo's experts would not be SGLang's")
        return backend

    def _defer_reductions(self, moe: bool) -> None:
        """TP >= 2: have each layer run, as tbo's transfers, the all-reduces its strategies name (`model.tp`); the
        decode and prefill strategies must agree on them (a layer hands its sums to SGLang one way)."""
        from tbo.integrations.sglang.model.tp import deferred_by, tp_coordinators, tp_reducer

        per_layer = []
        for layer in self.layers:
            modes = {slot: deferred_by(strategies.get(self.names.of(slot))) for slot in Slot}
            if layer.has_shared_experts:  # the shared expert's output is a partial sum too
                for slot in Slot:
                    name = self.names.of(slot)
                    if not sums_shared_as_routed(strategies.get(name)):
                        refuse({"strategy": name}, "'auto' (moe_tp_*) or a strategy that reduces the routed and "
                               "the shared output alike (moe_reduce_a/_b and shared_reduce_a/_b, or neither)",
                               f"{layer!r} has a shared expert whose output, like the routed one, is a partial sum "
                               "at tp_size>1, and this strategy sums one of the two itself and not the other")
            if modes[Slot.DECODE] != modes[Slot.PREFILL]:
                raise TboSglangError(f"TBO_SGLANG_CONFIG strategies {self.names.decode!r} and {self.names.prefill!r} "
                                     f"disagree on which tensor-parallel all-reduces of {layer!r} they run as "
                                     f"transfers ({sorted(modes[Slot.DECODE])} vs {sorted(modes[Slot.PREFILL])}); "
                                     "name a decode and a prefill strategy that reduce alike")
            per_layer.append(modes[Slot.DECODE])
        if not any(per_layer):
            if not moe:
                refuse({"strategy": self.names.decode}, "'auto' or a dense_tp_* strategy",
                       f"{self.architecture} has no MoE layer, and the strategy runs none of its tensor-parallel "
                       "all-reduces as transfers: nothing would overlap")
            return  # a strategy without reduce ops: SGLang's boundaries make every sum, as without tbo
        self.reducer, self.raw_reducer = tp_reducer(self.config.comm_timeout_s, self.config.link)
        coordinators = tp_coordinators()
        for layer, deferred in zip(self.layers, per_layer):
            layer.reducer, layer.deferred, layer.coordinators = self.reducer, deferred, coordinators

    def extra(self) -> dict[str, Any]:
        """What ``stats_file`` holds beside the counters: ``link`` (with ``link`` set: transfers booked on the emulated
        link, its busy seconds, and the seconds of them the overlap left exposed, waited for in a ``*_b`` op; proof
        that the link ran), ``adaptive`` (``split: "adaptive"``: the buckets, as `stats()` reports them) and, once the
        engine closed, ``summary`` (the lines it logged)."""
        out: dict[str, Any] = {}
        if self.attention is not None:
            out["attention"] = self.attention.report()
        link = link_report([x for x in (self.backend, self.reducer) if isinstance(x, EmulatedLink)])
        if link is not None:
            out["link"] = link
        if self.ep > 1:
            out["ep"] = {"size": self.ep, "rank": self.raw_backend.rank,
                         "group": _backend_of(self.raw_backend.transport.group),
                         "rows_dispatched": sum(layer.ep_rows_dispatched for layer in self.layers),
                         "rows_from_peers": sum(layer.ep_rows_from_peers for layer in self.layers)}
        if self.tp > 1:
            out["tp"] = {"size": self.tp, "rank": self.rank,
                         "group": None if self.raw_reducer is None else self.raw_reducer.backend,
                         "launched": 0 if self.raw_reducer is None else self.raw_reducer.launched,
                         "attn_sums_by_sglang": sum(layer.attn_sums_by_sglang for layer in self.layers)}
        if self.adaptive is not None:
            out["adaptive"] = [self.adaptive.report()]
        if self.loop is not None and self.loop.own_forward is not None:
            out["own_forward_steps"] = self.loop.own_steps
        if self.summary is not None:
            out["summary"] = self.summary
        return out

    def _bind(self, name: str, key: str = "strategy") -> Any:
        try:
            return strategies.bind_layers(self.layers, strategies.get(name), backend=self.backend,
                                          num_microbatches=self.config.num_microbatches)
        except StrategyError as e:
            raise TboSglangError(f"TBO_SGLANG_CONFIG {key} {name!r} cannot run SGLang's {self.architecture} "
                                 f"layers: {e}") from None

    def close(self) -> list[str]:
        """Take tbo off the runner (every undo, last first), log the summary lines, write ``stats_file`` (with them).
        Returns the lines. Called at SGLang's shutdown (`tbo.integrations.sglang.plugin`); a second call only
        returns them. The diagnostics never raise: a shutdown is no place to lose SGLang's own teardown."""
        if self.summary is not None:
            return self.summary
        try:
            self.undo.close()
        finally:
            lines = [summary_line(self.stats)]
            if self.adaptive is not None:
                lines += [f"tbo adaptive: {line}" for line in self.adaptive.split.summary()]
            self.summary = lines
            for line in lines:
                logger.info(line)
            if self.loop is not None:
                self.loop.write_stats()
        return lines
