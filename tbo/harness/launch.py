"""Run a function on N ranks: under ``torchrun`` in place, or spawned locally over gloo on 127.0.0.1.

Examples, benchmarks and tests all go through here, so the same script runs on a laptop (``--ranks 2``) and
multi-node under the launcher users already have (``torchrun --nnodes ...``). Each rank uses one torch thread, so
two ranks on a 2-core machine do not fight over cores. The parent waits with a deadline: a stuck rank is reported
and killed, never waited on forever.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable

__all__ = ["launch", "under_torchrun", "free_port", "RankError"]


class RankError(RuntimeError):
    """A rank failed; the message carries its traceback. ``results`` holds what the other ranks returned."""

    def __init__(self, message: str, results: dict[int, Any]) -> None:
        super().__init__(message)
        self.results = results


def under_torchrun() -> bool:
    """True when torchrun (or any env:// launcher) started this process."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world_size: int, port: int, backend: str, timeout_s: float) -> None:
    """The process group, met in a store on 127.0.0.1 only: a ``tcp://`` init method's store listens on every
    interface (its own socket binds the wildcard), so rank 0 binds the socket itself and hands it over."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
            sock.listen(128)
            store = dist.TCPStore("127.0.0.1", port, world_size, is_master=True, timeout=timeout,
                                  wait_for_workers=False, master_listen_fd=os.dup(sock.fileno()))
    else:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def _child(rank: int, world_size: int, port: int, backend: str, timeout_s: float, fn: Callable, args: tuple,
           results: Any) -> None:
    import torch.distributed as dist

    try:
        _init(rank, world_size, port, backend, timeout_s)
        # plain pickle copies tensors into the message: torch's queue would share their storage by a file
        # descriptor that the parent fetches from this process later, and this process may have exited by then
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # report everything, including KeyboardInterrupt in a child
        results.put((rank, False, traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()  # the report is out before teardown, which a broken group may not survive
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(
    fn: Callable[..., Any],
    ranks: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    comm_timeout_s: float = 60.0,
    failure_grace_s: float = 5.0,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on every rank with a process group initialised; return results by rank.

    Under torchrun this process is one rank: it runs ``fn`` once and returns ``[its result]``. Otherwise it spawns
    ``ranks`` processes (``fn`` and ``args`` must pickle) and returns all their results, raising `RankError` with
    the first failing rank's traceback (and, in ``.results``, what the others returned within ``failure_grace_s``),
    or `TimeoutError` if the ranks are not done within ``timeout_s``.
    """
    if under_torchrun():
        import torch.distributed as dist

        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if not dist.is_initialized():  # torchrun's own store: where torchrun was told to put it
            import torch

            torch.set_num_threads(1)
            dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=comm_timeout_s))
        return [fn(rank, world, *args)]
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(r, ranks, port, backend, comm_timeout_s, fn, args, results), daemon=True)
        for r in range(ranks)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    failures: dict[int, str] = {}
    gone_since: dict[int, float] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) + len(failures) < ranks:
            now = time.monotonic()
            if failures:  # the others may be blocked on the failed rank: give them a moment, then stop
                deadline = min(deadline, now + failure_grace_s)
            if now >= deadline:
                if failures:
                    break
                missing = sorted(set(range(ranks)) - set(out))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout_s:g}s")
            try:
                rank, ok, value = results.get(timeout=min(deadline - now, 0.5))
                (out if ok else failures)[rank] = pickle.loads(value) if ok else value
            except queue.Empty:
                for r, p in enumerate(procs):  # a rank that exited without a result (killed, os._exit, crash)
                    if r not in out and r not in failures and p.exitcode is not None:
                        if now - gone_since.setdefault(r, now) > 3.0:
                            failures[r] = f"rank {r} exited with code {p.exitcode} without a result"
    finally:
        for p in procs:
            p.join(timeout=0.5 if failures else 5.0)  # ranks done by now exit at once
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if failures:
        rank = min(failures)
        raise RankError(f"rank {rank} of {ranks} failed:\n{failures[rank]}", out)
    return [out[r] for r in range(ranks)]
