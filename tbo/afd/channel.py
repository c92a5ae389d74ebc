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
the process), and at most `MAX_UNCLAIMED` messages wait for a receive. A lost peer, or a broken frame, poisons the
channel: every wait then raises `AFDPeerError` naming it.

``kv`` frames carry a small key-value table for NCCL's bootstrap (`ChannelStore`), so that a CUDA pair forms its
NCCL group over the same authenticated connection, with no store anyone else can reach.
"""

from __future__ import annotations

import datetime
import queue
import socket
import struct
import threading
from collections import deque
from typing import Any

import torch

__all__ = ["SocketChannel", "ChannelStore", "MAX_UNCLAIMED"]

#: messages that may arrive before their receive is posted (the connector posts ahead: a few per step)
MAX_UNCLAIMED = 64
_HEADER = struct.Struct("!IIQ")  # kind, tag, length
_MSG, _KV = 1, 2
_MAX_KV = 1 << 16


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
                 send_timeout_s: float = 60.0) -> None:
        from tbo.afd.group import AFDPeerError

        self.sock, self.rank, self.peer, self.max_message_bytes = sock, rank, peer, max_message_bytes
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
            except OSError as e:
                error = self._peer_error(f"the AFD connection to {self.peer} failed while sending: "
                                         f"{'timed out' if isinstance(e, socket.timeout) else e.strerror or e}")
                self._fail(error)
                work.finish(self._poison)
                continue
            work.finish()

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

    def _recv_exact(self, view: memoryview) -> None:
        while len(view):
            try:
                n = self.sock.recv_into(view)
            except socket.timeout:  # the socket's timeout bounds sends; a receive just waits on
                continue
            if n == 0:
                raise EOFError
            view = view[n:]

    def _read_loop(self) -> None:
        header = bytearray(_HEADER.size)
        filling: _Work | None = None  # the receive this thread took off the posted ones and is reading into
        try:
            while True:
                self._recv_exact(memoryview(header))
                kind, tag, length = _HEADER.unpack(header)
                if kind == _KV:
                    if length > _MAX_KV or length < 4:
                        raise self._peer_error(f"{self.peer} sent a key-value frame of {length} bytes")
                    data = bytearray(length)
                    self._recv_exact(memoryview(data))
                    (klen,) = struct.unpack("!I", data[:4])
                    with self._lock:
                        self.kv[bytes(data[4:4 + klen]).decode("utf-8", "replace")] = bytes(data[4 + klen:])
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
                    data = bytearray(length)
                    self._recv_exact(memoryview(data))
                    with self._lock:  # a receive may have been posted meanwhile: it takes the message
                        posted = self._posted.get(tag)
                        work = posted.popleft() if posted else None
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
                        if self._unclaimed >= MAX_UNCLAIMED:
                            raise self._peer_error(f"{self.peer} sent more than {MAX_UNCLAIMED} messages nobody "
                                                   "asked for: refused")
                        self._arrived.setdefault(tag, deque()).append(data)  # no copy: nothing else holds it
                        self._unclaimed += 1
                    continue
                room = _bytes_of(work.buffer)
                if length > len(room):
                    error = self._too_long(length, len(room), tag)
                    work.finish(error)
                    raise error
                filling = work
                self._recv_exact(room[:length])
                filling = None
                work.nbytes = length
                work.finish()
        except EOFError:
            self._fail(self._peer_error(f"the AFD peer at {self.peer} closed the connection (connection closed: "
                                        "the peer is gone)"), filling)
        except OSError as e:
            self._fail(self._peer_error(f"the AFD connection to {self.peer} failed: {e.strerror or e} "
                                        "(connection reset: the peer is gone)"), filling)
        except BaseException as e:  # noqa: BLE001 - a protocol error: poisons the channel, named
            self._fail(e, filling)

    def _fail(self, error: BaseException, filling: _Work | None = None) -> None:
        """Poison the channel; every receive waiting fails with it: those posted, and ``filling``, the one the
        reader took off them and was reading into when its message was cut (a peer gone mid-frame: a process that
        exited while its writer thread was inside a frame), which would otherwise wait out its whole deadline."""
        with self._lock:
            if self._poison is None:
                self._poison = error
            waiting = [w for q in self._posted.values() for w in q]
            self._posted.clear()
            self.kv_changed.notify_all()
        if filling is not None and not filling.is_completed():
            waiting.append(filling)
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
