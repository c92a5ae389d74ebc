"""`TboEngine`: tbo installed on one vLLM model runner, and taken off again at shutdown.

Installing changes four attributes of this runner and its model, all on the instances (no class is touched), and
reroutes the rotary modules whose vLLM kernel is shape dependent (`tbo.integrations.vllm.fixes`):
the inner model's ``forward`` becomes the tbo `LayerLoop` (only for the steps tbo splits where vLLM's own forward
runs the others: compiled engines, and eager ones on one rank with the local backend,
`tbo.integrations.vllm.compiled`); the runner's ``execute_model`` runs inside the scoped `RunnerPatches` (and, with
a FULL ``cudagraph_mode``, its ``_warmup_and_capture`` captures tbo's split decode steps:
`tbo.integrations.vllm.graphs`); its
``initialize_metadata_builders`` makes one attention metadata builder per microbatch (vLLM's own code, seeing
microbatching on) and asserts it did (`check_metadata_builders`, a named `MetadataBuilderError`); its ``shutdown``
first takes tbo off (the instance attributes are deleted, so vLLM's own methods are what remains), logs the one
summary line, and writes ``stats_file`` if asked, then always runs vLLM's own
``shutdown``: a failure of tbo's part is logged, never allowed to skip vLLM's.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from tbo import strategies
from tbo.core.errors import StrategyError
from tbo.integrations.vllm.backend import backend_for, make_backend
from tbo.integrations.vllm.compiled import StepForwards, is_compiled, vllm_graph_off, vllm_runs_unsplit
from tbo.integrations.vllm.compute import EAGER, CompiledCompute
from tbo.integrations.vllm.config import StrategyNames, TboConfigError, TboVllmConfig
from tbo.integrations.vllm.fixes import fix_rotary_embeddings
from tbo.integrations.vllm.forward import LayerLoop
from tbo.integrations.vllm.layers import VllmDecoderLayer
from tbo.integrations.vllm.patches import RunnerPatches, check_metadata_builders
from tbo.integrations.vllm.quant import fp8_dispatch_for
from tbo.integrations.vllm.spec import runs_draft_pass
from tbo.integrations.vllm.stats import PROCESS_STATS, StatsFile, StepStats, summary_line
from tbo.integrations.vllm.structure import moe_dims, moe_runners

__all__ = ["TboEngine"]

logger = logging.getLogger("vllm.tbo")  # under vLLM's logger: its handler and format, its VLLM_LOGGING_LEVEL


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


class TboEngine:
    """tbo on ``runner`` (a vLLM ``GPUModelRunner``, or the CPU runner that inherits it), whose model is loaded."""

    def __init__(self, runner: Any, config: TboVllmConfig, family: str) -> None:
        from vllm.distributed import get_tensor_model_parallel_world_size

        self.runner, self.config, self.family = runner, config, family
        vllm_config = runner.vllm_config
        model = runner.model.model  # the ...Model inside ...ForCausalLM
        if (model.start_layer, model.end_layer) != (0, len(model.layers)):
            raise TboConfigError(f"the model holds layers {model.start_layer}..{model.end_layer} of "
                                 f"{len(model.layers)}: tbo needs the whole stack on this rank")
        hf = vllm_config.model_config.hf_text_config
        step_stats = StepStats()
        scaling = getattr(hf, "llama_4_scaling", None)  # DeepSeek: a per-token factor on q, computed per microbatch
        self.afd = None
        self.ep_size = 1
        self.fp8_dispatch = False
        if config.afd is not None:  # attention here, the FFN on `tbo afd-ffn` (tbo.integrations.vllm.afd)
            from tbo.integrations.vllm.afd.attention import AFDAttentionSide
            from tbo.integrations.vllm.afd.config import AFD_STRATEGY

            self.afd = AFDAttentionSide(runner, config.afd, [step_stats, PROCESS_STATS], llama_4_scaling=scaling)
            self.backend, self.layers = None, self.afd.layers
            names = StrategyNames(decode=AFD_STRATEGY, prefill=AFD_STRATEGY)
            self.strategies = dict.fromkeys(("decode", "prefill"), strategies.bind_layers(
                self.layers, strategies.get(AFD_STRATEGY)))
        else:
            from vllm.platforms import current_platform

            from tbo.integrations.vllm.ep import EpDecoderLayer, expert_parallel_size

            num_experts, top_k = moe_dims(model.layers)  # the runners' own, whatever the config calls them
            if vllm_config.parallel_config.enable_expert_parallel:
                self.ep_size = expert_parallel_size()
            #: FP8 rows with their scales on the wire, where the layers' quant methods take them (quant.py)
            self.fp8_dispatch = config.backend == "deepep" and fp8_dispatch_for(
                [(i, r.routed_experts) for i, r in moe_runners(model.layers)], config.fp8_dispatch)
            spec = vllm_config.speculative_config
            decode_tokens = vllm_config.scheduler_config.max_num_seqs * (1 + (spec.num_speculative_tokens or 0)
                                                                         if spec is not None else 1)
            self.backend = make_backend(config, num_experts, hidden=hf.hidden_size, top_k=top_k,
                                        max_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
                                        ep_size=self.ep_size, platform=current_platform.device_type,
                                        dtype=vllm_config.model_config.dtype, max_decode_tokens=decode_tokens,
                                        fp8=self.fp8_dispatch)
            tp = get_tensor_model_parallel_world_size()
            layer_cls = EpDecoderLayer if self.ep_size > 1 else VllmDecoderLayer
            self.layers = [layer_cls(layer, self.backend, i, tp, llama_4_scaling=scaling,
                                     fp8_dispatch=self.fp8_dispatch) for i, layer in enumerate(model.layers)]
            names = config.strategy_names(any(layer.has_shared_experts for layer in self.layers))
            self.strategies = {mode: self._bind(getattr(names, mode), top_k, mode)
                               for mode in ("decode", "prefill")}
        for layer in self.layers:
            layer.counters = (step_stats, PROCESS_STATS)
        self.adaptive = None
        if config.split == "adaptive":  # the thresholds give way to measured step costs
            from tbo.integrations.vllm.adaptive import LIVE, AdaptiveSteps

            self.adaptive = AdaptiveSteps(config, names)
            LIVE.append(self.adaptive)
        self.patches = RunnerPatches(runner, config.split_policy() if self.adaptive is None else self.adaptive.policy,
                                     adaptive=self.adaptive)
        stats_file = None
        if config.stats_file:
            extra = None if self.adaptive is None else (lambda: {"adaptive": [self.adaptive.report()]})
            stats_file = StatsFile(config.stats_file.replace("{rank}", str(_rank())), extra)
        self.loop = LayerLoop(model, self.layers, self.strategies, self.backend, self.patches, vllm_config,
                              stats=step_stats, stats_file=stats_file, op_times=config.op_times,
                              agreed_rows=config.agreed_rows)
        self._model = model
        #: the ops' tensor work and the final norm: compiled in a compiled engine (`tbo.integrations.vllm.compute`),
        #: as they are otherwise
        self.compute = EAGER
        if is_compiled(model):
            self.compute = CompiledCompute(vllm_config.compilation_config, [*self.layers, self.loop.ends],
                                           (step_stats, PROCESS_STATS))
            self.loop.compute = self.compute
            for layer in self.layers:
                layer.compute = self.compute
                if layer.runner is not None:  # built now: a trace of the compiled experts call finds it built
                    layer.runner.routed_experts._ensure_moe_quant_config_init()
            for s in (step_stats, PROCESS_STATS):  # the most graphs the compiled ops can make, beside their count
                s.op_compile_bound += self.compute.bound
        #: vLLM rotary kernels that would make a split step differ from the unsplit one, rerouted (fixes.py)
        self.rotary_fix = fix_rotary_embeddings(model)
        if self.rotary_fix:
            logger.warning("tbo: %d rotary-embedding module(s) rotate 3-D query/key views wrongly on this platform; "
                           "they run through 2-D copies here. A model whose attention passes them 3-D views "
                           "(DeepSeek's MLA) gets batch-dependent tokens from plain vLLM; one passing 2-D tensors "
                           "(Qwen3-MoE) computes the same either way. See tbo.integrations.vllm.fixes",
                           len(self.rotary_fix))
        #: which forward each step runs, where vLLM's own runs the unsplit ones (`tbo.integrations.vllm.compiled`):
        #: engines, compiled or eager, whose unsplit step vLLM's forward computes as tbo's loop would
        self.forwards = None
        #: a compiled engine whose every step runs the loop: vLLM's ``do_not_compile`` to put back (its graph of the
        #: whole model is never compiled: no step would run it)
        self._graph_off: Any = None
        mode = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
        full_graphs = mode is not None and mode.has_full_cudagraphs()
        # with a FULL cudagraph_mode (GPUs) unsplit steps are vLLM's graphs, whatever the backend (graphs.py)
        if vllm_runs_unsplit(backend=self.backend, afd=self.afd, op_times=config.op_times,
                             data_parallel_size=vllm_config.parallel_config.data_parallel_size) or (
                self.compute.compiled and full_graphs):
            self.forwards = StepForwards(model, self.loop, (step_stats, PROCESS_STATS))
        elif self.compute.compiled:
            self._graph_off = vllm_graph_off(model)
        #: a FULL ``cudagraph_mode``: CUDA graphs of split decode steps, captured and replayed by vLLM's own
        #: ``CUDAGraphWrapper`` (`tbo.integrations.vllm.graphs`); None otherwise (a CPU: vLLM's mode is NONE there)
        self.graphs = None
        if full_graphs:
            from tbo.integrations.vllm.graphs import SplitGraphs, check_graph_backend

            if self.backend is not None:  # what the captured decode steps dispatch through
                check_graph_backend(backend_for(self.backend, "decode"))
            self.graphs = self.patches.graphs = SplitGraphs(self.patches.policy, (step_stats, PROCESS_STATS))
        #: speculative decoding with MTP: the drafter's forwards through tbo too (`tbo.integrations.vllm.draft`)
        self.draft = None
        if runs_draft_pass(vllm_config.speculative_config):
            from tbo.integrations.vllm.draft import DraftPass

            self.draft = DraftPass(runner, self.backend, tp,
                                   lambda layers, mode: self._bind(getattr(names, mode), top_k, mode, layers),
                                   config.split_policy(), (step_stats, PROCESS_STATS),
                                   vllm_unsplit=self.forwards is not None, after=self.loop.write_stats,
                                   fp8_dispatch=self.fp8_dispatch)
        self._install()
        if vllm_config.parallel_config.data_parallel_size > 1:
            from tbo.integrations.vllm.dp import install_data_parallel

            install_data_parallel(self)
        logger.info("tbo: %s layers (%d MoE here) through strategies %s / %s, backend %r, %s", len(self.layers),
                    sum(layer.kind == "moe" for layer in self.layers), names.decode, names.prefill, self.backend,
                    config.split_policy())

    def _bind(self, name: str, top_k: int, mode: str, layers: list[Any] | None = None) -> Any:
        """The ``mode`` strategy ``name`` bound to the layers (``layers``: others, the MTP drafter's), sized for and
        checked against the backend its steps run over (DeepEP low-latency decode: one un-received call at a
        time)."""
        backend = backend_for(self.backend, mode)
        try:
            return strategies.bind_layers(self.layers if layers is None else layers,
                                          strategies.sized_for(strategies.get(name), backend, top_k), backend=backend)
        except StrategyError as e:
            raise TboConfigError(f"additional_config['tbo'] strategy {name!r} cannot run vLLM's {self.family} "
                                 f"layers: {e}") from None

    def _install(self) -> None:
        runner = self.runner
        execute, shutdown, sample = runner.execute_model, runner.shutdown, runner.sample_tokens
        init_builders = runner.initialize_metadata_builders

        @functools.wraps(init_builders)
        def initialize_metadata_builders(*args: Any, **kwargs: Any) -> Any:
            with self.patches.microbatching():  # one attention metadata builder per microbatch
                result = init_builders(*args, **kwargs)
            check_metadata_builders(runner.attn_groups, self.patches.policy.num_microbatches)
            if self.draft is not None:  # the drafter's attention groups: a builder per microbatch too
                self.draft.make_builders(self.patches.policy.num_microbatches)
            return result

        @functools.wraps(execute)
        def execute_model(*args: Any, **kwargs: Any) -> Any:
            with self.patches.scope():
                return execute(*args, **kwargs)

        @functools.wraps(sample)
        def sample_tokens(*args: Any, **kwargs: Any) -> Any:
            out = sample(*args, **kwargs)
            if self.adaptive is not None:  # the step's tokens are on the host: its wall time is measured
                self.adaptive.step_done()
            return out

        @functools.wraps(shutdown)
        def shutdown_(*args: Any, **kwargs: Any) -> Any:
            try:
                self.close()
            except Exception:  # noqa: BLE001 - taking tbo off must not keep vLLM from releasing the engine
                logger.exception("tbo: taking tbo off the runner failed; vLLM's own shutdown goes on")
            return shutdown(*args, **kwargs)

        if self.forwards is None:
            self._model.forward = self.loop
        else:  # vLLM's forward (or graph) for unsplit steps, the loop for split ones, chosen per step
            self.patches.on_step = self.forwards.on_step
            if self.compute.compiled:  # vLLM's warm-up compiles tbo's ops too (StepForwards.warming_up)
                dummy_run = runner._dummy_run

                @functools.wraps(dummy_run)
                def _dummy_run(*args: Any, **kwargs: Any) -> Any:
                    if self.compute.warm:
                        return dummy_run(*args, **kwargs)
                    with self.forwards.warming_up():
                        return dummy_run(*args, **kwargs)

                runner._dummy_run = _dummy_run
        runner.execute_model, runner.shutdown = execute_model, shutdown_
        if self.adaptive is not None:
            runner.sample_tokens = sample_tokens
        runner.initialize_metadata_builders = initialize_metadata_builders
        if self.graphs is not None:  # vLLM's capture of a size tbo splits runs with the size's plan
            runner._warmup_and_capture = self.graphs.wrap(runner._warmup_and_capture, self.patches)
        runner.tbo = self

    def close(self) -> None:
        """Take tbo off the runner and its model, log the summary line, write ``stats_file`` if configured.

        Each part runs whatever an earlier one raised (the first error is raised at the end), and the diagnostics
        (the summary line, ``stats_file``) never raise: a shutdown is no place to lose vLLM's own teardown."""
        for obj, name in ((self._model, "forward"), (self.runner, "execute_model"), (self.runner, "shutdown"),
                          (self.runner, "sample_tokens"),
                          (self.runner, "initialize_metadata_builders"), (self.runner, "_dummy_run"),
                          (self.runner, "_warmup_and_capture"),
                          (self.runner, "tbo")):
            obj.__dict__.pop(name, None)
        if self.forwards is not None:
            self.patches.on_step = None
            self.forwards.close()
        if self._graph_off is not None:
            self._graph_off()
            self._graph_off = None
        if self.draft is not None:
            self.draft.close()
        try:
            if self.afd is not None:
                self.afd.close()
        finally:
            self.rotary_fix.restore()
            try:
                logger.info(summary_line(self.loop.stats))
                if self.adaptive is not None:
                    for line in self.adaptive.split.summary():
                        logger.info("tbo adaptive: %s", line)
            except Exception:  # noqa: BLE001 - a diagnostic
                logger.exception("tbo: the summary line failed")
            if self.adaptive is not None:
                from tbo.integrations.vllm.adaptive import LIVE

                if self.adaptive in LIVE:
                    LIVE.remove(self.adaptive)
            self.loop.write_stats()
