"""`GraphRunner`: a decode step captured as CUDA graphs, one per batch-size bucket, single batch and TBO.

Eager TBO launches every op twice, and on a GPU the CPU then cannot keep up: a step that should gain from overlap
loses. Captured, a step is one launch. The runner captures ``step_fn`` once per bucket and per mode, each with the
bucket's fixed split plan (decode splits by request count, so a bucket decides its plan), warming up on a side
stream and sharing one memory pool. ``run(batch)`` pads the batch to the nearest bucket, copies it into that
bucket's static buffers, replays, and returns the outputs sliced to the real batch; above the largest bucket it runs
eager (unpadded: a capture-safe backend sizes that step for its own tokens, see `tbo.comm.alltoall`), and
``capture=False`` runs eager always. Every capture, the first of a bucket or a lazy one in the other mode, starts from
static buffers refilled with ``pad_values``, so warm-up and capture touch only what padding rows may touch.

Bucket choice, padding, plans and the fallback are plain Python. Capturing is a `Capturer`: `CudaGraphCapturer`
(``torch.cuda.graph``) by default, or `EagerCapturer`, which records nothing and replays by re-running the step on
the same static buffers, so everything around the graph behaves the same on a CPU. When the step raises during a
capture, that error is what the caller sees (not the capture's own failure to end that follows it).

What a step must do to be captured: no host sync and no data-dependent shape (LocalBackend MASKED with a fixed
capacity, a static KV cache; see `tbo.comm.alltoall`), every per-step value in an input tensor, and padding rows
that are harmless (``pad_values``: e.g. a scratch cache slot for padded requests).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch

from tbo.split.index import ForwardMode
from tbo.split.plan import SplitPlan, SplitPolicy

__all__ = ["GraphRunner", "Capturer", "CudaGraphCapturer", "EagerCapturer", "StepFn", "RunInfo"]

#: ``step_fn(inputs, plan)``: one step on ``inputs`` (every tensor's leading dim is the batch), overlapped over
#: ``plan``'s microbatches or as one batch when it is None; returns a tensor or a dict of tensors, batch first.
StepFn = Callable[[Mapping[str, torch.Tensor], SplitPlan | None], Any]


class Capturer(Protocol):
    """Turns a step on static buffers into something replayable."""

    def capture(self, fn: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
        """Warm ``fn`` up and capture it; return ``(replay, outputs)``: after ``replay()`` the outputs hold the
        results of running ``fn`` on the static buffers' current contents."""
        ...


class CudaGraphCapturer:
    """``torch.cuda.graph`` capture: ``warmup`` eager runs on a side stream first (lazy init, allocator warm-up,
    cuBLAS workspaces), then capture; every graph in one memory pool (``pool``, or a new one)."""

    def __init__(self, warmup: int = 2, pool: Any = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaGraphCapturer needs a CUDA device (use capture=False or EagerCapturer on a CPU)")
        self.warmup = warmup
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.graphs: list[Any] = []
        self._stream: Any = None

    def capture(self, fn: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        side = self._stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        failed: list[BaseException] = []
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                try:
                    out = fn()
                except BaseException as exc:
                    failed.append(exc)
                    raise
        except BaseException as exc:
            if failed and exc is not failed[0]:  # ending the broken capture failed too: the step's error comes first
                _note(failed[0], f"ending the CUDA graph capture then failed too: {type(exc).__name__}: {exc}")
                raise failed[0] from None
            raise
        self.graphs.append(graph)
        return graph.replay, out


def _note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(note)


class EagerCapturer:
    """Captures nothing: ``replay`` re-runs the step on the same static buffers and copies its results into the
    outputs returned at capture. The static buffers, padding, plans and slicing work exactly as with CUDA graphs
    (on a CPU, or to tell a capture bug from a model bug)."""

    def __init__(self, warmup: int = 1) -> None:
        self.warmup = warmup
        self.captures = 0

    def capture(self, fn: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
        for _ in range(self.warmup):
            fn()
        out = fn()
        self.captures += 1

        def replay() -> None:
            _copy_into(out, fn())

        return replay, out


def _copy_into(dst: Any, src: Any) -> None:
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    else:
        for key in dst:
            dst[key].copy_(src[key])


@dataclass(frozen=True)
class RunInfo:
    """How the last `GraphRunner.run` ran: ``"graph"`` (replayed ``bucket``) or ``"eager"`` (and why)."""

    how: str
    batch: int
    bucket: int | None
    tbo: bool
    plan: SplitPlan | None
    reason: str = ""


@dataclass
class _Captured:
    replay: Callable[[], None]
    outputs: Any


class GraphRunner:
    """Replays a captured step per batch-size bucket, single batch (``tbo=False``) and overlapped (``tbo=True``).

    ``batch_sizes``: the buckets. ``policy``: decides each bucket's split plan (a bucket it does not split runs its
    TBO request as the single graph). ``pad_values``: the value padding rows get, per input key (default 0).
    ``capture=False``: always eager, unpadded. ``capturer``: how graphs are made (default `CudaGraphCapturer`).
    ``clone_outputs``: return copies (default); else views of the static outputs, valid until the next replay of
    any graph in the pool.
    """

    def __init__(self, step_fn: StepFn, batch_sizes: Sequence[int], *, policy: SplitPolicy | None = None,
                 capture: bool = True, modes: Sequence[str] = ("single", "tbo"),
                 pad_values: Mapping[str, float | int] | None = None, capturer: Capturer | None = None,
                 clone_outputs: bool = True, forward_mode: ForwardMode = ForwardMode.DECODE) -> None:
        sizes = sorted(set(int(b) for b in batch_sizes))
        if not sizes or sizes[0] < 1:
            raise ValueError(f"batch_sizes must be positive batch sizes, got {list(batch_sizes)}")
        unknown = set(modes) - {"single", "tbo"}
        if unknown or not modes:
            raise ValueError(f"modes must be a non-empty subset of ('single', 'tbo'), got {tuple(modes)}")
        if not forward_mode.is_decode_like:
            raise ValueError(f"GraphRunner buckets decode-like steps (one bucket, one plan); got {forward_mode}")
        self.step_fn = step_fn
        self.batch_sizes = sizes
        self.policy = policy if policy is not None else SplitPolicy()
        self.capture = capture
        self.modes = tuple(modes)
        self.pad_values = dict(pad_values or {})
        self.clone_outputs = clone_outputs
        self.forward_mode = forward_mode
        self._capturer = capturer
        self._static: dict[int, dict[str, torch.Tensor]] = {}
        self._graphs: dict[tuple[int, bool], _Captured] = {}
        self._spec: dict[str, tuple[torch.dtype, tuple[int, ...], torch.device]] | None = None
        self.last: RunInfo | None = None

    # ---- plain Python: buckets and plans ------------------------------------------------------------------------
    def bucket_for(self, batch: int) -> int | None:
        """The smallest bucket holding ``batch`` requests, or None above the largest."""
        i = bisect_left(self.batch_sizes, batch)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    def plan_for(self, batch: int) -> SplitPlan | None:
        """The split plan of a ``batch``-request step (a bucket's is fixed by its size)."""
        return self.policy.plan(self.forward_mode, batch)

    def pad(self, inputs: Mapping[str, torch.Tensor], bucket: int) -> dict[str, torch.Tensor]:
        """``inputs`` padded to ``bucket`` rows with ``pad_values`` (new tensors; what `run` copies in place)."""
        batch = self._check(inputs)
        out = {}
        for key, value in inputs.items():
            padded = value.new_full((bucket, *value.shape[1:]), self.pad_values.get(key, 0))
            padded[:batch] = value
            out[key] = padded
        return out

    def _check(self, inputs: Mapping[str, torch.Tensor]) -> int:
        if not inputs:
            raise ValueError("run: inputs is empty; pass a dict of batch-first tensors")
        sizes = {}
        for key, value in inputs.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                raise TypeError(f"run: input {key!r} must be a tensor with a leading batch dimension, got "
                                f"{type(value).__name__}{'' if not isinstance(value, torch.Tensor) else ' scalar'}")
            sizes[key] = value.shape[0]
        if len(set(sizes.values())) != 1:
            raise ValueError(f"run: inputs disagree on the batch size: {sizes}")
        batch = next(iter(sizes.values()))
        if batch < 1:
            raise ValueError("run: the batch is empty")
        if self._spec is not None:
            if set(inputs) != set(self._spec):
                raise ValueError(f"run: inputs {sorted(inputs)} differ from the captured ones {sorted(self._spec)}")
            for key, value in inputs.items():
                dtype, tail, device = self._spec[key]
                if (value.dtype, tuple(value.shape[1:]), value.device) != (dtype, tail, device):
                    raise ValueError(f"run: input {key!r} is {value.dtype} {tuple(value.shape)} on {value.device}; "
                                     f"the graphs were captured for {dtype} [batch, {', '.join(map(str, tail))}] "
                                     f"on {device}")
        return batch

    # ---- capture and replay -------------------------------------------------------------------------------------
    @property
    def capturer(self) -> Capturer:
        if self._capturer is None:
            self._capturer = CudaGraphCapturer()
        return self._capturer

    def capture_all(self, example: Mapping[str, torch.Tensor]) -> None:
        """Capture every bucket and mode now, largest bucket first (smaller graphs then reuse its pool memory).

        ``example`` gives each input's dtype, trailing shape and device; its values are not used: static buffers
        are filled with ``pad_values`` before each capture, so warm-up and capture touch only what padding rows
        may touch.
        """
        if not self.capture:
            return
        self._check(example)
        for bucket in reversed(self.batch_sizes):
            for tbo in self._tbo_modes():
                self._graph(bucket, tbo, example)

    def _tbo_modes(self) -> list[bool]:
        return [mode == "tbo" for mode in self.modes]

    def _graph(self, bucket: int, tbo: bool, example: Mapping[str, torch.Tensor]) -> _Captured:
        plan = self.plan_for(bucket) if tbo else None
        key = (bucket, plan is not None)
        if key in self._graphs:
            return self._graphs[key]
        if self._spec is None:
            self._spec = {k: (v.dtype, tuple(v.shape[1:]), v.device) for k, v in example.items()}
        static = self._static.get(bucket)
        if static is None:
            static = {k: torch.empty((bucket, *tail), dtype=dtype, device=device)
                      for k, (dtype, tail, device) in self._spec.items()}
            self._static[bucket] = static
        # Every capture starts from padding, also when the bucket's other mode already ran: the buffers are shared,
        # and warm-up and capture run the step for real, so the last request's inputs would write its slots and
        # positions again (live KV entries, by then maybe another sequence's).
        for k, buf in static.items():
            buf.fill_(self.pad_values.get(k, 0))
        replay, outputs = self.capturer.capture(lambda: self.step_fn(static, plan))
        self._graphs[key] = captured = _Captured(replay, outputs)
        return captured

    def run(self, inputs: Mapping[str, torch.Tensor], tbo: bool = True) -> Any:
        """One step: replayed from the bucket's graph when there is one for this size and mode, else eager."""
        batch = self._check(inputs)
        mode = "tbo" if tbo else "single"
        bucket = self.bucket_for(batch)
        reason = ("capture=False" if not self.capture else f"mode {mode!r} not captured" if mode not in self.modes
                  else f"{batch} requests exceed the largest bucket {self.batch_sizes[-1]}" if bucket is None else "")
        if reason:
            plan = self.plan_for(batch) if tbo else None
            self.last = RunInfo("eager", batch, None, tbo, plan, reason)
            return self.step_fn(dict(inputs), plan)
        assert bucket is not None
        captured = self._graph(bucket, tbo, inputs)
        static = self._static[bucket]
        for key, value in inputs.items():
            buf = static[key]
            buf[:batch].copy_(value)
            if batch < bucket:
                buf[batch:].fill_(self.pad_values.get(key, 0))
        captured.replay()
        self.last = RunInfo("graph", batch, bucket, tbo, self.plan_for(bucket) if tbo else None)
        return _slice(captured.outputs, batch, self.clone_outputs)

    def __repr__(self) -> str:
        return (f"GraphRunner(buckets={self.batch_sizes}, modes={self.modes}, capture={self.capture}, "
                f"captured={sorted(self._graphs)})")


def _slice(out: Any, batch: int, clone: bool) -> Any:
    if isinstance(out, torch.Tensor):
        return out[:batch].clone() if clone else out[:batch]
    if isinstance(out, Mapping):
        return {k: (v[:batch].clone() if clone else v[:batch]) for k, v in out.items()}
    raise TypeError(f"step_fn must return a tensor or a dict of tensors, got {type(out).__name__}")
