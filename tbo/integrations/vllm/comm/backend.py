"""The expert-parallel backend the plugin dispatches vLLM's MoE tokens through, from ``additional_config``.

``local``: tbo's own all-to-all, NORMAL layout (vLLM's fused-MoE kernel takes each token once with its top-k ids and
weights): every expert on this rank (with tensor parallelism each rank holds all experts, sharded), or, with data
parallel + expert parallel, `tbo.integrations.vllm.comm.ep.EpBackend` over vLLM's expert-parallel group. ``deepep``:
DeepEP over that group, CUDA only. Steps with prefill run a NORMAL-layout kind (V2, or V1 normal mode); decode
steps run DeepEP's low-latency kernels (V1, MASKED layout, one un-received call at a time: checked against the
decode strategy's schedule when it is bound), whose slabs vLLM's batched experts kernel computes
(`tbo.integrations.vllm.model.masked`), where ``deepep_decode`` and the model allow it (`low_latency_refusal`): the two
backends then sit behind one `ModeBackends`, which the layer loop points at the step's strategy. ``link`` wraps the
backend in `EmulatedLink`, so that dispatch and combine take the time a real interconnect would and overlap shows
on a CPU.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

import torch

from tbo.comm.alltoall import LocalBackend
from tbo.comm.emulated import EmulatedLink
from tbo.comm.types import DispatchFormat
from tbo.integrations.vllm.config import TboVllmConfig
from tbo.integrations.vllm.errors import config_error
from tbo.split.kinds import Slot

__all__ = ["ModeBackends", "backend_for", "low_latency_refusal", "low_latency_tokens", "make_backend",
           "select_backend"]

logger = logging.getLogger("vllm.tbo")


def low_latency_tokens(max_decode_tokens: int, num_ranks: int) -> int:
    """DeepEP's ``num_max_dispatch_tokens_per_rank`` for decode steps of at most ``max_decode_tokens`` tokens per
    rank: that many, rounded up so that ``num_ranks`` times it is a multiple of 4 (DeepEP's TMA needs it)."""
    m = max(1, int(max_decode_tokens))
    while (num_ranks * m) % 4:
        m += 1
    return m


def low_latency_refusal(*, dtype: Any, hidden: int, top_k: int, num_ranks: int, max_decode_tokens: int) -> str | None:
    """Why DeepEP's low-latency kernels cannot carry this model's decode steps (None: they can): they take BF16
    hidden states of a hidden size they are compiled for, at most 11 experts per token, and a bounded token count
    (the queue depth: `tbo.comm.deepep.check_low_latency_sizes`)."""
    from tbo.comm.deepep import check_low_latency_sizes

    if dtype != torch.bfloat16:
        return f"its dispatch takes bfloat16 hidden states and this model runs in {dtype}"
    try:
        check_low_latency_sizes(num_ranks, low_latency_tokens(max_decode_tokens, num_ranks), hidden, top_k)
    except ValueError as e:
        return str(e)
    return None


class ModeBackends:
    """DeepEP for an engine: the low-latency backend for decode steps, a NORMAL-layout one for steps with prefill.
    Layers hold this; the layer loop calls `use` with the step's mode before the layers run, and every dispatch and
    combine of that step goes to that backend (a step runs one strategy, so its handles never cross backends)."""

    def __init__(self, decode: Any, prefill: Any) -> None:
        for name in ("num_experts", "num_local_experts", "rank", "num_ranks"):
            if getattr(decode, name) != getattr(prefill, name):
                raise ValueError(f"the decode and prefill backends differ in {name}: {getattr(decode, name)} != "
                                 f"{getattr(prefill, name)}")
        self.decode, self.prefill = decode, prefill
        self.num_experts, self.num_local_experts = decode.num_experts, decode.num_local_experts
        self.rank, self.num_ranks = decode.rank, decode.num_ranks
        self.active = prefill

    def for_mode(self, slot: Slot) -> Any:
        """The backend of a step run in ``slot``."""
        return self.decode if slot == Slot.DECODE else self.prefill

    def use(self, slot: Slot) -> Any:
        """Point every call until the next `use` at the ``slot`` backend; returns it."""
        self.active = self.for_mode(slot)
        return self.active

    @property
    def format(self) -> DispatchFormat:
        return self.active.format

    @property
    def carries_fp8(self) -> bool:
        """Whether a dispatch carries FP8 rows with their scales whichever backend a step runs over."""
        return bool(getattr(self.decode, "carries_fp8", False) and getattr(self.prefill, "carries_fp8", False))

    @property
    def hidden_dtypes(self) -> tuple[Any, ...] | None:
        """The activation dtypes both backends move (None: any), for `tbo.comm.types.payload_refusal`."""
        kinds = [d for d in (getattr(self.decode, "hidden_dtypes", None), getattr(self.prefill, "hidden_dtypes", None))
                 if d is not None]
        if not kinds:
            return None
        return tuple(d for d in kinds[0] if all(d in k for k in kinds))

    @property
    def accepts_rows_per_rank(self) -> bool:
        return bool(getattr(self.active, "accepts_rows_per_rank", False))

    def dispatch_a(self, *args: Any, **kwargs: Any) -> Any:
        return self.active.dispatch_a(*args, **kwargs)

    def dispatch_b(self, state: Any) -> Any:
        return self.active.dispatch_b(state)

    def combine_a(self, *args: Any, **kwargs: Any) -> Any:
        return self.active.combine_a(*args, **kwargs)

    def combine_b(self, state: Any) -> Any:
        return self.active.combine_b(state)

    @property
    def in_flight(self) -> list[Any]:
        return [*self.decode.in_flight, *self.prefill.in_flight]

    def drain(self) -> int:
        return int(self.decode.drain()) + int(self.prefill.drain())

    def __repr__(self) -> str:
        return f"ModeBackends(decode={self.decode!r}, prefill={self.prefill!r})"


def backend_for(backend: Any, slot: Slot) -> Any:
    """The backend a step run in ``slot`` runs over: the slot's own behind a `ModeBackends`, ``backend`` itself
    otherwise (nothing is made active: `select_backend` does that)."""
    return backend.for_mode(slot) if isinstance(backend, ModeBackends) else backend


def select_backend(backend: Any, slot: Slot) -> Any:
    """The backend a step run in ``slot`` runs over: the slot's own behind a `ModeBackends` (now active),
    ``backend`` itself otherwise."""
    return backend.use(slot) if isinstance(backend, ModeBackends) else backend


def make_backend(config: TboVllmConfig, num_experts: int, *, hidden: int, top_k: int, max_tokens: int,
                 ep_size: int = 1, platform: str = "cpu", dtype: Any = None, max_decode_tokens: int | None = None,
                 fp8: bool = False, deep_ep: ModuleType | None = None) -> Any:
    """The `EPBackend` ``config`` asks for, routing ``num_experts`` experts with top-``top_k`` over tokens of
    ``hidden`` channels, at most ``max_tokens`` per step (``max_decode_tokens`` per decode step), over ``ep_size``
    expert-parallel ranks, hidden states of ``dtype``. ``fp8``: its dispatches carry FP8 rows with their scales
    (DeepEP's normal-mode buffers sized for them; decode steps then run normal mode too, `_deepep`). ``deep_ep``:
    the module to build DeepEP buffers with instead of importing ``deep_ep`` (the CPU stand-in,
    `tbo.testing.deepep_standin`, in tests)."""
    if config.backend == "local" and ep_size > 1:
        from tbo.integrations.vllm.comm.ep import EpBackend, ep_group

        backend: Any = EpBackend(num_experts, ep_group(platform), config.comm_timeout_s)
    elif config.backend == "local":
        backend = LocalBackend(num_experts, DispatchFormat.NORMAL)
    else:
        backend = _deepep(config, num_experts, hidden=hidden, top_k=top_k, max_tokens=max_tokens, platform=platform,
                          dtype=dtype, max_decode_tokens=max_decode_tokens, fp8=fp8, deep_ep=deep_ep)
    if config.link is not None:  # around each backend a step runs over
        if isinstance(backend, ModeBackends):
            return ModeBackends(EmulatedLink.from_spec(backend.decode, config.link),
                                EmulatedLink.from_spec(backend.prefill, config.link))
        backend = EmulatedLink.from_spec(backend, config.link)
    return backend


def _deepep(config: TboVllmConfig, num_experts: int, *, hidden: int, top_k: int, max_tokens: int, platform: str,
            dtype: Any, max_decode_tokens: int | None, fp8: bool, deep_ep: ModuleType | None) -> Any:
    """DeepEP for steps with prefill (NORMAL layout), and behind a `ModeBackends` low-latency DeepEP for decode steps
    where ``deepep_decode`` and the model allow it. FP8 dispatch (``fp8``) hands the experts rows the quant method's
    own quantiser made before the dispatch, which normal mode carries as they are; low-latency mode quantises inside
    its own kernel, so with FP8 dispatch decode steps run normal mode too ("auto"), or are refused by name
    ("low_latency")."""
    from tbo.comm.deepep_select import deepep_backend
    from tbo.integrations.vllm.comm.ep import ep_group

    group = ep_group(platform)
    ranks = group.size()
    decode_tokens = max_tokens if max_decode_tokens is None else max_decode_tokens
    why = None if config.deepep_decode == "normal" else (
        "FP8 dispatch (fp8_dispatch) sends rows the quant method quantised, which only normal mode carries as they "
        "are" if fp8 else low_latency_refusal(dtype=dtype, hidden=hidden, top_k=top_k, num_ranks=ranks,
                                              max_decode_tokens=decode_tokens))
    if why is not None and config.deepep_decode == "low_latency":
        raise config_error({"deepep_decode": "low_latency"}, f"DeepEP's low-latency kernels cannot carry this model's "
                           f"decode steps ({why}); accepted: deepep_decode='normal' or 'auto' (then normal mode for "
                           "every step)")
    kind = config.deepep_kind  # "auto" in prefill mode: V2 when installed, else V1 normal; both NORMAL layout
    prefill = deepep_backend(group, num_experts, hidden=hidden, num_max_tokens_per_rank=max_tokens, num_topk=top_k,
                             kind=kind, mode=Slot.PREFILL, use_fp8=fp8, deep_ep=deep_ep)
    if config.deepep_decode == "normal":
        return prefill
    if why is not None:
        logger.info("tbo: DeepEP decode steps run normal mode, as prefill does: low-latency mode cannot carry them "
                    "(%s)", why)
        return prefill
    decode = deepep_backend(group, num_experts, hidden=hidden, num_topk=top_k, kind="v1_low_latency", mode=Slot.DECODE,
                            num_max_tokens_per_rank=low_latency_tokens(decode_tokens, ranks), deep_ep=deep_ep)
    return ModeBackends(decode, prefill)
