"""`AFDConfig`: who is attention and who is FFN, and whether steps are cut in two for dual-batch overlap.

With DBO the attention side sends microbatch 0, then computes microbatch 1 while the FFN side computes microbatch 0.
Two microbatches (the seed's DBO) are the default; 3 or 4 ping-pong the way MegaScale-Infer and Step-3 do, so that a
round trip to the FFN side longer than one microbatch's attention is still hidden (docs/afd.md says when a third
pays). Other counts are refused here, at configuration time; a count the FFN server does not serve is refused at the
join (`tbo.afd.group.AFDGroup.connect`). (The AFD recipe this follows calls each microbatch a "stage"; in tbo a stage
is a Yield-segment of a strategy, and a microbatch is a microbatch.) When a step is too small to split is
the `SplitPolicy`'s business; the thresholds default to the reference recipe's (decode 2, prefill 12).
"""

from __future__ import annotations

from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, model_validator

from tbo.comm.emulated import parse_link_spec
from tbo.split.plan import SplitPolicy

__all__ = ["AFDConfig", "AFD_NUM_MICROBATCHES", "AFD_MICROBATCH_COUNTS"]

#: Dual-batch overlap in AFD uses this many microbatches unless told otherwise.
AFD_NUM_MICROBATCHES = 2
#: the microbatch counts a split AFD step may have (an FFN server serves all of them unless told otherwise)
AFD_MICROBATCH_COUNTS = (2, 3, 4)


class AFDConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    role: Literal["attention", "ffn"]
    num_attention_ranks: int = 1
    num_ffn_ranks: int = 1
    dbo: bool = True
    num_microbatches: int = AFD_NUM_MICROBATCHES
    decode_token_threshold: int = 2
    prefill_token_threshold: int = 12
    #: an emulated link between attention and FFN ranks, ``"LATENCY_US,GBPS"`` (`tbo.afd.link`); None: none
    link: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _thresholds_follow_the_count(cls, data: Any) -> Any:
        """Unset thresholds follow the microbatch count (the recipe's decode 2, prefill 12 at two microbatches):
        ``AFDConfig(num_microbatches=3)`` splits decode from 3 tokens, prefill from 18."""
        if isinstance(data, Mapping) and "num_microbatches" in data:
            try:
                n = int(data["num_microbatches"])
            except (TypeError, ValueError):
                return data  # the field's own check names it
            data = {"decode_token_threshold": max(n, 2), "prefill_token_threshold": 6 * max(n, 2), **data}
        return data

    @model_validator(mode="after")
    def _check(self) -> "AFDConfig":
        if self.dbo and self.num_microbatches not in AFD_MICROBATCH_COUNTS:
            raise ValueError(f"AFD overlap runs {', '.join(map(str, AFD_MICROBATCH_COUNTS))} microbatches, got "
                             f"num_microbatches={self.num_microbatches}")
        if self.link is not None:
            parse_link_spec(self.link)  # malformed: refused here, naming the spec
        if self.num_attention_ranks < 1 or self.num_ffn_ranks < 1:
            raise ValueError("num_attention_ranks and num_ffn_ranks must be at least 1")
        if self.num_attention_ranks < self.num_ffn_ranks or self.num_attention_ranks % self.num_ffn_ranks:
            raise ValueError(f"num_attention_ranks={self.num_attention_ranks} must be a multiple of num_ffn_ranks="
                             f"{self.num_ffn_ranks} (each FFN rank serves the same number of attention ranks)")
        if self.dbo:
            self.split_policy()  # thresholds below the microbatch count are refused by SplitPolicy, naming the field
        return self

    def split_policy(self) -> SplitPolicy:
        return SplitPolicy(num_microbatches=self.num_microbatches, decode_token_threshold=self.decode_token_threshold,
                           prefill_token_threshold=self.prefill_token_threshold)

    @property
    def world_size(self) -> int:
        return self.num_attention_ranks + self.num_ffn_ranks
