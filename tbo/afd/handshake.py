"""The AFD join: a small handshake of tbo's own over one plain TCP connection, mutually authenticated.

Why not a store. A ``TCPStore`` is a general key-value server: any client that reaches its port can list, read and
write every key, before and after a claim, in any size and number. Defending one (forged verdicts, flooded tickets,
rewritten descriptions, a stranger racing the engine into the process group with a key it read) proved harder than
not having one. Here the FFN server listens on one socket, and every connection gets the same short exchange:

1. server -> engine ``hello``: a fresh nonce ``ns`` (one per connection) and whether a secret is required;
2. engine -> server ``claim``: a fresh nonce ``ne`` and ``HMAC(secret, "engine" | ns | ne)``;
3. server -> engine ``verdict``: refused (why), or accepted with ``HMAC(secret, "server" | ns | ne)`` and the
   description of what it serves;
4. engine -> server ``join`` (or why not): the engine checked the server's proof, then the description (the model,
   the largest request, the microbatch counts the server serves: a count it does not serve is refused here, by
   name, not mid-step); the join carries what the engine asks of the pair (an emulated ``link``, a string the
   server parses itself).

Integrity after the join (issue 61). With a secret, both sides derive a session key from it and both nonces
(`session_keys`: one key per direction), and every frame of the channel after the join carries a MAC under its
direction's key over its sequence number, its header and (`INTEGRITY` "full", an option) its payload (`tbo.afd.channel`): a
relay between the two can read, but neither rewrite, replay, drop nor reorder a frame without the next check
failing. "headers" covers every frame's header and every small message in full (the connector's 80-byte metadata
headers, the key-value frames), and not the bulk tensors. The server says its minimum in the verdict, the engine
asks for the stronger of the two in its join. Confidentiality stays the network's.

Both proofs cover both nonces and a role label: a proof recorded from one connection verifies on no other (fresh
nonces), and the server's proof is not an engine's (the label), so neither can be replayed or reflected. The secret
never crosses the wire. The engine sends nothing but its claim before the server proved itself, so a rogue server
gets no hidden state. The claim is the connection itself: an engine that gave up closed it, and a closed
connection claims nothing; its retry is a new connection.

Before a claim is accepted, a stranger costs the server bounded resources: frames of at most `MAX_FRAME` bytes
(the length is read first), at most `MAX_PENDING` connections in the handshake at once (the oldest is dropped for a
new one, so idle connections cannot keep the engine out), and a deadline on every connection's handshake. Once one
engine joined, the listening socket is closed: nothing more listens. Frames are JSON, parsed with a size and depth
bound (`tbo.afd.group.parse_json`), never unpickled or evaluated.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import socket
import struct
import threading
import time
from typing import Any, Callable

from tbo.afd.peer import TOKEN_ENV, AFDPeerError, parse_json

__all__ = ["HandshakeError", "INTEGRITY", "MAX_FRAME", "MAX_PENDING", "PROTOCOL", "accept_engine", "claim_server",
           "proof", "session_keys"]

#: the protocol's name and version, in every hello
PROTOCOL = "tbo-afd/1"
#: the largest handshake frame either side reads (the server's description included)
MAX_FRAME = 1 << 16
#: the largest frame the server reads before a claim was accepted (a claim is about 200 bytes)
MAX_CLAIM_FRAME = 1024
#: connections in the handshake at once on the server; a new one beyond drops the oldest
MAX_PENDING = 16
#: refusals told one by one per `LOG_WINDOW_S`; the rest are counted and told in one line (a stranger's flood of
#: connections wrote 14,000 lines in 10 s)
LOG_BURST = 10
LOG_WINDOW_S = 10.0
_LENGTH = struct.Struct("!I")
#: what a secret's MAC covers after the join, weakest first: "headers" (every frame's header and every small message
#: in full), "full" (every byte)
INTEGRITY = ("headers", "full")
#: the default: covering the bulk payloads too cost more than 3% of a decode step (docs/hardening.md), so "full" is
#: an option, asked by either side
DEFAULT_INTEGRITY = "headers"


class HandshakeError(RuntimeError):
    """One connection's handshake failed: the message says what the peer did or did not do."""


def proof(token: str, role: str, server_nonce: str, engine_nonce: str) -> str:
    """``role`` ("engine" or "server") proves it knows ``token`` for this one pair of nonces."""
    text = f"{PROTOCOL}|{role}|{server_nonce}|{engine_nonce}".encode()
    return hmac.new(token.encode(), text, hashlib.sha256).hexdigest()


def session_keys(token: str, server_nonce: str, engine_nonce: str) -> tuple[bytes, bytes]:
    """The pair's MAC keys after the join, engine-to-server and server-to-engine: derived from the secret and this
    connection's two nonces (so no other connection's frames verify), one per direction (so a frame reflected back
    to its sender does not)."""
    session = hmac.new(token.encode(), f"{PROTOCOL}|session|{server_nonce}|{engine_nonce}".encode(),
                       hashlib.sha256).digest()
    return (hmac.new(session, b"engine->server", hashlib.sha256).digest(),
            hmac.new(session, b"server->engine", hashlib.sha256).digest())


def _integrity(value: Any, what: str) -> str:
    if value not in INTEGRITY:
        raise HandshakeError(f"{what} asks for integrity {str(value)[:40]!r}: accepted {', '.join(INTEGRITY)}")
    return value


def _hex(value: str, what: str, length: int | None = None) -> str:
    """``value`` if it is lowercase hex (of ``length`` characters, or at least 32), else a `HandshakeError` naming
    ``what``: a proof or a nonce is compared and hashed as ASCII, and any other character (a non-ASCII letter, a lone
    surrogate, a NUL) raised an unnamed TypeError or UnicodeEncodeError."""
    ok = value.isascii() and all(c in "0123456789abcdef" for c in value)
    if not ok or (len(value) != length if length is not None else len(value) < 32):
        shown = value[:40].encode("ascii", "backslashreplace").decode()
        raise HandshakeError(f"{what} is not {length or 'at least 32'} lowercase hex characters (got "
                             f"{len(value)} characters: '{shown}'): not a tbo AFD peer of this version")
    return value


def _recv_exact(sock: socket.socket, n: int, deadline: float, what: str) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise HandshakeError(f"{what}: nothing complete arrived in time")
        sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(buf))
        except socket.timeout:
            raise HandshakeError(f"{what}: nothing complete arrived in time") from None
        except OSError as e:
            raise HandshakeError(f"{what}: the connection failed ({e.strerror or e})") from None
        if not chunk:
            raise HandshakeError(f"{what}: the peer closed the connection")
        buf += chunk
    return bytes(buf)


def send_frame(sock: socket.socket, message: dict[str, Any], deadline: float) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    if len(data) > MAX_FRAME:
        raise HandshakeError(f"a handshake frame of {len(data)} bytes is over the {MAX_FRAME} allowed")
    sock.settimeout(max(deadline - time.monotonic(), 1e-3))
    try:
        sock.sendall(_LENGTH.pack(len(data)) + data)
    except socket.timeout:
        raise HandshakeError("the peer did not take a handshake frame in time") from None
    except OSError as e:
        raise HandshakeError(f"the connection failed while sending ({e.strerror or e})") from None


def recv_frame(sock: socket.socket, deadline: float, what: str, max_bytes: int = MAX_FRAME) -> dict[str, Any]:
    """One frame: its length first (over ``max_bytes``: refused before reading it), then JSON, an object."""
    (length,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size, deadline, what))
    if length > max_bytes:
        raise HandshakeError(f"{what} announces {length} bytes, more than the {max_bytes} accepted: not a tbo AFD "
                             "peer of this version")
    try:
        message = parse_json(_recv_exact(sock, length, deadline, what), what, max_bytes=max_bytes, max_depth=4
                             if max_bytes <= MAX_CLAIM_FRAME else 32)
    except ValueError as e:
        raise HandshakeError(str(e)) from None
    if not isinstance(message, dict):
        raise HandshakeError(f"{what} is not a JSON object: not a tbo AFD peer")
    return message


def _field(message: dict[str, Any], name: str, kind: type, what: str) -> Any:
    value = message.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise HandshakeError(f"{what} has no valid {name!r}: not a tbo AFD peer of this version")
    if isinstance(value, str) and len(value) > 256:
        raise HandshakeError(f"{what}'s {name!r} is {len(value)} characters, more than 256")
    return value


# ---- the server's side ---------------------------------------------------------------------------------------------
class _RateLimited:
    """``on_refused`` at most `LOG_BURST` times per `LOG_WINDOW_S`; the refusals past it are counted, and the count
    told in one line when the window ends (at the next refusal, or when the server stops listening)."""

    def __init__(self, emit: Callable[[str], None], burst: int = LOG_BURST, window_s: float = LOG_WINDOW_S) -> None:
        self.emit, self.burst, self.window_s = emit, burst, window_s
        self.lock = threading.Lock()
        self.start, self.told, self.untold = time.monotonic(), 0, 0

    def __call__(self, message: str) -> None:
        with self.lock:
            summary = self._roll(time.monotonic())
            tell = self.told < self.burst
            if tell:
                self.told += 1
            else:
                self.untold += 1
        if summary:
            self.emit(summary)
        if tell:
            self.emit(message)

    def _roll(self, now: float, force: bool = False) -> str | None:
        """Start a new window if this one ended (or ``force``); the line counting what it did not tell."""
        if not force and now - self.start < self.window_s:
            return None
        summary = (f"{self.untold} more connection(s) refused or dropped in {now - self.start:.1f}s, not logged one "
                   f"by one (at most {self.burst} lines per {self.window_s:g}s)") if self.untold else None
        self.start, self.told, self.untold = now, 0, 0
        return summary

    def flush(self) -> None:
        with self.lock:
            summary = self._roll(time.monotonic(), force=True)
        if summary:
            self.emit(summary)


class _Pending:
    """The connections in the handshake: at most `MAX_PENDING`, the first accepted claim wins."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.conns: list[socket.socket] = []
        self.winner: socket.socket | None = None
        self.serving = False  # a claim was accepted and its join is awaited
        #: notified when a claim settles (its engine joined, declined or dropped), so that a claim arriving while
        #: another's join is awaited waits for the outcome instead of being refused for a join that may not come
        self.settled = threading.Condition(self.lock)
        self.done = threading.Event()
        self.listener: socket.socket | None = None
        self.joined: dict[str, Any] = {}  #: what the winner's join asked (``link``), and its ``session``
        self.integrity = DEFAULT_INTEGRITY  #: the least this server accepts (with a secret)

    def add(self, conn: socket.socket) -> None:
        with self.lock:
            self.conns.append(conn)
            while len(self.conns) > MAX_PENDING:  # the oldest makes room: idle strangers cannot fill the server
                _drop(self.conns.pop(0))

    def remove(self, conn: socket.socket) -> None:
        with self.lock:
            if conn in self.conns:
                self.conns.remove(conn)

    def drop_all(self) -> None:
        with self.lock:
            conns, self.conns = self.conns, []
        for conn in conns:
            _drop(conn)


def _drop(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    conn.close()


def _serve_one(conn: socket.socket, peer: str, pending: _Pending, token: str | None, info: dict[str, Any],
               handshake_s: float, on_refused: Callable[[str], None] | None) -> None:
    """One connection's handshake (in its own thread); the winner is handed over in ``pending``."""
    deadline = time.monotonic() + handshake_s
    ours = secrets.token_hex(16)
    accepted = False
    try:
        send_frame(conn, {"protocol": PROTOCOL, "nonce": ours, "token_required": bool(token)}, deadline)
        claim = recv_frame(conn, deadline, f"the claim from {peer}", MAX_CLAIM_FRAME)
        theirs = _field(claim, "nonce", str, f"the claim from {peer}")
        given = _field(claim, "proof", str, f"the claim from {peer}")
        has_token = bool(claim.get("token"))
        problem = None
        try:
            _hex(theirs, "its nonce")
            if token and has_token:
                _hex(given, "its proof", 64)
        except HandshakeError as e:
            problem = str(e)
        if problem is not None:
            pass  # a malformed nonce or proof, named above
        elif token and not has_token:
            problem = "the engine has no shared secret and this server requires one (give the engine the same secret)"
        elif not token and has_token:
            problem = ("the engine has a shared secret and this server has none: give both the same secret "
                       "(--token-file or TBO_AFD_TOKEN here), or neither")
        elif token and not hmac.compare_digest(given, proof(token, "engine", ours, theirs)):
            problem = "it did not prove it knows the shared secret"
        with pending.lock:
            if problem is None:
                pending.settled.wait_for(lambda: not pending.serving or pending.done.is_set(),
                                         max(0.0, deadline - time.monotonic()))
            if problem is None and (pending.serving or pending.done.is_set()):
                problem = "this server is already serving an engine: one engine per server"
            if problem is None:
                pending.serving = accepted = True
        if problem is not None:
            if on_refused is not None:  # logged before the peer is told, so the log never lags the refusal
                on_refused(f"refused a claim from {peer}: {problem}")
            send_frame(conn, {"ok": False, "error": problem}, deadline)
            return
        send_frame(conn, {"ok": True, "proof": proof(token, "server", ours, theirs) if token else "", "info": info,
                          **({"integrity": pending.integrity} if token else {})}, deadline)
        answer = recv_frame(conn, deadline, f"the join from {peer}", MAX_CLAIM_FRAME)
        if answer.get("join") is not True:
            reason = str(answer.get("error", "no reason given"))[:300]
            if on_refused is not None:
                on_refused(f"the engine at {peer} did not join: {reason}")
            return
        link = answer.get("link")
        if link is not None:
            from tbo.comm.emulated import parse_link_spec

            try:
                if not isinstance(link, str) or len(link) > 64:
                    raise ValueError("not a short string")
                parse_link_spec(link)
            except ValueError:
                raise HandshakeError(f"the join from {peer} has a malformed 'link' (a 'LATENCY_US,GBPS' string)")
        session = None
        if token:
            asked = _integrity(answer.get("integrity"), f"the join from {peer}")
            if INTEGRITY.index(asked) < INTEGRITY.index(pending.integrity):
                raise HandshakeError(f"the join from {peer} asks for integrity {asked!r}, less than this server's "
                                     f"{pending.integrity!r}")
            session = (*session_keys(token, ours, theirs), asked)
        with pending.lock:
            pending.winner = conn
            pending.joined = {"link": link, "session": session}
            pending.done.set()
            pending.settled.notify_all()
        if pending.listener is not None:  # wakes the accept loop at once (accept fails on a shut-down listener)
            try:
                pending.listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
    except HandshakeError as e:
        if on_refused is not None:
            on_refused(f"dropped a connection from {peer}: {e}")
    finally:
        if pending.winner is not conn:
            if accepted:
                with pending.lock:
                    pending.serving = False
                    pending.settled.notify_all()
            pending.remove(conn)
            _drop(conn)


def accept_engine(listener: socket.socket, token: str | None, info: dict[str, Any], timeout_s: float, where: str,
                  on_refused: Callable[[str], None] | None = None,
                  handshake_s: float = 10.0,
                  integrity: str = DEFAULT_INTEGRITY) -> tuple[socket.socket, dict[str, Any]]:
    """Serve handshakes on ``listener`` until one engine joined (returned, connected, with what its join asked:
    ``link``, and ``session``, (engine-to-server key, server-to-engine key, integrity) with a secret, else None)
    or ``timeout_s`` passed; the listener is closed either way. Each connection has ``handshake_s`` to finish.
    ``integrity``: the least MAC coverage this server accepts after the join (`INTEGRITY`)."""
    pending = _Pending()
    pending.listener = listener
    pending.integrity = integrity
    deadline = time.monotonic() + timeout_s
    log = None if on_refused is None else _RateLimited(on_refused)
    on_refused = log
    listener.settimeout(0.1)
    try:
        while not pending.done.is_set():
            if time.monotonic() > deadline:
                raise AFDPeerError(f"no attention side joined the FFN server at {where} within {timeout_s:g}s")
            try:
                conn, addr = listener.accept()
            except socket.timeout:
                continue
            except OSError:  # out of descriptors, say: wait for handshakes to end, never die of it
                if not pending.done.is_set():
                    time.sleep(0.05)
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pending.add(conn)
            threading.Thread(target=_serve_one, args=(conn, f"{addr[0]}:{addr[1]}", pending, token, info,
                                                      min(handshake_s, timeout_s), on_refused),
                             daemon=True, name="tbo-afd-handshake").start()
    finally:
        listener.close()
        with pending.lock:
            winner = pending.winner
            pending.conns = [c for c in pending.conns if c is not winner]
        pending.drop_all()
        if log is not None:
            log.flush()
    assert winner is not None
    winner.settimeout(None)
    return winner, pending.joined


# ---- the engine's side ---------------------------------------------------------------------------------------------
def claim_server(host: str, port: int, token: str | None, timeout_s: float,
                 check_info: Callable[[dict[str, Any]], None] | None, where: str,
                 join: dict[str, Any] | None = None,
                 integrity: str = DEFAULT_INTEGRITY) -> tuple[socket.socket, dict, tuple[bytes, bytes, str] | None]:
    """Connect, claim, check the server's proof and description, join (with ``join``'s fields: ``link``; and, with a
    secret, the stronger of ``integrity`` and the server's); the connected socket, the description and the session
    (engine-to-server key, server-to-engine key, integrity; None without a secret). Everything is bounded by ``timeout_s``; on any failure the connection is
    closed (so it claims nothing)."""
    deadline = time.monotonic() + timeout_s
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except (socket.timeout, TimeoutError):  # the SYN went unanswered: nothing refused it, nothing took it
        raise AFDPeerError(f"the FFN server at {where} did not accept the connection within {timeout_s:g}s "
                           "(connect_timeout_s): its listen backlog is full, connections held open to it faster than "
                           "it takes them (a connect flood; it accepts again once they end), or a firewall drops the "
                           "connection; not a server that is down, which refuses at once") from None
    except OSError as e:
        raise AFDPeerError(f"no tbo AFD FFN server at {where} (nothing answered within {timeout_s:g}s: "
                           f"{e.strerror or e}); start it first with `tbo afd-ffn --model DIR --listen {where}` "
                           "(a server already serving an engine no longer listens: one engine per server)") from None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            hello = recv_frame(sock, deadline, f"the hello of {where}", MAX_CLAIM_FRAME)
            if hello.get("protocol") != PROTOCOL:
                raise HandshakeError(f"it speaks {str(hello.get('protocol'))[:40]!r}, not {PROTOCOL!r}")
            theirs = _hex(_field(hello, "nonce", str, "its hello"), "its hello's nonce")
            required = bool(hello.get("token_required"))
            ours = secrets.token_hex(16)
            send_frame(sock, {"nonce": ours, "proof": proof(token, "engine", theirs, ours) if token else "",
                              "token": bool(token)}, deadline)
            if required and not token:
                raise AFDPeerError(f"the FFN server at {where} requires a shared secret and this engine has none: "
                                   f"give it the server's secret (additional_config tbo.afd.token, or the {TOKEN_ENV} "
                                   "environment variable)")
            if token and not required:
                raise AFDPeerError(f"this engine has a shared secret and the FFN server at {where} requires none: "
                                   "give both the same secret, or neither (refused: a server without a secret "
                                   "cannot prove who it is)")
            verdict = recv_frame(sock, deadline, f"the verdict of {where}")
            if verdict.get("ok") is not True:
                raise AFDPeerError(f"the FFN server at {where} refused this engine: "
                                   f"{str(verdict.get('error', 'no reason given'))[:300]}")
            given = verdict.get("proof", "")
            if token and not (isinstance(given, str) and given.isascii() and
                              hmac.compare_digest(given, proof(token, "server", theirs, ours))):
                raise AFDPeerError(f"the server at {where} did not prove it knows the shared secret: refused before "
                                   "anything was sent to it (a rogue server, or another secret)")
            info = verdict.get("info")
            if not isinstance(info, dict):
                raise AFDPeerError(f"{where} answered, but not as a tbo AFD FFN server (no description)")
            try:
                if check_info is not None:
                    check_info(info)
            except Exception as e:
                send_frame(sock, {"join": False, "error": str(e)[:300]}, deadline)
                raise
            session = None
            if token:
                mode = max(integrity, _integrity(verdict.get("integrity"), f"the verdict of {where}"),
                           key=INTEGRITY.index)
                session = (*session_keys(token, theirs, ours), mode)
            send_frame(sock, {**(join or {}), **({"integrity": session[2]} if session else {}), "join": True},
                       deadline)
        except HandshakeError as e:
            raise AFDPeerError(f"{where} did not complete a tbo AFD handshake within {timeout_s:g}s "
                               f"(connect_timeout_s={timeout_s:g}): {e} "
                               "(is it a tbo AFD FFN server of this version, and running?)") from None
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    return sock, info, session
