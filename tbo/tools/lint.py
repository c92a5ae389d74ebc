"""`lint`: find overlap bugs in a strategy before it runs, by walking its compiled schedule.

Overlap bugs show up as hangs, silent drift, or only on one rank; most are visible in the op list already:

* errors: a wait with no earlier launch (in the same microbatch), a launch never waited (both checked by the core,
  `tbo.core.ordering`, when a strategy is built; reported here for fragments), and, given a backend's
  `InFlightLimit`, every launch made while that many transfers are already in flight across microbatches
  (`tbo.core.inflight`; DeepEP low-latency tolerates one un-received call, the check binding a strategy makes);
* warnings: a launch and its wait in the same stage (nothing can overlap), or no compute at all between a launch and
  its wait, in either microbatch (except in the pipeline's drain, which no strategy can fill).

Findings are placed in the strategy the user wrote (layer, stage, ``operations`` index), also when lint walks
several layers of it joined, where stage and index numbers would otherwise be the joined run's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping

from tbo.core.dataflow import OpFlow, closest_names
from tbo.core.inflight import InFlightLimit, in_flight_violations, limit_of
from tbo.core.operations import Yield
from tbo.core.strategy import OperationsStrategy, OpVisit

__all__ = ["Finding", "lint", "tally"]


@dataclass(frozen=True)
class Finding:
    """One finding, placed in the strategy the user wrote: ``stage`` and ``index`` (its position in
    ``operations``, Yields counted) are the user's; ``layer`` is which copy of it in a joined run (`lint`'s
    ``layers``), and ``run_stage`` the stage of that run (both None when a single strategy was linted)."""

    level: Literal["error", "warning"]
    code: str
    message: str
    microbatch: int
    stage: int
    op: str
    index: int | None = None
    layer: int | None = None
    run_stage: int | None = None

    def __str__(self) -> str:
        layer = f"layer {self.layer}, " if self.layer is not None else ""
        at = f"operations[{self.index}] {self.op!r}" if self.index is not None else f"op {self.op!r}"
        run = f" (stage {self.run_stage} of the joined layers)" if self.run_stage is not None else ""
        return f"{self.level}: {self.code}: microbatch {self.microbatch}, {layer}stage {self.stage}, {at}{run}: " \
               f"{self.message}"


@dataclass
class _Launch:
    mb: int
    stage: int
    op: str
    index: int
    drain: bool  # every other microbatch had finished: nothing else is left to overlap it
    computed: bool = False  # did any compute op run since the launch?


class _Locator:
    """Positions in a run of ``layers`` copies of ``strategy`` joined by `concat` (no Yield added between layers:
    run index ``i`` is the user's ``operations[i % n]`` of layer ``i // n``), told as the user wrote them."""

    def __init__(self, strategy: OperationsStrategy, layers: int) -> None:
        self.n, self.joined = len(strategy.operations), layers > 1
        self.stage_of: list[int] = []
        stage = 0
        for item in strategy.operations:
            self.stage_of.append(stage)
            stage += item is Yield

    def __call__(self, index: int) -> tuple[int | None, int, int]:
        """(layer or None, stage, index) in the user's strategy."""
        local = index % self.n
        return (index // self.n if self.joined else None), self.stage_of[local], local

    def where(self, visit: OpVisit) -> str:
        layer, stage, index = self(visit.index)
        return f"{'' if layer is None else f'layer {layer}, '}stage {stage}, operations[{index}]"

    def finding(self, level: Any, code: str, message: str, mb: int, run_stage: int, op: str,
                index: int) -> Finding:
        layer, stage, local = self(index)
        return Finding(level, code, message, mb, stage, op, local, layer, run_stage if self.joined else None)


def lint(strategy: OperationsStrategy, num_microbatches: int = 2, low_latency: bool = False,
         backend: Any = None, layers: int = 1, ops: Mapping[str, OpFlow | None] | None = None) -> list[Finding]:
    """Findings for ``strategy`` run as ``num_microbatches`` interleaved microbatches (errors first).

    ``layers``: lint that many copies of ``strategy`` joined as a model runs them (`OperationsStrategy.concat`), to
    see the layer boundaries, as ``tbo lint --layers`` does; every finding still names the user's layer, stage and
    ``operations`` index (and the joined run's stage).

    The errors about pairing are the ones `OperationsStrategy` raises at construction (`tbo.core.ordering`); here
    they come back as findings for strategies built with ``fragment=True``, reported once, at microbatch 0 (every
    microbatch runs the same list). Launches pair with waits as that check paired them.

    ``backend``: an `InFlightLimit`, or a backend declaring one (``in_flight_limit``); every launch over it is an
    error. ``low_latency=True`` stands for DeepEP V1 low-latency's limit (one un-received call).

    A launch with no compute after it before its wait, in any microbatch, is a ``no-overlap`` warning, except in the
    pipeline's drain: when every other microbatch has already finished, nothing is left to overlap the transfer
    whatever the strategy, and no warning would say what to change.

    ``ops``: the ops a layer provides, by name, with their declared flows (`tbo.tools.layer_kinds.kind_flows`):
    what binding to that layer refuses becomes errors here: an ``unknown-op`` (with the closest names), and every op
    whose inputs are not there when it runs (``data-flow``, `tbo.core.dataflow`). An op that declares no flow is a
    ``undeclared-op`` warning: the check trusts it, and checks no State key after it.
    """
    if layers < 1:
        raise ValueError(f"lint needs layers >= 1, got {layers}")
    findings = [Finding("error", p.code, str(p), 0, p.stage, p.op, p.index) for p in strategy.transfer_order.problems]
    run = strategy if layers == 1 else OperationsStrategy.concat([strategy] * layers, name=strategy.name,
                                                                  fragment=True)
    at = _Locator(strategy, layers)
    if ops is not None:
        findings += _flow_findings(strategy, run, at, ops)
    order = run.transfer_order
    limit = backend if isinstance(backend, InFlightLimit) else limit_of(backend)
    if limit is None and low_latency:
        from tbo.comm.deepep import LOW_LATENCY_LIMIT  # torch: only when asked for

        limit = LOW_LATENCY_LIMIT
    if limit is not None:
        findings += [at.finding("error", "too-many-in-flight", v.describe(at.where), v.launch.mb, v.launch.stage,
                                v.launch.op, v.launch.index)
                     for v in in_flight_violations(run, limit, num_microbatches)]
    visits = list(run.walk(num_microbatches))
    last = {visit.mb: position for position, visit in enumerate(visits)}
    alive: dict[tuple[int, int], _Launch] = {}  # (microbatch, launch index) -> the transfer in flight
    for position, visit in enumerate(visits):
        mb, stage, name, role = visit.mb, visit.stage, visit.op, visit.role
        if role is None:
            for launch in alive.values():
                launch.computed = True
            continue
        if role[0] == "launch":
            drain = num_microbatches > 1 and all(end < position for other, end in last.items() if other != mb)
            alive[(mb, visit.index)] = _Launch(mb, stage, name, visit.index, drain)
            continue
        launch_index = order.pairs.get(visit.index)
        if launch_index is None:
            continue  # a wait without a launch: an error above
        launch = alive.pop((mb, launch_index))
        if launch.stage == stage:
            findings.append(at.finding("warning", "same-stage", f"{launch.op} and {name} are in the same stage: "
                                       "nothing can overlap the transfer; put a Yield between them", mb, stage,
                                       name, visit.index))
        elif not launch.computed and not launch.drain:
            findings.append(at.finding("warning", "no-overlap", f"no compute runs, in any microbatch, between "
                                       f"{launch.op} and {name}: move compute between them (this microbatch's own, "
                                       "or another's with a different delta_stages)", mb, stage, name,
                                       visit.index))
    return sorted(findings, key=lambda f: (f.level != "error", f.microbatch, f.layer or 0, f.stage))


def _flow_findings(strategy: OperationsStrategy, run: OperationsStrategy, at: _Locator,
                   ops: Mapping[str, OpFlow | None]) -> list[Finding]:
    """Unknown ops and data-flow problems against a layer's declared ``ops``, each once, placed in the user's list
    (the joined run adds what one layer hands the next)."""
    findings, seen = [], set()
    stage_of = {visit[0]: visit[1] for visit in strategy._flow_items()}
    for index, name in ((i, item) for i, item in enumerate(strategy.operations) if isinstance(item, str)):
        if name not in ops:
            close = closest_names(name, ops)
            hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
            findings.append(Finding("error", "unknown-op", f"this layer has no op {name!r}{hint}; its ops: "
                                    f"{', '.join(ops)}", 0, stage_of[index], name, index))
        elif ops[name] is None and name not in seen:
            findings.append(Finding("warning", "undeclared-op", f"{name!r} declares no data flow: nothing after it "
                                    "is checked", 0, stage_of[index], name, index))
        seen.add(name)
    placed = set()
    for p in strategy.flow_problems(catalog=ops) + (run.flow_problems(catalog=ops) if run is not strategy else []):
        layer, stage, index = at(p.index) if run is not strategy else (None, p.stage, p.index)
        if (index, p.key, p.code) in placed:
            continue
        placed.add((index, p.key, p.code))
        findings.append(Finding("error", p.code, p.message, 0, stage, p.op, index, layer))
    return findings


def tally(findings: list[Finding]) -> str:
    """``"0 error(s), 1 warning(s)"``: the count `tbo lint` prints, for scripts that lint from Python."""
    errors = sum(f.level == "error" for f in findings)
    return f"{errors} error(s), {len(findings) - errors} warning(s)"
