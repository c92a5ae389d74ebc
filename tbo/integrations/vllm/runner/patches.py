"""The two scoped patches that let tbo's `SplitPolicy` split a step of vLLM's model runner with data parallel 1.

vLLM 0.32's model runner already builds a step in microbatches when ``should_ubatch`` is set: per-microbatch slot
mappings, attention metadata from its own builders, and a forward context holding both as lists. With one
data-parallel rank it never sets it. For the duration of one ``execute_model`` call (and nothing else: not the
profiling and warm-up runs), `RunnerPatches.step`:

* shadows the runner's ``_determine_batch_execution_and_padding`` on this runner instance: vLLM's own result,
  with ``should_ubatch`` replaced by tbo's decision (`tbo.integrations.engine.step.decide`), which also honours
  vLLM's prefix-cache veto (``_allow_microbatching``, asked as if vLLM's microbatching were on);
* routes ``maybe_create_ubatch_slices`` in the model runner's module to the runner in scope, so that its slices
  are tbo's plan.

Both are put back when the call returns or raises. The module's function is process-wide, while engines (two in one
process, each in its own thread if the user likes) are not: it is patched once, by the first scope of any runner,
with a dispatcher (`_SlicesDispatch`) that finds the runner in scope on the calling thread (a thread with none gets
vLLM's own function), and vLLM's function is put back when the last scope of the process leaves. Scopes nest (a
dummy run inside ``execute_model``). With data parallel, the dummy runs (profiling, warm-up, an idle
rank's steps) are patched the same way (`dummy_scope`), and every step's decision is first agreed with the other DP
ranks (``agree``, `tbo.integrations.vllm.step.agree`). `RunnerPatches.microbatching` shows vLLM's own code the
runner's parallel config as it is with microbatching on, for two calls only: creating the attention metadata
builders (one per microbatch, as vLLM's DBO has) and vLLM's prefix-cache veto; `check_metadata_builders` then
asserts that every attention group got one builder of its own per microbatch (GPU builders keep persistent buffers:
a builder shared by two microbatches would overwrite microbatch 0's metadata with microbatch 1's, which CPU SDPA,
building fresh tensors, would hide).
"""

from __future__ import annotations

import inspect
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from tbo.integrations.engine.step import Step, decide
from tbo.integrations.vllm.step.slices import ubatch_slices
from tbo.split import ForwardMode, SplitPolicy

__all__ = ["MetadataBuilderError", "RunnerPatches", "check_metadata_builders"]

_DETERMINE = "_determine_batch_execution_and_padding"


class _Microbatching:
    """The engine's parallel config as vLLM's microbatching code reads it when microbatching is on with
    ``num_ubatches`` microbatches; every other attribute is the real config's."""

    def __init__(self, real: Any, num_ubatches: int) -> None:
        self._real, self.use_ubatching, self.num_ubatches = real, True, num_ubatches

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class MetadataBuilderError(RuntimeError):
    """An attention group without one metadata builder of its own per microbatch."""


def check_metadata_builders(attn_groups: list[list[Any]], num_microbatches: int) -> int:
    """Assert that every attention group of ``attn_groups`` (the runner's, per KV cache group) holds
    ``num_microbatches`` distinct metadata builders; returns how many groups were checked."""
    checked = 0
    for kv_group, groups in enumerate(attn_groups):
        for k, group in enumerate(groups):
            builders = list(group.metadata_builders)
            distinct = len({id(b) for b in builders})
            if len(builders) != num_microbatches or distinct != num_microbatches:
                layers = list(group.layer_names)
                raise MetadataBuilderError(
                    f"tbo needs one attention metadata builder per microbatch ({num_microbatches}), but attention "
                    f"group {k} of KV cache group {kv_group} ({group.backend.get_name()}, layers "
                    f"{layers[:2]}{'...' if len(layers) > 2 else ''}) has {len(builders)}, {distinct} distinct: "
                    f"microbatches sharing a builder would overwrite each other's attention metadata")
            checked += 1
    return checked


class _SlicesDispatch:
    """The process's one patch of the model runner module's ``maybe_create_ubatch_slices``: a call goes to the
    `RunnerPatches` in scope on the calling thread, or to vLLM's own function where none is."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0  #: scopes open in this process, over every runner and thread
        self._module: Any = None
        self._original: Callable[..., Any] | None = None
        self._local = threading.local()  #: ``stack``: this thread's RunnerPatches in scope, innermost last

    def enter(self, module: Any, patches: RunnerPatches) -> None:
        with self._lock:
            if self._users == 0:
                self._module, self._original = module, module.maybe_create_ubatch_slices
                module.maybe_create_ubatch_slices = self
            elif module is not self._module:
                raise RuntimeError(f"tbo patches {self._module.__name__}, not {module.__name__}")
            self._users += 1
        self._stack().append(patches)

    def leave(self, patches: RunnerPatches) -> None:
        stack = self._stack()
        if not stack or stack[-1] is not patches:
            raise RuntimeError("tbo's runner scopes left out of order on this thread")
        stack.pop()
        with self._lock:
            self._users -= 1
            if self._users == 0:
                self._module.maybe_create_ubatch_slices = self._original

    def in_scope(self) -> RunnerPatches | None:
        """The innermost `RunnerPatches` in scope on this thread."""
        stack = self._stack()
        return stack[-1] if stack else None

    def _stack(self) -> list[RunnerPatches]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def __call__(self, should_ubatch: bool, *args: Any, **kwargs: Any) -> Any:
        patches, original = self.in_scope(), self._original
        assert original is not None  # set by the first enter, and kept
        if patches is None:
            return original(should_ubatch, *args, **kwargs)
        return patches.slices(original, should_ubatch, *args, **kwargs)


_SLICES = _SlicesDispatch()


class RunnerPatches:
    """Per-runner state of the split decision, and the patches that hand it to vLLM for one step."""

    def __init__(self, runner: Any, policy: SplitPolicy, adaptive: Any = None) -> None:
        import vllm.v1.worker.gpu_model_runner as runner_module

        self.runner, self.policy, self._module = runner, policy, runner_module
        cls = type(runner)
        #: vLLM's own decision (``_determine_batch_execution_and_padding`` of the runner's class, bound)
        self._determine_vllm: Callable[..., Any] = getattr(cls, _DETERMINE).__get__(runner)
        self._signature = inspect.signature(self._determine_vllm)
        self._step: Step | None = None
        #: called with each step as it is decided, and with None when the step is over (where vLLM runs unsplit steps:
        #: `tbo.integrations.vllm.runner.forwards.StepForwards.on_step` picks the forward the step runs)
        self.on_step: Callable[[Step | None], None] | None = None
        self._depth = 0  #: scopes of this runner open (nested: a dummy run inside execute_model)
        #: data parallel: settles each step with the other DP ranks (``agree(step, vetoed) -> Step``) and runs vLLM's
        #: DP batch coordination for it (``agree.coordinate``): `tbo.integrations.vllm.step.agree.StepAgreementHook`, given by
        #: `agree_with_peers`; None: this engine decides alone
        self.agree: Any = None
        self._dummy: str | None = None  #: inside a dummy run: its Step mode ("idle" or "warmup")
        #: ``split: "adaptive"``: turns each decided step into the measured choice's (`tbo.integrations.vllm.step.adaptive`)
        self.adaptive = adaptive
        #: a FULL ``cudagraph_mode``: the split graphs, which settle the steps vLLM dispatches to them
        #: (`tbo.integrations.vllm.step.graphs.SplitGraphs`); None: no CUDA graphs of split steps
        self.graphs: Any = None
        self._fixed: Step | None = None  #: inside a split graph's capture (`fixed`): the step every decision returns

    def agree_with_peers(self, agree: Any) -> None:
        """Data parallel, the one place it plugs in here (`tbo.integrations.vllm.runner.dp.install_data_parallel`): every
        step's decision, the dummy runs' included, is first settled with the other DP ranks by ``agree`` (a
        `tbo.integrations.vllm.step.agree.StepAgreementHook`), and vLLM's own decision runs through ``agree.coordinate``
        (its DP batch coordination answered from the agreement, or its all-reduce under the agreement's deadline)."""
        self.agree = agree

    @property
    def step(self) -> Step | None:
        """The current execute_model call's decision; None outside one."""
        return self._step

    @step.setter
    def step(self, step: Step | None) -> None:
        self._step = step
        if self.on_step is not None:
            self.on_step(step)

    @contextmanager
    def microbatching(self) -> Iterator[None]:
        """While it lasts, the runner's ``parallel_config`` says microbatching is on with the policy's count."""
        runner = self.runner
        real = runner.parallel_config
        runner.parallel_config = _Microbatching(real, self.policy.num_microbatches)
        try:
            yield
        finally:
            runner.parallel_config = real

    @contextmanager
    def dummy_scope(self, mode: str) -> Iterator[None]:
        """Patch for one ``_dummy_run`` call (data parallel: its step takes part in the agreement) as ``mode``."""
        self._dummy = mode
        try:
            with self.scope():  # inside execute_model's scope already: it nests
                yield
        finally:
            self._dummy = None

    @contextmanager
    def fixed(self, step: Step) -> Iterator[None]:
        """Patch for one call of vLLM's (a CUDA graph's warm-ups and capture: `tbo.integrations.vllm.step.graphs`), every
        step in it decided as ``step``."""
        self._fixed = step
        try:
            with self.scope():
                yield
        finally:
            self._fixed = None

    @contextmanager
    def scope(self) -> Iterator[None]:
        """Patch for one ``execute_model`` call, and restore (the outermost scope of this runner restores)."""
        runner = self.runner
        _SLICES.enter(self._module, self)
        self._depth += 1
        if self._depth == 1:
            setattr(runner, _DETERMINE, self._determine)
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                runner.__dict__.pop(_DETERMINE, None)
                self.step = None
            _SLICES.leave(self)

    def _determine(self, *args: Any, **kwargs: Any) -> Any:
        if self.agree is not None:
            return self._determine_agreed(*args, **kwargs)
        cudagraph_mode, batch_desc, _, across_dp, cg_stats = self._determine_vllm(*args, **kwargs)
        if self._fixed is not None:  # a split graph's warm-up or capture: the size's plan
            self.step = self._fixed
            return cudagraph_mode, batch_desc, self._fixed.runner_split, across_dp, cg_stats
        bound = self._signature.bind(*args, **kwargs).arguments
        if self.graphs is not None and self.graphs.holds(getattr(cudagraph_mode, "name", "") == "FULL", batch_desc):
            return self._determine_graph(bound, batch_desc, across_dp, cg_stats, cudagraph_mode)
        allowed = self._allowed(bound) and batch_desc.num_reqs in (None, int(bound["num_reqs"]))
        step = self._decide(bound, allowed, batch_desc.num_tokens)
        self.step = step if self.adaptive is None else self.adaptive.decide(step)  # one decision, told once
        return cudagraph_mode, batch_desc, self.step.runner_split, across_dp, cg_stats

    def _determine_graph(self, bound: dict[str, Any], batch_desc: Any, across_dp: Any, cg_stats: Any,
                         cudagraph_mode: Any) -> Any:
        """A step vLLM dispatched to a FULL graph tbo captured split: replayed with the size's plan, or, where its
        own decision (on its real tokens) differs, run eager by vLLM's own eager decision (`tbo.integrations.vllm.
        graphs`)."""
        own = self._decide(bound, self._allowed(bound), int(bound["num_tokens"]))
        step = self.graphs.settle(own, batch_desc)
        if step is None:  # its split differs from its graph's: eager, unpadded, split by its own plan or not
            cudagraph_mode, batch_desc, _, across_dp, cg_stats = self._determine_vllm(**{**bound, "force_eager": True})
            step = own
        self.step = step
        return cudagraph_mode, batch_desc, step.runner_split, across_dp, cg_stats

    def _allowed(self, bound: dict[str, Any]) -> bool:
        """vLLM's own prefix-cache veto, asked as if its microbatching were on."""
        with self.microbatching():
            return self.runner._allow_microbatching(int(bound["num_reqs"]), bound["num_scheduled_tokens_np"])

    def _decide(self, bound: dict[str, Any], allowed: bool, padded_tokens: int) -> Step:
        num_reqs = int(bound["num_reqs"])
        batch = self.runner.input_batch
        past_prompt = batch.num_computed_tokens_cpu[:num_reqs] >= batch.num_prompt_tokens[:num_reqs]
        # speculative decoding: this step's draft tokens per request, as the runner's batch holds them (set from
        # the scheduler's scheduled_spec_decode_tokens before the step is decided)
        drafts = [len(t) for t in batch.spec_token_ids[:num_reqs]] if self.runner.speculative_config else None
        return decide(self.policy, bound["num_scheduled_tokens_np"][:num_reqs], past_prompt, allowed=allowed,
                      padded_tokens=padded_tokens, cascade=bool(bound.get("use_cascade_attn", False)), drafts=drafts)

    def _determine_agreed(self, *args: Any, **kwargs: Any) -> Any:
        """Data parallel: agree with the other ranks first (tbo's deadline bounds that wait: a stalled or dead peer
        is named there, before vLLM's own DP all-reduce, which tbo's deadline does not bound), then vLLM's own
        decision."""
        bound = self._signature.bind(*args, **kwargs).arguments
        num_tokens = int(bound["num_tokens"])
        if self._dummy is not None:  # a dummy run: nothing of its own to split; it takes part in its peers' steps
            step, vetoed = Step(self._dummy, ForwardMode.DECODE, num_tokens, None), False
        else:  # no CUDA graphs (checks.py): vLLM pads no DP step, so the plan's token count is the runner's
            allowed = self._allowed(bound)
            step, vetoed = self._decide(bound, allowed, num_tokens), not allowed
        step = self.step = self.agree(step, vetoed)  # type: ignore[misc]
        # vLLM's own DP batch coordination: answered from the agreement, or its all-reduce under the agreement's
        # deadline (`tbo.integrations.vllm.step.agree.StepAgreementHook.coordinate`)
        cudagraph_mode, batch_desc, _, across_dp, cg_stats = self.agree.coordinate(  # type: ignore[union-attr]
            self._determine_vllm, *args, **kwargs)
        if step.plan is not None and batch_desc.num_tokens != num_tokens:
            raise RuntimeError(f"tbo agreed to split a step of {num_tokens} tokens, but vLLM's runner padded it to "
                               f"{batch_desc.num_tokens}: its microbatches would not be the plan's")
        return cudagraph_mode, batch_desc, step.runner_split, across_dp, cg_stats

    def slices(self, original: Callable[..., Any], should_ubatch: bool, *args: Any, **kwargs: Any) -> Any:
        """``maybe_create_ubatch_slices`` for this runner's step: the plan's slices on a split step, vLLM's
        ``original`` otherwise."""
        step = self.step
        if not should_ubatch or step is None or not step.runner_split:
            return original(should_ubatch, *args, **kwargs)
        slices = ubatch_slices(step.plan)
        return slices, slices
