"""`AFDGroup`: a two-sided process group of AFD's own, outside ``torch.distributed``'s default group.

An engine that serves requests (vLLM) owns the default process group of its processes; its FFN servers are not in
it. So the attention side and an FFN server meet here instead: the FFN server listens (a ``TCPStore`` on a socket
bound to the host it was told, loopback by default, never the wildcard), publishes a small JSON description of
what it serves, and both join a gloo (CPU) or NCCL (CUDA) process group that is registered nowhere.
`TorchDistributedAFDConnector` sends and receives through it as it does through a registered group.

The meeting is guarded, because anyone who reaches the port can read and write the store:

- **one engine per server, claimed atomically**: the engine takes a ticket (``store.add``); the server judges the
  claims in ticket order and serves the first valid one; a later engine is refused by name ("already serving an
  engine at ...");
- **an optional shared secret** (``token``): the server publishes a fresh nonce, the engine proves it knows the
  secret with an HMAC of it (the secret never crosses the wire), and the process group's rendezvous keys are
  derived from the secret too, so a client without it cannot even name them;
- **what gloo reads is checked first**: the peer addresses gloo deserialises from the store go through
  `_CheckedStore`, which refuses (by name) a value of another size or shape than the one this process wrote
  itself, before gloo parses it (an empty value used to crash gloo with SIGSEGV);
- **closed after the claim**: once the group is formed, the server drops its store and closes the listening
  socket, so nothing more can be written (a store accepts any number of writes of any size).

Nothing read from the network here is unpickled or evaluated: the store carries JSON text that is parsed with a
size and depth bound and checked field by field, and the tensors that follow carry `AFDMeta` headers the connector
checks. See docs/hardening.md for what this boundary does and does not protect.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import os
import secrets
import socket
import threading
import time
from typing import Any, Callable

import torch

__all__ = ["AFDGroup", "AFDPeerError", "parse_address", "parse_json", "AFD_INFO_KEY", "TOKEN_ENV"]

#: the store key under which the FFN server publishes what it serves (JSON)
AFD_INFO_KEY = "tbo-afd/ffn"
#: the environment variable both sides read the shared secret from when it is not given explicitly
TOKEN_ENV = "TBO_AFD_TOKEN"
_TICKETS = "tbo-afd/tickets"  # store.add counter: a claim's ticket number
_JOINED = "tbo-afd/joined"  # set by the engine once its side of the group is formed
_SERVED = "tbo-afd/served"  # set once the server accepted a claim: the ticket it serves
_MAX_JSON_BYTES = 1 << 16
_MAX_JSON_DEPTH = 32
_POLL_S = 0.02
_WINDOW = 64  # tickets the server looks at per poll


class AFDPeerError(RuntimeError):
    """The other side of an AFD pair is missing, wrong, or gone; the message names it."""


def parse_address(address: str, what: str = "address") -> tuple[str, int]:
    """``"HOST:PORT"`` -> ``(host, port)``, or a ValueError naming ``what`` and the value."""
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"{what} {address!r} is not HOST:PORT (for example 127.0.0.1:29600)")
    return host.strip("[]"), int(port)


def _depth(text: str) -> int:
    """The deepest nesting of ``[`` / ``{`` outside strings (json.loads recurses once per level)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def parse_json(text: str | bytes, what: str, *, max_bytes: int = _MAX_JSON_BYTES,
               max_depth: int = _MAX_JSON_DEPTH) -> Any:
    """JSON text -> a Python value, or a ValueError naming ``what``: over ``max_bytes``, nested deeper than
    ``max_depth`` (checked before parsing: json.loads recurses once per level), not UTF-8 or not JSON."""
    if len(text) > max_bytes:
        raise ValueError(f"{what} is {len(text)} bytes, more than the {max_bytes} accepted")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{what} is not UTF-8 text: {e}") from None
    if _depth(text) > max_depth:
        raise ValueError(f"{what} is nested more than {max_depth} levels deep")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{what} is not valid JSON: {e}") from None


def _mac(token: str, nonce: str, ticket: int, purpose: str) -> str:
    return hmac.new(token.encode(), f"{nonce}|{ticket}|{purpose}".encode(), hashlib.sha256).hexdigest()


def _claim_key(ticket: int) -> str:
    return f"tbo-afd/claim/{ticket}"


def _verdict_key(ticket: int) -> str:
    return f"tbo-afd/verdict/{ticket}"


def _pg_prefix(token: str | None, nonce: str, ticket: int) -> str:
    """The process group's rendezvous keys: derived from the secret when there is one (a client without it cannot
    name, let alone overwrite, them)."""
    tag = _mac(token, nonce, ticket, "pg")[:32] if token else "open"
    return f"tbo-afd/pg/{ticket}/{tag}"


class _CheckedStore(torch.distributed.Store):
    """The store as gloo sees it: every peer address gloo reads is checked before gloo deserialises it.

    gloo's full-mesh rendezvous writes this rank's addresses under ``"DEVICE/RANK"`` and reads the peer's there.
    A value of another size (an empty one made gloo read past it: SIGSEGV; ten random bytes: a C++ length error)
    or with another leading layout than the one this process wrote itself is refused here, naming the key."""

    def __init__(self, inner: Any, rank: int, where: str) -> None:
        super().__init__()
        self.inner, self.rank, self.where = inner, rank, where
        self._own: dict[str, bytes] = {}

    def set(self, key: str, value: Any) -> None:
        data = bytes(value) if not isinstance(value, str) else value.encode()
        device, _, rank = key.partition("/")
        if rank == str(self.rank):
            self._own[device] = data
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        value = self.inner.get(key)
        device, _, rank = key.partition("/")
        own = self._own.get(device)
        if own is not None and rank != str(self.rank) and not _same_shape(own, bytes(value)):
            raise AFDPeerError(f"the peer's rendezvous address {key!r} read from {self.where} is {len(value)} bytes "
                               f"that are not a gloo address of this build ({len(own)} bytes): refused before gloo "
                               "parses it (someone else wrote to the store?)")
        return value

    def wait(self, keys: Any, timeout: Any = None) -> None:
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def add(self, key: str, value: int) -> int:
        return self.inner.add(key, value)

    def check(self, keys: Any) -> bool:
        return self.inner.check(keys)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self.inner.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: Any) -> None:
        self.inner.set_timeout(timeout)


def _same_shape(own: bytes, other: bytes) -> bool:
    """Same length, same leading words (gloo's counts and sizes), and an IPv4 / IPv6 socket address family where
    ours has one."""
    if len(own) != len(other) or len(own) < 20 or own[:18] != other[:18]:
        return False
    return int.from_bytes(other[18:20], "little") in (socket.AF_INET, socket.AF_INET6)


def _bound_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket bound to ``host`` only (the store's own would listen on every interface)."""
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
        sock.listen(64)
    except OSError as e:
        sock.close()
        raise AFDPeerError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _with_deadline(seconds: float, fn: Callable[[], Any], on_timeout: Callable[[], BaseException]) -> Any:
    """``fn()`` in a daemon thread; raise ``on_timeout()`` when it has not returned within ``seconds`` (a TCPStore
    client blocks without bound on a listener that accepts and never answers: a stopped server)."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box.append((False, e))

    worker = threading.Thread(target=run, daemon=True, name="tbo-afd-connect")
    worker.start()
    worker.join(seconds)
    if not box:
        raise on_timeout()
    ok, value = box[0]
    if not ok:
        raise value
    return value


class AFDGroup:
    """Point-to-point between the ranks of one AFD pair (attention ranks first, then FFN ranks).

    Create it with `listen` on the FFN side and `connect` on the attention side; `isend`, `irecv` return work
    handles that ``wait(timeout)``, as ``torch.distributed.isend`` / ``irecv`` do.
    """

    def __init__(self, store: Any, rank: int, size: int, backend: str, timeout_s: float, host: str,
                 prefix: str = "tbo-afd/pg", where: str = "the store") -> None:
        from torch.distributed import PrefixStore

        self.store, self.rank, self.size, self.backend = store, rank, size, backend
        self._socket: socket.socket | None = None
        timeout = datetime.timedelta(seconds=timeout_s)
        prefixed = _CheckedStore(PrefixStore(prefix, store), rank, where)
        if backend == "gloo":
            from torch.distributed import ProcessGroupGloo

            options = ProcessGroupGloo._Options()
            options._timeout = timeout
            # two devices, so two connections, each with its own transport thread and lock: one carries the
            # attention side's messages, the other the FFN side's (`isend`). On one connection, a rank's thread
            # that reads an incoming message while its main thread writes an outgoing one waits for that lock by
            # spinning, and on a rank with one core it spins until the scheduler preempts it (measured: stalls of
            # 2 to 4 ms per DBO decode step); apart, neither waits on the other
            options._devices = [ProcessGroupGloo.create_device(hostname=host) for _ in range(2)]  # where told, too
            self.pg = ProcessGroupGloo(prefixed, rank, size, options)
        elif backend == "nccl":
            from torch.distributed import ProcessGroupNCCL

            options = ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg = ProcessGroupNCCL(prefixed, rank, size, options)
        else:
            raise ValueError(f"AFD transport backend {backend!r}: accepted 'gloo' (CPU) or 'nccl' (CUDA)")
        if backend == "gloo":  # the group is formed and reads nothing more (NCCL reads it at its first op)
            # the server closes the store once the engine has read all it needs from it: the engine says so
            if rank == 0:
                store.set(_JOINED, "1")
            else:
                store.wait([_JOINED], timeout)
            prefixed.inner = self.store = None

    # ---- meeting -----------------------------------------------------------------------------------------------
    @classmethod
    def listen(cls, address: str, info: dict[str, Any], *, backend: str = "gloo", timeout_s: float = 600.0,
               on_listening: Any = None, token: str | None = None,
               on_refused: Callable[[str], None] | None = None) -> "AFDGroup":
        """The FFN side (rank 1 of 2): listen on ``address`` (port 0: a free one) and on nothing else, publish
        ``info``, call ``on_listening(host, port)``, and wait up to ``timeout_s`` for an engine to claim the server
        and join. ``token``: the shared secret a claim must prove it knows; a claim without it is refused (told to
        the engine, and to ``on_refused(message)``) and the server waits on for a valid one. Once the group is
        formed the store is dropped and the port closed."""
        from torch.distributed import TCPStore

        host, port = parse_address(address, "--listen")
        sock = _bound_socket(host, port)
        port = sock.getsockname()[1]
        where = f"{host}:{port}"
        try:
            store = TCPStore(host, port, 2, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                             wait_for_workers=False, master_listen_fd=os.dup(sock.fileno()))
            nonce = secrets.token_hex(16)
            store.set(AFD_INFO_KEY, json.dumps({**info, "nonce": nonce, "token_required": bool(token)}))
            if on_listening is not None:
                on_listening(host, port)
            ticket = _judge_claims(store, token, nonce, time.monotonic() + timeout_s, where, timeout_s, on_refused)
            try:
                group = cls(store, 1, 2, backend, timeout_s, host, _pg_prefix(token, nonce, ticket), where)
            except RuntimeError as e:  # AFDPeerError (a refused rendezvous value) included
                if isinstance(e, AFDPeerError):
                    raise
                raise AFDPeerError(f"the engine that claimed the FFN server at {where} did not join its process "
                                   f"group within {timeout_s:g}s: {str(e).strip().splitlines()[0]}") from None
        finally:
            sock.close()  # the store's copy of the socket goes with the store: nothing listens after this
        del store  # over gloo, closed to writes: the store and its listening socket end here
        return group

    @classmethod
    def connect(cls, address: str, *, backend: str = "gloo", connect_timeout_s: float = 10.0,
                timeout_s: float = 60.0, check_info: Any = None, token: str | None = None) -> "AFDGroup":
        """The attention side (rank 0 of 2): reach the FFN server at ``address``, read what it serves and pass it
        to ``check_info`` (which raises on a mismatch), claim it (presenting ``token`` when the server requires
        one), then join the group. Everything before the join is bounded by ``connect_timeout_s``, a server that
        accepts and never answers (a stopped one) included."""
        from torch.distributed import TCPStore

        host, port = parse_address(address, "the FFN server address")
        where = f"{host}:{port}"

        def reach() -> tuple[Any, dict[str, Any], int]:
            try:
                store = TCPStore(host, port, 2, is_master=False,
                                 timeout=datetime.timedelta(seconds=connect_timeout_s))
                raw = store.get(AFD_INFO_KEY)
            except (RuntimeError, OSError) as e:  # torch raises DistStoreError (a RuntimeError) when nobody answers
                raise AFDPeerError(f"no tbo AFD FFN server at {where} (nothing answered within "
                                   f"{connect_timeout_s:g}s: {str(e).strip().splitlines()[0]}); start it first with "
                                   f"`tbo afd-ffn --model DIR --listen {where}` (a server already serving an "
                                   "engine no longer listens: one engine per server)") from None
            info = _parse_info(raw, where)
            if check_info is not None:
                check_info(info)
            return store, info, _claim(store, info, token, where, connect_timeout_s)

        bound_s = 2 * connect_timeout_s + 5.0  # reaching it, then its verdict on the claim, each connect_timeout_s
        store, info, ticket = _with_deadline(bound_s, reach, lambda: AFDPeerError(
            f"the FFN server at {where} accepted the connection but did not answer within {bound_s:g}s "
            f"(connect_timeout_s={connect_timeout_s:g}): is it stopped (SIGSTOP) or not a tbo AFD FFN server?"))
        try:
            return cls(store, 0, 2, backend, max(timeout_s, connect_timeout_s), host,
                       _pg_prefix(token, str(info.get("nonce", "")), ticket), where)
        except RuntimeError as e:
            if isinstance(e, AFDPeerError):
                raise
            raise AFDPeerError(f"the FFN server at {where} did not join the AFD process group: "
                               f"{str(e).strip().splitlines()[0]}") from None

    # ---- point to point ----------------------------------------------------------------------------------------
    # A message's tag is its sender's rank: gloo runs tag t on device t % 2, so each direction has a connection
    # of its own (see __init__); NCCL ignores tags.
    def isend(self, tensor: torch.Tensor, dst: int) -> Any:
        return self.pg.send([tensor], dst, self.rank)

    def irecv(self, tensor: torch.Tensor, src: int | None) -> Any:
        """From ``src``, or from any rank when None (the work's ``_source_rank()`` says which)."""
        if src is None:
            return self.pg.recv_anysource([tensor], 1 - self.rank)
        return self.pg.recv([tensor], src, src)

    def close(self) -> None:
        """Leave the group (the store's socket closes with the object)."""
        pg, self.pg = self.pg, None
        self.store = None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except RuntimeError:  # already torn down by a lost peer
                pass


def _claim(store: Any, info: dict[str, Any], token: str | None, where: str, timeout_s: float) -> int:
    """The engine's side of the claim: a ticket, the proof, the server's verdict. Returns the ticket."""
    if store.check([_SERVED]):
        raise AFDPeerError(f"the FFN server at {where} is already serving an engine: one engine per server (start "
                           "another `tbo afd-ffn` for this one)")
    if info.get("token_required") and not token:
        raise AFDPeerError(f"the FFN server at {where} requires a shared secret: give this engine the server's "
                           f"--token (additional_config tbo.afd.token, or the {TOKEN_ENV} environment variable)")
    ticket = store.add(_TICKETS, 1)
    proof = _mac(token, str(info.get("nonce", "")), ticket, "claim") if token else ""
    store.set(_claim_key(ticket), json.dumps({"proof": proof}))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if store.check([_verdict_key(ticket)]):
            verdict = store.get(_verdict_key(ticket)).decode("utf-8", "replace")
            if verdict == "ok":
                return ticket
            raise AFDPeerError(f"the FFN server at {where} refused this engine: {verdict[:300]}")
        if store.check([_SERVED]) and store.get(_SERVED).decode("utf-8", "replace") != str(ticket):
            raise AFDPeerError(f"the FFN server at {where} is already serving an engine (another claimed it "
                               "first): one engine per server")
        time.sleep(_POLL_S)
    raise AFDPeerError(f"the FFN server at {where} did not answer this engine's claim within {timeout_s:g}s")


def _judge_claims(store: Any, token: str | None, nonce: str, deadline: float, where: str, timeout_s: float,
                  on_refused: Callable[[str], None] | None) -> int:
    """The server's side: judge the claims in ticket order, as their proofs come; the first valid one wins.
    A ticket taken without a claim written never blocks a later one."""
    judged: set[int] = set()
    while time.monotonic() < deadline:
        tickets = store.add(_TICKETS, 0)
        # the newest 64 tickets only: a client that takes a billion tickets costs a poll no more than 64 checks
        for ticket in range(max(1, tickets - _WINDOW + 1), tickets + 1):
            if ticket in judged or not store.check([_claim_key(ticket)]):
                continue
            judged.add(ticket)
            problem = _judge(store.get(_claim_key(ticket)), token, nonce, ticket)
            if problem is None:  # the verdict first: an engine that sees _SERVED has its verdict to read
                store.set(_verdict_key(ticket), "ok")
                store.set(_SERVED, str(ticket))
                return ticket
            if on_refused is not None:  # logged before the engine is told, so the log never lags the refusal
                on_refused(f"refused claim #{ticket} on {where}: {problem}")
            store.set(_verdict_key(ticket), problem)
        time.sleep(_POLL_S)
    raise AFDPeerError(f"no attention side joined the FFN server at {where} within {timeout_s:g}s")


def _judge(raw: bytes, token: str | None, nonce: str, ticket: int) -> str | None:
    try:
        claim = parse_json(raw, "the claim", max_bytes=1024, max_depth=2)
    except ValueError as e:
        return str(e)
    proof = claim.get("proof") if isinstance(claim, dict) else None
    if not isinstance(proof, str):
        return "the claim is not a tbo AFD claim"
    if token and not hmac.compare_digest(proof, _mac(token, nonce, ticket, "claim")):
        return ("it did not prove it knows the shared secret (the server's --token; the engine's "
                f"additional_config tbo.afd.token or {TOKEN_ENV})")
    return None


def _parse_info(raw: bytes, where: str) -> dict[str, Any]:
    try:
        info = parse_json(raw, "its description")
    except ValueError as e:
        raise AFDPeerError(f"{where} answered, but not as a tbo AFD FFN server ({e})") from None
    if not isinstance(info, dict):
        raise AFDPeerError(f"{where} answered, but not as a tbo AFD FFN server (its description is not a JSON "
                           "object)")
    return info
