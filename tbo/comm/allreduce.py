"""`TPAllReduce`: the tensor-parallel all-reduce as a transfer, so that one microbatch's reduction overlaps the
other microbatch's compute.

Under tensor parallelism every row-parallel projection (attention's ``o_proj``, the MLP's ``down_proj``, an MoE
layer's routed and shared outputs) ends in an all-reduce of a partial sum, and the GPU waits for it: on 4 GPUs over
PCIe that wait is a large share of a decode step. Treating it like dispatch and combine, ``reduce_a`` launches the
all-reduce asynchronously and returns an `AllReduceState` (kept in the microbatch's `State`, as `DispatchState`
is), and ``reduce_b`` waits for it, so a strategy can put the other microbatch's attention or MLP between them.

Behaviour, per place it runs:

* **One rank** (no group, or a group of one): the identity. ``reduce_a`` returns a completed state whose
  ``reduce_b`` hands the tensor back; nothing is launched, so a TP = 1 model runs the same op lists.
* **gloo (CPU)**: ``all_reduce(async_op=True)`` runs on gloo's own thread; ``reduce_b`` waits with this reducer's
  deadline (`tbo.comm.wait.wait_work`). A missed deadline or a peer that died is a `CommTimeoutError` naming this
  rank and the op, within the deadline, never a hang; and as the EP transports do, the reducer is then *poisoned*:
  the timed-out operation is still live inside the process group, so every later ``reduce_a`` is refused by name
  until the group and the reducer are rebuilt on every rank.
* **CUDA (NCCL)**: the launch is ordered by events, not by host waits. (CUDA tensors over a gloo group, which
  copies them through the host, take the gloo path above.) ``reduce_a`` makes the reducer's
  communication stream wait for the compute stream (the partial sum is ready), issues the all-reduce there, joins
  the collective's own stream back into the communication stream (``work.wait()`` with no timeout is a stream wait,
  not a host wait) and records a *done* event; ``record_stream`` keeps the tensor's memory from being reused while
  the communication stream still uses it. ``reduce_b`` makes the compute stream wait for *done*. No host
  synchronisation happens anywhere, so the pair is safe under CUDA-graph capture (the events become the captured
  graph's fork and join, as in `tbo.comm.copy_engine`) and the CPU keeps launching the other microbatch's kernels.
  The GPU deadline is therefore the process group's own (NCCL's watchdog, set by ``init_process_group(timeout=)``):
  a host-side deadline would need a host wait, which would stall the launch pipeline and break capture. `drain`
  (after a failed step, outside capture) waits on the host with this reducer's deadline.

The reduction is in place: ``reduce_a`` may sum into ``x`` (a row-parallel output's partial sum, owned by the
caller and not read again), and ``reduce_b`` returns the reduced tensor. A non-contiguous ``x`` is copied first.

`tbo.comm.emulated.EmulatedLink` wraps a reducer like any EP backend: it books ``wire_bytes`` (a ring all-reduce
sends ``2 (n - 1) / n`` times the payload per rank, `ring_allreduce_bytes`) at ``reduce_a`` and sleeps until the
transfer completes in ``reduce_b``, so compute between the two hides it on a CPU too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from tbo.comm.devices import device_key
from tbo.comm.wait import DEFAULT_TIMEOUT_S, wait_work
from tbo.core.errors import CommTimeoutError

__all__ = ["AllReduceState", "TPAllReduce", "ring_allreduce_bytes"]


def ring_allreduce_bytes(nbytes: int, num_ranks: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``nbytes`` over ``num_ranks`` ranks: ``2 (n - 1) / n`` times
    the payload (a reduce-scatter and an all-gather, each ``(n - 1) / n``); zero on one rank."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    return (2 * (num_ranks - 1) * int(nbytes)) // num_ranks


@dataclass(eq=False)
class AllReduceState:
    """An all-reduce in flight: returned by ``reduce_a``, consumed (once) by ``reduce_b``.

    ``pending`` is the torch.distributed work handle (None when nothing was launched: one rank, zero elements, or
    CUDA, where ``info["done"]`` is the event the compute stream joins); ``out`` the tensor that holds the sum once
    waited; ``nbytes`` the payload's bytes and ``wire_bytes`` what one rank sends (`ring_allreduce_bytes`).
    """

    pending: Any
    out: torch.Tensor
    nbytes: int = 0
    wire_bytes: int = 0
    what: str = "all-reduce"
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.what} of {self.nbytes} bytes"


class TPAllReduce:
    """The tensor-parallel all-reduce (sum) over a torch.distributed group, as ``reduce_a``/``reduce_b``.

    ``group``: the tensor-parallel group (None: the default group, or one rank when torch.distributed is not
    initialised). ``timeout_s``: the deadline of every host wait (gloo's ``reduce_b``, and `drain`). ``device``:
    where reductions run, only to make the CUDA communication stream ahead of time (say, before graph capture);
    by default each tensor's own device is used and its stream made on first use.

    Like an `EPBackend` it keeps nothing per microbatch: everything in flight lives in the returned states, so two
    microbatches can each have a reduction in flight. Every rank of the group calls ``reduce_a`` in the same order
    with tensors of the same shape (they are collectives).
    """

    def __init__(self, group: Any = None, *, timeout_s: float = DEFAULT_TIMEOUT_S, device: Any = None) -> None:
        import torch.distributed as dist

        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        distributed = dist.is_available() and dist.is_initialized()
        if group is not None and not distributed:
            raise RuntimeError("TPAllReduce was given a group, but torch.distributed is not initialised")
        self.group = group
        self.rank = dist.get_rank(group) if distributed else 0
        self.num_ranks = dist.get_world_size(group) if distributed else 1
        #: the group's backend ("nccl", "gloo", ...; None on one process): CUDA tensors take the stream-joined path
        #: over NCCL (and any backend but gloo); gloo copies CUDA tensors through the host, and is waited on the host
        self.backend = str(dist.get_backend(group)) if distributed else None
        self.timeout_s = float(timeout_s)
        self.poisoned: str | None = None  #: why every later reduction is refused (a wait that timed out)
        #: reductions this reducer launched (``reduce_a`` calls that reached the group; identity ones not counted)
        self.launched = 0
        self._in_flight: dict[int, AllReduceState] = {}
        self._streams: dict[torch.device, Any] = {}
        if device is not None and device_key(device).type == "cuda":
            self._stream(device_key(device))

    def __repr__(self) -> str:
        return f"TPAllReduce(rank={self.rank}, num_ranks={self.num_ranks}, timeout_s={self.timeout_s:g})"

    @property
    def label(self) -> str:
        return f"rank {self.rank} of {self.num_ranks} (tensor parallel)"

    # ---- the transfer -------------------------------------------------------------------------------------------
    def reduce_a(self, x: torch.Tensor, what: str = "all-reduce") -> AllReduceState:
        """Launch the sum of ``x`` over the group and return at once with the in-flight state (keep it in the
        microbatch's `State`; pass it to `reduce_b`). ``x`` may be summed in place. ``what`` names the reduction
        in errors (e.g. ``"attn_reduce"``)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{what}: reduce_a takes a tensor, got {type(x).__name__}")
        if self.poisoned is not None:
            raise CommTimeoutError(f"{self.label}: {what} refused: an earlier wait timed out ({self.poisoned}), and "
                                   "its operation is still live in the process group; rebuild the group and the "
                                   "TPAllReduce on every rank before the next step")
        wire = ring_allreduce_bytes(x.nbytes, self.num_ranks)
        if self.num_ranks == 1 or x.numel() == 0:  # nothing to sum with; every rank has the same shape (TP)
            return AllReduceState(None, x, x.nbytes, wire, what, done=True)
        if not x.is_contiguous():
            x = x.contiguous()
        self.launched += 1
        if x.device.type == "cuda" and self.backend != "gloo":
            state = self._launch_cuda(x, wire, what)
        else:
            import torch.distributed as dist

            work = dist.all_reduce(x, group=self.group, async_op=True)
            state = AllReduceState(work, x, x.nbytes, wire, what)
        self._in_flight[id(state)] = state
        return state

    def reduce_b(self, state: AllReduceState) -> torch.Tensor:
        """Wait for the all-reduce ``state`` stands for and return the sum (on CUDA: the compute stream waits for
        it, the host does not). A dead peer or a missed deadline is a `CommTimeoutError` naming this rank."""
        if not isinstance(state, AllReduceState):
            raise TypeError(f"reduce_b takes the AllReduceState reduce_a returned, got {type(state).__name__}")
        if state.done:
            if state.info.get("waited"):
                raise RuntimeError(f"{state} was already waited: each reduce_a state is waited once")
            state.info["waited"] = True
            return state.out
        try:
            if "done_event" in state.info:  # CUDA: a stream join, no host wait
                torch.cuda.current_stream(state.out.device).wait_event(state.info["done_event"])
            else:
                self._wait(state.pending, self.timeout_s, f"{state.what} (reduce_b)")
        finally:
            self._in_flight.pop(id(state), None)
        state.done = True
        state.info["waited"] = True
        return state.out

    # ---- the executor's contract (`tbo.core.executors.guard.Drainable`) -------------------------------------------
    @property
    def in_flight(self) -> list[AllReduceState]:
        """Reductions launched and not yet waited (for the watchdog's report)."""
        return list(self._in_flight.values())

    def drain(self) -> int:
        """Wait out every reduction still in flight (after a failed op), all within one deadline (0.2 x the
        deadline once a wait has timed out), and return how many there were."""
        pending = self.in_flight
        budget = 0.2 * self.timeout_s if self.poisoned is not None else self.timeout_s
        deadline = time.monotonic() + budget
        for state in pending:
            try:
                if "done_event" in state.info:
                    self._drain_cuda(state, deadline)
                else:
                    self._wait(state.pending, max(deadline - time.monotonic(), 1e-3), f"{state.what} (drain)")
            except Exception:  # the step already failed; a second error would hide the first
                pass
            self._in_flight.pop(id(state), None)
            state.done = True
        return len(pending)

    # ---- internals ----------------------------------------------------------------------------------------------
    def _wait(self, work: Any, timeout_s: float, what: str) -> None:
        try:
            wait_work(work, timeout_s, what, self.label)
        except CommTimeoutError as exc:
            self.poisoned = self.poisoned or str(exc)
            raise

    def _stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def _launch_cuda(self, x: torch.Tensor, wire: int, what: str) -> AllReduceState:
        """Fork to the communication stream, all-reduce there, join the collective back, record *done* (see the
        module docstring): no host wait, so capture-safe."""
        import torch.distributed as dist

        compute = torch.cuda.current_stream(x.device)
        comm = self._stream(device_key(x.device))
        ready = torch.cuda.Event()
        ready.record(compute)
        comm.wait_event(ready)  # the partial sum is written
        with torch.cuda.stream(comm):
            work = dist.all_reduce(x, group=self.group, async_op=True)
            work.wait()  # no timeout: the communication stream waits for the collective's stream (not the host)
            done = torch.cuda.Event()
            done.record(comm)
        x.record_stream(comm)  # allocated on the compute stream, used on comm: not reused before comm is past it
        return AllReduceState(None, x, x.nbytes, wire, what, info={"done_event": done})

    def _drain_cuda(self, state: AllReduceState, deadline: float) -> None:
        from tbo.comm import devices

        event = state.info["done_event"]
        if devices.capturing(state.out.device):  # a host wait would invalidate the capture: join on the stream
            torch.cuda.current_stream(state.out.device).wait_event(event)
            return
        while not event.query():  # a host wait, polled so that it too ends by the deadline
            if time.monotonic() > deadline:
                raise CommTimeoutError(f"{self.label}: {state.what} (drain) did not complete by its deadline")
            time.sleep(1e-4)
