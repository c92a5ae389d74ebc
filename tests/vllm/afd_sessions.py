"""The two processes of test_afd_exit.py (issue 63): many engine-then-exit sessions at the cost of one model build.

``server MODEL``: builds ``tbo afd-ffn``'s model once (`VllmFFNModel`), then serves one engine after another with
`serve_engine`, the code ``tbo afd-ffn`` runs after its build: one session per line on stdin (its
``--idle-timeout-s``; its defaults otherwise), each on a fresh loopback port (its "serving ... on HOST:PORT" line
on stdout). After each: a ``SESSION`` JSON line (exit status, the
time it ended, what it wrote to stderr).

``attention``: per line on stdin (``ADDRESS HIDDEN DTYPE LAYERS HOW``) forks a child, the attention side of one
session: it joins the server through `AFDGroup.connect`, sends a full step (every layer, two microbatches) through
the connector and checks every answer, then ends as ``HOW`` says, and exits. The parent prints an ``EXITED`` JSON line
(the time the child's exit was reaped, its status). A fork costs milliseconds where a new interpreter with torch
costs seconds on a small machine; the parent never computes, so the child's torch starts clean.

``HOW``: ``shutdown`` (the engine's close: the shutdown message, the channel closed, then exit), ``vanish`` (exit
without a word: the OS closes the socket between two messages), ``cut_shutdown`` (exit with the shutdown message's
frame header written and its payload not: a process that ended while its writer thread was inside that frame),
``cut_request`` (the same inside a request's payload).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time


def _server(model_dir: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from tbo.integrations.vllm.afd.ffn import VllmFFNModel, serve_engine

    model = VllmFFNModel(model_dir, "float32")
    args = argparse.Namespace(model=model_dir, listen="127.0.0.1:0", idle_timeout_s=600.0, timeout_s=60.0)
    print("BUILT", flush=True)
    for line in sys.stdin:  # one session per line: its --idle-timeout-s
        args.idle_timeout_s = float(line)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = serve_engine(model, args, None)
        print("SESSION " + json.dumps({"rc": rc, "ended": time.time(), "err": err.getvalue()[-2000:]}), flush=True)


def _attention_session(address: str, hidden: int, dtype_name: str, layers: int, how: str) -> None:
    import struct

    import torch

    from tbo.afd.connector import AFDMeta, AFDTopology, TorchDistributedAFDConnector
    from tbo.afd.group import AFDGroup

    dtype = getattr(torch, dtype_name)
    group = AFDGroup.connect(address, timeout_s=30)
    connector = TorchDistributedAFDConnector(AFDTopology(1, 1), 30, group=group)
    for layer in range(layers):  # a step of two stages per layer, as DBO sends it
        metas = [AFDMeta(layer, mb, 2, 3 + mb, hidden, dtype) for mb in range(2)]
        for meta in metas:
            connector.send_attn_output(torch.randn(meta.num_tokens, hidden, dtype=dtype), meta)
        for meta in metas:
            out = connector.recv_ffn_output(meta)
            assert tuple(out.shape) == (meta.num_tokens, hidden) and bool(torch.isfinite(out).all()), out.shape
    connector.flush()
    sock = group.channel.sock
    frame = struct.Struct("!IIQ")  # the channel's frame header: kind (1: a message), tag (the sender's rank), length
    if how == "shutdown":
        connector.shutdown()
        group.close()
    elif how == "cut_shutdown":  # the shutdown message's frame header, and the process gone before its 80 bytes
        sock.sendall(frame.pack(1, 0, 80))
    elif how == "cut_request":  # a whole request header, then its payload's frame cut after 64 of its bytes
        meta = AFDMeta(0, 0, 1, 4, hidden, dtype, step=1, seq=connector._send_seq[1])
        connector._isend(meta.encode(), 1).wait()
        time.sleep(0.5)  # the server has checked the header and posted the payload's receive: the reader takes it
        sock.sendall(frame.pack(1, 0, meta.nbytes + 8) + bytes(64))
    elif how != "vanish":
        raise ValueError(how)
    print("ENDING", how, flush=True)
    os._exit(0)  # as a process ends: whatever the writer thread was doing stops here, the OS closes the socket


def _attention() -> None:
    import torch  # noqa: F401 - imported once, before the forks: a child imports nothing

    import tbo.afd.connector  # noqa: F401
    import tbo.afd.group  # noqa: F401

    for line in sys.stdin:
        address, hidden, dtype_name, layers, how = line.split()
        pid = os.fork()
        if pid == 0:
            try:
                _attention_session(address, int(hidden), dtype_name, int(layers), how)
            except BaseException as e:  # noqa: BLE001 - told to the parent by the exit status
                print(f"attention side failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            os._exit(1)
        _, status = os.waitpid(pid, 0)
        print("EXITED " + json.dumps({"ended": time.time(), "status": os.waitstatus_to_exitcode(status)}),
              flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "server":
        _server(sys.argv[2])
    else:
        _attention()
