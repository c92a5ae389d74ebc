"""The AFD trust boundary (issue 45), tried as a hostile neighbour on the same host would, against real processes.

The FFN side is the real ``tbo afd-ffn`` (the tiny Qwen3-MoE checkpoint the vLLM AFD tests use, a subprocess on a
free loopback port); the engine side is a subprocess that joins it through `AFDGroup.connect` and sends requests
through `TorchDistributedAFDConnector`, the path a vLLM engine's `AFDAttentionSide` takes. Every test that checks a
refusal also checks that the engine holding the secret still gets in and is served (a request answered with the
server's FFN, finite and of the right shape). Without vLLM (``tbo afd-ffn`` needs it) these tests skip; `make
test-vllm` runs them in .venv-vllm.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ..listening import _listening_sockets

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "tbo").is_dir())
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = [pytest.mark.dist,
              pytest.mark.skipif(not HAVE_VLLM, reason="tbo afd-ffn needs vLLM (make test-vllm runs this file)")]
SECRET = "correct horse battery staple"

_ENGINE = """
import sys, torch
from tbo.afd.connector import AFDMeta, AFDTopology, TorchDistributedAFDConnector
from tbo.afd.group import AFDGroup, AFDPeerError
address, token, connect_timeout_s = sys.argv[1], sys.argv[2] or None, float(sys.argv[3])
try:
    group = AFDGroup.connect(address, timeout_s=30, connect_timeout_s=connect_timeout_s, token=token)
except AFDPeerError as e:
    print("REFUSED", str(e).replace("\\n", " "), flush=True)
    sys.exit(3)
c = TorchDistributedAFDConnector(AFDTopology(1, 1), 30, group=group)
print("JOINED", flush=True)
for line in sys.stdin:
    if line.strip() == "req":
        meta = AFDMeta(0, 0, 1, 3, 128, torch.float32)
        c.send_attn_output(torch.randn(3, 128), meta)
        out = c.recv_ffn_output(meta)
        print("SERVED", tuple(out.shape), bool(torch.isfinite(out).all()), float(out.abs().sum()) > 0, flush=True)
    else:
        c.shutdown()
        group.close()
        print("BYE", flush=True)
        break
"""


def _env(token: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TBO_AFD_TOKEN"}
    env["PYTHONPATH"] = str(ROOT)
    if token is not None:
        env["TBO_AFD_TOKEN"] = token
    return env


@pytest.fixture(scope="module")
def model(qwen3_moe: Path) -> Path:
    """The room's tiny Qwen3-MoE checkpoint (tests/vllm/conftest.py), the one the vLLM AFD tests serve."""
    return qwen3_moe


class _Proc:
    """A subprocess whose stdout is read line by line; killed at the end of the test if still running."""

    def __init__(self, argv: list[str], env: dict[str, str], prlimit: int | None = None) -> None:
        if prlimit is not None:
            argv = ["prlimit", f"--nofile={prlimit}:{prlimit}", *argv]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")

    def line(self, prefix: str | tuple[str, ...], timeout: float = 120) -> str:
        """The next line starting with ``prefix``; a process that exits or stays silent past ``timeout`` fails the
        test (a deadline against hangs, not a timing)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(f"no {prefix!r} within {timeout}s: {self.stderr()}") from None
            if not line:
                raise AssertionError(f"exited ({self.proc.poll()}) before {prefix!r}: {self.stderr()}")
            if line.startswith(prefix):
                return line.strip()

    def send(self, text: str) -> None:
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def stderr(self) -> str:
        self.kill()
        return self.proc.stderr.read()[-3000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


@pytest.fixture
def procs():
    started: list[_Proc] = []

    def start(*args, **kw) -> _Proc:
        started.append(_Proc(*args, **kw))
        return started[-1]

    yield start
    for p in started:
        p.kill()
        for pipe in (p.proc.stdin, p.proc.stderr):
            pipe.close()


def _server(procs, model, token: str | None = SECRET, prlimit: int | None = None) -> tuple[_Proc, str]:
    server = procs([sys.executable, "-m", "tbo", "afd-ffn", "--model", str(model), "--listen", "127.0.0.1:0",
                    "--dtype", "float32", "--idle-timeout-s", "120", "--timeout-s", "20", "--threads", "1"],
                   _env(token), prlimit)
    line = server.line("tbo afd-ffn: serving")
    return server, line.split(" on ", 1)[1].split(",", 1)[0]


def _engine(procs, address: str, token: str | None = SECRET, connect_timeout_s: float = 10,
            prlimit: int | None = None) -> _Proc:
    return procs([sys.executable, "-c", _ENGINE, address, token or "", str(connect_timeout_s)], _env(), prlimit)


def _served(engine: _Proc) -> None:
    """The engine is in and served: one request answered by the server's FFN."""
    engine.send("req")
    assert engine.line("SERVED") == "SERVED (3, 128) True True"


def _the_engine_gets_in(procs, address: str, server: _Proc, token: str | None = SECRET) -> None:
    """The engine with the right secret (or none, for an open server) joins, is served, shuts down; the server
    exits 0."""
    engine = _engine(procs, address, token)
    assert engine.line("JOINED") == "JOINED"
    _served(engine)
    engine.send("quit")
    assert engine.line("BYE") == "BYE"
    assert server.proc.wait(60) == 0


def _listening(pid: int) -> list[int]:
    """Every TCP port process ``pid`` listens on."""
    return [port for _, port in _listening_sockets(str(pid))]


def _frame(sock: socket.socket, message: dict) -> None:
    data = json.dumps(message).encode()
    sock.sendall(struct.pack("!I", len(data)) + data)


def _read_frame(sock: socket.socket) -> dict:
    sock.settimeout(30)
    head = b""
    while len(head) < 4:
        chunk = sock.recv(4 - len(head))
        assert chunk, "closed"
        head += chunk
    (n,) = struct.unpack("!I", head)
    body = b""
    while len(body) < n:
        chunk = sock.recv(n - len(body))
        assert chunk, "closed"
        body += chunk
    return json.loads(body)


def _rss_mib(pid: int) -> float:
    for row in open(f"/proc/{pid}/status"):
        if row.startswith("VmRSS:"):
            return int(row.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_strangers_before_the_claim_cannot_join_race_or_keep_the_engine_out(procs, model):
    """What used to work against the store: reading what to race with, forging verdicts and claims, holding the
    server with idle connections. Now a stranger learns a nonce that is good for its own connection only, its
    forged claims are refused, and the engine with the secret joins past all of them and is served."""
    server, address = _server(procs, model)
    host, port = address.split(":")
    idle = [socket.create_connection((host, int(port))) for _ in range(20)]  # more than the pending connections
    forger = socket.create_connection((host, int(port)))
    hello = _read_frame(forger)
    assert set(hello) == {"protocol", "nonce", "token_required"} and hello["token_required"] is True
    _frame(forger, {"nonce": "0" * 32, "proof": "f" * 64, "token": True})  # a guessed proof
    verdict = _read_frame(forger)
    assert verdict == {"ok": False, "error": "it did not prove it knows the shared secret"}, verdict
    racer = socket.create_connection((host, int(port)))
    _read_frame(racer)
    _frame(racer, {"ok": True, "served": 1, "verdict": "ok"})  # a forged verdict where a claim is due
    with pytest.raises(AssertionError):  # refused and closed
        _read_frame(racer)
    engine = _engine(procs, address)
    assert engine.line("JOINED") == "JOINED"
    _served(engine)
    # once the engine joined nothing listens: a stranger cannot even connect any more
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=5)
    assert _listening(server.proc.pid) == []
    for s in [*idle, forger, racer]:
        s.close()
    _served(engine)
    engine.send("quit")
    assert engine.line("BYE") == "BYE"
    assert server.proc.wait(60) == 0
    err = server.proc.stderr.read()
    assert "refused a claim from 127.0.0.1" in err and "did not prove it knows the shared secret" in err, err


def test_a_rogue_server_without_the_secret_gets_no_hidden_state(procs, model):
    """A server that does not know the secret says ok and hands a proof it cannot compute: the engine refuses it
    before it sends a single hidden state (the rogue reads nothing after the claim), then joins the real one."""
    rogue = socket.socket()
    rogue.bind(("127.0.0.1", 0))
    rogue.listen(4)
    engine = _engine(procs, f"127.0.0.1:{rogue.getsockname()[1]}")
    conn, _ = rogue.accept()
    _frame(conn, {"protocol": "tbo-afd/1", "nonce": "1" * 32, "token_required": True})
    claim = _read_frame(conn)
    assert SECRET not in json.dumps(claim) and len(claim["proof"]) == 64  # the secret never crosses the wire
    _frame(conn, {"ok": True, "proof": claim["proof"], "info": {"tbo_afd": 1}})  # its own proof, reflected
    line = engine.line("REFUSED")
    assert "did not prove it knows the shared secret: refused before anything was sent to it" in line, line
    conn.settimeout(30)
    rest = b""
    while chunk := conn.recv(1 << 16):
        rest += chunk
    assert rest == b"", rest  # no hidden state, not even a join
    conn.close()
    rogue.close()
    server, address = _server(procs, model)
    _the_engine_gets_in(procs, address, server)


def test_a_secret_on_one_side_only_is_named_on_both_and_the_right_engine_gets_in(procs, model):
    server, address = _server(procs, model)
    line = _engine(procs, address, token=None).line("REFUSED")
    assert "requires a shared secret and this engine has none" in line, line
    line = _engine(procs, address, token="another secret").line("REFUSED")
    assert "refused this engine: it did not prove it knows the shared secret" in line, line
    _the_engine_gets_in(procs, address, server)
    err = server.proc.stderr.read()
    assert "the engine has no shared secret and this server requires one" in err, err

    open_server, address = _server(procs, model, token=None)
    line = _engine(procs, address).line("REFUSED")
    assert "this engine has a shared secret and the FFN server at" in line and "requires none" in line, line
    _the_engine_gets_in(procs, address, open_server, token=None)
    assert "the engine has a shared secret and this server has none" in open_server.proc.stderr.read()


def test_200_connections_to_every_listener_at_96_descriptors_leave_both_alive_and_serving(procs, model):
    """gloo's leftover listeners used to leak a descriptor per connection (CLOSE_WAIT) until both processes
    aborted at their limit. Before the join the server's one listener takes 200 connections; after it, neither
    process listens on anything, and both serve on."""
    server, address = _server(procs, model, prlimit=96)
    host, port = address.split(":")
    assert _listening(server.proc.pid) == [int(port)]
    for _ in range(200):
        socket.create_connection((host, int(port))).close()
    engine = _engine(procs, address, prlimit=96)
    assert engine.line("JOINED") == "JOINED"
    _served(engine)
    for pid in (server.proc.pid, engine.proc.pid):
        for listening in _listening(pid):  # none, by design: the loop proves it stays so under connections
            for _ in range(200):
                try:
                    socket.create_connection(("127.0.0.1", listening)).close()
                except OSError:
                    pass
        assert _listening(pid) == [], pid
    for _ in range(200):  # where the server listened: refused, costs it nothing
        with pytest.raises(OSError):
            socket.create_connection((host, int(port)), timeout=5)
    assert server.proc.poll() is None and engine.proc.poll() is None
    _served(engine)
    engine.send("quit")
    assert engine.line("BYE") == "BYE"
    assert server.proc.wait(60) == 0


def test_a_flood_of_large_writes_before_the_claim_keeps_the_server_small(procs, model):
    """60 writes of 8 MiB used to grow the server by 500 MiB; now a frame over the claim's size is refused from its
    length alone, before a byte of it is read, and the engine gets in after the flood."""
    server, address = _server(procs, model)
    host, port = address.split(":")
    before = _rss_mib(server.proc.pid)
    blob = b"x" * (8 << 20)
    for _ in range(60):
        s = socket.create_connection((host, int(port)))
        _read_frame(s)
        try:
            s.sendall(struct.pack("!I", len(blob)) + blob)
        except OSError:  # the server closed the connection after reading the length
            pass
        s.close()
    time.sleep(0.5)
    grown = _rss_mib(server.proc.pid) - before
    assert grown < 32, grown
    _the_engine_gets_in(procs, address, server)
    assert "more than the 1024 accepted" in server.proc.stderr.read()


def test_a_connect_that_timed_out_never_claims_later_and_its_retry_gets_in(procs, model):
    """The server is stopped (SIGSTOP) while the engine connects: the connect gives up in its time, naming it. The
    server, resumed, finds that connection closed and claims nothing for it; the retry joins and is served (it used
    to be locked out by the first attempt's abandoned thread, which claimed the server later)."""
    server, address = _server(procs, model)
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        first = _engine(procs, address, connect_timeout_s=2)
        line = first.line("REFUSED")
        assert "did not complete a tbo AFD handshake within 2s (connect_timeout_s=2)" in line, line
        assert first.proc.wait(30) == 3
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    _the_engine_gets_in(procs, address, server)
