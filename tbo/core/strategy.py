"""`OperationsStrategy`: a layer's operation list as validated, immutable data.

A strategy is written once, per model and mode, as a Python list of op names (or callables) with `Yield` markers.
It is checked at construction, so a malformed list fails where it is written, with its list index, rather than deep
inside a forward pass: its shape (no empty stage, a valid lead) and its transfers (every ``X_b`` after an ``X_a``,
every ``X_a`` waited; `tbo.core.ordering`), once per strategy object. Stages are split once and cached on the
object; the executor never re-splits per call. String-only strategies round-trip through JSON, which is what
``tbo show`` reads.
"""

from __future__ import annotations

import json
from functools import cached_property
from typing import Any, Callable, Collection, Iterable, Iterator, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from tbo.core.dataflow import FlowProblem, closest_names, flow_of, flow_problems, layer_flows
from tbo.core.errors import StrategyError
from tbo.core.inflight import InFlightLimit, in_flight_violations
from tbo.core.operations import YIELD_NAME, Operation, Yield, comm_role, op_name
from tbo.core.ordering import TransferOrder, transfer_order
from tbo.core.schedule import OpVisit, Schedule, interleave

__all__ = ["OperationsStrategy", "OpVisit"]  # OpVisit: `tbo.core.schedule`'s, re-exported where it was


def _as_strategy_error(exc: ValidationError) -> StrategyError:
    """Pydantic wraps validator errors; hand the user ours, or a StrategyError naming the field."""
    for err in exc.errors():
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, StrategyError):
            return cause
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"]) or "strategy"
    return StrategyError(f"{loc}: {err['msg']}")


class OperationsStrategy(BaseModel):
    """An operation list with Yield markers, the lead between microbatches, and the DeepGEMM SM budget.

    ``delta_stages`` is how many stages each microbatch runs ahead of the next one. ``deep_gemm_num_sms`` limits
    DeepGEMM to that many SMs while the strategy runs, leaving the rest to communication kernels (None: no limit).

    ``fragment=True`` marks a list that is one piece of a longer run, whose transfers may cross its ends (a layer
    that launches a combine the next layer waits for): its launches and waits need not pair up within it. The run
    built from the pieces (`concat`) is checked as usual.
    """

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True, extra="forbid")

    operations: tuple[Any, ...]
    delta_stages: int = 0
    deep_gemm_num_sms: int | None = None
    name: str | None = None
    fragment: bool = False

    # ---- construction: our errors, not pydantic's wrappers --------------------------------------------------------
    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise _as_strategy_error(exc) from None

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> "OperationsStrategy":  # type: ignore[override]
        """A strategy from data (a dict, as read from JSON or YAML), where ``"Yield"`` stands for the marker."""
        if isinstance(obj, dict) and isinstance(obj.get("operations"), list):
            obj = {**obj, "operations": [Yield if item == YIELD_NAME else item for item in obj["operations"]]}
        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as exc:
            raise _as_strategy_error(exc) from None

    @classmethod
    def model_validate_json(cls, json_data: str | bytes, **kwargs: Any) -> "OperationsStrategy":  # type: ignore[override]
        """A strategy from `model_dump_json`'s text; ``"Yield"`` stands for the marker."""
        try:
            data = json.loads(json_data)
        except ValueError as exc:
            raise StrategyError(f"strategy JSON does not parse: {exc}") from None
        if not isinstance(data, dict):
            raise StrategyError(f"strategy JSON must be an object with 'operations', got {type(data).__name__}")
        return cls.model_validate(data, **kwargs)

    @field_validator("operations", mode="before")
    @classmethod
    def _check_operations(cls, ops: Any) -> tuple[Any, ...]:
        if isinstance(ops, (str, bytes)) or not isinstance(ops, Iterable):
            raise StrategyError(f"operations must be a list of ops and Yield markers, got {type(ops).__name__}")
        items = tuple(ops)
        if not items:
            raise StrategyError("operations is empty: a strategy needs at least one op")
        for i, item in enumerate(items):
            if item is Yield:
                if i == 0:
                    raise StrategyError("operations[0] is Yield: the first stage would be empty")
                if i == len(items) - 1:
                    raise StrategyError(f"operations[{i}] is Yield at the end: the last stage would be empty")
                if items[i - 1] is Yield:
                    raise StrategyError(f"operations[{i}] is a second Yield in a row: that stage would be empty")
            elif isinstance(item, str):
                if item == YIELD_NAME:
                    raise StrategyError(
                        f"operations[{i}] is the string {YIELD_NAME!r}: write the marker tbo.Yield (the string stands "
                        "for it only in data read by model_validate / model_validate_json)"
                    )
                if not item.isidentifier():
                    raise StrategyError(f"operations[{i}] = {item!r} is not a valid op name (an identifier)")
            elif not callable(item):
                raise StrategyError(
                    f"operations[{i}] = {item!r} ({type(item).__name__}) is neither a callable, an op name, nor Yield"
                )
        return items

    @field_validator("deep_gemm_num_sms")
    @classmethod
    def _check_sms(cls, n: int | None) -> int | None:
        if n is not None and n <= 0:
            raise StrategyError(f"deep_gemm_num_sms must be positive or None, got {n}")
        return n

    @model_validator(mode="after")
    def _check_delta(self) -> "OperationsStrategy":
        n = len(self.stages)
        if self.delta_stages < 0:
            raise StrategyError(f"delta_stages must be >= 0, got {self.delta_stages}")
        if self.delta_stages >= n:
            raise StrategyError(
                f"delta_stages={self.delta_stages} must be less than the number of stages ({n}): "
                "otherwise the microbatches never overlap"
            )
        return self

    @model_validator(mode="after")
    def _check_transfers(self) -> "OperationsStrategy":
        problems = () if self.fragment else self.transfer_order.problems
        if problems:
            raise StrategyError(
                f"strategy {self.name or '(unnamed)'}: " + "; ".join(str(p) for p in problems) + ". Every "
                "microbatch runs this list in this order, so the run would fail or leave a transfer in flight. (A "
                "list that is one piece of a longer run, with transfers crossing its ends, passes fragment=True.)"
            )
        return self

    # ---- derived, computed once ----------------------------------------------------------------------------------
    @cached_property
    def stages(self) -> tuple[tuple[Operation, ...], ...]:
        """The operation list cut at each Yield."""
        stages: list[tuple[Operation, ...]] = []
        current: list[Operation] = []
        for item in self.operations:
            if item is Yield:
                stages.append(tuple(current))
                current = []
            else:
                current.append(item)
        stages.append(tuple(current))
        return tuple(stages)

    @cached_property
    def stage_names(self) -> tuple[tuple[str, ...], ...]:
        """Debug names of each stage's ops; used for errors, tracing and `Schedule.render`."""
        return tuple(tuple(op_name(op) for op in stage) for stage in self.stages)

    @cached_property
    def transfer_order(self) -> TransferOrder:
        """How this list's launches and waits pair up, and what does not (`tbo.core.ordering`); computed once."""
        return transfer_order(self.stage_names)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @cached_property
    def is_bound(self) -> bool:
        """True when every op is callable: the strategy can run. Cached: the executor asks on every call."""
        return not any(isinstance(op, str) for op in self.operations)

    def describe(self) -> str:
        """One line per stage: ``stage 3: dispatch_b, experts, combine_a``."""
        head = f"strategy {self.name or '(unnamed)'}: {self.num_stages} stages, delta_stages={self.delta_stages}"
        if self.deep_gemm_num_sms is not None:
            head += f", deep_gemm_num_sms={self.deep_gemm_num_sms}"
        width = len(str(self.num_stages - 1))
        lines = [f"  stage {s:>{width}}: {', '.join(names)}" for s, names in enumerate(self.stage_names)]
        return "\n".join([head, *lines])

    # ---- the schedule, as data ----------------------------------------------------------------------------------
    def schedule(self, num_microbatches: int = 2, delta_stages: int | Sequence[int] | None = None) -> Schedule:
        """The compiled interleaving of ``num_microbatches`` copies of this strategy (cached by `interleave`)."""
        return interleave([self.num_stages] * num_microbatches,
                          self.delta_stages if delta_stages is None else delta_stages)

    def walk(self, num_microbatches: int = 2, delta_stages: int | Sequence[int] | None = None,
             role: Callable[[str], tuple[str, str] | None] = comm_role) -> Iterator[OpVisit]:
        """Every op in execution order, as the executor would run it: the one walk that the linter, the simulator
        and the renderers share. ``role`` classifies op names (the simulator passes its cost model's)."""
        names, firsts = self.stage_names, self._stage_firsts
        for mb, stage in self.schedule(num_microbatches, delta_stages).steps:
            for k, name in enumerate(names[stage]):
                yield OpVisit(mb, stage, name, role(name), firsts[stage] + k)

    @cached_property
    def _stage_firsts(self) -> tuple[int, ...]:
        """The index in ``operations`` of each stage's first op."""
        firsts, index = [], 0
        for stage in self.stages:
            firsts.append(index)
            index += len(stage) + 1
        return tuple(firsts)

    def check_in_flight(self, limit: InFlightLimit | None, num_microbatches: int = 2,
                        delta_stages: int | Sequence[int] | None = None) -> "OperationsStrategy":
        """Raise `StrategyError` if the compiled schedule launches a transfer while ``limit`` (a backend's
        `InFlightLimit`; None: no limit) is reached, naming both ops and both microbatches; return ``self``.

        Checked once per (limit, microbatch count, lead) and remembered, so calling it every step costs a lookup.
        """
        if limit is None:
            return self
        key = (limit, num_microbatches, delta_stages if not isinstance(delta_stages, list) else tuple(delta_stages))
        problems = self._in_flight_checked.get(key)
        if problems is None:
            problems = self._in_flight_checked[key] = in_flight_violations(self, limit, num_microbatches,
                                                                           delta_stages)
        if problems:
            more = f" ({len(problems) - 1} more launch{'es' if len(problems) > 2 else ''} like it)" if (
                len(problems) > 1) else ""
            delta = self.delta_stages if delta_stages is None else delta_stages
            raise StrategyError(
                f"strategy {self.name or '(unnamed)'} cannot run over {limit.backend} with {num_microbatches} "
                f"microbatches and delta_stages={delta}: {problems[0]}{more}. Move the launch after that wait (a "
                "later stage), or change delta_stages; `tbo lint` lists every such launch.")
        return self

    @cached_property
    def _in_flight_checked(self) -> dict:
        return {}

    def render_schedule(self, num_microbatches: int = 2, delta_stages: int | Sequence[int] | None = None,
                        width: int = 44) -> str:
        """A text table of the interleaved schedule, each cell a stage and its op names (`Schedule.render`)."""
        labels = [", ".join(names) for names in self.stage_names]
        return self.schedule(num_microbatches, delta_stages).render(labels, width=width)

    # ---- binding and joining ------------------------------------------------------------------------------------
    def bind(self, layer: object, inputs: Collection[str] | None = None) -> "OperationsStrategy":
        """Resolve every op name to ``layer.op_<name>``, and check the data flow (`check_flow`).

        Names the layer does not provide are reported together, with their indices and the closest names it does
        provide. ``inputs``: the keyword inputs the first op gets (None: whatever it needs)."""
        missing = []
        for i, item in enumerate(self.operations):
            if isinstance(item, str) and not callable(getattr(layer, f"op_{item}", None)):
                provided = [attr[3:] for attr in dir(layer) if attr.startswith("op_") and callable(
                    getattr(layer, attr, None))]
                close = closest_names(item, provided)
                missing.append(f"[{i}] op_{item}" + (f" (did you mean {' or '.join(map(repr, close))}?)" if close
                                                    else ""))
        if missing:
            raise StrategyError(
                f"cannot bind strategy {self.name or '(unnamed)'} to {type(layer).__name__}: missing methods "
                f"{', '.join(missing)}; the ops it provides: {', '.join(provided) or 'none'} (`tbo ops` lists each "
                "layer kind's)")
        bound = self._replace(operations=[getattr(layer, f"op_{it}") if isinstance(it, str) else it
                                          for it in self.operations])
        bound.check_flow(layer, inputs)
        return bound

    def flow_problems(self, layer: object = None, inputs: Collection[str] | None = None,
                      catalog: Mapping[str, Any] | None = None) -> list[FlowProblem]:
        """The ops whose inputs are not there when one microbatch runs this list (`tbo.core.dataflow`): each op's
        declared flow, from its callable or from ``layer.op_<name>`` (``catalog``: name -> `OpFlow`, in place of a
        layer, as `tbo lint --layer-kind` checks a list of names)."""
        if catalog is None:
            catalog = layer_flows(layer) if layer is not None else {}
        items = []
        for visit in self._flow_items():
            index, stage, item = visit
            if isinstance(item, str):
                flow = catalog.get(item) if layer is None else flow_of(getattr(layer, f"op_{item}", None), layer)
            else:
                flow = flow_of(item, layer)
            items.append((index, stage, op_name(item), flow))
        return flow_problems(items, catalog, inputs)

    def check_flow(self, layer: object = None, inputs: Collection[str] | None = None,
                   catalog: Mapping[str, Any] | None = None) -> "OperationsStrategy":
        """Raise `StrategyError` naming every op whose inputs are not there when it runs (`flow_problems`);
        return ``self``."""
        problems = self.flow_problems(layer, inputs, catalog)
        if problems:
            on = f" on {layer!r}" if layer is not None else ""
            raise StrategyError(
                f"strategy {self.name or '(unnamed)'} cannot run{on}: " + "; ".join(map(str, problems)) + ". Each "
                "microbatch runs the list in this order, one op after another (`tbo ops` lists what each op reads "
                "and writes)")
        return self

    def _flow_items(self) -> Iterator[tuple[int, int, Any]]:
        stage = 0
        for index, item in enumerate(self.operations):
            if item is Yield:
                stage += 1
            else:
                yield index, stage, item

    def _replace(self, **changes: Any) -> "OperationsStrategy":
        """A fresh, validated instance with some fields changed (model_copy would carry over the cached stages)."""
        fields = {"operations": self.operations, "delta_stages": self.delta_stages,
                  "deep_gemm_num_sms": self.deep_gemm_num_sms, "name": self.name, "fragment": self.fragment}
        return type(self)(**{**fields, **changes})

    def without(self, names: Iterable[str], name: str | None = None) -> "OperationsStrategy":
        """This strategy with the named ops removed (and any stage they leave empty), e.g. a model that has no
        shared experts. Stage boundaries between the remaining ops stay where they were.

        A name that is not an op of this strategy is a typo, and raises. The result is a different strategy, so
        it gets a name of its own (``deepseek_decode_without_shared_experts``) unless ``name`` gives one."""
        if isinstance(names, str):
            raise TypeError(f"without() takes a list of op names, not the string {names!r}: without([{names!r}])")
        drop = list(dict.fromkeys(names))
        have = [op_name(item) for item in self.operations if item is not Yield]
        unknown = [n for n in drop if n not in have]
        if unknown:
            raise StrategyError(f"{self.name or 'this strategy'} has no op named {', '.join(map(repr, unknown))}; "
                                f"its ops: {', '.join(dict.fromkeys(have))}")
        kept: list[Any] = []
        for item in self.operations:
            if item is Yield:
                if kept and kept[-1] is not Yield:
                    kept.append(Yield)
            elif op_name(item) not in drop:  # an op name is its own debug name
                kept.append(item)
        while kept and kept[-1] is Yield:
            kept.pop()
        stages = kept.count(Yield) + 1
        if name is None:
            name = f"{self.name or 'strategy'}_without_{'_'.join(drop)}"
        return self._replace(operations=kept, delta_stages=min(self.delta_stages, stages - 1), name=name)

    @classmethod
    def concat(cls, strategies: Iterable["OperationsStrategy"], name: str | None = None,
               fragment: bool = False) -> "OperationsStrategy":
        """Join per-layer strategies into one list, the way a model runs its layers back to back.

        No Yield is inserted between layers: the last stage of one layer and the first stage of the next run as one
        stage, as in DeepSeek decode where ``output, comm_postprocess_layer`` flows into the next ``attn_prepare``.
        The one joining rule: the whole run has one ``delta_stages`` and one ``deep_gemm_num_sms``, so every layer
        with more than one stage must agree on the lead (a one-stage layer, such as a dense layer, has none of its
        own and accepts any), and every layer on the SM budget. The joined list's transfers are checked unless
        ``fragment`` is set, whatever its pieces say: a run must pair up every launch it makes.
        """
        parts = list(strategies)
        if not parts:
            raise StrategyError("concat needs at least one strategy")
        leads = [(i, part) for i, part in enumerate(parts) if part.num_stages > 1]
        lead_i, lead = leads[0] if leads else (0, parts[0])
        for i, part in enumerate(parts):
            checks = [("deep_gemm_num_sms", parts[0], 0)]
            if part.num_stages > 1:
                checks.append(("delta_stages", lead, lead_i))
            for field, ref, ref_i in checks:
                if getattr(part, field) != getattr(ref, field):
                    raise StrategyError(
                        f"concat: strategy [{i}] has {field}={getattr(part, field)} but strategy [{ref_i}] has "
                        f"{getattr(ref, field)}; all layers of one run must agree"
                    )
        ops: list[Any] = []
        for part in parts:
            ops.extend(part.operations)
        return cls(
            operations=ops,
            delta_stages=lead.delta_stages,
            deep_gemm_num_sms=parts[0].deep_gemm_num_sms,
            name=name if name is not None else lead.name,
            fragment=fragment,
        )

    # ---- JSON ---------------------------------------------------------------------------------------------------
    def model_dump_json(self, **kwargs: Any) -> str:  # type: ignore[override]
        """JSON for a string-only strategy; Yield is written as ``"Yield"``. Callables cannot be serialised."""
        for i, item in enumerate(self.operations):
            if not (item is Yield or isinstance(item, str)):
                raise StrategyError(
                    f"operations[{i}] ({op_name(item)}) is a callable; only op names and Yield serialise to JSON"
                )
        data = {
            "name": self.name,
            "delta_stages": self.delta_stages,
            "deep_gemm_num_sms": self.deep_gemm_num_sms,
            "operations": [YIELD_NAME if item is Yield else item for item in self.operations],
        }
        if self.fragment:
            data["fragment"] = True
        return json.dumps(data, indent=kwargs.get("indent"))

    def __repr__(self) -> str:
        shown = ", ".join(repr(it) if it is Yield else repr(op_name(it)) for it in self.operations)
        return (
            f"OperationsStrategy(name={self.name!r}, delta_stages={self.delta_stages}, "
            f"deep_gemm_num_sms={self.deep_gemm_num_sms}{', fragment=True' if self.fragment else ''}, "
            f"operations=[{shown}])"
        )

    __str__ = describe
