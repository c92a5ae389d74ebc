"""Transfer ordering: every ``X_b`` waits for an earlier ``X_a``, and every ``X_a`` is waited for.

These are the two overlap bugs that break a run rather than slow it: a wait with nothing launched fails inside the
op (``op_dispatch_b() got an unexpected keyword argument 'h'`` when ``dispatch_b`` runs before ``dispatch_a``), and a
launch never waited leaves a transfer in flight past the step. Both rules hold per microbatch, and every microbatch
runs the same list, so they are checked on the list itself, in its own order, with no schedule and no microbatch
count: `OperationsStrategy` checks them when it is built, and `tbo.tools.lint` reports the same problems as errors
next to its schedule-dependent warnings.

Launches and waits pair up first-in first-out per transfer kind (``dispatch_a`` with the next ``dispatch_b``), as
backends complete transfers of one kind in launch order.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

from tbo.core.operations import comm_role

__all__ = ["OrderingProblem", "TransferOrder", "transfer_order"]

Role = Callable[[str], "tuple[str, str] | None"]


@dataclass(frozen=True)
class OrderingProblem:
    """One broken pairing. ``index`` is the op at fault in ``strategy.operations`` (Yields counted): the wait that
    has no earlier launch, or the launch never waited. For a wait, ``other`` is the same kind's next launch, the one
    that should have come first (None if nothing launches that kind after it)."""

    code: Literal["wait-without-launch", "never-waited"]
    kind: str
    index: int
    stage: int
    op: str
    other: int | None = None
    other_stage: int | None = None
    other_op: str | None = None

    def __str__(self) -> str:
        at = f"operations[{self.index}] {self.op!r} (stage {self.stage})"
        if self.code == "never-waited":
            return f"{at} launches a {self.kind!r} transfer that no later op waits for"
        if self.other is None:
            return f"{at} waits for a {self.kind!r} transfer that no earlier op launches"
        return (f"{at} waits for a {self.kind!r} transfer before operations[{self.other}] {self.other_op!r} "
                f"(stage {self.other_stage}) launches it: move the launch before the wait")


@dataclass(frozen=True)
class TransferOrder:
    """The pairing of one strategy list: ``pairs`` maps each wait's index to its launch's index."""

    pairs: dict[int, int]
    problems: tuple[OrderingProblem, ...]


def transfer_order(stage_names: Sequence[Sequence[str]], role: Role = comm_role) -> TransferOrder:
    """Pair the launches and waits of a list given as its stages' op names (`OperationsStrategy.stage_names`).

    Indices are positions in the flat operation list, Yields included, so that messages point where users edit.
    """
    pending: dict[str, deque[tuple[int, int, str]]] = defaultdict(deque)
    launches: dict[str, list[tuple[int, int, str]]] = defaultdict(list)
    pairs: dict[int, int] = {}
    orphans: list[tuple[str, int, int, str]] = []
    index = 0
    for stage, names in enumerate(stage_names):
        for name in names:
            r = role(name)
            if r is not None:
                verb, kind = r
                if verb == "launch":
                    pending[kind].append((index, stage, name))
                    launches[kind].append((index, stage, name))
                elif pending[kind]:
                    pairs[index] = pending[kind].popleft()[0]
                else:
                    orphans.append((kind, index, stage, name))
            index += 1
        index += 1  # the Yield after the stage
    problems: list[OrderingProblem] = []
    named: set[int] = set()
    for kind, index, stage, name in orphans:
        later = next((launch for launch in launches[kind] if launch[0] > index), None)
        if later is None:
            problems.append(OrderingProblem("wait-without-launch", kind, index, stage, name))
        else:
            named.add(later[0])
            problems.append(OrderingProblem("wait-without-launch", kind, index, stage, name, *later))
    for kind, queue in pending.items():
        for index, stage, name in queue:
            if index not in named:  # a swapped pair is one problem, reported at its wait
                problems.append(OrderingProblem("never-waited", kind, index, stage, name))
    return TransferOrder(pairs, tuple(sorted(problems, key=lambda p: p.index)))
