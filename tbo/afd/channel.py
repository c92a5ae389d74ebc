"""`SocketChannel`: an AFD pair's point-to-point messages over the connection its handshake authenticated.

Why not gloo for CPU tensors. A gloo process group keeps a listening socket per device open for as long as the group
lives, and accepts on it whoever connects: each connection a stranger opens and closes there leaves a descriptor
behind, and at the descriptor limit gloo aborts the process (``accept: Too many open files``). Closing it would mean
dropping the group. The handshake's connection is already there, authenticated, and between two processes; so CPU
tensors travel on it, and after the join nothing of the pair listens.

What it offers is what `TorchDistributedAFDConnector` uses of a process group: ``send`` (queued, in order, to this
side's writer thread, and its work done once the socket took every byte: the caller computes on while its message
is written, as with gloo's or NCCL's ``isend``; the tensor must stay unchanged until then, which the connector's
kept buffers ensure; the peer's reader thread always drains the socket, so a write never waits on the peer's
compute; on a 2-core machine the FFN side's 1.15 MB answers took 0.9 ms each of its compute thread when written in
it, 16 a step),
``recv`` posted before its message arrives (its bytes are read straight into the posted buffer), matched per tag in
the order posted, and work handles that ``wait(timeout)``. Every frame has a 16-byte header (kind, tag, length);
a message longer than the receive posted for it, or than ``max_message_bytes``, is refused by name (gloo would abort
the process). A lost peer, or a broken frame, poisons the channel: every wait then raises `AFDPeerError` naming it.

``kv`` frames carry a small key-value table for NCCL's bootstrap (`ChannelStore`), so that a CUDA pair forms its
NCCL group over the same authenticated connection, with no store anyone else can reach.

Budgets (issue 61). What a joined peer can make this side hold is bounded, in messages and in bytes, by what the
join agreed: at most `MAX_UNCLAIMED` messages and ``max_unclaimed_bytes`` (default twice ``max_message_bytes``,
the largest request or answer: room for one arriving before its receive is posted, and one more) wait for a
receive, checked from a frame's header before a byte of it is read; the key-value table holds at most
``kv_budget`` = (keys, bytes), and none at all on a ``tcp`` pair, which never uses it (a server that wrote 1,500
frames of 60 KB grew its engine by 150 MiB). A peer past a budget is refused by name, the channel poisoned and the
connection shut, so its further writes fail at once. What this side sends waits in the writer's queue only as long
as the connector keeps it (at most 16 messages before it waits for the oldest); the received frames are read into
posted buffers or into the budget above.

Integrity (issue 61). With a shared secret the handshake gives each direction a key (`tbo.afd.handshake.
session_keys`), and every frame is followed by a 16-byte MAC (HMAC-SHA256, truncated) under its direction's key,
over the frame's number on its connection (counted by both sides, never sent), its header, and its payload: all of
it under ``"full"``, under ``"headers"`` only a payload of at most `SMALL_FRAME` bytes (the connector's metadata
headers, key-value frames), not the bulk tensors. A frame is handed on only once its MAC verified: a relay that
rewrites, replays, drops or reorders one is refused by name at that frame, the channel poisoned. What a frame says
is not secret: confidentiality is the network's.
"""

from __future__ import annotations

import atexit
import datetime
import hashlib
import hmac
import queue
import socket
import struct
import threading
import weakref
from collections import deque
from typing import Any

import torch

from tbo.afd.peer import AFDPeerError

__all__ = ["SocketChannel", "ChannelStore", "MAX_UNCLAIMED"]

#: messages that may arrive before their receive is posted (the connector posts ahead: a few per step)
MAX_UNCLAIMED = 64
_HEADER = struct.Struct("!IIQ")  # kind, tag, length
_MSG, _KV = 1, 2
_MAX_KV = 1 << 16
#: the key-value table's budget on an NCCL pair: keys, bytes (NCCL's bootstrap of two ranks sets a few ids)
KV_BUDGET = (256, 1 << 20)
#: under integrity "headers", a payload up to this size is covered by its frame's MAC (the connector's 80-byte
#: metadata headers, key-value frames); a longer one (a tensor) is not
SMALL_FRAME = 256
_TAG = 16  # bytes of MAC after each frame, with integrity on
_SEQ = struct.Struct("!Q")


#: the channels not closed yet, ended at interpreter exit (`_close_at_exit`)
_OPEN: "weakref.WeakSet[SocketChannel]" = weakref.WeakSet()
_AT_EXIT: list[bool] = []


def _close_at_exit() -> None:
    """End every open channel's threads before the interpreter finalizes. A daemon thread still inside a socket or
    torch call at finalization is stopped where it stands when it next wants the GIL (``pthread_exit`` under C++
    frames): an engine aborted (SIGABRT) at exit in 2 of 51 runs after a refused answer. Closing the socket ends the
    reader's wait and the writer's queue; each thread is given a second to return."""
    channels = list(_OPEN)
    for channel in channels:
        try:
            channel.close()
        except Exception:  # noqa: BLE001 - at exit: the next channel still gets closed
            pass
    for channel in channels:
        for thread in (channel._reader, channel._writer):
            if thread is not threading.current_thread():
                thread.join(1.0)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"the AFD socket transport carries contiguous CPU tensors, got one on {tensor.device}")
    return memoryview(tensor.view(-1).view(torch.uint8).numpy()).cast("B")


class _Work:
    """A send or receive: ``wait(timeout)`` returns True when done, False at the deadline, raises if poisoned."""

    def __init__(self, channel: "SocketChannel", buffer: torch.Tensor | None = None) -> None:
        self.channel, self.buffer = channel, buffer
        self.event = threading.Event()
        self.error: BaseException | None = None
        self.nbytes = 0

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self.event.set()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if not self.event.wait(None if timeout is None else timeout.total_seconds()):
            return False
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        return self.event.is_set()

    def _source_rank(self) -> int:
        return 1 - self.channel.rank


class SocketChannel:
    """Two ranks, one connected socket (see the module docstring)."""

    def __init__(self, sock: socket.socket, rank: int, peer: str, max_message_bytes: int = 1 << 30,
                 send_timeout_s: float = 60.0, *, max_unclaimed_bytes: int | None = None,
                 kv_budget: tuple[int, int] | None = KV_BUDGET,
                 integrity: tuple[bytes, bytes, str] | None = None) -> None:
        """``max_unclaimed_bytes``: what may wait for a receive (default twice ``max_message_bytes``);
        ``kv_budget``: (keys, bytes) of the key-value table, or None: no key-value frame is taken (a tcp pair);
        ``integrity``: (this side's sending key, its receiving key, "full" or "headers"): every frame carries a MAC
        (see the module docstring); None: no MAC (a pair without a secret)."""
        self.sock, self.rank, self.peer, self.max_message_bytes = sock, rank, peer, max_message_bytes
        self.max_unclaimed_bytes = 2 * max_message_bytes if max_unclaimed_bytes is None else max_unclaimed_bytes
        self.kv_budget = kv_budget
        self._unclaimed_bytes = 0
        self._kv_bytes = 0
        self._send_key, self._recv_key, mode = integrity if integrity is not None else (None, None, "off")
        self.integrity = mode  #: what the frames' MAC covers: "full", "headers" or "off"
        self._covered = (1 << 64) if mode == "full" else SMALL_FRAME  # payloads up to this size are MAC'd
        self._frames_sent = self._frames_received = 0
        self._mac_payload = False  #: whether the frame being read has its payload under its MAC
        self._peer_error = AFDPeerError
        self.send_timeout_s = send_timeout_s
        sock.settimeout(send_timeout_s)  # bounds a send to a peer that stopped reading (its reader just waits on)
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._posted: dict[int, deque[_Work]] = {}
        self._arrived: dict[int, deque[bytearray]] = {}
        self._unclaimed = 0
        self._poison: BaseException | None = None
        self.kv: dict[str, bytes] = {}
        self.kv_changed = threading.Condition(self._lock)
        self._reader = threading.Thread(target=self._read_loop, daemon=True, name=f"tbo-afd-channel-{rank}")
        self._reader.start()
        self._outbox: queue.SimpleQueue[tuple[bytes, memoryview | bytes, _Work] | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, daemon=True, name=f"tbo-afd-writer-{rank}")
        self._writer.start()
        _OPEN.add(self)
        if not _AT_EXIT:  # registered with the first channel, not at import
            _AT_EXIT.append(True)
            atexit.register(_close_at_exit)

    # ---- sending -------------------------------------------------------------------------------------------------
    def _write(self, kind: int, tag: int, payload: memoryview | bytes) -> _Work:
        """Queue a frame for the writer thread; its work is done once the socket took it all (or failed, named)."""
        work = _Work(self)
        with self._send_lock:  # poison checked and frame queued at once: nothing is queued behind a close
            if self._poison is not None:
                raise self._poison
            self._outbox.put((_HEADER.pack(kind, tag, len(payload)), payload, work))
        return work

    def _write_loop(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None:
                return
            header, payload, work = item
            if self._poison is not None:
                work.finish(self._poison)
                continue
            try:
                self.sock.sendall(header)
                self.sock.sendall(payload)
                if self._send_key is not None:
                    self.sock.sendall(self._mac(self._send_key, self._frames_sent, header, payload))
                    self._frames_sent += 1
            except OSError as e:
                error = self._peer_error(f"the AFD connection to {self.peer} failed while sending: "
                                         f"{'timed out' if isinstance(e, socket.timeout) else e.strerror or e}")
                self._fail(error)
                work.finish(self._poison)
                continue
            work.finish()

    def _mac(self, key: bytes, number: int, header: bytes | bytearray, payload: Any = b"") -> bytes:
        """A frame's MAC: over its number, its header and (if covered) its payload."""
        mac = hmac.new(key, _SEQ.pack(number) + bytes(header), hashlib.sha256)
        if len(payload) <= self._covered or _HEADER.unpack(header)[0] == _KV:
            mac.update(payload)
        return mac.digest()[:_TAG]

    def _begin_check(self, header: bytearray, length: int) -> Any:
        """The receiving MAC of the frame whose header was just read (None without integrity, or for a payload it
        does not cover); the payload's bytes are added as they arrive (`_recv_exact`)."""
        if self._recv_key is None:
            return None
        mac = hmac.new(self._recv_key, _SEQ.pack(self._frames_received) + bytes(header), hashlib.sha256)
        self._frames_received += 1
        self._mac_payload = length <= self._covered or _HEADER.unpack(header)[0] == _KV
        return mac

    def _check(self, mac: Any) -> None:
        """Read the frame's MAC and compare: a frame is handed on only once it verified."""
        if mac is None:
            return
        tag = bytearray(_TAG)
        self._recv_exact(memoryview(tag))
        if not hmac.compare_digest(mac.digest()[:_TAG], bytes(tag)):
            raise self._peer_error(f"frame {self._frames_received - 1} from {self.peer} failed its integrity check "
                                   f"(HMAC-SHA256 under this connection's session key, integrity {self.integrity!r}): "
                                   "rewritten, replayed, reordered or dropped on the way (a relay?), or sent under "
                                   "another secret: refused, the connection ended")

    def send(self, tensor: torch.Tensor, tag: int) -> _Work:
        return self._write(_MSG, tag, _bytes_of(tensor))

    def set_kv(self, key: str, value: bytes) -> None:
        raw = key.encode()
        if len(raw) + len(value) + 4 > _MAX_KV:
            raise ValueError(f"key-value frame for {key!r} is over {_MAX_KV} bytes")
        with self._lock:
            self.kv[key] = value
            self.kv_changed.notify_all()
        self._write(_KV, 0, struct.pack("!I", len(raw)) + raw + value).wait(
            datetime.timedelta(seconds=self.send_timeout_s))

    # ---- receiving -----------------------------------------------------------------------------------------------
    def recv(self, tensor: torch.Tensor, tag: int) -> _Work:
        work = _Work(self, tensor)
        room = _bytes_of(tensor)
        with self._lock:
            if self._poison is not None:
                raise self._poison
            arrived = self._arrived.get(tag)
            if not arrived:
                self._posted.setdefault(tag, deque()).append(work)
                return work
            data = arrived.popleft()
            self._unclaimed -= 1
            self._unclaimed_bytes -= len(data)
        if len(data) > len(room):
            error = self._too_long(len(data), len(room), tag)
            self._fail(error)
            raise error
        room[:len(data)] = data
        work.nbytes = len(data)
        work.finish()
        return work

    def _too_long(self, got: int, room: int, tag: int) -> BaseException:
        return self._peer_error(f"{self.peer} sent a message of {got} bytes where {room} were posted (tag {tag}): "
                                "refused, the pair is out of step or the peer speaks another version")

    def _recv_exact(self, view: memoryview, mac: Any = None) -> None:
        """Fill ``view``, then add it to ``mac`` (when the frame's MAC covers its payload) in one call: hashing each
        chunk as it arrived took the GIL back once more per chunk, each a wait behind the compute thread."""
        whole = view
        while len(view):
            try:
                n = self.sock.recv_into(view)
            except socket.timeout:  # the socket's timeout bounds sends; a receive just waits on
                continue
            if n == 0:
                raise EOFError
            view = view[n:]
        if mac is not None and self._mac_payload:
            mac.update(whole)

    def _read_loop(self) -> None:
        header = bytearray(_HEADER.size)
        try:
            while True:
                self._recv_exact(memoryview(header))
                kind, tag, length = _HEADER.unpack(header)
                mac = self._begin_check(header, length)
                if kind == _KV:
                    if self.kv_budget is None:
                        raise self._peer_error(f"{self.peer} sent a key-value frame ({length} bytes), which a tcp "
                                               "pair never uses (only an NCCL pair's bootstrap does): refused")
                    if length > _MAX_KV or length < 4:
                        raise self._peer_error(f"{self.peer} sent a key-value frame of {length} bytes")
                    data = bytearray(length)
                    self._recv_exact(memoryview(data), mac)
                    self._check(mac)
                    (klen,) = struct.unpack("!I", data[:4])
                    key, value = bytes(data[4:4 + klen]).decode("utf-8", "replace"), bytes(data[4 + klen:])
                    with self._lock:
                        old = self.kv.get(key)
                        grown = self._kv_bytes + len(key) + len(value) - (0 if old is None else len(key) + len(old))
                        keys = len(self.kv) + (old is None)
                        if keys > self.kv_budget[0] or grown > self.kv_budget[1]:
                            raise self._peer_error(
                                f"{self.peer} set more key-value entries than the {self.kv_budget[0]} keys and "
                                f"{self.kv_budget[1]} bytes an NCCL bootstrap needs ({keys} keys, {grown} bytes): "
                                "refused")
                        self.kv[key], self._kv_bytes = value, grown
                        self.kv_changed.notify_all()
                    continue
                if kind != _MSG:
                    raise self._peer_error(f"{self.peer} sent a frame of unknown kind {kind}: not a tbo AFD peer "
                                           "of this version")
                if length > self.max_message_bytes:
                    raise self._peer_error(f"{self.peer} announced a message of {length} bytes, more than the "
                                           f"{self.max_message_bytes} this side takes: refused before reading it")
                with self._lock:
                    posted = self._posted.get(tag)
                    work = posted.popleft() if posted else None
                if work is None:
                    with self._lock:  # the budget is checked before a byte of the message is read
                        if self._unclaimed >= MAX_UNCLAIMED or \
                                self._unclaimed_bytes + length > self.max_unclaimed_bytes:
                            raise self._peer_error(
                                f"{self.peer} sent more than this side asked for: {self._unclaimed + 1} messages "
                                f"({self._unclaimed_bytes + length} bytes) waiting for a receive, over the budget of "
                                f"{MAX_UNCLAIMED} messages and {self.max_unclaimed_bytes} bytes: refused")
                        self._unclaimed += 1  # reserved while it is read
                        self._unclaimed_bytes += length
                    data = bytearray(length)
                    self._recv_exact(memoryview(data), mac)
                    self._check(mac)
                    with self._lock:  # a receive may have been posted meanwhile: it takes the message
                        posted = self._posted.get(tag)
                        work = posted.popleft() if posted else None
                        if work is not None:
                            self._unclaimed -= 1
                            self._unclaimed_bytes -= length
                    if work is not None:
                        room = _bytes_of(work.buffer)
                        if length > len(room):
                            error = self._too_long(length, len(room), tag)
                            work.finish(error)
                            raise error
                        room[:length] = data
                        work.nbytes = length
                        work.finish()
                        continue
                    with self._lock:
                        self._arrived.setdefault(tag, deque()).append(data)  # no copy: nothing else holds it
                    continue
                room = _bytes_of(work.buffer)
                if length > len(room):
                    error = self._too_long(length, len(room), tag)
                    work.finish(error)
                    raise error
                try:
                    self._recv_exact(room[:length], mac)
                    self._check(mac)
                except BaseException as e:  # the receive is told why: its bytes are not handed on
                    work.finish(e if isinstance(e, self._peer_error) else self._peer_error(
                        f"the AFD connection to {self.peer} ended in the middle of a message (the peer is gone)"))
                    raise
                work.nbytes = length
                work.finish()
        except EOFError:
            self._fail(self._peer_error(f"the AFD peer at {self.peer} closed the connection (connection closed: "
                                        "the peer is gone)"))
        except OSError as e:
            self._fail(self._peer_error(f"the AFD connection to {self.peer} failed: {e.strerror or e} "
                                        "(connection reset: the peer is gone)"))
        except BaseException as e:  # noqa: BLE001 - a protocol error: poisons the channel, named
            self._fail(e)
            try:  # and ends the connection: the peer's further writes fail at once, nothing more is read
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._poison is None:
                self._poison = error
            waiting = [w for q in self._posted.values() for w in q]
            self._posted.clear()
            self.kv_changed.notify_all()
        for work in waiting:
            work.finish(self._poison)

    def close(self) -> None:
        """Close the connection (the reader thread ends with it; the writer thread once it took what was queued:
        each queued send's work fails, named)."""
        with self._send_lock:
            self._fail(self._peer_error(f"the AFD channel to {self.peer} was closed by this side"))
            self._outbox.put(None)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class ChannelStore(torch.distributed.Store):
    """A ``torch.distributed.Store`` for NCCL's bootstrap, mirrored over the authenticated channel: ``set`` writes
    here and to the peer, ``get`` / ``wait`` wait for a key from either side. Nothing else can reach it."""

    def __init__(self, channel: SocketChannel, timeout_s: float) -> None:
        super().__init__()
        self.channel, self.timeout_s = channel, timeout_s

    def set(self, key: str, value: Any) -> None:
        self.channel.set_kv(key, value.encode() if isinstance(value, str) else bytes(value))

    def _wait_for(self, keys: list[str], timeout: Any = None) -> None:
        seconds = self.timeout_s if timeout is None else timeout.total_seconds()
        ch = self.channel
        with ch.kv_changed:
            if not ch.kv_changed.wait_for(lambda: ch._poison is not None or all(k in ch.kv for k in keys), seconds):
                raise RuntimeError(f"the AFD peer at {ch.peer} did not set {keys} within {seconds:g}s (timed out)")
            if ch._poison is not None and not all(k in ch.kv for k in keys):
                raise ch._poison

    def get(self, key: str) -> bytes:
        self._wait_for([key])
        return self.channel.kv[key]

    def wait(self, keys: Any, timeout: Any = None) -> None:
        self._wait_for(list(keys), timeout)

    def check(self, keys: Any) -> bool:
        return all(k in self.channel.kv for k in keys)

    def add(self, key: str, value: int) -> int:
        # one writer per key in NCCL's bootstrap of two ranks; a local counter, mirrored
        current = int(self.channel.kv.get(key, b"0") or 0) + value
        self.set(key, str(current))
        return current

    def num_keys(self) -> int:
        return len(self.channel.kv)

    def delete_key(self, key: str) -> bool:
        return self.channel.kv.pop(key, None) is not None

    def set_timeout(self, timeout: Any) -> None:
        self.timeout_s = timeout.total_seconds()
