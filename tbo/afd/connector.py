"""The attention-FFN connector: hidden states out, FFN results back, each behind a fixed-size metadata header.

Ranks ``[0, M)`` are attention ranks, ``[M, M + N)`` FFN ranks; attention rank ``a`` talks to FFN rank
``M + a // (M / N)``. Each message is a header (`AFDMeta` as int64) followed by the payload, so the FFN side knows,
before it allocates or uses anything, which layer and microbatch a tensor belongs to and how big it is. Sends are
asynchronous; every receive has a deadline and raises `CommTimeoutError` naming the rank, the layer and the
microbatch. Over gloo, receives are posted before their messages arrive (`_Posted`).

The ranks meet in a registered ``torch.distributed`` group (the default one, or ``group=``), or in an `AFDGroup` of
their own when an engine owns the default group (vLLM): the connector sends through either the same way (an
`AFDGroup` on CPU carries the messages on its authenticated socket, with gloo's point-to-point semantics, a
message longer than its posted receive refused by name instead of aborting the process).

Header words, in order: magic ``0x7B0AFD``, shutdown flag, layer, microbatch (stage) index, number of microbatches,
tokens, hidden size, dtype code (index into float32, float64, bfloat16, float16), step, sequence number. Every
payload ends with an 8-byte trailer repeating its message's sequence number, so that a payload shorter than its
header says (which gloo accepts into a longer buffer) is refused instead of served from the bytes a previous
request left there. The step counter is the attention side's: an answer echoes its request's, and one of another
step (left by a failed step) is refused, naming both.

gloo aborts the whole process when a message is longer than its posted receive. So every receive is posted with
the room the protocol allows: a header receive has room for more words than a header has; a request's payload is
received only after its header was checked (at most ``max_request_bytes``), into a buffer of that size; an answer
into a buffer of the largest answer the server may send (``max_answer_bytes``). A peer that sends more than that
can still abort its partner: only a peer that has joined the group can, and docs/hardening.md says where that
boundary lies.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Protocol

import torch

from tbo.afd.group import AFDGroup, AFDPeerError
from tbo.afd.link import DelayedSends, link_timeline
from tbo.comm.emulated import LinkTimeline
from tbo.comm.wait import DEFAULT_TIMEOUT_S, named_comm_error, wait_work
from tbo.core.errors import CommTimeoutError

__all__ = ["AFDMeta", "AFDConnector", "AFDTopology", "TorchDistributedAFDConnector", "HEADER_WORDS",
           "MAX_MICROBATCHES"]

_MAGIC = 0x7B0AFD
_KEEP_SENDS = 16
_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
#: words of a header on the wire
HEADER_WORDS = 10
#: words a gloo header receive is posted with: room for a longer message, so that one up to this size is refused by
#: name (a message longer than its posted receive aborts the receiving process inside gloo)
_HEADER_ROOM = 16
#: what a posted header receive is filled with: a word still equal to it after the wait was never written
_UNWRITTEN = -0x5EA1_0AFD_5EA1_0AFD
#: the most microbatches one request may say its step has
MAX_MICROBATCHES = 64
_TRAILER = 8  # bytes after every payload: its message's sequence number


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
    step: int = 0  #: the attention side's step counter (set by the connector; an answer echoes its request's)
    seq: int = 0  #: the message's number on its connection (set by the connector at send)

    def encode(self) -> torch.Tensor:
        return torch.tensor([_MAGIC, int(self.shutdown), self.layer_idx, self.microbatch_idx, self.num_microbatches,
                             self.num_tokens, self.hidden, _DTYPES.index(self.dtype), self.step, self.seq],
                            dtype=torch.int64)

    @classmethod
    def decode(cls, header: torch.Tensor, src: int) -> "AFDMeta":
        """Check every word, and that the message was exactly `HEADER_WORDS` long (the receive is posted with room
        to spare, filled with a marker: a shorter message leaves the marker in its last words, a longer one
        overwrites the room after them)."""
        words = header.tolist()
        if len(words) < HEADER_WORDS or _UNWRITTEN in words[:HEADER_WORDS] or any(
                w != _UNWRITTEN for w in words[HEADER_WORDS:]):
            written = sum(1 for w in words if w != _UNWRITTEN)
            raise RuntimeError(f"AFD header from rank {src} is not {HEADER_WORDS} words long (about {written} were "
                               "written); the peers are out of step or speak another version")
        magic, shutdown, layer, mb, num_mbs, tokens, hidden, dtype, step, seq = words[:HEADER_WORDS]
        if magic != _MAGIC:
            raise RuntimeError(f"AFD header from rank {src} is corrupt (magic {magic:#x}); the peers are out of step")
        if shutdown not in (0, 1) or not 0 <= dtype < len(_DTYPES) or min(tokens, hidden, step, seq) < 0 or (
                not shutdown and not (0 <= mb < num_mbs <= MAX_MICROBATCHES and layer >= 0)):
            raise RuntimeError(f"AFD header from rank {src} is malformed: shutdown={shutdown}, layer {layer}, "
                               f"microbatch {mb} of {num_mbs} (at most {MAX_MICROBATCHES}), {tokens} tokens x "
                               f"{hidden}, dtype code {dtype}, step {step}, sequence {seq}")
        return cls(layer, mb, num_mbs, tokens, hidden, _DTYPES[dtype], bool(shutdown), src, step, seq)

    @property
    def nbytes(self) -> int:
        return self.num_tokens * self.hidden * self.dtype.itemsize

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
    """A header receive, and (attention side) the answer's payload receive, posted before their message arrives.

    gloo's point-to-point is a rendezvous: a send's bytes move only once the receiver has posted a matching receive.
    A receive posted after its message is announced costs a round trip through the sender's transport thread, which
    shares a busy core with the sender's compute; posted early, the sender writes the bytes itself, at once. gloo
    takes a message shorter than the posted buffer (the trailer and the header's length check catch one), never a
    longer one. ``seq`` and ``step``: what the message must say.
    """

    header: torch.Tensor
    header_work: Any
    payload: torch.Tensor | None
    payload_work: Any
    seq: int
    step: int = 0
    expect: tuple[int, int, int] = (0, 0, 0)  #: attention side: the request's layer, microbatch and tokens


class TorchDistributedAFDConnector:
    """`AFDConnector` over torch.distributed point-to-point (gloo on CPU, NCCL on GPU)."""

    def __init__(self, topology: AFDTopology, timeout_s: float = DEFAULT_TIMEOUT_S, group: Any = None,
                 idle_timeout_s: float = 600.0, *, device: Any = None,
                 check_request: Callable[[AFDMeta], None] | None = None,
                 max_request_bytes: int | None = None, max_answer_bytes: int | None = None,
                 link: str | LinkTimeline | None = None, refuse_nonfinite: bool = False) -> None:
        """``timeout_s`` bounds every wait inside a step; ``idle_timeout_s`` bounds how long an FFN rank waits for
        the next request, which includes the attention side's time between steps. ``group``: a registered
        process group, or an `AFDGroup`. ``device``: where received payloads go. ``check_request`` (FFN side)
        sees every request's header before its payload is received, and raises to refuse it.
        ``max_request_bytes`` (FFN side): the largest payload a request may carry; over gloo with one attention
        peer, each request's header receive is then posted before it arrives (`_Posted`), and its payload lands in
        a buffer of that size. ``max_answer_bytes`` (attention side): the largest answer the FFN side may send (its
        ``max_tokens`` of hidden states); each answer's receive is posted with that room (default: the request's
        size). ``link``: ``"LATENCY_US,GBPS"`` (or a `LinkTimeline`): this side's messages leave when an emulated
        link of that latency and bandwidth delivers them (`tbo.afd.link`); None: at once. ``refuse_nonfinite``
        (attention side): an answer holding a NaN or an inf is refused by name instead of handed on (off by default:
        it reads every answer once more; docs/hardening.md has its cost)."""
        import torch.distributed as dist

        self.topology, self.timeout_s, self.group = topology, timeout_s, group
        self.idle_timeout_s, self.device, self.check_request = idle_timeout_s, device, check_request
        if isinstance(group, AFDGroup):
            self.rank, world, backend = group.rank, group.size, group.backend
            isend, irecv = group.isend, group.irecv
        else:
            self.rank, world, backend = dist.get_rank(), dist.get_world_size(group), dist.get_backend(group)
            isend = lambda t, dst: dist.isend(t, dst, group=group)  # noqa: E731
            irecv = lambda t, src: dist.irecv(t, src, group=group)  # noqa: E731
        self._isend = lambda t, dst: self._call(isend, t, dst, f"afd send to rank {dst}")
        self._irecv = lambda t, src: self._call(irecv, t, src, f"afd receive from rank {src}")
        if world != topology.num_attention_ranks + topology.num_ffn_ranks:
            raise ValueError(f"world size {world} != {topology.num_attention_ranks} attention + "
                             f"{topology.num_ffn_ranks} FFN ranks")
        self._sent: list[_Sent] = []
        #: gloo's point-to-point ops are independent of one another, so a receive can wait posted while sends run
        #: (NCCL runs a pair's sends and receives in order on one stream: a receive posted early would hold back
        #: the sends behind it, the overlap itself; NCCL also needs each receive the exact size of its message)
        self.post_early = str(backend).lower() in ("gloo", "tcp")  # tcp: an AFDGroup's authenticated socket
        self._header_words = _HEADER_ROOM if self.post_early else HEADER_WORDS
        self._answers: dict[tuple[int, int], list[_Posted]] = {}  #: attention side: receives posted at send time
        self._next: _Posted | None = None  #: FFN side: the next request's header receive, posted before it arrives
        self._buffer: torch.Tensor | None = None  #: FFN side: where requests' payloads land
        self.max_request_bytes = max_request_bytes
        self.max_answer_bytes = max_answer_bytes
        if not self.post_early or topology.is_attention(self.rank) or len(topology.attention_peers(self.rank)) != 1:
            self.max_request_bytes = None  # NCCL, or receives from any peer: each payload sized by its header
        self._send_seq: dict[int, int] = {}  #: per peer: the sequence number of the next message sent to it
        self._recv_seq: dict[int, int] = {}  #: per peer: of the next message expected from it
        self._step = 0  #: attention side: this step's number
        self._step_keys: set[tuple[int, int]] = set()  #: (layer, microbatch) sent in this step
        #: why this connector refuses every later transfer: a wait that timed out (or found its peer gone) leaves
        #: messages in flight that would pair with the next step's, as in `TorchDistributedTransport`
        self.poisoned: str | None = None
        self.link = link_timeline(link)
        self.refuse_nonfinite = refuse_nonfinite
        self._delayed = None if self.link is None else DelayedSends(self.link, self._isend, str(self.rank))

    def _call(self, fn: Callable[[torch.Tensor, Any], Any], tensor: torch.Tensor, peer: Any, what: str) -> Any:
        """gloo raises a lost peer synchronously from ``send`` / ``recv``: as the named `CommTimeoutError` a wait
        would raise."""
        try:
            return fn(tensor, peer)
        except RuntimeError as e:
            named = named_comm_error(e, what, self.timeout_s, f"rank {self.rank}")
            if named is e:
                raise
            raise named from e

    def _wait(self, work: Any, timeout_s: float, what: str) -> None:
        """`wait_work`; a time-out (or a lost peer) poisons the connector (`poisoned`)."""
        try:
            wait_work(work, timeout_s, what, f"rank {self.rank}")
        except CommTimeoutError as e:
            self.poisoned = self.poisoned or str(e)
            raise

    def _refuse_if_poisoned(self, what: str) -> None:
        if self.poisoned is not None:
            raise CommTimeoutError(f"rank {self.rank}: {what} refused: an earlier wait of this AFD pair timed out "
                                   f"({self.poisoned}), and its messages may still arrive into this step's: rebuild "
                                   "the pair (a new group and connector) before the next step")

    @staticmethod
    def _next_seq(counters: dict[int, int], peer: int) -> int:
        seq = counters.get(peer, 0)
        counters[peer] = seq + 1
        return seq

    # ---- shared -------------------------------------------------------------------------------------------------
    def _send(self, tensor: torch.Tensor | None, meta: AFDMeta, dst: int) -> _Sent:
        """Header, then payload with its trailer (none for a shutdown message)."""
        meta = replace(meta, seq=self._next_seq(self._send_seq, dst))
        header = meta.encode().to(self.device) if self.device is not None else meta.encode()
        buffers = [header]
        if tensor is not None:
            flat = tensor.contiguous().view(-1).view(torch.uint8)
            wire = torch.empty(flat.numel() + _TRAILER, dtype=torch.uint8, device=flat.device)
            wire[:flat.numel()].copy_(flat)
            wire[flat.numel():].copy_(torch.tensor([meta.seq], dtype=torch.int64).view(torch.uint8))
            buffers.append(wire)
        if self._delayed is not None:  # header and payload leave together, when the emulated link delivers them
            kind = "afd_request" if self.topology.is_attention(self.rank) else "afd_answer"
            works = self._delayed.send(buffers, dst, kind)
        else:
            works = [self._isend(b, dst) for b in buffers]
        sent = _Sent(tuple(works), tuple(buffers))
        self._sent.append(sent)
        while len(self._sent) > _KEEP_SENDS:  # long answered by now: waiting costs nothing and frees the buffers
            for work in self._sent.pop(0).works:
                wait_work(work, self.timeout_s, "afd send")
        return sent

    def _payload(self, buffer: torch.Tensor, meta: AFDMeta, peer: int, work: Any = None) -> torch.Tensor:
        """The payload in ``buffer`` (received, header checked), once its trailer says it is this message's whole:
        a shorter one leaves another number there. Where the transport says how long the message was (an
        `AFDGroup`'s socket: ``work.nbytes``), a payload of another length is named with both lengths."""
        nbytes = meta.nbytes
        received = getattr(work, "nbytes", None)
        if isinstance(received, int) and received != nbytes + _TRAILER:
            raise AFDPeerError(f"rank {peer} sent a payload of {received - _TRAILER} bytes where its header says "
                               f"{nbytes} ({meta.describe()}, {meta.num_tokens} tokens x {meta.hidden}): "
                               f"{'longer' if received > nbytes + _TRAILER else 'shorter'} than its header says, "
                               "refused")
        if nbytes + _TRAILER > buffer.numel():
            raise AFDPeerError(f"rank {peer} announced {meta.describe()} of {meta.num_tokens} tokens x {meta.hidden} "
                               f"({meta.dtype}): {nbytes} bytes, more than the {buffer.numel() - _TRAILER} posted")
        trailer = int(buffer[nbytes:nbytes + _TRAILER].clone().view(torch.int64)[0])
        if trailer != meta.seq:
            raise AFDPeerError(f"rank {peer} sent a payload shorter than its header says ({meta.describe()}, "
                               f"{meta.num_tokens} tokens x {meta.hidden}: {nbytes} bytes and a trailer expected): "
                               "refused, not served from stale bytes")
        return buffer[:nbytes].view(meta.dtype).view(meta.num_tokens, meta.hidden)

    def _recv_payload(self, meta: AFDMeta, src: int, what: str) -> torch.Tensor:
        buffer = torch.empty(meta.nbytes + _TRAILER, dtype=torch.uint8, device=self.device)
        work = self._irecv(buffer, src)
        self._wait(work, self.timeout_s, what)
        return self._payload(buffer, meta, src, work)

    def _header_buffer(self) -> torch.Tensor:
        return torch.full((self._header_words,), _UNWRITTEN, dtype=torch.int64, device=self.device)

    def _post_header(self, src: int) -> tuple[torch.Tensor, Any, int]:
        header = self._header_buffer()
        return header, self._irecv(header, src), self._next_seq(self._recv_seq, src)

    def _check_seq(self, meta: AFDMeta, expected: int) -> AFDMeta:
        if meta.seq != expected:
            raise AFDPeerError(f"rank {meta.src} sent message {meta.seq} where {expected} was expected "
                               f"({meta.describe()}): a message was lost or replayed")
        return meta

    def _recv_header(self, src: int | None, what: str, timeout_s: float) -> AFDMeta:
        header = self._header_buffer()
        work = self._irecv(header, src)
        self._wait(work, timeout_s, what)
        meta = AFDMeta.decode(header, src if src is not None else work._source_rank())
        return self._check_seq(meta, self._next_seq(self._recv_seq, meta.src))

    def flush(self) -> None:
        """Wait for every send still in flight (before shutting down)."""
        for sent in self._sent:
            for work in sent.works:
                wait_work(work, self.timeout_s, "afd send")
        self._sent.clear()

    @property
    def in_flight(self) -> list[str]:
        """Answers posted and not yet taken (attention side): what a failed step leaves behind."""
        return [f"afd answer for layer {layer}, microbatch {mb}" for (layer, mb), posted in self._answers.items()
                for _ in posted]

    def drain(self, budget_s: float | None = None) -> int:
        """After a failed step: wait out the answers still posted, all within one deadline (default ``timeout_s``),
        and drop them, so that the next step's receives do not take them; return how many there were. An answer
        that does not come in time arrives later into the next step's receives, which refuse it by its step."""
        posted = [p for answers in self._answers.values() for p in answers]
        self._answers.clear()
        self._step_keys.clear()
        self._step += 1  # the next step is another one, whatever it sends first
        self._wait_posted(posted, self.timeout_s if budget_s is None else budget_s)
        return len(posted)

    def _drop_stale(self) -> None:
        """Wait out (0.2 x ``timeout_s`` for all) and drop the answers a failed step left posted: gloo matches
        receives in the order they were posted, so the next step's answers come only after them. If one does not
        come, the pair is out of step: refused by name, not paired with the next step's."""
        stale = [p for answers in self._answers.values() for p in answers]
        self._answers.clear()
        left = self._wait_posted(stale, 0.2 * self.timeout_s)
        if left:
            raise AFDPeerError(f"rank {self.rank}: {left} answer(s) of an earlier, failed step never came from FFN "
                               f"rank {self.topology.ffn_peer(self.rank)}: the pair is out of step (rebuild it)")

    @staticmethod
    def _wait_posted(posted: list[_Posted], budget_s: float) -> int:
        """Wait for ``posted`` receives within one deadline; return how many did not complete."""
        import time

        deadline = time.monotonic() + budget_s
        for i, p in enumerate(posted):
            try:
                for work in (p.header_work, p.payload_work):
                    wait_work(work, max(deadline - time.monotonic(), 1e-3), "afd drain")
            except Exception:  # the step already failed; a second error would hide the first
                return len(posted) - i
        return 0

    # ---- attention side -----------------------------------------------------------------------------------------
    def send_attn_output(self, hidden: torch.Tensor, meta: AFDMeta) -> _Sent:
        """Send the stage's hidden states; over gloo, post the receives of its answer at once (`_Posted`): the
        FFN side answers each attention rank in the order it asked. A (layer, microbatch) sent again starts a new
        step."""
        self._refuse_if_poisoned(f"afd send ({meta.describe()})")
        key = (meta.layer_idx, meta.microbatch_idx)
        if key in self._step_keys:
            self._step += 1
            self._step_keys.clear()
            if self._answers:  # a step failed without a drain (an op of its own raised): clear its posted answers
                self._drop_stale()
        self._step_keys.add(key)
        meta = replace(meta, step=self._step)
        peer = self.topology.ffn_peer(self.rank)
        sent = self._send(hidden, meta, peer)
        if self.post_early:
            room = max(meta.nbytes, self.max_answer_bytes or 0) + _TRAILER
            header, header_work, seq = self._post_header(peer)
            payload = torch.empty(room, dtype=torch.uint8, device=self.device)
            answer = _Posted(header, header_work, payload, self._irecv(payload, peer), seq, self._step,
                             (meta.layer_idx, meta.microbatch_idx, meta.num_tokens))
            self._answers.setdefault(key, []).append(answer)
        return sent

    def recv_ffn_output(self, meta: AFDMeta) -> torch.Tensor:
        self._refuse_if_poisoned(f"afd_recv ({meta.describe()})")
        peer = self.topology.ffn_peer(self.rank)
        what = f"afd_recv ({meta.describe()}) from FFN rank {peer}"
        answer = self._take_answer(meta)
        if answer is not None:
            self._wait(answer.header_work, self.timeout_s, what)
            got = self._check_seq(AFDMeta.decode(answer.header, peer), answer.seq)
            step = answer.step
        else:
            got = self._recv_header(peer, what, self.timeout_s)
            step = self._step
        if (got.layer_idx, got.microbatch_idx, got.num_tokens, got.step) != (
                meta.layer_idx, meta.microbatch_idx, meta.num_tokens, step):
            raise RuntimeError(f"rank {self.rank}: FFN rank {peer} answered {got.describe()} ({got.num_tokens} "
                               f"tokens, step {got.step}) while {meta.describe()} ({meta.num_tokens} tokens, step "
                               f"{step}) was expected")
        self._check_answer(got, meta, peer)
        if answer is None:
            out = self._recv_payload(got, peer, what)
        else:
            self._wait(answer.payload_work, self.timeout_s, what)
            out = self._payload(answer.payload, got, peer, answer.payload_work)
        if self.refuse_nonfinite and not bool(torch.isfinite(out).all()):
            bad = int((~torch.isfinite(out)).sum())
            raise AFDPeerError(f"rank {self.rank}: FFN rank {peer} answered {meta.describe()} with {bad} non-finite "
                               f"value(s) (NaN or inf) in its {meta.num_tokens} x {meta.hidden} rows: refused "
                               "(refuse_nonfinite is on)")
        return out

    def _check_answer(self, got: AFDMeta, meta: AFDMeta, peer: int) -> None:
        """An answer is its request's shape: the same rows, hidden size, dtype and microbatch count (the step, layer
        and microbatch are checked with the stale-answer rule above; the sequence by `_check_seq`). Anything else is
        refused by name before its payload is used: it would be handed to the model as if it were the FFN output."""
        wrong = [f"{name} {theirs} where {ours} was asked" for name, theirs, ours in (
            ("rows", got.num_tokens, meta.num_tokens), ("hidden size", got.hidden, meta.hidden),
            ("dtype", str(got.dtype).removeprefix("torch."), str(meta.dtype).removeprefix("torch.")),
            ("microbatch count", got.num_microbatches, meta.num_microbatches)) if theirs != ours]
        if got.shutdown:
            wrong.insert(0, "a shutdown message")
        if wrong:
            raise AFDPeerError(f"rank {self.rank}: FFN rank {peer} answered {meta.describe()} with {'; '.join(wrong)}: "
                               "refused, not handed on (another model or dtype on the server, or a faulty peer)")

    def _take_answer(self, meta: AFDMeta) -> _Posted | None:
        """The receives posted for this layer and stage's answer."""
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
        self._refuse_if_poisoned("afd: the next request")
        if self.max_request_bytes is not None:
            return self._recv_posted_request()
        peers = self.topology.attention_peers(self.rank)
        # one peer: receive from it by name, so that its death is noticed at once (an any-source receive waits on)
        src = peers[0] if len(peers) == 1 else None
        header = self._header_buffer()
        work = self._irecv(header, src)
        self._wait(work, self.idle_timeout_s, "afd: waiting for the next request from the attention ranks")
        meta = AFDMeta.decode(header, src if src is not None else work._source_rank())
        if meta.src not in peers:
            raise RuntimeError(f"FFN rank {self.rank} got a request from rank {meta.src}, which is not one of its "
                               f"attention ranks {peers}")
        self._check_seq(meta, self._next_seq(self._recv_seq, meta.src))
        if meta.shutdown:
            return torch.zeros(0, 1), meta
        if self.check_request is not None:
            self.check_request(meta)
        return self._recv_payload(meta, meta.src, f"afd payload ({meta.describe()}) from rank {meta.src}"), meta

    def _recv_posted_request(self) -> tuple[torch.Tensor, AFDMeta]:
        """One peer over gloo: each request's header receive is posted before it comes (`_Posted`); once the
        header is checked (its payload at most ``max_request_bytes``), its payload receive is posted into a buffer of
        that size, then the next request's header receive, so that it arrives while this one's FFN runs. The
        payload returned is a view of the buffer, valid until the next call."""
        peer = self.topology.attention_peers(self.rank)[0]
        current, self._next = self._next, None
        if current is None:
            header, header_work, seq = self._post_header(peer)
            current = _Posted(header, header_work, None, None, seq)
        self._wait(current.header_work, self.idle_timeout_s,
                  "afd: waiting for the next request from the attention ranks")
        meta = self._check_seq(AFDMeta.decode(current.header, peer), current.seq)
        if meta.shutdown:
            return torch.zeros(0, 1), meta
        if self.check_request is not None:
            self.check_request(meta)
        if meta.nbytes > self.max_request_bytes:
            raise AFDPeerError(f"rank {peer} sent {meta.describe()} of {meta.num_tokens} tokens x {meta.hidden}: "
                               f"{meta.nbytes} bytes, more than the {self.max_request_bytes} this FFN rank takes "
                               "(refused before its payload is received)")
        if self._buffer is None:
            self._buffer = torch.empty(self.max_request_bytes + _TRAILER, dtype=torch.uint8, device=self.device)
        payload_work = self._irecv(self._buffer, peer)
        header, header_work, seq = self._post_header(peer)
        self._next = _Posted(header, header_work, None, None, seq)
        self._wait(payload_work, self.timeout_s, f"afd payload ({meta.describe()}) from rank {peer}")
        return self._payload(self._buffer, meta, peer, payload_work), meta

    def send_ffn_output(self, out: torch.Tensor, meta: AFDMeta) -> _Sent:
        self._refuse_if_poisoned(f"afd answer ({meta.describe()})")
        return self._send(out, replace(meta, num_tokens=out.shape[0], hidden=out.shape[1], dtype=out.dtype),
                          meta.src)
