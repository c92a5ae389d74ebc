"""The attention side of AFD inside vLLM: each decoder layer keeps its attention and sends its FFN's input away.

`AFDAttentionSide` is what `TboEngine` installs when ``additional_config["tbo"]["afd"]`` is set. At engine start
it reaches the FFN server (a named `AFDPeerError` if nothing answers, or if it serves another model), joins the
pair's own process group (vLLM keeps the default one), and takes the FFN modules out of the loaded model: each
decoder layer's feed-forward module (``mlp``, ``block_sparse_moe``, ...) becomes a `RemoteFFN` that holds no
weights and refuses to run. The layers then run as `VllmAFDLayer` ops in the ``afd_attention_dbo`` strategy:
attention as the plugin runs it, then ``afd_send`` (the post-attention normed hidden states, with layer, stage
index and stage count in the header), Yield, ``afd_recv``.

The router stays with the experts, on the FFN side: it is part of vLLM's MoE module (one ``mlp(x)`` call is
vLLM colocated's math, grouped and bias-corrected routing included), and the wire then carries one tensor per
stage instead of the hidden states plus top-k ids and weights.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from tbo.afd.attention import AFDAttentionLayer
from tbo.afd.connector import AFDMeta, AFDTopology, TorchDistributedAFDConnector
from tbo.afd.group import AFDGroup, AFDPeerError, resolve_token
from tbo.core.dataflow import declares
from tbo.core.errors import CommTimeoutError
from tbo.integrations.vllm.afd.config import AFDVllmConfig
from tbo.integrations.vllm.model.layers import VllmDecoderLayer
from tbo.integrations.engine.stats import StepStats

__all__ = ["AFDAttentionSide", "AFDLink", "RemoteFFN", "VllmAFDLayer"]

logger = logging.getLogger("vllm.tbo")


class RemoteFFN(torch.nn.Module):
    """Where a decoder layer's ``mlp`` was: no weights; computing the FFN here is a bug, and says so."""

    def __init__(self, layer_idx: int, address: str) -> None:
        super().__init__()
        self.layer_idx, self.address = layer_idx, address

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError(f"layer {self.layer_idx}'s FFN runs on the tbo AFD FFN server at {self.address}; "
                           "the attention side has no FFN weights")

    def extra_repr(self) -> str:
        return f"layer {self.layer_idx} -> {self.address}"


class AFDLink:
    """The connector as the layers use it: counts the stages sent, and names the FFN server in every failure."""

    def __init__(self, connector: TorchDistributedAFDConnector, address: str, counters: list[StepStats]) -> None:
        self.connector, self.address, self.counters = connector, address, counters

    def _failed(self, what: str, meta: AFDMeta, e: Exception) -> AFDPeerError:
        return AFDPeerError(f"tbo AFD: the FFN server at {self.address} failed to {what} for {meta.describe()} "
                            f"(is `tbo afd-ffn` still running?): {e}")

    def send_attn_output(self, hidden: torch.Tensor, meta: AFDMeta) -> Any:
        try:
            sent = self.connector.send_attn_output(hidden, meta)
        except (CommTimeoutError, RuntimeError) as e:
            raise self._failed("take the hidden states", meta, e) from e
        for s in self.counters:
            s.afd_stages_sent += 1
        return sent

    def recv_ffn_output(self, meta: AFDMeta) -> torch.Tensor:
        try:
            return self.connector.recv_ffn_output(meta)
        except (CommTimeoutError, RuntimeError) as e:
            # the step fails: its other answers still posted are waited out (shortly) and dropped, and one that
            # comes later is refused by its step number, never taken for the next step's
            self.connector.drain(budget_s=0.2 * self.connector.timeout_s)
            raise self._failed("answer", meta, e) from e


class VllmAFDLayer(VllmDecoderLayer):
    """A vLLM decoder layer whose FFN is remote: the plugin's attention ops, then `tbo.afd`'s send and receive."""

    kind = "afd"
    _meta = AFDAttentionLayer._meta
    op_afd_send = AFDAttentionLayer.op_afd_send
    op_afd_recv = AFDAttentionLayer.op_afd_recv

    def __init__(self, layer: Any, link: AFDLink, layer_idx: int, llama_4_scaling: Any = None) -> None:
        super().__init__(layer, None, layer_idx, 1, llama_4_scaling=llama_4_scaling)
        self.kind = "afd"
        self.connector = link

    @declares(takes="ffn_out", writes="layer_out")
    def op_output(self, state: Any) -> None:
        state.layer_out = state.pop("ffn_out")  # vLLM hands the residual on unadded: the next norm adds it


def _check_info(info: dict[str, Any], vllm_config: Any, address: str) -> None:
    """The FFN server must serve this engine's model: same architecture, layers, hidden size and dtype."""
    model = vllm_config.model_config
    hf = model.hf_text_config
    want = {"architecture": (model.hf_config.architectures or [None])[0], "num_layers": hf.num_hidden_layers,
            "hidden_size": hf.hidden_size, "dtype": str(model.dtype).removeprefix("torch.")}
    if info.get("tbo_afd") != 1:
        raise AFDPeerError(f"{address} is not a tbo AFD FFN server of this version (it says {info.get('tbo_afd')!r})")
    wrong = [f"{k}: server {info.get(k)!r}, engine {v!r}" for k, v in want.items() if info.get(k) != v]
    if wrong:
        raise AFDPeerError(f"the FFN server at {address} serves another model ({'; '.join(wrong)}): start it with "
                           f"this engine's --model and --dtype")
    max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
    if not isinstance(info.get("max_tokens"), int) or info["max_tokens"] < max_tokens:
        raise AFDPeerError(f"the FFN server at {address} takes at most {info.get('max_tokens')} tokens per request, "
                           f"the engine's max_num_batched_tokens is {max_tokens}: raise its --max-tokens")


class AFDAttentionSide:
    """AFD on one vLLM model runner: the link to the FFN server, the layers, and the FFN modules taken out."""

    def __init__(self, runner: Any, config: AFDVllmConfig, counters: list[StepStats], *,
                 llama_4_scaling: Any = None, num_microbatches: int | list[int] = 2, link: str | None = None) -> None:
        """``num_microbatches``: the count(s) this engine's split steps may have (the server must serve each: refused
        at the join, naming both, if it does not); ``link``: ``"LATENCY_US,GBPS"``, an emulated link between the
        engine and the server, each direction (the server learns it at the join)."""
        from vllm.platforms import current_platform

        vllm_config = runner.vllm_config
        self.address = config.ffn
        try:
            token = resolve_token(config.token, "additional_config tbo.afd.token")
        except ValueError as e:
            raise AFDPeerError(f"tbo AFD: {e}") from None
        # an answer is as long as its request, at most a step's tokens: its receives are posted with that room
        largest = (vllm_config.scheduler_config.max_num_batched_tokens * vllm_config.model_config.hf_text_config.
                   hidden_size * vllm_config.model_config.dtype.itemsize)
        self.group = AFDGroup.connect(config.ffn, backend=config.backend_for(current_platform.device_type),
                                      connect_timeout_s=config.connect_timeout_s, timeout_s=config.timeout_s,
                                      check_info=lambda info: _check_info(info, vllm_config, config.ffn),
                                      token=token, max_message_bytes=largest + 128,
                                      num_microbatches=num_microbatches, link=link, integrity=config.integrity)
        connector = TorchDistributedAFDConnector(AFDTopology(1, 1), config.timeout_s, group=self.group,
                                                 device=runner.device if runner.device.type != "cpu" else None,
                                                 max_answer_bytes=largest, link=link,
                                                 refuse_nonfinite=config.refuse_nonfinite)
        self.link = AFDLink(connector, config.ffn, counters)
        model = runner.model.model
        self.freed_bytes = _take_out_ffns(runner.model, model, vllm_config, config.ffn)
        self.layers = [VllmAFDLayer(layer, self.link, i, llama_4_scaling) for i, layer in enumerate(model.layers)]
        logger.info("tbo AFD: %d layers' FFNs on the server at %s (%.1f MiB of FFN weights freed here)%s",
                    len(self.layers), config.ffn, self.freed_bytes / 2**20,
                    f", over an emulated link of {connector.link.describe()}" if connector.link else "")

    def close(self) -> None:
        """Tell the FFN server this engine is done (it exits 0), and leave the group."""
        try:
            self.link.connector.shutdown()
        except (CommTimeoutError, RuntimeError) as e:  # the server is already gone: nothing to tell
            logger.warning("tbo AFD: could not tell the FFN server at %s that the engine shuts down: %s",
                           self.address, e)
        self.group.close()


def _take_out_ffns(outer: Any, model: Any, vllm_config: Any, address: str) -> int:
    """Replace every decoder layer's ``mlp`` by a `RemoteFFN` and drop every reference vLLM kept to it (its
    forward-context registry, the model's MoE layer lists), so that its weights are freed; returns their bytes."""
    from tbo.integrations.vllm.model.structure import attention_and_ffn

    names = [attention_and_ffn(layer, i)[1] for i, layer in enumerate(model.layers)]  # mlp, block_sparse_moe, ...
    gone: set[int] = set()
    freed = 0
    for i, (layer, name) in enumerate(zip(model.layers, names)):
        mlp = getattr(layer, name)
        gone.update(id(m) for m in mlp.modules())
        freed += sum(p.numel() * p.element_size() for p in mlp.parameters())
        setattr(layer, name, RemoteFFN(i, address))
    registry = vllm_config.compilation_config.static_forward_context
    for name in [name for name, module in registry.items() if id(module) in gone]:
        del registry[name]
    for name, value in list(vars(outer).items()):
        if isinstance(value, list) and any(id(v) in gone for v in value):
            setattr(outer, name, [v for v in value if id(v) not in gone])
    return freed
