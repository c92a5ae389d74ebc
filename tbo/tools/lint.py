"""`lint`: find overlap bugs in a strategy before it runs, by walking its compiled schedule.

Overlap bugs show up as hangs, silent drift, or only on one rank; most are visible in the op list already:

* errors: a wait with no earlier launch (in the same microbatch), a launch never waited (both checked by the core,
  `tbo.core.ordering`, when a strategy is built; reported here for fragments), and, given a backend's
  `InFlightLimit`, every launch made while that many transfers are already in flight across microbatches
  (`tbo.core.inflight`; DeepEP low-latency tolerates one un-received call, the check binding a strategy makes);
* warnings: a launch and its wait in the same stage (nothing can overlap), or no compute at all between a launch and
  its wait, in either microbatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from tbo.core.inflight import InFlightLimit, in_flight_violations, limit_of
from tbo.core.strategy import OperationsStrategy

__all__ = ["Finding", "lint"]


@dataclass(frozen=True)
class Finding:
    level: Literal["error", "warning"]
    code: str
    message: str
    microbatch: int
    stage: int
    op: str

    def __str__(self) -> str:
        return f"{self.level}: {self.code}: microbatch {self.microbatch}, stage {self.stage}, op {self.op!r}: " \
               f"{self.message}"


@dataclass
class _Launch:
    mb: int
    stage: int
    op: str
    computed: bool = False  # did any compute op run since the launch?


def lint(strategy: OperationsStrategy, num_microbatches: int = 2, low_latency: bool = False,
         backend: Any = None) -> list[Finding]:
    """Findings for ``strategy`` run as ``num_microbatches`` interleaved microbatches (errors first).

    The errors about pairing are the ones `OperationsStrategy` raises at construction (`tbo.core.ordering`); here
    they come back as findings for strategies built with ``fragment=True``, reported once, at microbatch 0 (every
    microbatch runs the same list). Launches pair with waits as that check paired them.

    ``backend``: an `InFlightLimit`, or a backend declaring one (``in_flight_limit``); every launch over it is an
    error. ``low_latency=True`` stands for DeepEP V1 low-latency's limit (one un-received call). Lint a strategy of
    at least two layers (`OperationsStrategy.concat`) to see the layer boundaries, as ``tbo lint --layers`` does.
    """
    order = strategy.transfer_order
    findings = [Finding("error", p.code, str(p), 0, p.stage, p.op) for p in order.problems]
    limit = backend if isinstance(backend, InFlightLimit) else limit_of(backend)
    if limit is None and low_latency:
        from tbo.comm.deepep import LOW_LATENCY_LIMIT  # torch: only when asked for

        limit = LOW_LATENCY_LIMIT
    if limit is not None:
        findings += [Finding("error", "too-many-in-flight", str(v), v.launch.mb, v.launch.stage, v.launch.op)
                     for v in in_flight_violations(strategy, limit, num_microbatches)]
    alive: dict[tuple[int, int], _Launch] = {}  # (microbatch, launch index) -> the transfer in flight
    for visit in strategy.walk(num_microbatches):
        mb, stage, name, role = visit.mb, visit.stage, visit.op, visit.role
        if role is None:
            for launch in alive.values():
                launch.computed = True
            continue
        if role[0] == "launch":
            alive[(mb, visit.index)] = _Launch(mb, stage, name)
            continue
        launch_index = order.pairs.get(visit.index)
        if launch_index is None:
            continue  # a wait without a launch: an error above
        launch = alive.pop((mb, launch_index))
        if launch.stage == stage:
            findings.append(Finding("warning", "same-stage", f"{launch.op} and {name} are in the same stage: "
                                    "nothing can overlap the transfer", mb, stage, name))
        elif not launch.computed:
            findings.append(Finding("warning", "no-overlap", f"no compute runs, in any microbatch, between "
                                    f"{launch.op} and {name}", mb, stage, name))
    return sorted(findings, key=lambda f: (f.level != "error", f.microbatch, f.stage))
