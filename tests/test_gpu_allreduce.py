"""`TPAllReduce` on CUDA tensors. Skipped without CUDA.

Two ranks share one GPU over gloo (NCCL refuses two ranks on one device): the sum of CUDA tensors written by kernels
on the compute stream, exact; and a one-rank reducer inside a CUDA-graph capture (the identity: nothing to launch,
nothing read on the host). The NCCL path (communication stream joined by events) needs two GPUs.
"""

import pytest
import torch

from tbo.comm import TPAllReduce
from tbo.harness.launch import launch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _cuda_sum(rank, world):
    reducer = TPAllReduce(timeout_s=60)
    x = torch.arange(3 * 7, dtype=torch.float32, device="cuda").view(3, 7) * (rank + 1)  # a kernel writes it
    state = reducer.reduce_a(x)
    out = reducer.reduce_b(state)
    return out.cpu(), reducer.backend, out.device.type


@pytest.mark.dist
def test_cuda_tensors_over_gloo_sum_exactly():
    for out, backend, device in launch(_cuda_sum, 2, timeout_s=120):
        assert backend == "gloo" and device == "cuda"
        assert torch.equal(out, torch.arange(21, dtype=torch.float32).view(3, 7) * 3)


def test_one_rank_reducer_inside_a_capture():
    reducer = TPAllReduce(device="cuda")
    x = torch.ones(4, 8, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = reducer.reduce_b(reducer.reduce_a(x * 2)) + 1
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full((4, 8), 3.0, device="cuda"))
