"""The tensor work of `VllmDecoderLayer`'s ops as functions of vLLM's modules and tensors: run as they are, or
compiled in a compiled engine.

Why functions: in a compiled engine (no ``enforce_eager``) tbo's steps run its schedule one op at a time, the
transfers (``*_a``, ``*_b``) between them. Tracing the whole schedule would trace the transfers, the emulated link's
threads, the observers and the forward-context switches too. Instead, what each op computes (the residual-add
norms, the QKV projection with the q/k norms and rotary, the attention call, the routing, the experts kernel, the
MLPs, the MoE output's scale and sum, and the model's final norm) is a function here of the layer's own vLLM
modules and its tensors, and a compiled engine runs these functions compiled (`CompiledCompute`), as vLLM compiles
its graph of the whole model: torch.compile with vLLM's backend and inductor options (its
``inductor_compile_config``), ``fullgraph`` (a function that cannot be traced whole is an error, never a silent
eager fallback), the token dimension marked dynamic and dynamo's shape guards dropped (vLLM's
``TorchCompileWithNoGuardsWrapper`` drops every guard): one graph serves every token count, 1 included.

A graph key is what sets one graph apart: the function and the modules a layer gives it, by structure and
constants, not by identity (`_module_key`: the module's type, its printed sizes and constants, its parameters'
shapes; parameters are graph inputs, so one graph serves every layer alike, and a 60-layer model compiles as few
graphs as a 3-layer one). vLLM's attention calls name their layer through vLLM's ``LayerName``, an opaque value
torch lifts as a graph input, so the attention call is layer-agnostic too. Each key compiles once: the engine's keys
are its compile bound (`CompiledCompute.bound`, ``op_compile_bound`` in `tbo.integrations.engine.stats`, beside
``op_compiles``), fixed at engine start and independent of the plan shapes and the steps. Dynamo's other guards stay
(`_Graph`) for each caller's first call: a module constant the key does not see (a layer without rotary, say)
compiles one graph more, counted and logged, never runs another layer's graph. That first call settles which graph
the caller runs, and its later calls run it directly: dynamo's transformed code of that graph, called as a plain
function (vLLM runs its own graph so, through dynamo's bytecode hook), without torch.compile's per-call wrapper and
guard checks, which cost about 10 µs a call here, some 60 calls per 4-layer split step (``guarded_op_calls`` counts
the calls that went through the guards: none in serving). vLLM's warm-up compiles them all, at the warm-up's full
token count, as it compiles its own graph (`tbo.integrations.vllm.runner.forwards.StepForwards.warming_up`; an engine
whose every step runs the loop runs it in its warm-up anyway), and so settles every caller.

What stays eager: the router's gate GEMM (one GEMM, nothing to fuse), the transfers, and everything tbo does between
ops (the executor, the observers). With data parallelism the experts op too: `run_local_experts` groups the received
rows by their local slot count on the host.

Numerics: the compiled functions run vLLM's own modules (``forward_native`` of its custom ops, as its graph does in
a compiled engine) through the same options, with the same dynamic dimension: tbo's loop computes, with them, what
vLLM's compiled graph computes, bit for bit, on the same batch (tests/vllm/test_compiled.py). Run eagerly, the same
modules round otherwise in the last bit (inductor's fused kernels are not aten's), the final norm included.
"""

from __future__ import annotations

import logging
import types
import weakref
from typing import Any, Callable

import torch

from tbo.integrations.engine.stats import StepStats

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


def attention_core(attn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Qwen3-MoE's attention kernel (vLLM's ``Attention``: its KV cache, the forward context's metadata) and output
    projection."""
    return attn.o_proj(attn.attn(q, k, v))[0]


def attention(attn: Any, positions: torch.Tensor, hidden: torch.Tensor, extra: dict[str, Any]) -> torch.Tensor:
    """Any other attention module whole (DeepSeek's MLA, GPT-OSS's with sinks, Llama-4's), called by keyword:
    GPT-OSS's takes ``(hidden_states, positions)``, the others the other way round. ``extra``: DeepSeek's
    ``llama_4_scaling``, where the module takes it."""
    return attn(positions=positions, hidden_states=hidden, **extra)


def route(router: Any, hidden: torch.Tensor, logits: torch.Tensor,
          ids_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE runner's top-k: ``(weights, ids)``."""
    return router.select_experts(hidden_states=hidden, router_logits=logits, topk_indices_dtype=ids_dtype)


def experts(call: Any, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """vLLM's fused-MoE experts kernel on NORMAL rows (each row's weighted sum over its top-k experts), through the
    layer's quant method (``call``: its `tbo.integrations.vllm.model.quant.ExpertsCall`)."""
    return call.local(hidden, ids, weights)


def mlp(module: Any, hidden: torch.Tensor) -> torch.Tensor:
    """A dense layer's MLP or a shared expert: vLLM's module (its down projection all-reduces over TP)."""
    return module(hidden)


def moe_output(runner: Any, routed: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
    """A MoE layer's output as vLLM's MoE runner makes it: the routed part scaled by the runner's
    ``routed_scaling_factor`` (DeepSeek's), then the shared expert's added (compiled, inductor fuses the two as in
    vLLM's graph)."""
    scale = float(runner.routed_scaling_factor)
    if scale != 1.0:
        routed = routed * scale
    return routed if shared is None else shared + routed


#: name -> (function, the positions of its arguments whose first dimension is the token count: the first of them
#: is a tensor). Each function's first argument is the module (or object) that names its graph key.
FUNCTIONS: dict[str, tuple[Callable[..., Any], tuple[int, ...]]] = {
    "norm": (norm, (1,)),
    "add_norm": (add_norm, (1, 2)),
    "qkv": (qkv, (1, 2)),
    "attention_core": (attention_core, (1, 2, 3)),
    "attention": (attention, (1, 2, 3)),
    "route": (route, (1, 2)),
    "experts": (experts, (1, 2, 3)),
    "mlp": (mlp, (1,)),
    "moe_output": (moe_output, (1, 2)),
}


class Compute:
    """The functions the ops call, as they are (`EAGER`): the eager engine's computation, unchanged."""

    compiled = False

    def __init__(self) -> None:
        for name, (fn, _) in FUNCTIONS.items():
            setattr(self, name, fn)


EAGER = Compute()

COMPILED = tuple(FUNCTIONS)  #: what `CompiledCompute` compiles: all of them

logger = logging.getLogger("vllm.tbo")


class CompiledCompute(Compute):
    """The functions compiled, one graph per graph key (see the module docstring), for the engine whose ``callers``
    (its layers and its model's ends, each with a ``compute_keys()``) call them, with vLLM's backend and inductor
    options from ``compilation_config``. `compiles` counts the graphs traced per function; ``counters`` (the engine's
    `StepStats`, one) counts them (``op_compiles``) and the calls that ran compiled (``compiled_op_calls``): one
    count per call, nothing fanned out on the op's path."""

    compiled = True

    def __init__(self, compilation_config: Any, callers: list[Any], counters: tuple[Any, ...] = ()) -> None:
        super().__init__()
        if len(counters) > 1:
            raise ValueError("the compiled ops count into one engine's StepStats")
        #: the engine's stats (a private one where none is given)
        self.stats = counters[0] if counters else StepStats()
        backend = compilation_config.backend or "inductor"
        #: vLLM's inductor options, less what its own wrapper adds for dynamo (it writes into the same dict)
        self.options = {k: v for k, v in dict(compilation_config.inductor_compile_config).items()
                        if k != "guard_filter_fn"} if backend == "inductor" else {}
        self.backend = backend
        self.compiles: dict[str, int] = dict.fromkeys(COMPILED, 0)
        graphs: dict[tuple[Any, ...], _Graph] = {}
        #: (function, id of the object naming the key) -> that key's graph: how a call finds its graph
        self._graphs: dict[tuple[str, int], _Graph] = {}
        for caller in callers:
            for name, objects in caller.compute_keys():
                key = (name, tuple(_module_key(o) for o in objects))
                if key not in graphs:
                    graphs[key] = _Graph(self, name)
                self._graphs[(name, id(objects[0]))] = graphs[key]
        #: the engine's graph keys, each compiled once: the most graphs it can make (``op_compile_bound``)
        self.keys = list(graphs)
        #: per function, its keys: the graphs it may compile
        self.bounds = {name: sum(k[0] == name for k in self.keys) for name in COMPILED}
        for name in COMPILED:
            setattr(self, name, self._dispatch(name))

    @property
    def bound(self) -> int:
        """The most graphs this engine compiles: one per graph key."""
        return len(self.keys)

    @property
    def warm(self) -> bool:
        """Whether every graph key has been compiled."""
        return sum(self.compiles.values()) >= self.bound

    def _dispatch(self, name: str) -> Callable[..., Any]:
        graphs = self._graphs

        def call(first: Any, *rest: Any) -> Any:
            graph = graphs.get((name, id(first)))
            if graph is None:
                raise RuntimeError(f"tbo: compiled op function {name!r} called with a {type(first).__name__} that no "
                                   "layer declared in its compute_keys(): it has no graph key")
            return graph(first, *rest)

        call.__name__ = call.__qualname__ = f"compiled_{name}"
        return call


class _Graph:
    """One graph key's compiled function: a copy of the function (a fresh code object: dynamo keeps its graphs per
    code object, so an engine's graphs are its own), compiled at its first call of two tokens or more with the token
    dimension dynamic, as vLLM's graph is. Dynamo's guards stay, but for two kinds, dropped as vLLM drops them (it
    drops every guard): the shape guards, so that one graph serves every token count, 1 included (a graph of two
    tokens or more would otherwise be guarded against one, and dynamo specializes a one-token graph), and the
    torch-function-mode guard (no mode runs while serving; the host-read test runs one). Every other guard keeps its
    check on a caller's first call: a module whose constants differ where `_module_key` does not see it compiles
    another graph, counted and logged past the bound, never a wrong one. Later calls of a caller run the graph its
    first call ran, directly (`_settle`); a caller's modules and the kinds of its arguments do not change between
    its calls (only their token counts, which no guard checks), so its first call's guards hold for them all. A call
    with fewer than two tokens before the graph exists runs the function eagerly (the engine's warm-up compiles
    every key at its full token count first: `tbo.integrations.vllm.runner.forwards.StepForwards.warming_up`)."""

    def __init__(self, owner: CompiledCompute, name: str) -> None:
        import torch._dynamo

        self.owner, self.name = owner, name
        self.fn, self.dynamic = FUNCTIONS[name]
        self.ready = False
        self.eager_calls = 0  #: calls that ran eagerly, before the graph was compiled (see the class docstring)
        fn = self.fn
        own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
        self.compiled = torch.compile(own, fullgraph=True, dynamic=False, backend=self._backend,
                                      options={"guard_filter_fn": _serving_guards}, recompile_limit=RECOMPILE_LIMIT)
        self._own = own
        #: dynamo's transformed code of ``own``, one per graph traced, in order (`_on_bytecode`)
        self.codes: list[types.CodeType] = []
        #: per caller (the id of the object that names the key: one layer's module), the transformed code its first
        #: compiled call ran, as a function; None: which graph it ran is not known, so its calls keep dynamo's guards
        self._direct: dict[int, Callable[..., Any] | None] = {}
        _transformed_by_hook(own.__code__, self)
        self._mark = torch._dynamo.mark_dynamic

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        owner, name = self.owner, self.name
        owner.compiles[name] += 1  # every graph dynamo traces of this key's function, a recompilation included
        owner.stats.op_compiles += 1
        if owner.compiles[name] == owner.bounds[name] + 1:
            logger.warning("tbo: compiled op function %r traced graph %d, past its bound of %d (a module constant "
                           "tbo's graph keys do not see): see op_compiles in stats()", name, owner.compiles[name],
                           owner.bounds[name])
        if owner.backend == "inductor":
            from torch._inductor.compile_fx import compile_fx

            compiled = compile_fx(gm, example_inputs, config_patches=dict(owner.options))
        else:
            from torch._dynamo.backends.registry import lookup_backend

            compiled = lookup_backend(owner.backend)(gm, example_inputs)
        self.ready = True
        return compiled

    def __call__(self, *args: Any) -> Any:
        run = self._direct.get(id(args[0]))
        if run is None:  # this caller's first call, or a caller whose graph is not known: dynamo's guards
            if not self.ready and args[self.dynamic[0]].shape[0] < 2:
                return self._eager(args)
            run = self._guarded
        self.owner.stats.compiled_op_calls += 1
        return run(*args)

    def _eager(self, args: tuple[Any, ...]) -> Any:
        """A call before the graph exists with too few tokens to compile it on (see the class docstring)."""
        if not self.eager_calls:
            logger.warning("tbo: compiled op function %r called with fewer than 2 tokens before its graph was "
                           "compiled (no warm-up ran it): this call runs eagerly", self.name)
        self.eager_calls += 1
        return self.fn(*args)

    def _guarded(self, *args: Any) -> Any:
        """The call through torch.compile: dynamo checks the guards of the graphs it has and runs the one that
        passes, or traces and compiles one (the first call of a key, or a module constant the key does not see).
        A caller's first call settles which graph its later calls run (`_settle`)."""
        self.owner.stats.guarded_op_calls += 1
        if not self.ready:
            for i in self.dynamic:  # the token dimension, as vLLM marks its graph's inputs
                arg = args[i]
                for t in arg.values() if isinstance(arg, dict) else (arg,):
                    if isinstance(t, torch.Tensor):
                        self._mark(t, 0)
        traced = len(self.codes)
        out = self.compiled(*args)
        if id(args[0]) not in self._direct:
            self._direct[id(args[0])] = self._settle(traced)
        return out

    def _settle(self, traced: int) -> Callable[..., Any] | None:
        """After a caller's first guarded call, which had seen ``traced`` graphs: the graph it ran, as a function of
        dynamo's transformed code (the code dynamo runs when that graph's guards pass: it takes the function's own
        arguments, reads the dynamic sizes off them and calls the compiled graph). The call traced a graph: that
        one, whose guards were built from this caller's arguments. Else, with one graph: the one whose guards just
        passed. Else (past the bound, more than one graph and none traced now): None, and the caller keeps
        dynamo's guards on every call."""
        codes = self.codes
        code = codes[-1] if len(codes) > traced else codes[0] if len(codes) == 1 else None
        if code is None:
            return None
        own = self._own
        return types.FunctionType(code, own.__globals__, own.__name__, own.__defaults__, own.__closure__)


#: the ids of `_Graph`'s own functions' code objects -> their graph: where `_on_bytecode` files dynamo's transformed
#: code. By id: the copies of one function's code compare equal (code objects compare by value), and each graph's
#: copy is its own (it keeps it alive)
_BY_CODE: "weakref.WeakValueDictionary[int, _Graph]" = weakref.WeakValueDictionary()
_hook: list[Any] = []  #: the handle of `_on_bytecode`, registered with dynamo at the first `_Graph`


def _transformed_by_hook(code: types.CodeType, graph: _Graph) -> None:
    """Have dynamo's transformed code of ``code`` filed in ``graph.codes`` at each graph dynamo traces of it. A torch
    without dynamo's bytecode hook files nothing: every call then keeps the guards (`_Graph._settle`), logged once."""
    if not _hook:
        try:
            from torch._dynamo.convert_frame import register_bytecode_hook
        except ImportError:
            logger.warning("tbo: this torch has no dynamo bytecode hook: compiled op calls go through torch.compile's "
                           "guards on every call (slower, the same graphs)")
            _hook.append(None)
        else:
            _hook.append(register_bytecode_hook(_on_bytecode))
    _BY_CODE[id(code)] = graph


def _on_bytecode(old: types.CodeType, new: types.CodeType) -> None:
    """Dynamo's bytecode hook (vLLM's ``TorchCompileWithNoGuardsWrapper`` uses the same): ``new`` is the code dynamo
    made of ``old`` for the graph it just traced; filed for `_Graph`'s own functions, ignored for any other code."""
    graph = _BY_CODE.get(id(old))
    if graph is not None and graph._own.__code__ is old:
        graph.codes.append(new)


#: dynamo's guard kinds `_Graph` drops (see its docstring)
DROPPED_GUARDS = frozenset({"SHAPE_ENV", "TORCH_FUNCTION_STATE"})
#: dynamo's recompile limit per compiled function: far above any bound, so that a graph past the bound still
#: compiles (counted, logged) instead of dynamo running the function eagerly from then on
RECOMPILE_LIMIT = 64


def _serving_guards(guard_entries: list[Any]) -> list[bool]:
    """Dynamo's ``guard_filter_fn``: every guard but the `DROPPED_GUARDS` kinds."""
    return [entry.guard_type not in DROPPED_GUARDS for entry in guard_entries]


def _module_key(module: Any) -> tuple[Any, ...]:
    """What a graph of a compiled function is keyed by in ``module``: its type, its modules' printed sizes and
    constants (vLLM's layers print theirs: features, eps; on a CPU a linear layer's weight lives in a oneDNN handle,
    its parameter emptied) and its parameters' shapes and dtypes. A dense MLP and a shared expert of one model are
    the same class with other sizes: two keys."""
    if module is None or isinstance(module, (bool, int, float, str)):  # a constant (the routed scaling factor)
        return (type(module).__qualname__, module)
    if not isinstance(module, torch.nn.Module):  # a plain object (the MoE router): its constants and tensor shapes
        return (type(module).__qualname__, tuple(sorted(
            (k, (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v) for k, v in vars(module).items()
            if v is None or isinstance(v, (bool, int, float, str, torch.Tensor)))))
    params = tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters())
    return (type(module).__qualname__, repr(module), params)
