"""`tbo.afd.channel.SocketChannel`'s sends: queued to a writer thread, done once the socket took every byte.

Over a socket pair whose far end is a plain socket this test reads (or does not), so what is asserted is the
channel's own behaviour: ``send`` returns before its bytes are taken, the work completes once they are, frames
arrive whole and in order, and a peer that goes away fails the queued sends by name, never a hang.
"""

from __future__ import annotations

import datetime
import socket
import struct

import pytest
import torch

from tbo.afd.channel import SocketChannel
from tbo.afd.group import AFDPeerError

_HEADER = struct.Struct("!IIQ")
BIG = 16 << 20  # far more than a socket pair's buffers hold: the writer must wait for the far end to read


def _read_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(min(n - len(out), 1 << 20))
        assert chunk, "the channel closed early"
        out += chunk
    return bytes(out)


def test_a_send_returns_before_its_bytes_are_taken_and_completes_once_they_are():
    mine, far = socket.socketpair()
    channel = SocketChannel(mine, 0, "the test's far end")
    try:
        first = torch.arange(BIG // 4, dtype=torch.int32)
        second = torch.tensor([7, 8, 9], dtype=torch.int64)
        big, small = channel.send(first, 0), channel.send(second, 0)
        # nobody read yet: the 16 MB frame cannot all be in the socket's buffers, so neither send is done
        assert not big.wait(datetime.timedelta(seconds=0.2)) and not small.is_completed()
        kind, tag, length = _HEADER.unpack(_read_exact(far, _HEADER.size))
        assert (kind, tag, length) == (1, 0, BIG)
        assert torch.equal(torch.frombuffer(bytearray(_read_exact(far, length)), dtype=torch.int32), first)
        assert _HEADER.unpack(_read_exact(far, _HEADER.size))[2] == 24
        assert torch.equal(torch.frombuffer(bytearray(_read_exact(far, 24)), dtype=torch.int64), second)
        assert big.wait(datetime.timedelta(seconds=10)) and small.wait(datetime.timedelta(seconds=10))
    finally:
        channel.close()
        far.close()


@pytest.mark.parametrize("ended_by", ["the peer", "this side"])
def test_an_ended_connection_fails_the_queued_sends_by_name(ended_by):
    """Three 16 MB sends queued, none taken: the peer goes away without reading a byte, or this side closes the
    channel. Each send fails, naming the peer, and a later send is refused at once (the channel is poisoned)."""
    mine, far = socket.socketpair()
    channel = SocketChannel(mine, 0, "the FFN server at 127.0.0.1:1")
    try:
        works = [channel.send(torch.zeros(BIG // 4, dtype=torch.int32), 0) for _ in range(3)]
        (far if ended_by == "the peer" else channel).close()
        for work in works:
            with pytest.raises(AFDPeerError, match="the FFN server at 127.0.0.1:1"):
                work.wait(datetime.timedelta(seconds=10))
        with pytest.raises(AFDPeerError, match="the FFN server at 127.0.0.1:1"):
            channel.send(torch.zeros(4), 0)
    finally:
        channel.close()
        far.close()


@pytest.mark.parametrize("cut", ["inside the payload", "after the frame header"])
def test_a_receive_whose_message_the_peer_cut_off_fails_by_name_not_at_its_deadline(cut):
    """Issue 63: a peer process that exits while its writer thread is inside a frame (the frame header written, the
    payload not, or not all of it) leaves the receive the reader had already taken for that frame. It fails with
    the peer's end, named, as the receives still posted do: a wait that returns False at its deadline instead is a
    server that outlives its engine by that deadline."""
    mine, far = socket.socketpair()
    channel = SocketChannel(mine, 1, "the engine at 127.0.0.1:1")
    try:
        taken = channel.recv(torch.empty(64, dtype=torch.uint8), 0)
        posted = channel.recv(torch.empty(64, dtype=torch.uint8), 0)
        far.sendall(_HEADER.pack(1, 0, 64) + (b"x" * 10 if cut == "inside the payload" else b""))
        assert not taken.wait(datetime.timedelta(seconds=0.2))  # the reader took it and waits for the rest
        far.close()
        for work in (taken, posted):
            with pytest.raises(AFDPeerError, match=r"the engine at 127.0.0.1:1 closed the connection"):
                work.wait(datetime.timedelta(seconds=30))
    finally:
        channel.close()
        far.close()
