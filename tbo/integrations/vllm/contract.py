"""The contract between tbo and vLLM's source: every vLLM symbol tbo's vLLM integration imports, wraps, patches,
calls by keyword or reads an attribute of, and in which vLLM releases it must be there.

Why a table: tbo reaches into vLLM's model runner and model layers (private methods, attributes set in
``__init__``, a module global it reroutes). A vLLM release that renames or moves one of them breaks tbo at an
engine's start, or worse, leaves a patch with nothing to patch. With every such symbol listed here, one place says
what tbo depends on, and a checker (`tbo.tools.vllm_contract`, ``make contract``) reads each admitted release's
source by AST, never importing it, and fails by entry name when one moved: before a user meets it.

This module imports nothing of vLLM (it is data). An entry's ``where`` names the tbo modules that depend on it; a
change there that adds a vLLM symbol adds its entry here (``tests/test_vllm_contract.py`` keeps the table and the
code's vLLM imports in step).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["ALL", "CONTRACT", "KINDS", "RUNNERS", "V1", "V2_ENTRIES", "Entry", "entries_for", "release_of"]

#: the vLLM releases (major.minor) tbo admits, each with the model runners it has: ``"v1"`` (``vllm/v1/worker/
#: gpu_model_runner.py`` and the CPU runner deriving from it) and ``"v2"`` (Model Runner V2, ``vllm/v1/worker/gpu/``
#: and ``vllm/v1/worker/cpu/``). 0.34 deleted V1 (``gpu_model_runner.py``, ``cpu_model_runner.py``,
#: ``gpu_input_batch.py``, ``split_attn_metadata``, V1's spec-decode proposers). The version gate
#: (`tbo.integrations.vllm.admit.checks.check_vllm_version`) and the contract both read this.
RUNNERS: dict[str, tuple[str, ...]] = {"0.32": ("v1", "v2"), "0.33": ("v1", "v2"), "0.34": ("v2",)}
#: the releases the contract covers
ALL = tuple(RUNNERS)
#: the releases that still have V1's model runner
V1 = tuple(r for r, runners in RUNNERS.items() if "v1" in runners)

#: how tbo uses a symbol, and so what the checker asks of it
KINDS = {
    "module": "the module exists",
    "import": "``from module import name``: the name is bound at the module's top level (defined, assigned or "
              "re-exported)",
    "call": "tbo calls it with these parameter names: each is a parameter of its signature",
    "wrap": "tbo wraps this method (on the class, or on a runner instance): it exists with these parameters",
    "patch": "tbo replaces this module global or instance attribute for a scope: it is bound there, with these "
             "parameters",
    "read": "tbo reads these attributes of the class's instances: each is assigned in the class body, a method's "
            "``self.<attr> = ...``, or defined as a method or property (the class or an in-tree base)",
    "subclass": "tbo subclasses it: the class exists",
}


@dataclass(frozen=True)
class Entry:
    """One vLLM symbol tbo depends on (see the module docstring)."""

    module: str  #: the dotted module, ``vllm.v1.worker.gpu_model_runner``
    name: str | None  #: ``Class``, ``Class.method``, ``function`` or a global; None: the module itself
    kind: str  #: one of `KINDS`
    #: the parameter names tbo passes or binds (each must be one of the signature's); with ``leading``, the first
    #: positional parameters after ``self``, in this order
    params: tuple[str, ...] = ()
    attrs: tuple[str, ...] = ()  #: ``read``: the attributes tbo reads on an instance
    releases: tuple[str, ...] = ALL  #: the releases that must have it
    #: ``wrap`` on the class itself (the plugin wraps ``cls.__dict__[method]``): defined in that class, not a base
    own: bool = False
    leading: bool = False  #: ``params`` are the leading positional parameters, in order (tbo calls positionally)
    where: str = ""  #: the tbo modules that depend on it, under ``tbo.integrations.vllm``

    @property
    def label(self) -> str:
        """The entry's name in reports: ``module:name``."""
        return self.module if self.name is None else f"{self.module}:{self.name}"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"contract entry {self.label}: kind {self.kind!r} is not one of {', '.join(KINDS)}")
        unknown = [r for r in self.releases if r not in ALL]
        if unknown:
            raise ValueError(f"contract entry {self.label}: releases {unknown} are not covered ({', '.join(ALL)})")
        if self.kind == "read" and not self.attrs:
            raise ValueError(f"contract entry {self.label}: a 'read' entry lists the attributes read")


def release_of(version: str) -> str:
    """``"0.33"`` for a vLLM version ``"0.33.0"`` (or ``"0.33.1rc1"``, ``"0.33"``); a `ValueError` naming it when it
    does not start with ``major.minor``."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise ValueError(f"vLLM version {version!r} is not major.minor[.patch]")
    return f"{int(m[1])}.{int(m[2])}"


_GPU = "vllm.v1.worker.gpu_model_runner"
_CPU = "vllm.v1.worker.cpu_model_runner"
_MOE = "vllm.model_executor.layers.fused_moe"
_FWD = "vllm.forward_context"
_V2 = "vllm.v1.worker.gpu.model_runner"
_V2U = "vllm.v1.worker.gpu.ubatch_utils"

#: Model Runner V2's symbols (`tbo.integrations.vllm.runner.v2`, the V2 runner classes of the plugin and of
#: `tbo.integrations.vllm.admit.runners`), part of `CONTRACT`; ``tests/vllm/test_v2.py`` also asks the installed vLLM
#: for each (Python's view of what the checker reads). tbo's V2 port was written against 0.32; an entry that holds
#: on fewer releases says where and why in a comment (docs/versions.md, "Model Runner V2 across releases").
V2_ENTRIES: tuple[Entry, ...] = (
    # ---- the runner classes whose load_model the plugin wraps (never silent: tbo's checks before the weights) -----
    Entry(_V2, "GPUModelRunner.load_model", "wrap", params=("load_dummy_weights",), own=True,
          where="plugin (RUNNER_CLASSES), admit.runners (V2_RUNNER_CLASSES)"),
    Entry("vllm.v1.worker.cpu.model_runner", "CPUModelRunner.load_model", "wrap", params=("load_dummy_weights",),
          where="plugin (RUNNER_CLASSES; inherited from V2's GPUModelRunner, wrapped there), admit.runners"),
    Entry("vllm.v1.worker.mm_encoder_model_runner", "MMEncoderModelRunner.load_model", "wrap",
          params=("load_dummy_weights",),
          where="plugin (RUNNER_CLASSES; inherited from V2's GPUModelRunner, wrapped there), admit.runners"),
    # 0.34 only: the non-x86 CPU worker's V2 runner without Triton (``CpuPlatform.uses_standalone_cpu_model_runner``),
    # not a GPUModelRunner subclass, its own load_model. The plugin wraps it so that tbo's config is refused there by
    # name (never silent): admit.runners.REFUSED_RUNNER_CLASSES.
    Entry("vllm.v1.worker.cpu.standalone_model_runner", "StandaloneCPUModelRunner.load_model", "wrap",
          params=("load_dummy_weights",), own=True, releases=("0.34",),
          where="plugin (RUNNER_CLASSES: admit.runners.REFUSED_RUNNER_CLASSES, refused by runner_kind)"),
    # ---- the V2 runner's methods wrapped on the instance, attributes read -------------------------------------------
    Entry(_V2, "GPUModelRunner.execute_model", "wrap", params=("scheduler_output",), where="runner.v2"),
    Entry(_V2, "GPUModelRunner.initialize_kv_cache", "wrap", params=("kv_cache_config",), where="runner.v2"),
    Entry(_V2, "GPUModelRunner.gather_batch_req_state", "wrap", params=("scheduler_output", "dummy_run"),
          leading=True, where="runner.v2 (V2Patches.scope: its result[0], the step's BatchReqState)"),
    Entry(_V2, "GPUModelRunner.shutdown", "wrap", where="runner.v2"),
    Entry(_V2, "GPUModelRunner.sample_tokens", "wrap", params=("grammar_output",),
          where="runner.v2 (split: \"adaptive\": the step's clock stops when its tokens are sampled)"),
    Entry(_V2, "GPUModelRunner", "read",
          attrs=("vllm_config", "model", "model_state", "attn_groups", "kv_cache_config", "device", "max_num_reqs",
                 "ubatch_runner"), where="runner.v2, runner.engine (ubatch_runner also set: tbo's TboUBatchRunner)"),
    # the split decision: the module global as gpu/model_runner.py imported it (from gpu/dp_utils.py)
    Entry(_V2, "dispatch_cg_and_sync_dp", "patch", params=("cudagraph_manager", "num_reqs", "num_tokens"),
          leading=True, where="runner.v2 (_DISPATCH: vLLM's own, then tbo's descriptor)"),
    Entry(_V2, "BatchReqState", "read",
          attrs=("num_scheduled_tokens", "is_prefilling_np", "num_computed_prefill_tokens_np", "num_draft_tokens_np"),
          where="runner.v2 (v2_facts)"),
    Entry("vllm.v1.worker.gpu.cudagraph_utils", "BatchExecutionDescriptor", "read",
          attrs=("cg_mode", "num_tokens", "num_ubatches"), where="runner.v2 (dataclasses.replace(num_ubatches=))"),
    # ---- the microbatch setup: metadata builders per microbatch, the step's sub-batches -----------------------------
    Entry("vllm.v1.worker.gpu", "attn_utils", "import", where="runner.v2"),
    Entry("vllm.v1.worker.gpu.attn_utils", "get_num_ubatches", "patch", params=("parallel_config",), leading=True,
          where="runner.v2 (V2Patches.microbatching, during initialize_kv_cache)"),
    Entry("vllm.v1.worker.gpu.attn_utils", "build_slot_mappings_by_layer", "call",
          params=("slot_mappings", "kv_cache_config"), leading=True, where="runner.v2 (TboUBatchRunner.prepare)"),
    Entry(_V2U, "_slice_input_batch", "call",
          params=("input_batch", "ubatch_slice", "query_start_loc_buf", "seq_lens_buf"), leading=True,
          where="runner.v2 (TboUBatchRunner.prepare)"),
    Entry(_V2U, "UBatchState", "call", params=("slices", "forward_contexts"), where="runner.v2"),
    # what V2's execute_model asks of its ubatch_runner, which tbo's TboUBatchRunner answers in its place. 0.34 changed
    # prepare's signature: (input_batch, block_tables, slot_mappings, batch_desc, dp_sync_state=None, for_capture=),
    # called with batch_desc and dp_sync_state positionally, where 0.32 and 0.33 have cg_mode=. TboUBatchRunner.prepare
    # takes either (its fourth parameter is the mode or the descriptor whose cg_mode it reads; its fifth 0.34's
    # dp_sync_state), so each signature is an entry for its releases.
    Entry(_V2U, "UBatchRunner.prepare", "patch",
          params=("input_batch", "block_tables", "slot_mappings", "cg_mode", "for_capture"), leading=True,
          releases=("0.32", "0.33"), where="runner.v2 (TboUBatchRunner.prepare, in the runner's ubatch_runner)"),
    Entry(_V2U, "UBatchRunner.prepare", "patch",
          params=("input_batch", "block_tables", "slot_mappings", "batch_desc", "dp_sync_state", "for_capture"),
          leading=True, releases=("0.34",),
          where="runner.v2 (TboUBatchRunner.prepare, in the runner's ubatch_runner; 0.34's signature)"),
    Entry(_V2U, "UBatchRunner.run", "patch", params=("model", "model_inputs", "ubatch_state"), leading=True,
          where="runner.v2 (TboUBatchRunner.run)"),
    Entry(_V2U, "UBatchRunner.abort_pending_run", "patch", where="runner.v2 (TboUBatchRunner.abort_pending_run)"),
    # six parameters passed positionally, then for_capture= and ubatch_idx= by keyword (their order is checked too)
    Entry("vllm.v1.worker.gpu.model_states.interface", "ModelState.prepare_attn", "call",
          params=("input_batch", "cudagraph_mode", "block_tables", "slot_mappings", "attn_groups", "kv_cache_config",
                  "for_capture", "ubatch_idx"), leading=True, where="runner.v2 (TboUBatchRunner.prepare)"),
    Entry("vllm.v1.worker.gpu.input_batch", "InputBatch", "read",
          attrs=("num_tokens", "num_scheduled_tokens", "is_padding", "max_query_len"),
          where="runner.v2 (TboUBatchRunner.prepare; dataclasses.replace(max_query_len=))"),
)

#: every vLLM symbol tbo's vLLM integration depends on, and how (the module docstring)
CONTRACT: tuple[Entry, ...] = (
    # ---- the plugin: what vLLM's runners and engine core give tbo to wrap ---------------------------------------
    Entry(_GPU, "GPUModelRunner.load_model", "wrap", params=("load_dummy_weights",), own=True, releases=V1,
          where="plugin (RUNNER_CLASSES)"),
    Entry(_CPU, "CPUModelRunner.load_model", "wrap", params=("load_dummy_weights",), own=True, releases=V1,
          where="plugin (RUNNER_CLASSES)"),
    Entry(_CPU, "_set_torch_accelerator_to_noop", "call", releases=V1, where="afd.ffn"),
    Entry("vllm.v1.engine.core", "DPEngineCoreProc._has_global_unfinished_reqs", "wrap", params=("local_unfinished",),
          own=True, leading=True, where="plugin (DP_ENGINE_SYNC), runner.dp"),
    Entry("vllm.v1.engine.core", "DPEngineCoreProc", "read",
          attrs=("vllm_config", "dp_group", "dp_rank", "input_queue"), where="plugin, runner.dp"),
    Entry("vllm.platforms", "current_platform", "import", where="plugin, runner.engine, afd, model.masked"),
    Entry("vllm.platforms.interface", "Platform", "read", attrs=("device_type", "dist_backend", "is_cuda"),
          where="plugin, runner.engine, afd, model.masked"),
    Entry("vllm.version", "__version__", "import", where="plugin, afd.ffn (vllm.__version__, the version gate)"),
    # ---- the V1 runner: methods wrapped on the instance, the decision patched, attributes read -------------------
    Entry(_GPU, "GPUModelRunner.execute_model", "wrap", params=("scheduler_output",), releases=V1,
          where="runner.install, runner.dp"),
    Entry(_GPU, "GPUModelRunner.sample_tokens", "wrap", params=("grammar_output",), releases=V1,
          where="runner.install"),
    Entry(_GPU, "GPUModelRunner.shutdown", "wrap", releases=V1, where="runner.install"),
    Entry(_GPU, "GPUModelRunner.initialize_metadata_builders", "wrap",
          params=("kv_cache_config", "kernel_block_sizes"), releases=V1, where="runner.install"),
    Entry(_GPU, "GPUModelRunner._warmup_and_capture", "wrap", params=("desc", "cudagraph_runtime_mode"),
          releases=V1, where="runner.install, step.graphs"),
    Entry(_GPU, "GPUModelRunner._dummy_run", "wrap", params=("num_tokens",), releases=V1,
          where="runner.install, runner.dp"),
    Entry(_GPU, "GPUModelRunner._determine_batch_execution_and_padding", "patch",
          params=("num_tokens", "num_reqs", "num_scheduled_tokens_np", "force_eager"), releases=V1,
          where="runner.patches (shadowed on the instance, bound by name)"),
    Entry(_GPU, "GPUModelRunner._allow_microbatching", "call", params=("num_reqs", "num_scheduled_tokens_np"),
          leading=True, releases=V1, where="runner.patches (the prefix-cache veto)"),
    Entry(_GPU, "GPUModelRunner", "read",
          attrs=("vllm_config", "model", "parallel_config", "compilation_config", "speculative_config",
                 "input_batch", "attn_groups", "drafter"), releases=V1,
          where="plugin, runner.engine, runner.patches, runner.install, runner.dp, runner.draft"),
    Entry(_GPU, "maybe_create_ubatch_slices", "patch", releases=V1,
          where="runner.patches (the module global, rerouted to the runner in scope)"),
    Entry("vllm.v1.worker.ubatch_utils", "maybe_create_ubatch_slices", "call", params=("should_ubatch",),
          leading=True, where="runner.patches (vLLM's function, called through)"),
    Entry("vllm.v1.worker.ubatch_utils", "UBatchSlice", "call", params=("request_slice", "token_slice"),
          leading=True, where="step.batch, runner.v2"),
    Entry("vllm.v1.worker.ubatch_utils", "split_attn_metadata", "call", releases=V1, where="runner.draft"),
    Entry("vllm.v1.worker.gpu_input_batch", "InputBatch", "read",
          attrs=("num_computed_tokens_cpu", "num_prompt_tokens", "spec_token_ids"), releases=V1,
          where="runner.patches (the batch tbo decides on)"),
    Entry("vllm.v1.worker.dp_utils", "skip_dp_coordination", "call", where="step.agree"),
    Entry("vllm.v1.worker.utils", "AttentionGroup", "read",
          attrs=("backend", "layer_names", "metadata_builders", "kernel_block_size", "create_metadata_builders",
                 "get_metadata_builder", "_with_kernel_block_table"), where="runner.patches, runner.draft"),
    Entry("vllm.v1.worker.utils", "AttentionGroup.create_metadata_builders", "call",
          params=("kernel_block_size", "num_metadata_builders"), where="runner.draft"),
    # ---- the MTP drafter (V1's proposer) --------------------------------------------------------------------------
    Entry("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer", "read",
          attrs=("vllm_config", "device", "model", "draft_attn_groups"), releases=V1, where="runner.draft"),
    Entry("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer.build_per_group_and_layer_attn_metadata",
          "wrap", params=("common_attn_metadata", "draft_index"), leading=True, releases=V1, where="runner.draft"),
    # ---- the forward context --------------------------------------------------------------------------------------
    Entry(_FWD, "get_forward_context", "call", where="runner.loop, runner.draft"),
    Entry(_FWD, "override_forward_context", "call", params=("forward_context",), where="runner.contexts"),
    Entry(_FWD, "create_forward_context", "call",
          params=("attn_metadata", "vllm_config", "dp_metadata", "cudagraph_runtime_mode", "batch_descriptor",
                  "slot_mapping", "additional_kwargs", "skip_compiled", "is_padding"),
          where="runner.contexts, runner.v2"),
    Entry(_FWD, "set_forward_context", "call", params=("attn_metadata", "vllm_config", "num_tokens"),
          where="afd.ffn"),
    Entry(_FWD, "ForwardContext", "read",
          attrs=("attn_metadata", "slot_mapping", "cudagraph_runtime_mode", "batch_descriptor", "additional_kwargs",
                 "skip_compiled", "is_padding"), where="runner.contexts, runner.draft"),
    # ---- configs ----------------------------------------------------------------------------------------------------
    Entry("vllm.config", "CUDAGraphMode", "import", where="runner.dp, runner.v2"),
    Entry("vllm.config", "set_current_vllm_config", "call", where="afd.ffn"),
    Entry("vllm.config.vllm", "VllmConfig", "read",
          attrs=("additional_config", "model_config", "parallel_config", "scheduler_config", "compilation_config",
                 "speculative_config", "lora_config", "instance_id"), where="plugin, admit, runner, afd, metrics"),
    Entry("vllm.config.parallel", "ParallelConfig", "read",
          attrs=("data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size", "enable_expert_parallel",
                 "enable_dbo", "ubatch_size", "enable_eplb", "expert_placement_strategy",
                 "decode_context_parallel_size", "prefill_context_parallel_size", "use_ubatching", "num_ubatches"),
          where="admit (checks, parallel, speculative), runner.engine, runner.patches (use_ubatching and "
                "num_ubatches: what the microbatching shim answers for)"),
    Entry("vllm.config.parallel", "ParallelConfig", "read", attrs=("cpu_distributed_timeout_seconds",),
          releases=("0.33", "0.34"), where="runner.dp (the engine-loop DP sync's point-to-point waits read it)"),
    Entry("vllm.config.model", "ModelConfig", "read",
          attrs=("hf_config", "hf_text_config", "dtype", "enforce_eager", "quantization", "use_mla",
                 "served_model_name"), where="admit, runner.engine, step.agree, afd, metrics"),
    # ---- the stat-logger plugin (entry point vllm.stat_logger_plugins): tbo's figures in /metrics ------------------
    Entry("vllm.v1.metrics.loggers", "AggregateStatLoggerBase", "subclass", where="metrics"),
    Entry("vllm.v1.metrics.loggers", "AggregateStatLoggerBase.__init__", "wrap",
          params=("vllm_config", "engine_indexes"), leading=True, where="metrics (TboStatLogger's constructor)"),
    Entry("vllm.v1.metrics.loggers", "StatLoggerBase.record", "wrap",
          params=("scheduler_stats", "iteration_stats", "mm_cache_stats", "engine_idx"), leading=True,
          where="metrics (TboStatLogger.record)"),
    Entry("vllm.v1.metrics.loggers", "StatLoggerBase.log_engine_initialized", "wrap", where="metrics"),
    # ---- the endpoint plugin (entry point vllm.endpoint_plugins, allow-listed by VLLM_PLUGINS): GET /tbo/trace --------
    Entry("vllm.plugins", "ENDPOINT_PLUGINS_GROUP", "import", where="trace_route (the group pyproject.toml names)"),
    Entry("vllm.plugins", "load_endpoint_plugins", "call", params=("supported_tasks",),
          where="trace_route (vLLM's loader: a plugin VLLM_PLUGINS does not name is never loaded)"),
    Entry("vllm.plugins.endpoint_plugins.interface", "EndpointPlugin", "read", attrs=("name", "required_tasks"),
          where="trace_route (TboTraceEndpoint's name and required_tasks)"),
    Entry("vllm.plugins.endpoint_plugins.interface", "EndpointPlugin.attach_router", "wrap", params=("app",),
          leading=True, where="trace_route (TboTraceEndpoint.attach_router)"),
    Entry("vllm.plugins.endpoint_plugins.interface", "EndpointPlugin.init_state", "wrap",
          params=("engine_client", "state", "args"), leading=True, where="trace_route (TboTraceEndpoint.init_state)"),
    Entry("vllm.engine.protocol", "EngineClient", "read", attrs=("vllm_config",),
          where="trace_route (init_state reads the engine's config)"),
    Entry("vllm.config.scheduler", "SchedulerConfig", "read", attrs=("max_num_seqs", "max_num_batched_tokens"),
          where="runner.engine, afd.attention"),
    Entry("vllm.config.compilation", "CompilationConfig", "read",
          attrs=("cudagraph_mode", "backend", "inductor_compile_config", "static_forward_context"),
          where="admit.graphs, runner.dp, step.agree, model.compute"),
    Entry("vllm.config.compilation", "CUDAGraphMode", "read", attrs=("has_full_cudagraphs", "NONE", "FULL"),
          where="runner.engine, admit.graphs, step.graphs"),
    Entry("vllm.config.speculative", "SpeculativeConfig", "read", attrs=("method", "num_speculative_tokens"),
          where="admit.speculative, runner.engine, runner.draft"),
    Entry("vllm.engine.arg_utils", "EngineArgs.create_engine_config", "call", where="afd.ffn"),
    Entry("vllm.compilation.counter", "compilation_counter", "import", where="runner.forwards"),
    Entry("vllm.compilation.counter", "CompilationCounter", "read",
          attrs=("num_graphs_seen", "num_backend_compilations", "num_compiled_artifacts_loaded"),
          where="runner.forwards"),
    # ---- distributed ------------------------------------------------------------------------------------------------
    Entry("vllm.distributed", "get_dp_group", "call", where="runner.dp"),
    Entry("vllm.distributed", "get_ep_group", "call", where="comm.ep"),
    Entry("vllm.distributed", "get_tp_group", "call", where="comm.tp, runner.engine"),
    Entry("vllm.distributed", "get_tensor_model_parallel_world_size", "call", where="runner.engine"),
    Entry("vllm.distributed", "tensor_model_parallel_all_reduce", "call", where="model.layers"),
    Entry("vllm.distributed", "init_distributed_environment", "call", where="afd.ffn"),
    Entry("vllm.distributed", "ensure_model_parallel_initialized", "call", where="afd.ffn"),
    Entry("vllm.distributed", "parallel_state", "import", where="afd.ffn"),
    Entry("vllm.distributed.parallel_state", "GroupCoordinator", "read",
          attrs=("cpu_group", "world_size", "unique_name", "device_communicator"),
          where="runner.dp, comm, afd.ffn"),
    Entry("vllm.model_executor.model_loader", "get_model", "call", params=("vllm_config",), where="afd.ffn"),
    # ---- the model layers: MoE runner and experts, linear, models ----------------------------------------------------
    Entry(f"{_MOE}.runner.moe_runner_interface", "MoERunnerInterface", "import", where="model.structure"),
    Entry(f"{_MOE}.runner.moe_runner", "MoERunner", "read",
          attrs=("routed_experts", "router", "gate", "shared_experts", "shared_expert_gate", "routed_input_transform",
                 "routed_output_transform", "moe_config", "routed_scaling_factor", "_fused_output_is_reduced"),
          where="model.structure, model.layers"),
    Entry(f"{_MOE}.runner.shared_experts", "SharedExperts", "read", attrs=("_layer",), where="model.structure"),
    Entry(f"{_MOE}.routed_experts", "RoutedExperts", "read",
          attrs=("global_num_experts", "local_num_experts", "top_k", "quant_method", "moe_config", "expert_map",
                 "activation", "forward_modular", "_ensure_moe_quant_config_init"),
          where="model.structure, model.quant, model.masked, runner.engine"),
    Entry(f"{_MOE}.routed_experts", "RoutedExperts.forward_modular", "call", params=("x", "topk_weights", "topk_ids"),
          where="model.quant"),
    Entry(f"{_MOE}.config", "FusedMoEConfig", "read", attrs=("is_sequence_parallel", "dp_size", "has_bias",
                                                             "in_dtype"), where="model.structure, model.quant"),
    Entry(f"{_MOE}.modular_kernel", "FusedMoEKernel", "call", where="model.quant"),
    Entry(f"{_MOE}.modular_kernel", "FusedMoEActivationFormat", "read", attrs=("Standard",), where="model.quant"),
    Entry(f"{_MOE}.modular_kernel", "ExpertTokensMetadata", "call",
          params=("expert_num_tokens", "expert_num_tokens_cpu"), where="model.masked"),
    Entry(f"{_MOE}.prepare_finalize.no_dp_ep", "MoEPrepareAndFinalizeNoDPEPModular", "call", where="model.quant"),
    Entry(f"{_MOE}.utils", "moe_kernel_quantize_input", "call",
          params=("quant_dtype", "per_act_token_quant", "block_shape"), where="model.quant"),
    Entry(f"{_MOE}.experts.triton_moe", "TritonExperts", "import", where="model.masked"),
    Entry(f"{_MOE}.experts.fused_batched_moe", "BatchedTritonExperts", "call",
          params=("moe_config", "quant_config", "max_num_tokens", "num_dispatchers"), where="model.masked"),
    Entry("vllm.model_executor.layers.attention_layer_base", "AttentionLayerBase", "import",
          where="model.structure"),
    Entry("vllm.model_executor.layers.linear", "RowParallelLinear", "read", attrs=("reduce_results", "tp_size"),
          where="model.tp"),
    Entry("vllm.model_executor.models.qwen3_moe", "Qwen3MoeAttention.forward", "call",
          params=("positions", "hidden_states"), where="model.structure, model.layers"),
    Entry("vllm.model_executor.models.deepseek_v2", "_get_llama_4_scaling", "call",
          params=("original_max_position_embeddings", "scaling_beta", "positions"), where="model.layers"),
    Entry("vllm.model_executor.models.registry", "_TEXT_GENERATION_MODELS", "import", where="admit.catalog"),
) + V2_ENTRIES


def entries_for(release: str) -> list[Entry]:
    """The entries a vLLM ``release`` (``"0.34"``) must satisfy."""
    if release not in ALL:
        raise ValueError(f"vLLM {release} is not covered by tbo's contract ({', '.join(ALL)})")
    return [e for e in CONTRACT if release in e.releases]
