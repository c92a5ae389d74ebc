"""The attention-FFN connector: hidden states out, FFN results back, each behind a fixed-size metadata header.

Ranks ``[0, M)`` are attention ranks, ``[M, M + N)`` FFN ranks; attention rank ``a`` talks to FFN rank
``M + a // (M / N)``. Each message is a header (`AFDMeta` as int64) followed by the payload, so the FFN side knows,
before it allocates or uses anything, which layer and microbatch a tensor belongs to and how big it is. Sends are
asynchronous; every receive has a deadline and raises `CommTimeoutError` naming the rank, the layer and the
microbatch. Over gloo, receives are posted before their messages arrive (`_Posted`).

The ranks meet in a registered ``torch.distributed`` group (the default one, or ``group=``), or in an `AFDGroup` of
their own when an engine owns the default group (vLLM): the connector sends through either the same way.

Header words, in order: magic ``0x7B0AFD``, shutdown flag, layer, microbatch (stage) index, number of microbatches,
tokens, hidden size, dtype code (index into float32, float64, bfloat16, float16).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Protocol

import torch

from tbo.afd.group import AFDGroup, AFDPeerError
from tbo.comm.wait import DEFAULT_TIMEOUT_S, wait_work

__all__ = ["AFDMeta", "AFDConnector", "AFDTopology", "TorchDistributedAFDConnector"]

_MAGIC = 0x7B0AFD
_KEEP_SENDS = 16
_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


@dataclass(frozen=True)
class AFDMeta:
    """What travels ahead of every payload."""

    layer_idx: int
    microbatch_idx: int
    num_microbatches: int
    num_tokens: int
    hidden: int
    dtype: torch.dtype = torch.float32
    shutdown: bool = False
    src: int = -1  #: filled in by the receiver: the rank it came from

    def encode(self) -> torch.Tensor:
        return torch.tensor([_MAGIC, int(self.shutdown), self.layer_idx, self.microbatch_idx, self.num_microbatches,
                             self.num_tokens, self.hidden, _DTYPES.index(self.dtype)], dtype=torch.int64)

    @classmethod
    def decode(cls, header: torch.Tensor, src: int) -> "AFDMeta":
        magic, shutdown, layer, mb, num_mbs, tokens, hidden, dtype = header.tolist()
        if magic != _MAGIC:
            raise RuntimeError(f"AFD header from rank {src} is corrupt (magic {magic:#x}); the peers are out of step")
        if shutdown not in (0, 1) or not 0 <= dtype < len(_DTYPES) or min(tokens, hidden) < 0 or (
                not shutdown and not 0 <= mb < num_mbs):
            raise RuntimeError(f"AFD header from rank {src} is malformed: shutdown={shutdown}, microbatch {mb} of "
                               f"{num_mbs}, {tokens} tokens x {hidden}, dtype code {dtype}")
        return cls(layer, mb, num_mbs, tokens, hidden, _DTYPES[dtype], bool(shutdown), src)

    def describe(self) -> str:
        return f"layer {self.layer_idx}, microbatch {self.microbatch_idx}/{self.num_microbatches}"


@dataclass(frozen=True)
class AFDTopology:
    num_attention_ranks: int
    num_ffn_ranks: int

    def ffn_peer(self, attention_rank: int) -> int:
        return self.num_attention_ranks + attention_rank // (self.num_attention_ranks // self.num_ffn_ranks)

    def attention_peers(self, ffn_rank: int) -> list[int]:
        per = self.num_attention_ranks // self.num_ffn_ranks
        first = (ffn_rank - self.num_attention_ranks) * per
        return list(range(first, first + per))

    def is_attention(self, rank: int) -> bool:
        return rank < self.num_attention_ranks


class AFDConnector(Protocol):
    def send_attn_output(self, hidden: torch.Tensor, meta: AFDMeta) -> Any: ...

    def recv_ffn_output(self, meta: AFDMeta) -> torch.Tensor: ...

    def recv_attn_output(self) -> tuple[torch.Tensor, AFDMeta]: ...

    def send_ffn_output(self, out: torch.Tensor, meta: AFDMeta) -> Any: ...


@dataclass
class _Sent:
    works: tuple[Any, ...]
    buffers: tuple[torch.Tensor, ...]  # kept alive until the sends complete


@dataclass
class _Posted:
    """A header receive and a payload receive, posted before their message arrives.

    gloo's point-to-point is a rendezvous: a send's bytes move only once the receiver has posted a matching receive.
    A receive posted after its message is announced costs a round trip through the sender's transport thread, which
    shares a busy core with the sender's compute; posted early, the sender writes the bytes itself, at once. gloo
    takes a message shorter than the posted buffer, so the FFN side posts a buffer of its largest request.
    """

    header: torch.Tensor
    header_work: Any
    payload: torch.Tensor
    payload_work: Any


class TorchDistributedAFDConnector:
    """`AFDConnector` over torch.distributed point-to-point (gloo on CPU, NCCL on GPU)."""

    def __init__(self, topology: AFDTopology, timeout_s: float = DEFAULT_TIMEOUT_S, group: Any = None,
                 idle_timeout_s: float = 600.0, *, device: Any = None,
                 check_request: Callable[[AFDMeta], None] | None = None,
                 max_request_bytes: int | None = None) -> None:
        """``timeout_s`` bounds every wait inside a step; ``idle_timeout_s`` bounds how long an FFN rank waits for
        the next request, which includes the attention side's time between steps. ``group``: a registered
        process group, or an `AFDGroup`. ``device``: where received payloads go. ``check_request`` (FFN side)
        sees every request's header before its payload is used, and raises to refuse it.
        ``max_request_bytes`` (FFN side): the largest payload a request may carry; over gloo with one attention
        peer, each request's receives are then posted before it arrives (`_Posted`)."""
        import torch.distributed as dist

        self.topology, self.timeout_s, self.group = topology, timeout_s, group
        self.idle_timeout_s, self.device, self.check_request = idle_timeout_s, device, check_request
        if isinstance(group, AFDGroup):
            self.rank, world, backend = group.rank, group.size, group.backend
            self._isend, self._irecv = group.isend, group.irecv
        else:
            self.rank, world, backend = dist.get_rank(), dist.get_world_size(group), dist.get_backend(group)
            self._isend = lambda t, dst: dist.isend(t, dst, group=group)
            self._irecv = lambda t, src: dist.irecv(t, src, group=group)
        if world != topology.num_attention_ranks + topology.num_ffn_ranks:
            raise ValueError(f"world size {world} != {topology.num_attention_ranks} attention + "
                             f"{topology.num_ffn_ranks} FFN ranks")
        self._sent: list[_Sent] = []
        #: gloo's point-to-point ops are independent of one another, so a receive can wait posted while sends run
        #: (NCCL runs a pair's sends and receives in order on one stream: a receive posted early would hold back
        #: the sends behind it, the overlap itself)
        self.post_early = str(backend).lower() == "gloo"
        self._answers: dict[tuple[int, int], list[_Posted]] = {}  #: attention side: receives posted at send time
        self._next: _Posted | None = None  #: FFN side: the next request's receives, posted before it arrives
        self._spare: torch.Tensor | None = None  #: FFN side: the request buffer not in use (two alternate)
        self.max_request_bytes = max_request_bytes
        if not self.post_early or topology.is_attention(self.rank) or len(topology.attention_peers(self.rank)) != 1:
            self.max_request_bytes = None  # NCCL, or receives from any peer: each payload sized by its header

    # ---- shared -------------------------------------------------------------------------------------------------
    def _send(self, tensor: torch.Tensor | None, meta: AFDMeta, dst: int) -> _Sent:
        """Header, then payload (none for a shutdown message)."""
        header = meta.encode().to(self.device) if self.device is not None else meta.encode()
        works, buffers = [self._isend(header, dst)], [header]
        if tensor is not None:
            payload = tensor.contiguous()
            works.append(self._isend(payload, dst))
            buffers.append(payload)
        sent = _Sent(tuple(works), tuple(buffers))
        self._sent.append(sent)
        while len(self._sent) > _KEEP_SENDS:  # long answered by now: waiting costs nothing and frees the buffers
            for work in self._sent.pop(0).works:
                wait_work(work, self.timeout_s, "afd send")
        return sent

    def _recv_payload(self, meta: AFDMeta, src: int, what: str) -> torch.Tensor:
        out = torch.empty(meta.num_tokens, meta.hidden, dtype=meta.dtype, device=self.device)
        wait_work(self._irecv(out, src), self.timeout_s, what)
        return out

    def _post(self, src: int, payload: torch.Tensor) -> _Posted:
        """Post a header receive and a payload receive from ``src``, in that order (gloo matches them in order)."""
        header = torch.empty(8, dtype=torch.int64, device=self.device)
        header_work = self._irecv(header, src)
        return _Posted(header, header_work, payload, self._irecv(payload, src))

    def _recv_header(self, src: int | None, what: str, timeout_s: float) -> AFDMeta:
        header = torch.empty(8, dtype=torch.int64, device=self.device)
        work = self._irecv(header, src)
        wait_work(work, timeout_s, what)
        return AFDMeta.decode(header, src if src is not None else work._source_rank())

    def flush(self) -> None:
        """Wait for every send still in flight (before shutting down)."""
        for sent in self._sent:
            for work in sent.works:
                wait_work(work, self.timeout_s, "afd send")
        self._sent.clear()

    # ---- attention side -----------------------------------------------------------------------------------------
    def send_attn_output(self, hidden: torch.Tensor, meta: AFDMeta) -> _Sent:
        """Send the stage's hidden states; over gloo, post the receives of its answer at once (`_Posted`): the
        answer has the same shape, and the FFN side answers each attention rank in the order it asked."""
        peer = self.topology.ffn_peer(self.rank)
        sent = self._send(hidden, meta, peer)
        if self.post_early:
            answer = self._post(peer, torch.empty(meta.num_tokens, meta.hidden, dtype=meta.dtype, device=self.device))
            self._answers.setdefault((meta.layer_idx, meta.microbatch_idx), []).append(answer)
        return sent

    def recv_ffn_output(self, meta: AFDMeta) -> torch.Tensor:
        peer = self.topology.ffn_peer(self.rank)
        what = f"afd_recv ({meta.describe()}) from FFN rank {peer}"
        answer = self._take_answer(meta)
        if answer is not None:
            wait_work(answer.header_work, self.timeout_s, what)
            got = AFDMeta.decode(answer.header, peer)
        else:
            got = self._recv_header(peer, what, self.timeout_s)
        if (got.layer_idx, got.microbatch_idx, got.num_tokens) != (meta.layer_idx, meta.microbatch_idx, meta.num_tokens):
            raise RuntimeError(f"rank {self.rank}: FFN rank {peer} answered {got.describe()} ({got.num_tokens} "
                               f"tokens) while {meta.describe()} ({meta.num_tokens} tokens) was expected")
        if answer is None:
            return self._recv_payload(got, peer, what)
        wait_work(answer.payload_work, self.timeout_s, what)
        return answer.payload

    def _take_answer(self, meta: AFDMeta) -> _Posted | None:
        """The receives posted for this layer and stage's answer (the oldest, if a failed step left some)."""
        key = (meta.layer_idx, meta.microbatch_idx)
        posted = self._answers.get(key)
        if not posted:
            return None
        answer = posted.pop(0)
        if not posted:
            del self._answers[key]
        return answer

    def shutdown(self) -> None:
        """Tell this rank's FFN peer that it will send nothing more."""
        self._send(None, AFDMeta(-1, 0, 0, 0, 1, shutdown=True), self.topology.ffn_peer(self.rank))
        self.flush()

    # ---- FFN side -----------------------------------------------------------------------------------------------
    def recv_attn_output(self) -> tuple[torch.Tensor, AFDMeta]:
        """The next request from any of this FFN rank's attention ranks, in arrival order."""
        if self.max_request_bytes is not None:
            return self._recv_posted_request()
        peers = self.topology.attention_peers(self.rank)
        # one peer: receive from it by name, so that its death is noticed at once (an any-source receive waits on)
        meta = self._recv_header(peers[0] if len(peers) == 1 else None,
                                 "afd: waiting for the next request from the attention ranks", self.idle_timeout_s)
        if meta.src not in self.topology.attention_peers(self.rank):
            raise RuntimeError(f"FFN rank {self.rank} got a request from rank {meta.src}, which is not one of its "
                               f"attention ranks {self.topology.attention_peers(self.rank)}")
        if meta.shutdown:
            return torch.zeros(0, 1), meta
        if self.check_request is not None:
            self.check_request(meta)
        return self._recv_payload(meta, meta.src, f"afd payload ({meta.describe()}) from rank {meta.src}"), meta

    def _recv_posted_request(self) -> tuple[torch.Tensor, AFDMeta]:
        """One peer over gloo: each request's receives are posted before it comes (`_Posted`), into one of two
        buffers of ``max_request_bytes``; the next request's go into the other as soon as this one is in, so that
        it arrives while this one's FFN runs. The payload returned is a view of its buffer, valid until the next
        call."""
        peer = self.topology.attention_peers(self.rank)[0]
        current = self._next if self._next is not None else self._post(peer, self._request_buffer())
        self._next = None
        wait_work(current.header_work, self.idle_timeout_s,
                  "afd: waiting for the next request from the attention ranks")
        meta = AFDMeta.decode(current.header, peer)
        if meta.shutdown:  # no payload follows: its posted receive ends with the group
            return torch.zeros(0, 1), meta
        if self.check_request is not None:
            self.check_request(meta)
        nbytes = meta.num_tokens * meta.hidden * meta.dtype.itemsize
        if nbytes > current.payload.numel():
            raise AFDPeerError(f"rank {peer} sent {meta.describe()} of {meta.num_tokens} tokens x {meta.hidden}: "
                               f"{nbytes} bytes, more than the {current.payload.numel()} this FFN rank takes")
        wait_work(current.payload_work, self.timeout_s, f"afd payload ({meta.describe()}) from rank {peer}")
        self._next = self._post(peer, self._request_buffer())  # the previous request's buffer: its FFN is done
        self._spare = current.payload
        return current.payload[:nbytes].view(meta.dtype).view(meta.num_tokens, meta.hidden), meta

    def _request_buffer(self) -> torch.Tensor:
        buffer, self._spare = self._spare, None
        if buffer is None:
            buffer = torch.empty(self.max_request_bytes, dtype=torch.uint8, device=self.device)
        return buffer

    def send_ffn_output(self, out: torch.Tensor, meta: AFDMeta) -> _Sent:
        return self._send(out, replace(meta, num_tokens=out.shape[0], hidden=out.shape[1], dtype=out.dtype),
                          meta.src)

