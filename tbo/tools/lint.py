"""`lint`: find overlap bugs in a strategy before it runs, by walking its compiled schedule.

Overlap bugs show up as hangs, silent drift, or only on one rank; most are visible in the op list already:

* errors: a wait with no earlier launch (in the same microbatch), a launch never waited, and in low-latency mode more
  than two transfers in flight at once across microbatches (DeepEP double-buffers);
* warnings: a launch and its wait in the same stage (nothing can overlap), or no compute at all between a launch and
  its wait, in either microbatch.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Literal

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
    seq: int  # position in the global execution order
    computed: bool = False  # did any compute op run since the launch?


def lint(strategy: OperationsStrategy, num_microbatches: int = 2, low_latency: bool = False) -> list[Finding]:
    """Findings for ``strategy`` run as ``num_microbatches`` interleaved microbatches (errors first)."""
    findings: list[Finding] = []
    pending: dict[tuple[int, str], deque[_Launch]] = defaultdict(deque)
    alive: list[_Launch] = []
    seq = 0
    for visit in strategy.walk(num_microbatches):
        mb, stage, name, role = visit.mb, visit.stage, visit.op, visit.role
        seq += 1
        if role is None:
            for launch in alive:
                launch.computed = True
            continue
        kind = role[1]
        if role[0] == "launch":
            launch = _Launch(mb, stage, name, seq)
            pending[(mb, kind)].append(launch)
            alive.append(launch)
            if low_latency and len(alive) > 2:
                where = ", ".join(f"{a.op} of microbatch {a.mb} (stage {a.stage})" for a in alive)
                findings.append(Finding("error", "too-many-in-flight", f"{len(alive)} low-latency transfers in "
                                        f"flight ({where}); DeepEP double-buffers: at most two", mb, stage, name))
            continue
        queue = pending[(mb, kind)]
        if not queue:
            findings.append(Finding("error", "wait-without-launch", f"waits for a {kind!r} transfer that this "
                                    f"microbatch never launched", mb, stage, name))
            continue
        launch = queue.popleft()
        alive.remove(launch)
        if launch.stage == stage and launch.mb == mb:
            findings.append(Finding("warning", "same-stage", f"{launch.op} and {name} are in the same stage: "
                                    "nothing can overlap the transfer", mb, stage, name))
        elif not launch.computed:
            findings.append(Finding("warning", "no-overlap", f"no compute runs, in any microbatch, between "
                                    f"{launch.op} and {name}", mb, stage, name))
    for (mb, kind), queue in pending.items():
        for launch in queue:
            findings.append(Finding("error", "never-waited", f"launches a {kind!r} transfer that is never waited",
                                    launch.mb, launch.stage, launch.op))
    return sorted(findings, key=lambda f: (f.level != "error", f.microbatch, f.stage))
