"""Data flow: what each op reads and writes, declared beside it, so that a strategy's op order is checked when it is
bound to a layer, before any step runs.

Ops pass data through the microbatch's write-once `State` and through what one op returns to the next. A list that
runs ``experts`` before ``dispatch_b``, or drops ``select_experts`` with ``without()``, builds, lints and binds as
well-formed; without declarations it fails only at its first split step, with ``State has no key 'dispatched'``.
With them, `OperationsStrategy.bind` walks the list once, as every microbatch runs it, and refuses it naming the op,
the key it reads, the op that writes that key, and what to move.

An op declares its flow with `declares`::

    @declares(takes="dispatched", writes="expert_out")
    def op_experts(self, state): ...

or, where it depends on the layer (a layer with a shared expert, a dense layer), with a function of the layer::

    @declares(lambda layer: OpFlow(takes=("routed_out", "shared_out") if layer.has_shared_experts else ...))

A declaration belongs to the function: an override without one is undeclared, and an undeclared op (a user's plain
function, a layer that declares nothing) is opaque: the check trusts it and stops checking State keys after it, as it
cannot know what it wrote or removed, until an op that clears the State (a layer's last). `same_flow` lets an
override keep its parent's declaration.
"""

from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterable, Mapping, Sequence, Union

__all__ = ["OpFlow", "FlowProblem", "declares", "same_flow", "flow_of", "layer_flows", "flow_problems",
           "closest_names", "FLOW_ATTR"]

#: the attribute `declares` sets on an op function
FLOW_ATTR = "__tbo_flow__"


def _names(value: Union[str, Iterable[str]]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


@dataclass(frozen=True)
class OpFlow:
    """What one op reads and writes.

    * ``reads``: State keys it reads and leaves for later ops (``state.mlp_in``);
    * ``takes``: State keys it reads and removes (``state.pop("dispatched")``): no later op can read them;
    * ``writes``: State keys it sets (write-once: the key must not be set already);
    * ``inputs``: keyword arguments it needs from what the op right before it returned (or from the step's inputs,
      for a run's first op);
    * ``returns``: the keys of the dict it returns, handed to the next op;
    * ``pinned``: step metadata it reads, pinned by the caller for the whole step (``positions``, ``attn``): listed,
      never checked;
    * ``clears``: it drops every key still set (a layer's last op): the next layer starts from an empty State.
    """

    reads: tuple[str, ...] = ()
    takes: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    inputs: tuple[str, ...] = ()
    returns: tuple[str, ...] = ()
    pinned: tuple[str, ...] = ()
    clears: bool = False

    def __post_init__(self) -> None:
        for name in ("reads", "takes", "writes", "inputs", "returns", "pinned"):
            object.__setattr__(self, name, _names(getattr(self, name)))

    @property
    def needs(self) -> tuple[str, ...]:
        """The State keys it needs set when it runs."""
        return self.reads + self.takes

    def describe(self) -> str:
        """``reads mlp_in; takes router_logits; writes topk``: the parts that are not empty."""
        parts = [f"{label} {', '.join(keys)}" for label, keys in (
            ("inputs", self.inputs), ("reads", self.reads), ("takes", self.takes), ("writes", self.writes),
            ("returns", self.returns), ("pinned", self.pinned)) if keys]
        if self.clears:
            parts.append("clears the State")
        return "; ".join(parts) or "nothing"


#: A declaration: a flow, or a function of the layer giving one.
Declaration = Union[OpFlow, Callable[[Any], OpFlow]]


def declares(flow: Declaration | None = None, /, *, reads: Union[str, Iterable[str]] = (),
             takes: Union[str, Iterable[str]] = (), writes: Union[str, Iterable[str]] = (),
             inputs: Union[str, Iterable[str]] = (), returns: Union[str, Iterable[str]] = (),
             pinned: Union[str, Iterable[str]] = (), clears: bool = False) -> Callable[[Any], Any]:
    """Decorate an op with its data flow: the keywords (`OpFlow`'s fields), or one `OpFlow` or function of the
    layer returning one, for a flow that depends on the layer (``lambda layer: OpFlow(...)``)."""
    if flow is None:
        flow = OpFlow(reads, takes, writes, inputs, returns, pinned, clears)
    elif not (isinstance(flow, OpFlow) or callable(flow)):
        raise TypeError(f"declares() takes an OpFlow, a function of the layer, or keywords; got {flow!r}")

    def mark(fn: Any) -> Any:
        setattr(fn, FLOW_ATTR, flow)
        return fn

    return mark


def same_flow(parent: Any) -> Callable[[Any], Any]:
    """Decorate an override with the declaration of the op it overrides (``@same_flow(Base.op_experts)``): for an
    override that changes how, not what (a path for empty microbatches)."""
    flow = getattr(parent, FLOW_ATTR, None)
    if flow is None:
        raise TypeError(f"same_flow: {getattr(parent, '__qualname__', parent)!r} declares no flow")
    return declares(flow)


def flow_of(op: Any, layer: Any = None) -> OpFlow | None:
    """The declared flow of an op (a bound method, a function, a partial, a callable object), None if undeclared.

    A declaration that is a function of the layer is called with the method's instance, or ``layer``."""
    target, owner = op, layer
    for _ in range(32):  # partials, bound methods and functools.wraps wrappers, down to the declared function
        if isinstance(target, functools.partial):
            target = target.func
        elif hasattr(target, "__self__") and hasattr(target, "__func__"):  # a bound method
            owner, target = target.__self__, target.__func__
        elif getattr(target, "__wrapped__", None) is not None and not (
                getattr(target, FLOW_ATTR, None) is not None and owner is not None):
            target = target.__wrapped__
        else:
            break
    decl = getattr(target, FLOW_ATTR, None)  # a callable object: its class may declare
    if decl is None or isinstance(decl, OpFlow):
        return decl
    if owner is None:  # a declaration that depends on a layer, with no layer to ask: nothing can be said
        return None
    flow = decl(owner)
    if not isinstance(flow, OpFlow):
        raise TypeError(f"the flow declaration of {getattr(target, '__qualname__', target)!r} returned "
                        f"{type(flow).__name__}, not an OpFlow")
    return flow


def layer_flows(layer: Any) -> dict[str, OpFlow | None]:
    """Every op a layer provides (its ``op_<name>`` methods, by name), with its declared flow or None."""
    found: dict[str, OpFlow | None] = {}
    for attr in sorted(dir(layer)):
        if not attr.startswith("op_") or len(attr) <= 3:
            continue
        try:
            op = getattr(layer, attr)
        except AttributeError:
            continue
        if callable(op):
            found[attr[3:]] = flow_of(op, layer)
    return found


def closest_names(name: str, names: Iterable[str], n: int = 3) -> list[str]:
    """The names most like ``name`` (a misspelt op), best first."""
    return difflib.get_close_matches(name, list(names), n=n, cutoff=0.6)


@dataclass(frozen=True)
class FlowProblem:
    """One op whose data is not there when it runs: where (``index`` in ``operations``, ``stage``), which op, which
    key, and the message (what produces it and what to move)."""

    index: int
    stage: int
    op: str
    key: str
    message: str
    code: str = "data-flow"

    def __str__(self) -> str:
        return f"operations[{self.index}] {self.op!r} (stage {self.stage}): {self.message}"


@dataclass
class _Written:
    op: str
    index: int


@dataclass
class _Walk:
    """One microbatch walking the list: which keys are set (and by whom), which were taken (and by whom)."""

    have: dict[str, _Written] = field(default_factory=dict)
    taken: dict[str, _Written] = field(default_factory=dict)
    opaque: str | None = None  # the first undeclared op: State keys are not checked after it (until a clear)


def _producers(key: str, catalog: Mapping[str, OpFlow | None], field_name: str = "writes") -> list[str]:
    return [name for name, flow in catalog.items() if flow is not None and key in getattr(flow, field_name)]


def _at(positions: Mapping[str, list[int]], names: Sequence[str], after: int) -> list[tuple[str, int]]:
    """(name, index) of each of ``names`` that the list holds after ``after``."""
    return [(n, i) for n in names for i in positions.get(n, ()) if i > after]


def flow_problems(items: Sequence[tuple[int, int, str, OpFlow | None]],
                  catalog: Mapping[str, OpFlow | None] | None = None,
                  inputs: Collection[str] | None = None) -> list[FlowProblem]:
    """Every op whose inputs are not there when it runs, in the order one microbatch runs ``items``.

    ``items``: ``(index in operations, stage, op name, declared flow or None)`` for each op, Yields left out.
    ``catalog``: the ops the layer provides (`layer_flows`), to name which op would produce a missing key.
    ``inputs``: the step's inputs to the first op; None: whatever it needs.
    """
    catalog = dict(catalog or {})
    for _, _, name, flow in items:
        catalog.setdefault(name, flow)
    positions: dict[str, list[int]] = {}
    for index, _, name, _ in items:
        positions.setdefault(name, []).append(index)
    problems: list[FlowProblem] = []
    walk = _Walk()
    handed: Collection[str] | None = inputs  # what the previous op returned; None: unknown, so anything
    prev: str | None = None
    for index, stage, name, flow in items:
        if flow is None:
            walk.opaque = walk.opaque or name
            handed, prev = None, name
            continue
        missing_inputs = [k for k in flow.inputs if handed is not None and k not in handed]
        for key in missing_inputs:
            givers = _producers(key, catalog, "returns")
            before = f"{prev!r}, the op right before it, returns " + (
                "nothing" if not handed else f"only {', '.join(sorted(handed))}") if prev else \
                "the step's inputs do not hold it"
            fix = (f"{' or '.join(map(repr, givers))} return{'s' if len(givers) == 1 else ''} it: put {name!r} right "
                   f"after {'it' if len(givers) == 1 else 'one of them'}, or first in the layer") if givers else \
                f"put {name!r} first in the layer, where the step's inputs are handed to it"
            problems.append(FlowProblem(index, stage, name, key, (
                f"takes the keyword input {key!r}, which only the op right before it hands over; {before}. {fix}"),
                "data-flow-input"))
        if walk.opaque is None:
            for key in flow.needs:
                if key in walk.have:
                    continue
                problems.append(FlowProblem(index, stage, name, key, _missing(name, index, key, flow, walk,
                                                                              catalog, positions)))
            for key in flow.writes:
                if key in walk.have and key not in flow.takes:
                    by = walk.have[key]
                    problems.append(FlowProblem(index, stage, name, key, (
                        f"writes {key!r}, which {by.op!r} (operations[{by.index}]) wrote and no op between them took; "
                        "State keys are write-once: remove one of the two, or put the op that takes it between them"),
                        "data-flow-overwrite"))
        for key in flow.takes:
            if key in walk.have:
                walk.taken[key] = _Written(name, index)
            walk.have.pop(key, None)
        if flow.clears:  # an empty State: whatever an undeclared op before did is gone, so checking resumes
            walk.have.clear()
            walk.taken.clear()
            walk.opaque = None
        for key in flow.writes:
            walk.have[key] = _Written(name, index)
            walk.taken.pop(key, None)
        handed, prev = flow.returns, name
    return problems


def _missing(name: str, index: int, key: str, flow: OpFlow, walk: _Walk, catalog: Mapping[str, OpFlow | None],
             positions: Mapping[str, list[int]]) -> str:
    how = "takes" if key in flow.takes else "reads"
    head = f"{how} {key!r}, which is not set when it runs"
    if key in walk.taken:
        by = walk.taken[key]
        return (f"{head}: {by.op!r} (operations[{by.index}]) took it (removed it from the State) before. Put "
                f"{name!r} before {by.op!r}")
    writers = _producers(key, catalog)
    later = _at(positions, writers, index)
    if later:
        writer, at = later[0]
        return (f"{head}: {writer!r} writes it, but runs after it (operations[{at}]). Move {name!r} after "
                f"{writer!r} (to a later stage), or {writer!r} before {name!r}")
    if writers:
        return (f"{head}: {' or '.join(map(repr, writers))} write{'s' if len(writers) == 1 else ''} it, and this "
                f"strategy has no such op before it. Add {writers[0]!r} before {name!r}")
    return f"{head}, and no op of this layer writes it"
