"""Which ``compilation_config.cudagraph_mode`` tbo runs split steps under, and which decode backend a CUDA graph can
hold: refused by name at engine start. How the split graphs are captured and replayed: `tbo.integrations.vllm.step.graphs`.
"""

from __future__ import annotations

from typing import Any

from tbo.integrations.vllm.config import TboVllmConfig
from tbo.integrations.vllm.errors import config_error, refuse
from tbo.integrations.vllm.step.graphs import mode_name

__all__ = ["GRAPH_MODES", "check_cudagraph_mode", "check_graph_backend"]


#: the ``cudagraph_mode`` names tbo runs split steps under (NONE aside): the ones with FULL graphs
GRAPH_MODES = ("FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")


def check_cudagraph_mode(vllm_config: Any, config: TboVllmConfig) -> None:
    """Refuse, naming it, a ``compilation_config.cudagraph_mode`` tbo cannot run split steps under (module
    docstring); NONE and the `GRAPH_MODES` pass, the latter only without data parallelism and adaptive splitting."""
    name = mode_name(getattr(vllm_config.compilation_config, "cudagraph_mode", None) or "NONE")
    if name == "NONE":
        return
    if name not in GRAPH_MODES:
        why = ("PIECEWISE alone pads every step to a capture size, which tbo never splits, and its graphs are pieces "
               "of the compiled forward that tbo's split steps do not run" if name == "PIECEWISE" else
               "not a mode tbo knows")
        refuse({"compilation_config.cudagraph_mode": name}, f"NONE, {', '.join(GRAPH_MODES)}, or enforce_eager=True",
               why)
    dp = vllm_config.parallel_config.data_parallel_size
    if dp > 1:
        refuse({"compilation_config.cudagraph_mode": name, "data_parallel_size": dp},
               "cudagraph_mode NONE, or enforce_eager=True", "CUDA graphs of split steps are built for one "
               "data-parallel rank: with several, each step's padded size would first have to be agreed")
    if config.split == "adaptive":
        refuse({"split": "adaptive", "compilation_config.cudagraph_mode": name},
               "split='static', or cudagraph_mode NONE",
               "adaptive splitting chooses per step; a CUDA graph fixes the split per size")


def check_graph_backend(backend: Any) -> None:
    """Refuse, naming it, a backend for decode steps that a CUDA graph cannot hold: tbo's local backend (one rank:
    under `tbo.comm.devices.no_host_reads` its NORMAL route is the identity, fixed shapes) and DeepEP low-latency
    (``capture_safe``) can be captured; DeepEP normal mode and V2 read their receive counts on the host, and an
    emulated link times its transfers on the host."""
    from tbo.comm.alltoall import LocalBackend

    if type(backend) is LocalBackend or getattr(backend, "capture_safe", False):
        return
    raise config_error("a FULL compilation_config.cudagraph_mode", f"the decode steps' backend {backend!r} cannot be "
                       "captured in a CUDA graph (it reads the host inside a step); accepted: backend 'local' without "
                       "a link, or backend 'deepep' with low-latency decode (deepep_decode 'low_latency'), or "
                       "cudagraph_mode NONE")
