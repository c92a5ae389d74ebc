"""The draft pass of vLLM's MTP drafter through tbo's layer loop, split by a decision of its own.

With ``speculative_config={"method": "mtp"}`` vLLM's proposer (``v1/spec_decode/llm_base_proposer.py``) runs the MTP
model once per draft token of a step: the first forward over the target step's tokens (each request's 1 + k verified
ones, or a prefill's prompt), each later one over one token per request. An MTP layer (DeepSeek's
``DeepSeekMultiTokenPredictorLayer``) is a decoder layer with an MoE, ``mtp_block``, between its own pre-processing
(``enorm``, ``hnorm``, ``eh_proj`` over the token embedding and the target's hidden state) and post-processing (the
residual add, ``shared_head``). `DraftPass` replaces only the block's ``forward``, on the instance: vLLM's MTP layer
still makes its pre- and post-processing with its own modules and calls the block as before, and the block runs as a
one-layer stack of `VllmDecoderLayer` ops through `model_forward_maybe_tbo`, with the engine's backend and strategy.

Each forward is decided alone (`tbo.integrations.engine.step.decide_draft`: decode-like, cut between requests), from
the requests' token counts of the ``CommonAttentionMetadata`` the proposer builds its attention metadata from just
before that forward. It runs the engine's decode strategy, over the decode backend (DeepEP low-latency, where the
engine has it), unless a request brings more than 1 + k tokens (a prompt, in the first forward after a prefill):
then the prefill strategy and backend, as a target step with a prefill. `DraftPass` keeps the proposer's metadata
by wrapping its ``build_per_group_and_layer_attn_metadata``.

vLLM's V1 runner never microbatches the drafter ("DBO ubatching not implemented for EAGLE" in the proposer's
``_determine_batch_execution_and_padding``): the proposer builds one metadata for the whole pass, with one builder
per attention group, and its forward context holds no lists. So a split pass gets its microbatches' metadata here,
the smallest way vLLM's own code allows: vLLM's ``split_attn_metadata`` (what its runner's DBO uses) cuts the common
metadata by the plan's requests and tokens, and each microbatch's is built by the drafter's own attention groups
(``build_for_drafting``, with that draft index), each microbatch with a builder of its own (`make_builders`: a GPU
builder keeps persistent buffers, and builder 0 keeps the whole pass's metadata vLLM built and still holds).
Each microbatch's forward context is the pass's, with its metadata and its slice of the slot mapping.

A forward without attention metadata (vLLM's dummy runs: profiling, warm-up) runs vLLM's own block, uncounted.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

from tbo.integrations.vllm.errors import TboConfigError
from tbo.integrations.vllm.model.fixes import fix_rotary_embeddings
from tbo.split.kinds import Slot

__all__ = ["DraftPass", "mtp_blocks"]


def mtp_blocks(model: Any) -> list[tuple[int, Any]]:
    """``(layer index, mtp_block)`` of each MTP layer of the drafter's ``model`` (vLLM's ``DeepSeekMTP``: its
    ``model.layers`` maps ``"num_hidden_layers + i"`` to a layer holding the decoder layer ``mtp_block``); a
    `TboConfigError` naming the drafter where it holds none."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    items = list(layers.items()) if hasattr(layers, "items") else []
    if not items or not all(hasattr(layer, "mtp_block") for _, layer in items):
        raise TboConfigError(f"speculative_config method 'mtp': the drafter {type(model).__name__} holds no MTP "
                             "layers with an `mtp_block` decoder layer (vLLM's DeepSeek MTP layout), so tbo cannot run "
                             "its forward; remove additional_config['tbo'] or the speculative_config")
    return [(int(idx), layer.mtp_block) for idx, layer in items]


class DraftPass:
    """tbo on ``runner.drafter`` (an MTP proposer): its blocks' forwards through tbo, each split by its own plan.

    ``bind(layers, slot)`` binds the engine's strategy of ``slot`` to a one-layer stack; ``counters`` are the
    `StepStats` that count ``draft_steps``; ``vllm_unsplit``: a pass that does not split runs vLLM's own block (as
    the engine's unsplit target steps run vLLM's forward); ``after`` runs after each counted forward (the engine's
    ``stats_file`` write); ``fp8_dispatch``: the engine's dispatches carry FP8 rows (`tbo.integrations.vllm.model.quant`).
    """

    def __init__(self, runner: Any, backend: Any, tp_size: int, bind: Callable[[list[Any], Slot], Any], policy: Any,
                 counters: Sequence[Any], *, vllm_unsplit: bool, after: Callable[[], None] | None = None,
                 fp8_dispatch: bool = False) -> None:
        from tbo.integrations.vllm.model.layers import VllmDecoderLayer

        self.runner, self.drafter, self.backend, self.policy = runner, runner.drafter, backend, policy
        self.counters, self.vllm_unsplit, self.after = tuple(counters), vllm_unsplit, after
        #: a forward whose requests bring at most this many tokens each runs the decode strategy (1 + k)
        self.decode_len = 1 + int(runner.vllm_config.speculative_config.num_speculative_tokens or 0)
        self.blocks = []  #: (block, its VllmDecoderLayer, its bound strategy per mode)
        for idx, block in mtp_blocks(self.drafter.model):
            # vLLM's MTP layer calls its block without DeepSeek's llama_4_scaling: neither does tbo's
            layer = VllmDecoderLayer(block, backend, idx, tp_size, llama_4_scaling=None, fp8_dispatch=fp8_dispatch)
            if layer.residual_multiplier is not None:
                raise TboConfigError(f"MTP layer {idx}: its block adds its residual itself; tbo's MTP pass hands "
                                     "vLLM's MTP layer the (hidden_states, residual) pair its blocks return")
            layer.counters = self.counters
            self.blocks.append((block, layer, {slot: bind([layer], slot) for slot in Slot}))
        self.layers = [layer for _, layer, _ in self.blocks]
        #: the drafter's rotary modules, rerouted where vLLM's CPU kernel is shape dependent, as the target's are
        #: (`tbo.integrations.vllm.model.fixes`; vLLM may share them with the target's, and the fix counts references)
        self.rotary_fix = fix_rotary_embeddings(self.drafter.model)
        #: the common attention metadata (and draft index) of the forward about to run, kept from the proposer's
        #: ``build_per_group_and_layer_attn_metadata``
        self._pending: tuple[Any, int] | None = None
        self._install()

    # ---- installing ------------------------------------------------------------------------------------------------
    def _install(self) -> None:
        drafter = self.drafter
        build = drafter.build_per_group_and_layer_attn_metadata

        @functools.wraps(build)
        def build_per_group_and_layer_attn_metadata(common_attn_metadata: Any, draft_index: int = 0) -> Any:
            self._pending = (common_attn_metadata, draft_index)
            return build(common_attn_metadata, draft_index)

        drafter.build_per_group_and_layer_attn_metadata = build_per_group_and_layer_attn_metadata
        for block, layer, bound in self.blocks:
            block.forward = functools.partial(self._forward, block, layer, bound)

    def make_builders(self, num_microbatches: int) -> None:
        """Give each of the drafter's attention groups ``1 + num_microbatches`` metadata builders, made by vLLM's
        ``create_metadata_builders`` as the proposer made its one: builder 0 stays vLLM's (the whole pass), builder
        ``k + 1`` builds microbatch k's. Called after the proposer's ``initialize_attn_backend``."""
        from tbo.integrations.vllm.runner.patches import check_metadata_builders

        drafter = self.drafter
        for group in drafter.draft_attn_groups:
            group.create_metadata_builders(drafter.vllm_config, drafter.device,
                                           kernel_block_size=group.kernel_block_size,
                                           num_metadata_builders=1 + num_microbatches)
        check_metadata_builders([drafter.draft_attn_groups], 1 + num_microbatches)

    def close(self) -> None:
        """Put vLLM's own methods back (the instance attributes go)."""
        self.drafter.__dict__.pop("build_per_group_and_layer_attn_metadata", None)
        for block, _, _ in self.blocks:
            block.__dict__.pop("forward", None)
        self._pending = None
        self.rotary_fix.restore()

    # ---- one forward -----------------------------------------------------------------------------------------------
    def _forward(self, block: Any, layer: Any, bound: dict[str, Any], positions: Any, hidden_states: Any,
                 residual: Any = None, llama_4_scaling: Any = None) -> Any:
        from vllm.forward_context import get_forward_context

        from tbo.integrations.engine.step import decide_draft

        if llama_4_scaling is not None:
            raise RuntimeError("vLLM's MTP layer passed llama_4_scaling to its block; tbo's MTP pass runs the block "
                               "as vLLM 0.32's MTP layers call it, without")
        ctx = get_forward_context()
        pending = self._pending
        if ctx.attn_metadata is None or pending is None:  # a dummy run (profiling, warm-up): vLLM's, uncounted
            return type(block).forward(block, positions, hidden_states, residual)
        cad, draft_index = pending
        num_reqs = int(cad.num_reqs)
        starts = cad.query_start_loc_cpu[:num_reqs + 1].tolist()
        lens = [b - a for a, b in zip(starts, starts[1:])]
        step = decide_draft(self.policy, lens, padded_tokens=int(hidden_states.shape[0]))
        plan = step.plan
        if plan is None and self.vllm_unsplit:
            out = type(block).forward(block, positions, hidden_states, residual)
        else:
            slot = Slot.DECODE if max(lens, default=1) <= self.decode_len else Slot.PREFILL  # a prompt: prefill's
            out = self._run(layer, bound[slot], slot, positions, hidden_states, residual, plan,
                            None if plan is None else self._contexts(ctx, cad, draft_index, plan))
        for s in self.counters:
            s.record_draft(plan is not None)
        if self.after is not None:
            self.after()
        return out

    def _run(self, layer: Any, strategy: Any, slot: Slot, positions: Any, hidden_states: Any, residual: Any,
             plan: Any, contexts: list[Any] | None) -> tuple[Any, Any]:
        """The block as a one-layer stack through tbo's loop with the ``slot`` strategy and backend: split over
        ``plan`` (each microbatch's stages in its context of ``contexts``), or whole."""
        from tbo.comm.devices import no_host_reads
        from tbo.integrations.vllm.comm.backend import select_backend
        from tbo.integrations.vllm.runner.contexts import ContextSwitcher
        from tbo.runtime.forward import model_forward_maybe_tbo

        inputs = {"hidden_states": hidden_states}
        if residual is not None:
            inputs["residual"] = residual

        def pinned(mb: Any) -> dict[str, Any]:
            return {"positions": positions if mb is None else positions[mb.tokens_start:mb.tokens_end]}

        backend = select_backend(self.backend, slot)  # DeepEP: the slot's kind
        with no_host_reads(plan is not None and slot == Slot.DECODE):  # a split decode forward: fixed shapes
            out = model_forward_maybe_tbo([layer], inputs, strategy, plan, pinned=pinned,
                                          output_key=("hidden_states", "residual"), backend=backend,
                                          stage_hooks=None if contexts is None else ContextSwitcher(contexts))
        return out["hidden_states"], out["residual"]

    def _contexts(self, ctx: Any, cad: Any, draft_index: int, plan: Any) -> list[Any]:
        """Microbatch k's forward context: the pass's ``ctx`` with the drafter's attention metadata built for its
        slice of ``cad`` (vLLM's ``split_attn_metadata``) by builder ``k + 1``, and its slice of the slot mapping."""
        from vllm.v1.worker.ubatch_utils import split_attn_metadata

        from tbo.integrations.vllm.runner.contexts import microbatch_context
        from tbo.integrations.vllm.step.batch import ubatch_slices

        contexts = []
        for k, (mb, part) in enumerate(zip(plan.microbatches, split_attn_metadata(ubatch_slices(plan), cad))):
            metadata: dict[str, Any] = {}
            for group in self.drafter.draft_attn_groups:
                built = group.get_metadata_builder(k + 1).build_for_drafting(
                    common_attn_metadata=group._with_kernel_block_table(part, k + 1), draft_index=draft_index)
                metadata.update(dict.fromkeys(group.layer_names, built))
            tokens = slice(mb.tokens_start, mb.tokens_end)
            slots = {name: mapping[tokens] for name, mapping in ctx.slot_mapping.items()}
            contexts.append(microbatch_context(ctx, metadata, self.drafter.vllm_config, slots, tokens))
        return contexts
