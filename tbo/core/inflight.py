"""A backend's limit on transfers launched and not yet received, checked on the compiled schedule.

Some transports cannot hold many transfers in flight at once. DeepEP's low-latency kernels are the sharp case: dispatch
and combine share one double buffer and one toggle, and each call's send phase cleans the other half, where the
previous call's receive flags live. So the previous call must have been received (its hook called) before the next
one launches; otherwise that receive waits forever and the GPUs hang (DeepEP issue #513). Which call comes after
which is decided by the schedule, across microbatches and layers, so the rule is a property of the schedule: a
backend declares an `InFlightLimit`, and `in_flight_violations` walks the compiled schedule in the executor's order
and reports every launch made while the limit is already reached, naming both ops and both microbatches.

The core knows no backend: the limit is plain data (a count and the transfer kinds it covers), declared by the
backend as its ``in_flight_limit`` attribute and read here with `limit_of`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol, Sequence

from tbo.core.ordering import TransferOrder
from tbo.core.schedule import OpVisit

__all__ = ["InFlightLimit", "InFlightViolation", "in_flight_violations", "limit_of"]


class WalkedStrategy(Protocol):
    """What `in_flight_violations` reads of a strategy: its transfer order, its ops' names per stage and its
    schedule's walk. An `OperationsStrategy` is one; it is named by what it offers, not imported, because the
    strategy module checks its own schedule with this one (no import circle in `tbo.core`)."""

    @property
    def transfer_order(self) -> TransferOrder: ...

    @property
    def stage_names(self) -> Sequence[Sequence[str]]: ...

    def walk(self, num_microbatches: int = 2, delta_stages: int | Sequence[int] | None = None) -> Iterable[OpVisit]:
        ...


@dataclass(frozen=True)
class InFlightLimit:
    """At most ``max_unreceived`` transfers of ``kinds`` (all kinds if empty) launched and not yet waited, counted
    across every microbatch. ``backend`` names who declares it and ``why`` says what breaks, for the messages."""

    max_unreceived: int
    kinds: frozenset[str] = frozenset()
    backend: str = "the backend"
    why: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.max_unreceived, bool) or not isinstance(self.max_unreceived, int) or (
                self.max_unreceived < 1):
            raise ValueError(f"InFlightLimit.max_unreceived must be a positive int, got {self.max_unreceived!r}")
        object.__setattr__(self, "kinds", frozenset(self.kinds))

    def covers(self, kind: str) -> bool:
        return not self.kinds or kind in self.kinds


@dataclass(frozen=True)
class InFlightViolation:
    """``launch`` was made while ``blocking`` (the oldest transfer still in flight) had not been received, with
    ``limit.max_unreceived`` transfers already in flight."""

    launch: OpVisit
    blocking: OpVisit
    waited_by: str  # the op that would receive ``blocking``
    in_flight: int
    limit: InFlightLimit

    def __str__(self) -> str:
        return self.describe()

    def describe(self, where: Callable[[OpVisit], str] | None = None) -> str:
        """The message; ``where(visit)`` says where an op is (default: its stage and index in the list checked;
        `tbo.lint` passes one that names the user's layer, stage and index in a joined run)."""
        if where is None:
            def where(v: OpVisit) -> str:
                return f"stage {v.stage}, operations[{v.index}]"
        a, b, lim = self.launch, self.blocking, self.limit
        text = (f"microbatch {a.mb}'s {a.op!r} ({where(a)}) launches while microbatch {b.mb}'s {b.op!r} ({where(b)}) "
                f"is not yet received (its {self.waited_by!r} has not run): that makes {self.in_flight + 1} "
                f"transfers in flight, and {lim.backend} tolerates at most {lim.max_unreceived}")
        return text + (f" ({lim.why})" if lim.why else "")


def limit_of(backend: Any) -> InFlightLimit | None:
    """The `InFlightLimit` ``backend`` declares (its ``in_flight_limit`` attribute), or None."""
    limit = getattr(backend, "in_flight_limit", None)
    if limit is not None and not isinstance(limit, InFlightLimit):
        raise TypeError(f"{type(backend).__name__}.in_flight_limit must be a tbo.core.inflight.InFlightLimit or "
                        f"None, got {type(limit).__name__}")
    return limit


def in_flight_violations(strategy: WalkedStrategy, limit: InFlightLimit, num_microbatches: int = 2,
                         delta_stages: int | Sequence[int] | None = None) -> tuple[InFlightViolation, ...]:
    """Every launch of ``strategy``'s compiled schedule (``num_microbatches`` copies, in the executor's order) made
    while ``limit`` was already reached. A strategy for a whole stack (`bind_layers`, `concat`) is checked across
    its layer boundaries too; a wait with no launch (a fragment) is skipped."""
    pairs = strategy.transfer_order.pairs
    waiter: dict[int, str] = {}  # launch index -> the name of the op that waits for it
    names = [name for stage in strategy.stage_names for name in (*stage, None)]
    for wait, launch in pairs.items():
        waiter[launch] = names[wait] or "?"
    alive: dict[tuple[int, int], OpVisit] = {}  # (microbatch, launch index) -> the launch, oldest first
    found: list[InFlightViolation] = []
    for visit in strategy.walk(num_microbatches, delta_stages):
        if visit.role is None or not limit.covers(visit.role[1]):
            continue
        if visit.role[0] == "launch":
            if len(alive) >= limit.max_unreceived:
                oldest = next(iter(alive.values()))
                found.append(InFlightViolation(visit, oldest, waiter.get(oldest.index, "?"), len(alive), limit))
            alive[(visit.mb, visit.index)] = visit
        elif visit.index in pairs:
            alive.pop((visit.mb, pairs[visit.index]), None)
    return tuple(found)
