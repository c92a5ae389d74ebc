"""The AFD workload: attention ranks step the reference model with remote FFNs, FFN ranks serve them.

Behind `examples/afd_dbo.py`, `benchmarks/afd.py` and the AFD tests. Each attention rank has its own batch; every
step is run without DBO (one microbatch) and split into each of ``microbatches`` (2 by default; 3 or 4 ping-pong),
timed, and compared with the colocated model's plain `forward()`. ``link``: an emulated link between the two sides
(`tbo.afd.link`), so that a round trip shows on one machine.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal


from tbo.models import ModelConfig, ReferenceModel
from tbo.split import ForwardMode
from tbo.comm.emulated import parse_link_spec
from tbo.tools.afd_pipeline import AFDCosts
from tbo.tools.simulate import Cost
from tbo.tools.trace import Tracer
from tbo.harness.workload import make_batch
from tbo.afd.attention import AFDAttentionModel
from tbo.afd.config import AFDConfig
from tbo.afd.connector import AFDMeta, AFDTopology, TorchDistributedAFDConnector
from tbo.afd.group import AFDGroup
from tbo.afd.server import AFDFFNServer

__all__ = ["AFDCase", "AFDResult", "measured_costs", "run_afd"]


@dataclass(frozen=True)
class AFDCase:
    mode: Literal["decode", "prefill"] = "decode"
    num_seqs: int = 8
    ctx: int = 16
    num_attention_ranks: int = 1
    num_ffn_ranks: int = 1
    num_layers: int = 4
    hidden_size: int = 64
    ffn_multiple: int = 1  #: expert width as a multiple of the hidden size (balances the FFN side's work)
    repeats: int = 3
    batch_invariant: bool = True
    timeout_s: float = 30.0
    ffn_dies_after: int | None = None  #: an FFN rank exits (os._exit) after serving this many requests
    microbatches: tuple[int, ...] = (2,)  #: the split counts measured (the first is ``dbo_ms``)
    link: str | None = None  #: ``"LATENCY_US,GBPS"`` between attention and FFN ranks, each direction
    #: "gloo": the launch's process group (any M:N); "tcp": an `AFDGroup` pair, the authenticated socket that
    #: ``tbo afd-ffn`` serves and vLLM's AFD joins (1:1), its FFN side posting each request's header ahead
    transport: Literal["gloo", "tcp"] = "gloo"
    #: "tcp" only: None, no secret (no MAC); "full" / "headers": a secret on both sides, and what each frame's MAC
    #: covers after the join (`tbo.afd.channel`)
    integrity: Literal["full", "headers"] | None = None


@dataclass
class AFDResult:
    rank: int
    role: str
    tokens: int = 0
    split: bool = False
    max_diff: float = 0.0
    no_dbo_ms: list[float] = field(default_factory=list)
    dbo_ms: list[float] = field(default_factory=list)  #: at the first of the case's microbatch counts
    split_ms: dict[int, list[float]] = field(default_factory=dict)  #: step times by microbatch count
    received: list[AFDMeta] = field(default_factory=list)
    ffn_busy_ms: dict[int, float] = field(default_factory=dict)  #: FFN rank: compute per step, by number of microbatches
    #: per mode ("no_dbo", "dbo"), from one traced step: attention-side compute, and time spent waiting for FFN
    #: results (``afd_recv``: FFN compute plus transfers, less whatever the other microbatch hid)
    attention_ms: dict[str, float] = field(default_factory=dict)
    wait_ms: dict[str, float] = field(default_factory=dict)
    link_messages: int = 0  #: messages this rank sent over the emulated link (0 without one)
    #: attention rank: its compute per step (the traced step, waits left out), by number of microbatches (1: unsplit)
    stage_ms: dict[int, float] = field(default_factory=dict)
    transport: str = ""  #: what carried the messages: "gloo" (a process group) or "tcp" (an `AFDGroup`'s socket)

    @property
    def speedup(self) -> float:
        return statistics.median(self.no_dbo_ms) / statistics.median(self.dbo_ms)

    def speedup_at(self, num_microbatches: int) -> float:
        """No overlap's median step time over this count's."""
        return statistics.median(self.no_dbo_ms) / statistics.median(self.split_ms[num_microbatches])


def model_config(case: AFDCase) -> ModelConfig:
    return ModelConfig.scaled("deepseek", case.hidden_size, case.num_layers, ffn_multiple=case.ffn_multiple,
                              batch_invariant=case.batch_invariant)


def run_afd(rank: int, world: int, case: AFDCase) -> AFDResult:
    topology = AFDTopology(case.num_attention_ranks, case.num_ffn_ranks)
    config = AFDConfig(role="attention" if topology.is_attention(rank) else "ffn",
                       num_attention_ranks=case.num_attention_ranks, num_ffn_ranks=case.num_ffn_ranks,
                       num_microbatches=case.microbatches[0], link=case.link)
    model = ReferenceModel(model_config(case))
    connector = _connector(rank, case, topology, config)
    if config.role == "ffn":
        server = AFDFFNServer(model, connector)
        if case.ffn_dies_after is not None:
            _die_after(server, case.ffn_dies_after)
        server.serve()
        steps = Counter(m.num_microbatches for m in server.received if (m.layer_idx, m.microbatch_idx) == (0, 0))
        return AFDResult(rank, "ffn", received=list(server.received),
                         ffn_busy_ms={n: s * 1e3 / steps[n] for n, s in server.busy_s.items()},
                         link_messages=_link_messages(connector), transport=_transport(connector))
    return _attention(rank, case, config, model, connector)


def _connector(rank: int, case: AFDCase, topology: AFDTopology, config: AFDConfig) -> TorchDistributedAFDConnector:
    """The rank's connector over ``case.transport``. Over "tcp" the FFN rank listens on a free loopback port, which
    it hands to the attention rank over the launch's process group; the attention rank joins as an engine does,
    asking for the case's link and checking that the server serves its counts. The FFN rank takes requests of at
    most the case's largest step (``max_request_bytes``, as ``tbo afd-ffn`` does), so that each request's header
    receive is posted before it arrives."""
    if case.transport == "gloo":
        return TorchDistributedAFDConnector(topology, case.timeout_s, link=config.link)
    if case.transport != "tcp":
        raise ValueError(f"AFDCase.transport={case.transport!r}: accepted 'gloo' or 'tcp'")
    if (case.num_attention_ranks, case.num_ffn_ranks) != (1, 1):
        raise ValueError(f"AFDCase.transport='tcp' pairs one attention rank with one FFN rank, got "
                         f"{case.num_attention_ranks}:{case.num_ffn_ranks} (use 'gloo')")
    import torch.distributed as dist

    port = [0]
    if topology.is_attention(rank):
        dist.broadcast_object_list(port, src=topology.ffn_peer(rank))
        group = AFDGroup.connect(f"127.0.0.1:{port[0]}", connect_timeout_s=case.timeout_s, timeout_s=case.timeout_s,
                                 num_microbatches=case.microbatches, link=config.link, **_secret(case))
        return TorchDistributedAFDConnector(topology, case.timeout_s, group=group, link=config.link)
    tokens = case.num_seqs * (2 * case.ctx if case.mode == "prefill" else 1)  # make_batch: prompts <= 1.5 x ctx
    max_bytes = tokens * case.hidden_size * model_config(case).torch_dtype.itemsize

    def listening(host: str, bound: int) -> None:
        dist.broadcast_object_list([bound], src=rank)

    group = AFDGroup.listen("127.0.0.1:0", {}, timeout_s=case.timeout_s, on_listening=listening,
                            max_message_bytes=max_bytes + 128, microbatches=case.microbatches, **_secret(case))
    return TorchDistributedAFDConnector(topology, case.timeout_s, group=group, link=group.peer_link,
                                        max_request_bytes=max_bytes)


def _secret(case: AFDCase) -> dict[str, Any]:
    """The pair's secret and integrity (a fixed secret: the two ranks are one run's, on loopback)."""
    if case.integrity is None:
        return {}
    return {"token": "tbo-afd-harness", "integrity": case.integrity}


def _die_after(server: AFDFFNServer, n: int) -> None:
    send = server.connector.send_ffn_output

    def send_then_maybe_die(out, meta):  # type: ignore[no-untyped-def]
        if server.served >= n:
            os._exit(1)  # the FFN process dies mid-step, without a word
        return send(out, meta)

    server.connector.send_ffn_output = send_then_maybe_die  # type: ignore[method-assign]


def _attention(rank: int, case: AFDCase, config: AFDConfig, model: ReferenceModel,
               connector: TorchDistributedAFDConnector) -> AFDResult:
    afd = AFDAttentionModel(model, connector)
    batch = make_batch(model, case.mode, case.num_seqs, case.ctx, seed=rank)
    mode = ForwardMode.EXTEND if case.mode == "prefill" else ForwardMode.DECODE
    lens = list(batch.meta.extend_lens) if case.mode == "prefill" else None
    thresholds = {"decode_token_threshold", "prefill_token_threshold"}  # each count's own defaults
    plans = {n: AFDConfig(**{**config.model_dump(exclude=thresholds), "num_microbatches": n}).split_policy().plan(
        mode, batch.num_tokens, lens) for n in case.microbatches}
    plan = plans[case.microbatches[0]]
    reference = model.forward(batch.ids, batch.meta, batch.cache.clone())
    result = AFDResult(rank, "attention", batch.num_tokens, plan is not None)
    try:
        for n, split in [*plans.items(), (1, None)]:  # each count, then unsplit: each equal to the colocated model
            got = afd.forward(batch.ids, batch.meta, batch.cache.clone(), split)
            result.max_diff = max(result.max_diff, float((got - reference).abs().max()))
            result.split_ms[n] = []
        del result.split_ms[1]
        result.dbo_ms = result.split_ms[case.microbatches[0]]
        for _ in range(case.repeats):
            for times, step_plan in [(result.no_dbo_ms, None)] + [(result.split_ms[n], plans[n]) for n in plans]:
                t0 = time.perf_counter()
                afd.forward(batch.ids, batch.meta, batch.cache.clone(), step_plan)
                times.append((time.perf_counter() - t0) * 1e3)
        # one more traced step each: where time goes ("no_dbo", "dbo": the first count; every count by number)
        for name, step_plan in [("no_dbo", None), *((n, plans[n]) for n in plans)]:
            tracer = Tracer()
            afd.forward(batch.ids, batch.meta, batch.cache.clone(), step_plan, observer=tracer)
            spans = tracer.finish().lane("compute")
            wait_ms = sum(s.duration for s in spans if s.name == "afd_recv") * 1e3
            compute_ms = sum(s.duration for s in spans) * 1e3 - wait_ms
            key = "no_dbo" if name == "no_dbo" else "dbo" if name == case.microbatches[0] else None
            if key is not None:
                result.wait_ms[key], result.attention_ms[key] = wait_ms, compute_ms
            result.stage_ms[1 if name == "no_dbo" else int(name)] = compute_ms
    finally:
        if case.ffn_dies_after is None:
            connector.shutdown()
    result.link_messages = _link_messages(connector)
    result.transport = _transport(connector)
    return result


def _transport(connector: TorchDistributedAFDConnector) -> str:
    return connector.group.backend if isinstance(connector.group, AFDGroup) else "gloo"


def _link_messages(connector: TorchDistributedAFDConnector) -> int:
    return 0 if connector.link is None else connector.link.stats.count


def measured_costs(case: AFDCase, attention: AFDResult, ffn: AFDResult) -> AFDCosts:
    """The pipeline model's costs (`tbo.tools.afd_pipeline.AFDCosts`) from one run of ``case``: each side's compute
    per layer at each measured microbatch size (the attention rank's traced steps, the FFN rank's busy time, each
    divided over its microbatches and layers, as a table by tokens) and ``case.link``. What the benchmark feeds
    `choose_count`, so that the model's choice of count is checked against the counts it just measured."""
    sizes = {1: attention.tokens, **{n: attention.tokens / n for n in case.microbatches}}

    def per_layer(ms: dict[int, float]) -> Cost:
        points = sorted((sizes[n], ms[n] / 1e3 / (n * case.num_layers)) for n in sizes if n in ms)
        return Cost(kind="table", points=points)

    latency_s, bandwidth = (0.0, 1e12) if case.link is None else parse_link_spec(case.link)
    return AFDCosts(attention=per_layer(attention.stage_ms), ffn=per_layer(ffn.ffn_busy_ms),
                    num_layers=case.num_layers, bytes_per_token=case.hidden_size * 4.0, latency_s=latency_s,
                    bandwidth=bandwidth)
