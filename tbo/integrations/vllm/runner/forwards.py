"""Compiled engines (no ``enforce_eager``): each step runs either vLLM's own compiled graph or tbo's schedule with
its ops compiled.

vLLM's ``@support_torch_compile`` puts a ``__call__`` on the inner model's class that runs the compiled graph of
the class's own ``forward`` (traced once, at the first call: ``CompilationMode.DYNAMO_TRACE_ONCE``), unless the
instance's ``do_not_compile`` is set, when it calls ``self.forward`` as Python. So, per step, with scoped instance
attributes only (nothing on the class):

* a step tbo does not split runs vLLM's compiled graph, unchanged: no instance ``forward``, ``do_not_compile`` as
  vLLM set it. It costs what it costs without tbo (the plugin adds the split decision and a count);
* a split step runs tbo's schedule: ``forward`` is the `LayerLoop` and ``do_not_compile`` is True for that step
  only, and both are put back when the step's ``execute_model`` returns. The schedule (the executor, the transfers,
  the forward-context switches) runs as Python; each op's tensor work runs compiled (`tbo.integrations.vllm.model.compute`,
  one graph per graph key, compiled at vLLM's warm-up: `StepForwards.warming_up`), and a split decode step reads
  nothing on the host (`tbo.comm.devices.no_host_reads`).

An eager engine whose unsplit step vLLM's own forward computes exactly as tbo's layers would (one rank, tbo's
local backend with no emulated link, no data parallelism, no AFD, no ``op_times``: `vllm_runs_unsplit`) takes the
same per-step choice: its unsplit steps run vLLM's own eager forward, so that they cost what they cost without tbo
(tbo's layer ops over the local backend route and permute in Python-driven kernels vLLM's fused MoE does not need:
+15% of a 128-request decode step on 2 cores). Where tbo's dispatch is the point (a link, expert parallelism, AFD,
``op_times``), every step runs the layer loop, and a compiled engine never compiles vLLM's graph of the whole model
(`vllm_graph_off`): its steps run tbo's compiled ops.

`compiles` reports vLLM's and dynamo's compilation counters; tbo's own compiled ops are counted in ``op_compiles``
(`tbo.integrations.engine.stats`), so that a test can see that no step recompiles after warm-up.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

from tbo.split.kinds import StepKind

__all__ = ["StepForwards", "compiles", "is_compiled", "vllm_graph_off", "vllm_runs_unsplit"]


def is_compiled(model: Any) -> bool:
    """Whether vLLM compiles ``model`` (the inner ``...Model``): its ``support_torch_compile`` wrapper is on and
    compilation is not off for it."""
    return "do_not_compile" in vars(model) and not model.do_not_compile


def compiles() -> dict[str, int]:
    """This process's compilations so far: vLLM's compilation counter (graphs traced, backend compilations,
    artifacts loaded from vLLM's compile cache) and dynamo's own (``unique_graphs``: every trace, a recompilation
    included). A step that recompiled grows one of them."""
    from torch._dynamo.utils import counters
    from vllm.compilation.counter import compilation_counter as c

    return {"graphs_seen": c.num_graphs_seen, "backend_compilations": c.num_backend_compilations,
            "artifacts_loaded": c.num_compiled_artifacts_loaded, "dynamo_graphs": counters["stats"]["unique_graphs"]}


def vllm_runs_unsplit(*, backend: Any, afd: Any, data_parallel_size: int, op_times: bool,
                      reducer: Any = None) -> bool:
    """Whether vLLM's own forward computes an unsplit step as tbo's layer loop would, so that an eager engine's
    unsplit steps can run it (the module docstring): tbo's plain local backend (every expert here, no emulated link:
    vLLM's fused MoE is the same routing and experts), or a dense model's layers (no backend) whose deferred
    all-reduces (``reducer``) run over no emulated link (vLLM's projections reduce the same sums), one DP rank, no
    AFD (the FFN lives elsewhere) and no ``op_times`` (it times tbo's ops on every counted step)."""
    from tbo.comm.alltoall import LocalBackend

    plain_reducer = reducer is None or type(reducer).__name__ == "TPAllReduce"  # no EmulatedLink around it
    layers = type(backend) is LocalBackend or (backend is None and reducer is not None)
    return layers and plain_reducer and afd is None and data_parallel_size == 1 and not op_times


def vllm_graph_off(model: Any) -> Callable[[], None]:
    """A compiled engine whose every step runs tbo's loop (a link, data parallelism, ``op_times``: not
    `vllm_runs_unsplit`): ``model``'s ``forward`` is the loop for good and vLLM's ``do_not_compile`` is set, so that
    vLLM's graph of the whole model is never compiled (no step would run it; with expert parallelism its MoE would
    move the tokens itself). Returns what puts vLLM's ``do_not_compile`` back (the engine deletes the forward)."""
    saved = model.do_not_compile
    model.do_not_compile = True

    def restore() -> None:
        model.do_not_compile = saved

    return restore


class StepForwards:
    """Per engine that lets vLLM run its unsplit steps (compiled engines, and eager ones where `vllm_runs_unsplit`):
    which forward the inner ``model`` runs in the step just decided (see the module docstring). ``counters``: the
    `StepStats` that count the unsplit steps, which never reach the layer loop."""

    def __init__(self, model: Any, loop: Any, counters: tuple[Any, ...]) -> None:
        self.model, self.loop, self.counters = model, loop, counters
        #: vLLM's own ``do_not_compile`` (None: the model has no compile wrapper), put back after every split step
        self._do_not_compile = vars(model).get("do_not_compile")
        self.split_steps = self.vllm_steps = 0

    def on_step(self, step: Any) -> None:
        """``step`` was just decided (None: the step is over, or a run with no decision: profiling, warm-up)."""
        model = self.model
        if step is not None and step.plan is not None:
            model.forward = self.loop
            if self._do_not_compile is not None:
                model.do_not_compile = True
            self.split_steps += 1
            return
        model.__dict__.pop("forward", None)
        if self._do_not_compile is not None:
            model.do_not_compile = self._do_not_compile
        if step is not None and step.kind != StepKind.WARMUP:  # vLLM's own forward (or graph) runs it: count it
            self.vllm_steps += 1
            idle = step.kind == StepKind.IDLE
            for s in self.counters:
                s.record(step.kind, 0 if idle else step.num_tokens, 1, False, step.counted_reason)
            if step.kind.samples:  # its time, to its tokens, as a step of tbo's loop (a dummy or draft: none)
                self.loop.clock.start(step.kind, False)

    @contextmanager
    def warming_up(self) -> Iterator[None]:
        """For one of vLLM's dummy runs (its warm-up: the profile run, of the full token count), in a compiled
        engine whose compiled ops (`tbo.integrations.vllm.model.compute`) are not all compiled yet: the run calls vLLM's
        own forward (its compiled graph, compiled there as vLLM's warm-up always does) and then tbo's loop on the
        same inputs, unsplit, so that every graph key of tbo's ops compiles at that token count, before any
        request; vLLM's output is the run's. The loop runs no step (nothing is counted)."""
        model, own = self.model, self._do_not_compile

        def both(*args: Any, **kwargs: Any) -> Any:
            del model.forward
            model.do_not_compile = own
            try:
                out = model(*args, **kwargs)  # vLLM's __call__: its compiled graph
            finally:
                model.forward, model.do_not_compile = both, True
            self.loop(*args, **kwargs)
            return out

        model.forward, model.do_not_compile = both, True
        try:
            yield
        finally:
            model.__dict__.pop("forward", None)
            model.do_not_compile = own

    def close(self) -> None:
        self.on_step(None)
