"""`AFDConfig`: who is attention and who is FFN, and whether steps are cut in two for dual-batch overlap.

With DBO the attention side sends microbatch 0, then computes microbatch 1 while the FFN side computes microbatch 0: it
works with exactly two microbatches, so any other count is refused here, at configuration time. (The AFD recipe this
follows calls each microbatch a "stage"; in tbo a stage is a Yield-segment of a strategy, and a microbatch is a
microbatch.) When a step is too small to split is
the `SplitPolicy`'s business; the thresholds default to the reference recipe's (decode 2, prefill 12).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator

from tbo.split.plan import SplitPolicy

__all__ = ["AFDConfig", "AFD_NUM_MICROBATCHES"]

#: Dual-batch overlap in AFD uses exactly this many microbatches.
AFD_NUM_MICROBATCHES = 2


class AFDConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    role: Literal["attention", "ffn"]
    num_attention_ranks: int = 1
    num_ffn_ranks: int = 1
    dbo: bool = True
    num_microbatches: int = AFD_NUM_MICROBATCHES
    decode_token_threshold: int = 2
    prefill_token_threshold: int = 12

    @model_validator(mode="after")
    def _check(self) -> "AFDConfig":
        if self.dbo and self.num_microbatches != AFD_NUM_MICROBATCHES:
            raise ValueError(f"AFD dual-batch overlap requires exactly {AFD_NUM_MICROBATCHES} microbatches, got "
                             f"num_microbatches={self.num_microbatches}")
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
