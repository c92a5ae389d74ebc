"""The two scoped patches that hand vLLM's model runner each step's split, as the engine's `StepDecider` decided it.

These only patch: what a step is, and in which order its decision is made (graphs, adaptive, the DP agreement), is
the decider's (`tbo.integrations.vllm.step.decider`). Here vLLM's call is handed to it (`_RunnerCall`: vLLM's own
decision, its prefix-cache veto, the runner's batch), and its answer is handed back to vLLM.


vLLM 0.32's model runner already builds a step in microbatches when ``should_ubatch`` is set: per-microbatch slot
mappings, attention metadata from its own builders, and a forward context holding both as lists. With one
data-parallel rank it never sets it. For the duration of one ``execute_model`` call (and nothing else: not the
profiling and warm-up runs), `RunnerPatches.scope`:

* shadows the runner's ``_determine_batch_execution_and_padding`` on this runner instance: vLLM's own result,
  with ``should_ubatch`` replaced by the decider's decision, which also honours vLLM's prefix-cache veto
  (``_allow_microbatching``, asked as if vLLM's microbatching were on);
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

import functools
import inspect
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from tbo.integrations.engine.step import Step, StepFacts, decide_facts
from tbo.integrations.vllm.step.batch import VllmDecision, ubatch_slices
from tbo.integrations.vllm.step.decider import StepDecider
from tbo.split import SplitPolicy

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


def timed_sample(engine: Any, sample: Callable[..., Any]) -> Callable[..., Any]:
    """The runner's ``sample_tokens`` (V1's and V2's), ending the adaptive split's clock and the step-time
    histogram's (`tbo.integrations.engine.stats.StepClock`) once the step's tokens are on the host: the wait the runner
    makes anyway, so the measurement adds no device sync."""

    @functools.wraps(sample)
    def sample_tokens(*args: Any, **kwargs: Any) -> Any:
        out = sample(*args, **kwargs)
        if engine.adaptive is not None:
            engine.adaptive.step_done()
        loop = engine.loop
        if loop is not None and loop.clock.stop():  # the step's time joins stats(); stats_file then says so too
            loop.write_stats()
        return out

    return sample_tokens


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
    """The patches that hand one runner's steps to its `StepDecider` (``decider``), scoped to one call of vLLM's."""

    def __init__(self, runner: Any, decider: StepDecider) -> None:
        import vllm.v1.worker.gpu_model_runner as runner_module

        self.runner, self.decider, self._module = runner, decider, runner_module
        cls = type(runner)
        #: vLLM's own decision (``_determine_batch_execution_and_padding`` of the runner's class, bound)
        self._determine_vllm: Callable[..., Any] = getattr(cls, _DETERMINE).__get__(runner)
        self._signature = inspect.signature(self._determine_vllm)
        self._depth = 0  #: scopes of this runner open (nested: a dummy run inside execute_model)

    # ---- what the decider holds, as the runner's scopes see it -------------------------------------------------
    @property
    def policy(self) -> SplitPolicy:
        return self.decider.policy

    @property
    def step(self) -> Step | None:
        """The current execute_model call's decision (the decider's); None outside one."""
        return self.decider.step

    @step.setter
    def step(self, step: Step | None) -> None:
        self.decider.step = step

    @property
    def on_step(self) -> Callable[[Step | None], None] | None:
        """The decider's ``on_step``."""
        return self.decider.on_step

    # ---- the scopes --------------------------------------------------------------------------------------------
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
        self.decider.dummy = mode
        try:
            with self.scope():  # inside execute_model's scope already: it nests
                yield
        finally:
            self.decider.dummy = None

    @contextmanager
    def fixed(self, step: Step) -> Iterator[None]:
        """Patch for one call of vLLM's (a CUDA graph's warm-ups and capture: `tbo.integrations.vllm.step.graphs`),
        every step in it decided as ``step``."""
        self.decider.fixed = step
        try:
            with self.scope():
                yield
        finally:
            self.decider.fixed = None

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

    # ---- vLLM's calls, handed to the decider -------------------------------------------------------------------
    def _determine(self, *args: Any, **kwargs: Any) -> Any:
        return self.decider.determine(_RunnerCall(self, args, kwargs))

    def _allowed(self, arguments: dict[str, Any]) -> bool:
        """vLLM's own prefix-cache veto, asked as if its microbatching were on."""
        with self.microbatching():
            return self.runner._allow_microbatching(int(arguments["num_reqs"]), arguments["num_scheduled_tokens_np"])

    def _decide(self, arguments: dict[str, Any], allowed: bool, padded_tokens: int,
                policy: SplitPolicy | None = None) -> Step:
        """tbo's own decision (`tbo.integrations.engine.step.decide_facts`) on the runner's batch, adapted to its
        `StepFacts`, with ``policy`` (the adaptive split's for a microbatch count it chose) or the decider's."""
        num_reqs = int(arguments["num_reqs"])
        batch = self.runner.input_batch
        past_prompt = batch.num_computed_tokens_cpu[:num_reqs] >= batch.num_prompt_tokens[:num_reqs]
        # speculative decoding: this step's draft tokens per request, as the runner's batch holds them (set from
        # the scheduler's scheduled_spec_decode_tokens before the step is decided)
        drafts = tuple(len(t) for t in batch.spec_token_ids[:num_reqs]) if self.runner.speculative_config else None
        facts = StepFacts(scheduled=tuple(int(n) for n in arguments["num_scheduled_tokens_np"][:num_reqs]),
                          past_prompt=tuple(bool(p) for p in past_prompt), padded_tokens=padded_tokens,
                          drafts=drafts, allowed=allowed)  # V1 has its own prefix-cache veto: ``allowed``
        return decide_facts(policy or self.policy, facts)

    def slices(self, original: Callable[..., Any], should_ubatch: bool, *args: Any, **kwargs: Any) -> Any:
        """``maybe_create_ubatch_slices`` for this runner's step: the plan's slices on a split step, vLLM's
        ``original`` otherwise."""
        step = self.step
        if not should_ubatch or step is None or not step.runner_split:
            return original(should_ubatch, *args, **kwargs)
        slices = ubatch_slices(step.plan)
        return slices, slices


class _RunnerCall:
    """One call of vLLM's ``_determine_batch_execution_and_padding`` on ``patches``' runner, as the decider asks it
    (`tbo.integrations.vllm.step.decider.RunnerCall`)."""

    def __init__(self, patches: RunnerPatches, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.patches, self.args, self.kwargs = patches, args, kwargs
        self.arguments = patches._signature.bind(*args, **kwargs).arguments
        self.num_tokens, self.num_reqs = int(self.arguments["num_tokens"]), int(self.arguments["num_reqs"])

    def vllm(self, force_eager: bool = False) -> VllmDecision:
        if force_eager:
            return VllmDecision.of(self.patches._determine_vllm(**{**self.arguments, "force_eager": True}))
        return VllmDecision.of(self.patches._determine_vllm(*self.args, **self.kwargs))

    def coordinated(self, coordinate: Callable[..., Any]) -> VllmDecision:
        return VllmDecision.of(coordinate(self.patches._determine_vllm, *self.args, **self.kwargs))

    def allowed(self) -> bool:
        return self.patches._allowed(self.arguments)

    def own(self, allowed: bool, padded_tokens: int, policy: SplitPolicy | None = None) -> Step:
        return self.patches._decide(self.arguments, allowed, padded_tokens, policy)
