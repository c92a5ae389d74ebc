"""`SplitWitness`: proof that a step was split, which an equality with ``forward()`` alone is not.

An equivalence test that compares TBO's output with the unsplit model passes just as well when nothing is ever split
(`tests/mutants/never_split`). Passed as the executor's observer, a witness counts the ops each microbatch ran: a
split step runs every op once per microbatch, an unsplit one only microbatch 0's.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from tbo.core.observer import Observer


class SplitWitness(Observer):
    """Records the ops each microbatch ran, over one or several steps."""

    def __init__(self) -> None:
        self.names: defaultdict[int, list[str]] = defaultdict(list)

    def on_op_start(self, mb: int, stage: int, name: str) -> None:
        self.names[mb].append(name)

    @property
    def ops(self) -> Counter[int]:
        """How many ops each microbatch ran."""
        return Counter({mb: len(names) for mb, names in self.names.items()})

    @property
    def microbatches(self) -> list[int]:
        """The microbatches that ran ops, e.g. ``[0, 1]`` for split steps, ``[0]`` for unsplit ones."""
        return sorted(self.ops)

    @property
    def every_step_split(self) -> bool:
        """True when ops ran in two microbatches, the same number in each: every step seen was split in two."""
        return self.microbatches == [0, 1] and self.ops[0] == self.ops[1]

    def expect(self, split: bool, what: str = "the step") -> None:
        """Assert ``what`` was split in two (``split``) or ran as one batch; the message says which it was."""
        if split:
            assert self.every_step_split, f"{what} was not split: ops per microbatch {dict(self.ops)}"
        else:
            assert self.microbatches == [0], f"{what} was split though it should not be: {dict(self.ops)}"
