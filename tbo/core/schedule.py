"""The compiled interleaving of microbatch stages: a `Schedule` is plain, immutable, printable data.

The rule is one line: microbatch ``i`` runs its stage ``s`` in round ``s + offset[i]``, where ``offset[i]`` is
``i * delta_stages``; within a round, microbatches run in index order. With two equal microbatches that is the
classic TBO shape: A runs ``delta`` stages alone, then A and B alternate, then B runs its last ``delta`` stages.

Compiling this once, and caching it, keeps the executor's hot loop free of bookkeeping; having it as data lets
``tbo show`` print it, the linter check it and the simulator replay it without running a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Iterator, Sequence

__all__ = ["OpVisit", "Schedule", "Step", "interleave", "offsets_for"]

#: One step of a schedule: (microbatch, stage).
Step = tuple[int, int]


@dataclass(frozen=True)
class OpVisit:
    """One op as the schedule runs it: its microbatch, its stage, its name, its communication role
    (``("launch" | "wait", kind)``, or None for compute) and its ``index`` in ``strategy.operations``. What the
    linter, the simulator and the renderers read."""

    mb: int
    stage: int
    op: str
    role: tuple[str, str] | None
    index: int


@dataclass(frozen=True)
class Schedule:
    """Steps ``(microbatch, stage)`` in execution order, with the stage counts and per-microbatch offsets."""

    num_stages: tuple[int, ...]
    offsets: tuple[int, ...]
    steps: tuple[Step, ...]

    @property
    def num_microbatches(self) -> int:
        return len(self.num_stages)

    @property
    def microbatch_order(self) -> tuple[int, ...]:
        """Just the microbatch of each step: all the executor needs, since each microbatch keeps its own cursor."""
        return tuple(mb for mb, _ in self.steps)

    def round_of(self, mb: int, stage: int) -> int:
        return stage + self.offsets[mb]

    @property
    def num_rounds(self) -> int:
        return max(n + off for n, off in zip(self.num_stages, self.offsets))

    def rounds(self) -> tuple[tuple[Step, ...], ...]:
        """Steps grouped by round."""
        grouped: list[list[Step]] = [[] for _ in range(self.num_rounds)]
        for mb, stage in self.steps:
            grouped[self.round_of(mb, stage)].append((mb, stage))
        return tuple(tuple(r) for r in grouped)

    def __iter__(self) -> Iterator[Step]:
        return iter(self.steps)

    def __len__(self) -> int:
        return len(self.steps)

    def render(self, names: Sequence[str] | Sequence[Sequence[str]] | None = None, width: int = 44) -> str:
        """A text table: one row per round, one column per microbatch, each cell the stage and its op names.

        ``names`` is one label per stage shared by every microbatch (e.g. ``"dispatch_b, experts, combine_a"``), or
        one such sequence per microbatch; None shows stage numbers only.
        """
        per_mb = _labels_per_microbatch(names, self.num_stages)
        header = ["round"] + [f"microbatch {chr(65 + mb) if mb < 26 else mb}" for mb in range(self.num_microbatches)]
        rows: list[list[str]] = []
        for r, steps in enumerate(self.rounds()):
            cells = [""] * self.num_microbatches
            for mb, stage in steps:
                label = per_mb[mb][stage] if per_mb else ""
                cell = f"s{stage}" + (f" {label}" if label else "")
                cells[mb] = cell if len(cell) <= width else cell[: width - 1] + "…"
            rows.append([str(r), *cells])
        widths = [max(len(row[c]) for row in [header, *rows]) for c in range(len(header))]
        fmt = " | ".join(f"{{:<{w}}}" for w in widths)
        rule = "-+-".join("-" * w for w in widths)
        return "\n".join([fmt.format(*header).rstrip(), rule, *(fmt.format(*row).rstrip() for row in rows)])

    def __str__(self) -> str:
        return self.render()


def _labels_per_microbatch(
    names: Sequence[str] | Sequence[Sequence[str]] | None, num_stages: tuple[int, ...]
) -> list[Sequence[str]] | None:
    if names is None:
        return None
    if len(names) and not isinstance(names[0], str):
        per_mb = [list(n) for n in names]  # type: ignore[arg-type]
        if len(per_mb) != len(num_stages):
            raise ValueError(f"render: {len(per_mb)} name lists for {len(num_stages)} microbatches")
    else:
        per_mb = [list(names)] * len(num_stages)  # type: ignore[list-item]
    for mb, (labels, n) in enumerate(zip(per_mb, num_stages)):
        if len(labels) != n:
            raise ValueError(f"render: microbatch {mb} has {n} stages but {len(labels)} labels")
    return per_mb


def offsets_for(num_microbatches: int, delta_stages: int | Sequence[int]) -> tuple[int, ...]:
    """Per-microbatch start rounds: ``i * delta`` for an int, or the given list (``[0, 2]`` equals ``2``)."""
    if isinstance(delta_stages, bool) or not isinstance(delta_stages, (int, Sequence)):
        raise ValueError(f"delta_stages must be an int or a list of ints, got {delta_stages!r}")
    if isinstance(delta_stages, int):
        if delta_stages < 0:
            raise ValueError(f"delta_stages must be >= 0, got {delta_stages}")
        return tuple(i * delta_stages for i in range(num_microbatches))
    offsets = tuple(delta_stages)
    if len(offsets) != num_microbatches:
        raise ValueError(f"delta_stages has {len(offsets)} entries for {num_microbatches} microbatches")
    for mb, off in enumerate(offsets):
        if isinstance(off, bool) or not isinstance(off, int) or off < 0:
            raise ValueError(f"delta_stages[{mb}] = {off!r} must be a non-negative int")
    return offsets


def interleave(num_stages: Sequence[int], delta_stages: int | Sequence[int]) -> Schedule:
    """Compile the schedule for microbatches with these stage counts. Cached: equal arguments give the same object."""
    counts = tuple(int(n) for n in num_stages)
    if not counts:
        raise ValueError("interleave needs at least one microbatch")
    for mb, n in enumerate(counts):
        if n < 1:
            raise ValueError(f"microbatch {mb} has {n} stages; it needs at least one")
    return _interleave(counts, offsets_for(len(counts), delta_stages))


@lru_cache(maxsize=256)
def _interleave(num_stages: tuple[int, ...], offsets: tuple[int, ...]) -> Schedule:
    steps = sorted(
        ((stage + offsets[mb], mb, stage) for mb, n in enumerate(num_stages) for stage in range(n)),
    )
    return Schedule(num_stages=num_stages, offsets=offsets, steps=tuple((mb, stage) for _, mb, stage in steps))
