"""Compiled engines (no ``enforce_eager``): each step runs either vLLM's own compiled graph or tbo's schedule.

vLLM's ``@support_torch_compile`` puts a ``__call__`` on the inner model's class that runs the compiled graph of
the class's own ``forward`` (traced once, at the first call: ``CompilationMode.DYNAMO_TRACE_ONCE``), unless the
instance's ``do_not_compile`` is set, when it calls ``self.forward`` as Python. So, per step, with scoped instance
attributes only (nothing on the class):

* a step tbo does not split runs vLLM's compiled graph, unchanged: no instance ``forward``, ``do_not_compile`` as
  vLLM set it. It costs what it costs without tbo (the plugin adds the split decision and a count);
* a split step runs tbo's schedule: ``forward`` is the `LayerLoop` and ``do_not_compile`` is True for that step
  only, and both are put back when the step's ``execute_model`` returns. Its ops run eagerly today (vLLM's own
  modules, each a kernel call), and a split decode step reads nothing on the host (`tbo.comm.devices.no_host_reads`):
  what a per-op or whole-schedule trace of fixed shapes would need.

A graph key here is vLLM's: one trace of its forward with a dynamic token dimension, so tbo causes no compile at all;
`compiles` reports vLLM's compilation counter, so that a test can see that no step recompiles after warm-up.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CompiledSteps", "compiles", "is_compiled"]


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


class CompiledSteps:
    """Per compiled engine: which forward the inner ``model`` runs in the step just decided (see the module
    docstring). ``counters``: the `StepStats` that count the unsplit steps, which never reach the layer loop."""

    def __init__(self, model: Any, loop: Any, counters: tuple[Any, ...]) -> None:
        self.model, self.loop, self.counters = model, loop, counters
        self._do_not_compile = model.do_not_compile  # vLLM's own value, put back after every split step
        self.split_steps = self.compiled_steps = 0

    def on_step(self, step: Any) -> None:
        """``step`` was just decided (None: the step is over, or a run with no decision: profiling, warm-up)."""
        model = self.model
        if step is not None and step.plan is not None:
            model.forward = self.loop
            model.do_not_compile = True
            self.split_steps += 1
            return
        model.__dict__.pop("forward", None)
        model.do_not_compile = self._do_not_compile
        if step is not None and step.mode != "warmup":  # vLLM's compiled graph runs it: count it here
            self.compiled_steps += 1
            for s in self.counters:
                s.record(step.mode, 0 if step.mode == "idle" else step.num_tokens, 1, False)

    def close(self) -> None:
        self.on_step(None)
