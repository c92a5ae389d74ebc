"""`SglangEngine`: tbo on one SGLang ModelRunner, built in undoable steps at engine start.

Built when the runner has loaded its model (`tbo.integrations.sglang.plugin` hooks ``ModelRunner.initialize``), in the
process that runs the model: the config read from ``TBO_SGLANG_CONFIG`` and checked, the deployment checked (what
tbo does not run inside SGLang is refused by name), the model admitted by its structure, the layers wrapped as ops,
the expert-parallel backend made (``link``: an emulated interconnect around it), the strategies bound, and the inner
model's ``forward`` replaced, on that instance only, by tbo's `LayerLoop`. Each step that changes something records
its undo (`UndoStack`), so a refusal at any step leaves the runner as found, and `close` takes tbo off again.
"""

from __future__ import annotations

import logging
from typing import Any

from tbo import strategies
from tbo.comm.alltoall import LocalBackend
from tbo.comm.emulated import EmulatedLink
from tbo.comm.types import DispatchFormat
from tbo.core.errors import StrategyError
from tbo.integrations.engine.adaptive import AdaptiveSteps
from tbo.integrations.engine.stats import StatsFile, StepStats, summary_line
from tbo.integrations.engine.undo import UndoStack
from tbo.integrations.sglang.config import TboSglangConfig
from tbo.integrations.sglang.errors import TboSglangError, refuse
from tbo.integrations.sglang.model.layers import SglangDecoderLayer
from tbo.integrations.sglang.model.structure import model_structure
from tbo.integrations.sglang.runner.loop import LayerLoop
from tbo.integrations.sglang.stats import ENGINES

__all__ = ["SglangEngine", "check_deployment"]

logger = logging.getLogger("sglang.tbo")

#: attention backends that take every per-batch value from the ForwardBatch they are handed, so that one backend
#: serves every microbatch; the others plan metadata per batch and would need one backend per microbatch
ATTENTION_BACKENDS = ("torch_native",)


def check_deployment(server_args: Any, parallel: Any) -> None:
    """Refuse, by name, what tbo does not run inside SGLang (yet)."""
    if getattr(server_args, "enable_two_batch_overlap", False):
        refuse("SGLang's --enable-two-batch-overlap", "tbo's split instead of SGLang's (one owner of the layer loop)",
               "two owners of the layer loop")
    for name, value in (("tp_size", parallel.tp_size), ("pp_size", parallel.pp_size),
                        ("moe_ep_size", parallel.moe_ep_size), ("attn_dp_size", getattr(parallel, "attn_dp_size", 1))):
        if value != 1:
            refuse(f"SGLang's {name}={value}", f"{name}=1",
                   "tensor, pipeline, expert and attention data parallelism inside SGLang are not wired to tbo yet "
                   "(docs/sglang.md, 'Not yet')")
    spec = getattr(server_args, "speculative_algorithm", None)
    if spec not in (None, "", "NONE"):
        refuse(f"SGLang's speculative_algorithm={spec!r}", "none", "speculative decoding is not wired to tbo yet")
    backend = getattr(server_args, "attention_backend", None)
    if backend not in ATTENTION_BACKENDS:
        refuse(f"SGLang's attention_backend={backend!r}", ", ".join(map(repr, ATTENTION_BACKENDS)),
               "this backend plans its metadata per batch: each microbatch would need its own backend instance")


class SglangEngine:
    """tbo on one ModelRunner (see the module docstring)."""

    def __init__(self, runner: Any, config: TboSglangConfig) -> None:
        from sglang.srt.runtime_context import get_parallel

        self.config, self.undo = config, UndoStack()
        self.stats, self.loop, self.adaptive = StepStats(), None, None
        #: the lines `close` logged (None: still open); ``stats_file`` carries them from then on
        self.summary: list[str] | None = None
        try:
            parallel = get_parallel()
            check_deployment(runner.server_args, parallel)
            self._build(runner, config, int(parallel.tp_rank))
        except BaseException:
            self.undo.close()
            raise

    def _build(self, runner: Any, config: TboSglangConfig, rank: int) -> None:
        structure = model_structure(runner.model)
        self.architecture = structure.architecture
        backend: Any = LocalBackend(structure.num_experts, DispatchFormat.NORMAL)
        if config.link is not None:
            backend = EmulatedLink.from_spec(backend, config.link)
        self.backend = backend
        last = len(structure.layers) - 1
        self.layers = [SglangDecoderLayer(layer, s, backend, i, structure.inner.norm if i == last else None)
                       for i, (layer, s) in enumerate(zip(structure.layers, structure.structures))]
        for layer in self.layers:
            layer.stats = self.stats
        names = config.strategy_names(shared_experts=False)
        bound = {"decode": self._bind(names.decode), "prefill": self._bind(names.prefill)}
        adaptive = None
        if config.split == "adaptive":  # one rank: only a link has transfers to hide, and its wire time to observe
            adaptive = self.adaptive = AdaptiveSteps(config, names, transfers=isinstance(backend, EmulatedLink))
            if isinstance(backend, EmulatedLink):
                adaptive.wire = lambda: backend.booked_s
        path = None if config.stats_file is None else config.stats_file.replace("{rank}", str(rank))
        self.loop = LayerLoop(structure.inner, self.layers, bound, backend, config.split_policy(), adaptive=adaptive,
                              stats=self.stats, stats_file=None if path is None else StatsFile(path, self._extra),
                              op_times=config.op_times)
        self.undo.push("the engine's stats in the process registry",
                       ENGINES.register(self.stats, None if adaptive is None else adaptive.report))
        self.undo.set_attr(structure.inner, "forward", self.loop)  # nn.Module.__call__ finds the instance's
        logger.info("tbo: %s runs its %d layers through tbo (strategies %s / %s, %d microbatches)",
                    self.architecture, len(self.layers), names.decode, names.prefill, config.num_microbatches)

    def _extra(self) -> dict[str, Any]:
        """What ``stats_file`` holds beside the counters: ``link`` (with ``link`` set: transfers booked on the emulated
        link, its busy seconds, and the seconds of them the overlap left exposed, waited for in a ``*_b`` op; proof
        that the link ran), ``adaptive`` (``split: "adaptive"``: the buckets, as `stats()` reports them) and, once the
        engine closed, ``summary`` (the lines it logged)."""
        out: dict[str, Any] = {}
        if isinstance(self.backend, EmulatedLink):
            s = self.backend.stats
            out["link"] = {"transfers": s.count, "busy_s": s.comm_s, "exposed_s": s.exposed_s}
        if self.adaptive is not None:
            out["adaptive"] = [self.adaptive.report()]
        if self.summary is not None:
            out["summary"] = self.summary
        return out

    def _bind(self, name: str) -> Any:
        try:
            return strategies.bind_layers(self.layers, strategies.get(name), backend=self.backend,
                                          num_microbatches=self.config.num_microbatches)
        except StrategyError as e:
            raise TboSglangError(f"TBO_SGLANG_CONFIG strategy {name!r} cannot run SGLang's {self.architecture} "
                                 f"layers: {e}") from None

    def close(self) -> list[str]:
        """Take tbo off the runner (every undo, last first), log the summary lines, write ``stats_file`` (with them).
        Returns the lines. Called at SGLang's shutdown (`tbo.integrations.sglang.plugin`); a second call only
        returns them. The diagnostics never raise: a shutdown is no place to lose SGLang's own teardown."""
        if self.summary is not None:
            return self.summary
        try:
            self.undo.close()
        finally:
            lines = [summary_line(self.stats)]
            if self.adaptive is not None:
                lines += [f"tbo adaptive: {line}" for line in self.adaptive.split.summary()]
            self.summary = lines
            for line in lines:
                logger.info(line)
            if self.loop is not None:
                self.loop.write_stats()
        return lines
