"""`AFDGroup`: a two-sided group of AFD's own, outside ``torch.distributed``'s default group.

An engine that serves requests (vLLM) owns the default process group of its processes; its FFN servers are not in
it. So the attention side and an FFN server meet here instead: the FFN server listens on one TCP socket bound to
the host it was told (loopback by default, never the wildcard unless told), and each connection gets tbo's own
handshake (`tbo.afd.handshake`): mutual proof of the shared secret over both sides' nonces, one engine served, the
server's description handed over only once the server proved itself. Then the listening socket is closed, and:

- **CPU** (``backend="tcp"``; ``"gloo"`` is read as it): the pair's messages travel on the authenticated
  connection itself (`tbo.afd.channel.SocketChannel`). Nothing of the pair listens after the join (a gloo group
  would keep a listener a stranger can exhaust descriptors on, for as long as it lives).
- **CUDA** (``backend="nccl"``): an NCCL group, bootstrapped through a store mirrored over the authenticated
  connection (`tbo.afd.channel.ChannelStore`), so no store anyone else can reach holds its keys. NCCL's own
  bootstrap then opens sockets of its own (docs/hardening.md says what they expose).

Nothing read from the network here is unpickled or evaluated: the handshake carries JSON frames parsed with a size
and depth bound and checked field by field; the tensors that follow carry `AFDMeta` headers the connector checks.
See docs/hardening.md for what this boundary does and does not protect.
"""

from __future__ import annotations

import datetime
import json
import socket
from typing import Any, Callable, Sequence

import torch

from tbo.afd.peer import TOKEN_ENV, AFDPeerError, parse_json  # re-exported: their documented home

__all__ = ["AFDGroup", "AFDPeerError", "check_counts", "parse_address", "parse_json", "resolve_token", "TOKEN_ENV", "BACKENDS",
           "is_loopback"]

#: the transports an `AFDGroup` runs: "tcp" (CPU tensors on the authenticated connection; "gloo" is an alias kept
#: for configurations written before) and "nccl" (CUDA)
BACKENDS = ("tcp", "gloo", "nccl")


def resolve_token(explicit: str | None, source: str) -> str | None:
    """The shared secret: ``explicit`` (named ``source`` in errors) when given, else the `TOKEN_ENV` environment
    variable, else None. An empty one is refused by name: an empty secret used to turn the secret off silently."""
    import os

    if explicit is not None:
        if not explicit.strip():
            raise ValueError(f"{source} is empty: give a non-empty shared secret, or none at all")
        return explicit
    value = os.environ.get(TOKEN_ENV)
    if value is not None and not value.strip():
        raise ValueError(f"the {TOKEN_ENV} environment variable is set but empty: give a non-empty shared secret, "
                         "or unset it")
    return value


def is_loopback(host: str) -> bool:
    """Whether ``host`` resolves to loopback addresses only (what a server may listen on without a secret)."""
    import ipaddress

    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def parse_address(address: str, what: str = "address") -> tuple[str, int]:
    """``"HOST:PORT"`` -> ``(host, port)``, or a ValueError naming ``what`` and the value."""
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"{what} {address!r} is not HOST:PORT (for example 127.0.0.1:29600)")
    return host.strip("[]"), int(port)


def _bound_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket bound to ``host`` only."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ValueError(f"--listen host {host!r} does not resolve: {e}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise AFDPeerError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock




def _integrity(value: str) -> str:
    from tbo.afd.handshake import INTEGRITY

    if value not in INTEGRITY:
        raise ValueError(f"integrity {value!r}: accepted {', '.join(map(repr, INTEGRITY))} (what the MAC of each frame "
                         "after the join covers, with a secret)")
    return value


def _served(microbatches: Sequence[int] | None) -> list[int]:
    from tbo.afd.config import AFD_MICROBATCH_COUNTS

    served = sorted(set(AFD_MICROBATCH_COUNTS if microbatches is None else microbatches))
    wrong = [n for n in served if n not in AFD_MICROBATCH_COUNTS]
    if wrong or not served:
        raise ValueError(f"microbatches {list(microbatches or [])}: an FFN server serves split steps of "
                         f"{', '.join(map(str, AFD_MICROBATCH_COUNTS))} microbatches")
    return served


def check_counts(info: dict[str, Any], counts: Sequence[int], where: str) -> None:
    """Refuse, naming both, a microbatch count the FFN server at ``where`` does not serve (its description's
    ``microbatches``; a server that publishes none serves two, the seed's)."""
    served = info.get("microbatches", [2])
    if not isinstance(served, list) or not all(isinstance(n, int) for n in served):
        raise AFDPeerError(f"the FFN server at {where} says it serves microbatches {str(served)[:80]}: not a list of "
                           "counts (another version?)")
    missing = [n for n in counts if n not in served]
    if missing:
        raise AFDPeerError(f"the FFN server at {where} serves split steps of {', '.join(map(str, served))} "
                           f"microbatches, and this engine's num_microbatches is {', '.join(map(str, missing))}: "
                           "refused at the join (start the server with --microbatches including it, or set "
                           "num_microbatches to a count it serves)")


class AFDGroup:
    """Point-to-point between the two ranks of one AFD pair (rank 0 attention, rank 1 FFN).

    Create it with `listen` on the FFN side and `connect` on the attention side; `isend`, `irecv` return work
    handles that ``wait(timeout)``, as ``torch.distributed.isend`` / ``irecv`` do.
    """

    def __init__(self, sock: socket.socket, rank: int, backend: str, timeout_s: float, where: str,
                 max_message_bytes: int = 1 << 30, session: tuple[bytes, bytes, str] | None = None) -> None:
        """``session``: (engine-to-server key, server-to-engine key, integrity) from the handshake, with a secret:
        every frame after the join then carries a MAC (`tbo.afd.channel`)."""
        from tbo.afd.channel import ChannelStore, SocketChannel

        if backend not in BACKENDS:
            raise ValueError(f"AFD transport backend {backend!r}: accepted 'tcp' (CPU; 'gloo' is read as it) or "
                             "'nccl' (CUDA)")
        self.rank, self.size, self.where = rank, 2, where
        self.backend = "nccl" if backend == "nccl" else "tcp"
        from tbo.afd.channel import KV_BUDGET

        keys = None
        if session is not None:  # rank 0 (the engine) sends under the engine-to-server key
            to_server, to_engine, mode = session
            keys = (to_server, to_engine, mode) if rank == 0 else (to_engine, to_server, mode)
        self.channel = SocketChannel(sock, rank, where, max_message_bytes, send_timeout_s=timeout_s,
                                     kv_budget=KV_BUDGET if self.backend == "nccl" else None, integrity=keys)
        #: what each frame's MAC covers after the join: "full", "headers", or "off" (no secret)
        self.integrity = self.channel.integrity
        self.pg: Any = None
        #: FFN side: the emulated link (``"LATENCY_US,GBPS"``) the engine asked for at the join, or None
        self.peer_link: str | None = None
        if self.backend == "nccl":
            from torch.distributed import ProcessGroupNCCL

            options = ProcessGroupNCCL.Options()
            options._timeout = datetime.timedelta(seconds=timeout_s)
            try:
                self.pg = ProcessGroupNCCL(ChannelStore(self.channel, timeout_s), rank, 2, options)
            except RuntimeError as e:
                self.channel.close()
                raise AFDPeerError(f"the AFD pair with {where} did not form its NCCL group: "
                                   f"{str(e).strip().splitlines()[0]}") from None

    # ---- meeting -----------------------------------------------------------------------------------------------
    @classmethod
    def listen(cls, address: str, info: dict[str, Any], *, backend: str = "tcp", timeout_s: float = 600.0,
               on_listening: Any = None, token: str | None = None,
               on_refused: Callable[[str], None] | None = None, max_message_bytes: int = 1 << 30,
               handshake_s: float = 10.0, microbatches: Sequence[int] | None = None,
               integrity: str = "headers") -> "AFDGroup":
        """The FFN side (rank 1): listen on ``address`` (port 0: a free one) and on nothing else, call
        ``on_listening(host, port)``, and serve handshakes for up to ``timeout_s`` until one engine joined.
        ``token``: the shared secret both sides prove they know; a connection that does not is refused (told to the
        engine, and to ``on_refused(message)``) and the server waits on. ``info``: what it serves, handed to the
        engine once the server proved itself. ``max_message_bytes``: the largest message the engine may send.
        ``microbatches``: the counts of a split step this server serves (default all of `AFD_MICROBATCH_COUNTS`;
        published in ``info``, checked by the engine at the join). The port is closed once the engine joined; the
        link the engine asked for is ``peer_link``. ``integrity`` (with a secret): the least MAC coverage of the
        frames after the join this server accepts, "headers" (the default) or "full" (every byte; see
        `tbo.afd.channel`)."""
        if token is not None and not token:
            raise ValueError("the shared secret is empty: give a non-empty one, or none")
        host, port = parse_address(address, "--listen")
        info = {**info, "microbatches": _served(microbatches)}
        json.dumps(info)  # the description must be JSON: refused here, not at the first claim
        sock = _bound_socket(host, port)
        port = sock.getsockname()[1]
        where = f"{host}:{port}"
        from tbo.afd.handshake import accept_engine

        try:
            if on_listening is not None:
                on_listening(host, port)
        except BaseException:
            sock.close()
            raise
        conn, joined = accept_engine(sock, token, info, timeout_s, where, on_refused, handshake_s,
                                     _integrity(integrity))  # closes ``sock``
        peer = conn.getpeername()
        group = cls(conn, 1, backend, timeout_s, f"the engine at {peer[0]}:{peer[1]}", max_message_bytes,
                    joined.get("session"))
        group.peer_link = joined.get("link")
        return group

    @classmethod
    def connect(cls, address: str, *, backend: str = "tcp", connect_timeout_s: float = 10.0,
                timeout_s: float = 60.0, check_info: Any = None, token: str | None = None,
                max_message_bytes: int = 1 << 30, num_microbatches: int | Sequence[int] | None = None,
                link: str | None = None, integrity: str = "headers") -> "AFDGroup":
        """The attention side (rank 0): reach the FFN server at ``address``, prove the secret (``token``), check
        the server's proof, check that it serves every count in ``num_microbatches`` (the counts this engine's
        split steps may have; refused by name here, not mid-step), pass its description to ``check_info`` (which
        raises on a mismatch), then join, asking for ``link`` (``"LATENCY_US,GBPS"``: the server's answers then
        cross an emulated link of that latency, as this side's requests do). All of it is bounded by
        ``connect_timeout_s``; a connect that failed or gave up closed its connection, so it never claims the
        server later. ``integrity`` (with a secret): the MAC coverage of the frames after the join this engine asks
        for, "full" or "headers"; the pair runs the stronger of its and the server's."""
        if token is not None and not token:
            raise ValueError("the shared secret is empty: give a non-empty one, or none")
        from tbo.afd.handshake import claim_server

        host, port = parse_address(address, "the FFN server address")
        where = f"{host}:{port}"
        counts = [num_microbatches] if isinstance(num_microbatches, int) else list(num_microbatches or [])

        def check(info: dict[str, Any]) -> None:
            check_counts(info, counts, where)
            if check_info is not None:
                check_info(info)

        conn, _info, session = claim_server(host, port, token, connect_timeout_s, check, where,
                                            join=None if link is None else {"link": link},
                                            integrity=_integrity(integrity))
        return cls(conn, 0, backend, max(timeout_s, connect_timeout_s), f"the FFN server at {where}",
                   max_message_bytes, session)

    # ---- point to point ----------------------------------------------------------------------------------------
    # A message's tag is its sender's rank, so each direction is matched apart (NCCL ignores tags).
    def isend(self, tensor: torch.Tensor, dst: int) -> Any:
        if self.pg is not None:
            return self.pg.send([tensor], dst, self.rank)
        return self.channel.send(tensor, self.rank)

    def irecv(self, tensor: torch.Tensor, src: int | None) -> Any:
        """From ``src`` (the other rank; None means it too: a pair has one peer)."""
        peer = 1 - self.rank
        if self.pg is not None:
            return self.pg.recv([tensor], peer, peer)
        return self.channel.recv(tensor, peer)

    def close(self) -> None:
        """Leave the group and close the connection."""
        pg, self.pg = self.pg, None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except RuntimeError:  # already torn down by a lost peer
                pass
        self.channel.close()
