"""tbo on vLLM's Model Runner V2 (``vllm.v1.worker.gpu.model_runner.GPUModelRunner`` and its CPU subclass).

V2 has its own seat for a split step, vLLM's DBO, which it builds only with more than one DP rank: a
``BatchExecutionDescriptor`` with ``num_ubatches > 1`` from ``dispatch_cg_and_sync_dp`` makes ``execute_model`` ask
its ``ubatch_runner`` to ``prepare`` the step (one sub-batch, attention metadata from the runner's own builders and
forward context per microbatch: ``UBatchState``) and to ``run`` the model over it. tbo takes that seat on one rank,
for one ``execute_model`` call at a time (`V2Patches.scope`), with these changes only, each put back:

* ``initialize_kv_cache`` runs with vLLM's microbatch count (``get_num_ubatches``, as ``attn_utils`` reads it) the
  policy's, so that every attention group gets one metadata builder per microbatch (asserted after:
  `check_metadata_builders`), and the runner's ``ubatch_runner`` is tbo's `TboUBatchRunner`;
* ``gather_batch_req_state`` is watched, on the instance, for the step's ``BatchReqState`` (its requests in batch
  order, decode first: what tbo decides on);
* ``dispatch_cg_and_sync_dp``, as ``gpu/model_runner.py`` imported it, is vLLM's own and then tbo's decision
  (`tbo.integrations.engine.step.decide` on the step's `StepFacts`, `v2_facts`): a split step's descriptor says the
  plan's microbatch count; a dummy, profile or warm-up run without a batch, a padded or CUDA-graph step, stays vLLM's;
* `TboUBatchRunner.prepare` slices the batch by the plan's token and request ranges (vLLM's own sub-batch slicing,
  a cut request in both microbatches) and builds each microbatch's attention metadata with
  ``model_state.prepare_attn(..., ubatch_idx=k)``; its ``run`` calls the model once, whose layer stack is tbo's
  `LayerLoop`: microbatch k's stages run in microbatch k's forward context, as on V1.

Everything V2 does not run with tbo yet is refused at engine start (`tbo.integrations.vllm.admit.runners.check_v2`).
`V2_SYMBOLS` lists every V2 name this module reads, patches or wraps: the vLLM contract's V2 entries
(`tbo.integrations.vllm.contract.V2_ENTRIES`).
"""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Callable, Iterator

from tbo.integrations.engine.step import Step, StepFacts, decide_facts, readers_last
from tbo.integrations.engine.undo import UndoStack
from tbo.integrations.vllm.contract import V2_ENTRIES
from tbo.integrations.vllm.runner.engine import TboEngine
from tbo.integrations.vllm.runner.patches import check_metadata_builders, timed_sample
from tbo.integrations.vllm.step.decider import StepDecider

__all__ = ["TboUBatchRunner", "V2Engine", "V2Patches", "V2_SYMBOLS", "v2_facts"]

_RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"

#: every Model Runner V2 symbol tbo touches: the contract's V2 entries (`tbo.integrations.vllm.contract.V2_ENTRIES`,
#: one table, checked per release by AST and, for the installed vLLM, by ``tests/vllm/test_v2.py``)
V2_SYMBOLS = V2_ENTRIES


class _ModuleDispatch:
    """The process's one patch of a module global (``dispatch_cg_and_sync_dp`` in V2's runner module): a call goes to
    the `V2Patches` in scope on the calling thread, or to vLLM's own function where none is. Put back when the last
    scope of the process leaves."""

    def __init__(self, attr: str, handler: str) -> None:
        self.attr, self.handler = attr, handler
        self._lock = threading.Lock()
        self._users = 0
        self._module: Any = None
        self._original: Callable[..., Any] | None = None
        self._local = threading.local()

    def _stack(self) -> list[Any]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def enter(self, module: Any, owner: Any) -> None:
        with self._lock:
            if self._users == 0:
                self._module, self._original = module, getattr(module, self.attr)
                setattr(module, self.attr, self)
            self._users += 1
        self._stack().append(owner)

    def leave(self, owner: Any) -> None:
        stack = self._stack()
        if not stack or stack[-1] is not owner:
            raise RuntimeError(f"tbo's {self.attr} scopes left out of order on this thread")
        stack.pop()
        with self._lock:
            self._users -= 1
            if self._users == 0:
                setattr(self._module, self.attr, self._original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        stack, original = self._stack(), self._original
        assert original is not None
        if not stack:
            return original(*args, **kwargs)
        return getattr(stack[-1], self.handler)(original, *args, **kwargs)


_DISPATCH = _ModuleDispatch("dispatch_cg_and_sync_dp", "dispatch")


def v2_facts(batch: Any, padded_tokens: int) -> StepFacts:
    """V2's facts of a step, as tbo decides on them: the ``BatchReqState`` ``batch`` (requests in batch order) and the
    token count the runner will run (``padded_tokens``, the descriptor's)."""
    drafts = batch.num_draft_tokens_np
    return StepFacts(scheduled=tuple(int(n) for n in batch.num_scheduled_tokens),
                     past_prompt=tuple(not bool(p) for p in batch.is_prefilling_np),
                     computed=tuple(int(n) for n in batch.num_computed_prefill_tokens_np),
                     padded_tokens=int(padded_tokens),
                     drafts=None if drafts is None else tuple(int(d) for d in drafts))


class TboUBatchRunner:
    """What V2's ``execute_model`` asks of its ``ubatch_runner`` (``prepare``, ``run``), answered with tbo's plan:
    the microbatches are the decided `Step`'s, their metadata the runner's own builders', their forward the layer
    loop's (module docstring)."""

    def __init__(self, runner: Any, decider: StepDecider) -> None:
        self.runner, self.decider = runner, decider
        self.num_ubatches = decider.policy.num_microbatches
        self._buffers: list[tuple[Any, Any]] = []  #: per microbatch: query_start_loc and seq_lens, kept across steps
        #: the current split step's microbatch forward contexts (`prepare`), read by the layer loop
        self.contexts: list[Any] | None = None

    def _buffer(self, k: int) -> tuple[Any, Any]:
        import torch

        while len(self._buffers) <= k:
            n, device = self.runner.max_num_reqs, self.runner.device
            self._buffers.append((torch.zeros(n + 1, dtype=torch.int32, device=device),
                                  torch.zeros(n, dtype=torch.int32, device=device)))
        return self._buffers[k]

    def prepare(self, input_batch: Any, block_tables: Any, slot_mappings: Any, mode: Any = None,
                dp_sync_state: Any = None, for_capture: bool = False, **named: Any) -> Any:
        """Each microbatch of tbo's plan as V2's `UBatchState`: its slice of the input batch, and its attention
        metadata and forward context built by the runner's own model state (``ubatch_idx``: its own builder).

        ``mode``: the step's CUDA graph mode, which vLLM 0.32 and 0.33 pass as ``cg_mode``; 0.34 passes the step's
        ``BatchExecutionDescriptor`` (``batch_desc``, whose ``cg_mode`` it is) and its ``dp_sync_state`` (None on
        one rank; tbo's plan, not the sync's uniform count, cuts the step)."""
        mode = named.pop("cg_mode", named.pop("batch_desc", mode))
        if named:
            raise TypeError(f"TboUBatchRunner.prepare got unexpected arguments {sorted(named)} from vLLM's Model "
                            "Runner V2 (tbo.integrations.vllm.contract lists the signatures it answers)")
        cg_mode = getattr(mode, "cg_mode", mode)  # 0.34: the descriptor's
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import create_forward_context
        from vllm.v1.worker.gpu.attn_utils import build_slot_mappings_by_layer
        from vllm.v1.worker.gpu.ubatch_utils import UBatchState, _slice_input_batch
        from vllm.v1.worker.ubatch_utils import UBatchSlice

        step = self.decider.step
        if step is None or step.plan is None:
            raise RuntimeError("vLLM's Model Runner V2 asked tbo to prepare microbatches for a step tbo did not split")
        plan, runner = step.plan, self.runner
        if input_batch.num_tokens != plan.num_tokens:
            raise RuntimeError(f"tbo planned {plan.num_tokens} tokens but V2's input batch holds "
                               f"{input_batch.num_tokens}")
        cg_mode = CUDAGraphMode.NONE if cg_mode is None else cg_mode
        slices, contexts = [], []
        for k, mb in enumerate(plan.microbatches):
            s = UBatchSlice(slice(mb.requests_start, mb.requests_end), slice(mb.tokens_start, mb.tokens_end))
            query_start_loc, seq_lens = self._buffer(k)
            ubatch = _slice_input_batch(input_batch, s, query_start_loc, seq_lens)
            if getattr(ubatch, "max_query_len", None) is not None:  # the microbatch's own, not the step's
                ubatch = replace(ubatch, max_query_len=int(ubatch.num_scheduled_tokens.max()))
            slots = slot_mappings[:, s.token_slice]
            tables = tuple(table[s.request_slice] for table in block_tables)
            metadata = runner.model_state.prepare_attn(ubatch, cg_mode, tables, slots, runner.attn_groups,
                                                       runner.kv_cache_config, ubatch_idx=k, for_capture=for_capture)
            contexts.append(create_forward_context(metadata, runner.vllm_config, dp_metadata=None,
                                                   cudagraph_runtime_mode=cg_mode,
                                                   slot_mapping=build_slot_mappings_by_layer(slots,
                                                                                             runner.kv_cache_config),
                                                   is_padding=ubatch.is_padding))
            slices.append(s)
        self.contexts = contexts
        return UBatchState(slices=slices, forward_contexts=contexts)

    def run(self, model: Any, model_inputs: dict[str, Any], ubatch_state: Any) -> Any:
        """The whole model, once: its layer stack is the layer loop, which runs the microbatches."""
        if ubatch_state.forward_contexts is not self.contexts:
            raise RuntimeError("V2 runs a microbatched step tbo did not prepare")
        try:
            return model(**model_inputs)
        finally:
            self.contexts = None

    def microbatch_contexts(self, plan: Any) -> list[Any]:
        """The layer loop's microbatch contexts for ``plan`` (the ones `prepare` built for it)."""
        if self.contexts is None or len(self.contexts) != plan.num_microbatches:
            raise RuntimeError(f"tbo planned {plan.num_microbatches} microbatches but V2's runner prepared "
                               f"{'none' if self.contexts is None else len(self.contexts)}")
        return self.contexts

    def abort_pending_run(self) -> None:
        """V2's capture error path calls this; tbo starts no threads."""


class V2Patches:
    """The scoped patches that hand one V2 runner's steps to its `StepDecider` (module docstring)."""

    def __init__(self, runner: Any, decider: StepDecider) -> None:
        import importlib

        self.runner, self.decider = runner, decider
        self._module = importlib.import_module(_RUNNER_MODULE)
        self._batch: Any = None  #: the step's BatchReqState, as gather_batch_req_state returned it
        self._depth = 0
        #: steps the prefix-cache rule kept whole (`tbo.integrations.engine.step.readers_last`: a request reading
        #: cached blocks before another request of the step)
        self.vetoes = 0

    @property
    def policy(self) -> Any:
        return self.decider.policy

    @contextmanager
    def microbatching(self) -> Iterator[None]:
        """While it lasts, V2's attention setup (``attn_utils.get_num_ubatches``) makes one metadata builder per
        microbatch of the policy's count."""
        from vllm.v1.worker.gpu import attn_utils

        real, n = attn_utils.get_num_ubatches, self.policy.num_microbatches
        attn_utils.get_num_ubatches = lambda parallel_config: n
        try:
            yield
        finally:
            attn_utils.get_num_ubatches = real

    @contextmanager
    def scope(self) -> Iterator[None]:
        """Patch for one ``execute_model`` call, and restore."""
        runner = self.runner
        _DISPATCH.enter(self._module, self)
        self._depth += 1
        if self._depth == 1:
            gather = type(runner).gather_batch_req_state.__get__(runner)

            def gather_batch_req_state(*args: Any, **kwargs: Any) -> Any:
                result = gather(*args, **kwargs)
                self._batch = result[0]
                return result

            runner.gather_batch_req_state = gather_batch_req_state
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                runner.__dict__.pop("gather_batch_req_state", None)
                self._batch = None
                self.decider.step = None
            _DISPATCH.leave(self)

    def dispatch(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``dispatch_cg_and_sync_dp`` for this runner's step: vLLM's descriptor, with the plan's microbatch count
        where tbo splits the step."""
        from vllm.config import CUDAGraphMode

        desc, sync = original(*args, **kwargs)
        batch, self._batch = self._batch, None
        step: Step | None = None
        if batch is not None and sync is None:  # a real batch of one rank; dummy and profile runs stay vLLM's
            facts = v2_facts(batch, desc.num_tokens)
            if desc.cg_mode != CUDAGraphMode.NONE:  # a graph's step runs vLLM's graph, whole
                facts = replace(facts, allowed=False)
            step = decide_facts(self.policy, facts)
            adaptive = self.decider.adaptive
            if adaptive is not None:  # the measured choice's; planned again where it chose another count
                step = adaptive.decide(step, lambda policy: decide_facts(policy, facts))
            self.vetoes += int(facts.computed is not None and not readers_last(facts.scheduled, facts.computed))
        self.decider.step = step  # one decision, told once (the forward the step runs: StepForwards)
        if step is not None and step.plan is not None:
            desc = replace(desc, num_ubatches=step.plan.num_microbatches)
        return desc, sync


class V2Engine(TboEngine):
    """tbo on a Model Runner V2 runner: `TboEngine`'s build, its split and runner steps V2's (module docstring)."""

    def _build_split(self) -> None:
        self._build_decider()  # thresholds or the adaptive choice, as on V1
        self.patches = V2Patches(self.runner, self.decider)

    def _build_draft(self) -> None:  # refused on V2 at start (check_v2)
        self.draft = None

    def _build_loop(self) -> None:
        super()._build_loop()
        self.ubatches = TboUBatchRunner(self.runner, self.decider)
        assert self.loop is not None
        self.loop.contexts_for = self.ubatches.microbatch_contexts

    def _install(self) -> None:
        install_on_v2_runner(self, self.undo)


def install_on_v2_runner(engine: V2Engine, undo: UndoStack) -> None:
    """Wrap ``engine.runner``'s methods for ``engine``, each with its undo on ``undo``."""
    runner, patches = engine.runner, engine.patches
    init_kv = runner.initialize_kv_cache

    @functools.wraps(init_kv)
    def initialize_kv_cache(*args: Any, **kwargs: Any) -> Any:
        with patches.microbatching():  # one attention metadata builder per microbatch
            result = init_kv(*args, **kwargs)
        check_metadata_builders(runner.attn_groups, patches.policy.num_microbatches)
        if runner.ubatch_runner is not None and runner.ubatch_runner is not engine.ubatches:
            raise RuntimeError("vLLM built its own microbatch runner (DBO) beside tbo's")
        runner.ubatch_runner = engine.ubatches
        return result

    sample = runner.sample_tokens

    sample_tokens = timed_sample(engine, sample)

    from tbo.integrations.vllm.runner.install import _install_forward, install_step_and_shutdown

    _install_forward(engine, undo)
    install_step_and_shutdown(engine, undo)
    undo.set_attr(runner, "sample_tokens", sample_tokens)  # ends the step's clocks (the histogram's, adaptive's)
    undo.set_attr(runner, "initialize_kv_cache", initialize_kv_cache)
    undo.set_attr(runner, "ubatch_runner", engine.ubatches)
    undo.set_attr(runner, "tbo", engine)
