"""One vocabulary for engine steps: what a step is (`StepKind`) and which of the engine's two strategies runs it
(`Slot`).

Why it exists: "decode" and "prefill" carried at least five meanings across tbo's engine integrations (the step's
kind, the strategy slot, the agreement's vote, the backend's mode, a config key), each a bare string, and a field
named for one held another (issue 58). Two enums keep the two ideas apart: a mixed step (chunked prefill beside
decodes) is of kind ``MIXED`` and runs the ``PREFILL`` slot; a verify step is of kind ``DECODE`` and runs the
``DECODE`` slot; a data-parallel dummy step is ``IDLE`` and runs whatever slot its peers agreed.

Both are ``str`` enums whose members equal, hash and print as their values: the stats file's keys, the metrics'
labels, the config's keys and the step agreement's wire encoding stay the strings they were, and code that still
holds a string compares equal to the member.
"""

from __future__ import annotations

import enum

from tbo.split.index import ForwardMode

__all__ = ["StepKind", "Slot"]


class _Word(str, enum.Enum):
    """A ``str`` enum that is its value everywhere a string is: equality, hashing (a dict keyed by members finds
    the string, and the reverse), ``str()``, ``repr()`` (an error message naming a kind reads ``'decode'``, as
    before), ``format()`` and JSON."""

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class StepKind(_Word):
    """What an engine step is, by its requests: what ``stats()`` counts steps by."""

    DECODE = "decode"  #: every request past its prompt (a speculative verify step too)
    PREFILL = "prefill"  #: no request past its prompt
    MIXED = "mixed"  #: chunked prefill beside decodes
    IDLE = "idle"  #: data parallelism: a dummy step run only for the peers' collectives
    WARMUP = "warmup"  #: an engine's warm-up or graph capture: run, never counted
    DRAFT = "draft"  #: one forward of a drafter's model (MTP): counted apart from steps

    @property
    def samples(self) -> bool:
        """Whether the engine samples tokens after it: a real step (a dummy step, a warm-up and a draft forward do
        not end in the step's sampling)."""
        return self in (StepKind.DECODE, StepKind.PREFILL, StepKind.MIXED)


class Slot(_Word):
    """Which of an engine's two strategies runs a step: its decode strategy (fixed shapes, the decode backend) or
    its prefill one (whose forms serve any step)."""

    DECODE = "decode"
    PREFILL = "prefill"

    @classmethod
    def of(cls, forward_mode: ForwardMode) -> "Slot":
        """The slot a batch of ``forward_mode`` needs: decode for decode-like batches (a verify step too), prefill
        otherwise."""
        return cls.DECODE if forward_mode.is_decode_like else cls.PREFILL
