"""GPU and network specs, and the few efficiency factors that turn peak numbers into achieved ones.

A prediction needs what a datasheet gives (peak FLOPs, HBM and link bandwidths, SM count) and how much of it real
kernels reach. The second part is kept to a handful of physical factors, the same for every configuration: the share
of tensor-core peak a GEMM or an attention kernel reaches, the share of HBM bandwidth a memory-bound kernel reaches,
the share of a link's bandwidth DeepEP reaches, and the fixed cost of a kernel launch. None depends on the model, the
batch or the EP size, so a configuration nobody measured gets the same treatment as the ones that were.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tbo.tools.inputs import load_json_model

__all__ = ["Hardware", "Efficiency", "HARDWARE", "get_hardware", "DEFAULT_EFFICIENCY", "FITTED_FACTORS"]

TFLOPS = 1e12
GBPS = 1e9  # GB/s in bytes per second (the decimal gigabytes datasheets use)

#: Fixed time of one DeepEP dispatch or combine beyond its bytes (kernel launch, the network round trip, the arrival
#: signal). No datasheet gives it for a whole transfer: fitted by benchmarks/published.py to DeepEP's H800 + CX7
#: rows (see FITTED_FACTORS), and used for every preset, which all pair a ConnectX-7 400 Gb/s NIC with each GPU.
_CX7_MESSAGE_LATENCY_S = 27.2e-6


class Hardware(BaseModel):
    """One GPU of a node and its links: dense peaks (no sparsity), HBM, SMs, NVLink and NIC per direction.

    Bandwidths are per GPU and per direction, in bytes per second: a dispatch sends and receives at once.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    bf16_flops: float = Field(gt=0, allow_inf_nan=False, description="dense BF16 tensor-core peak, FLOP/s")
    fp8_flops: float = Field(gt=0, allow_inf_nan=False, description="dense FP8 tensor-core peak, FLOP/s")
    hbm_bandwidth: float = Field(gt=0, allow_inf_nan=False, description="HBM bandwidth, bytes/s")
    num_sms: int = Field(gt=0, description="streaming multiprocessors")
    nvlink_bandwidth: float = Field(gt=0, allow_inf_nan=False, description="NVLink bandwidth per GPU per direction, bytes/s")
    nic_bandwidth: float = Field(gt=0, allow_inf_nan=False, description="scale-out NIC bandwidth per GPU per direction, bytes/s")
    message_latency_s: float = Field(ge=0, allow_inf_nan=False, description="fixed time of one dispatch or combine beyond its bytes")
    gpus_per_node: int = Field(default=8, gt=0, description="GPUs sharing one NVLink domain")
    memory_bytes: float | None = Field(default=None, gt=0, allow_inf_nan=False,
                                       description="HBM capacity per GPU, bytes (None: memory is not checked)")

    def peak_flops(self, dtype: Literal["bf16", "fp8"]) -> float:
        return self.fp8_flops if dtype == "fp8" else self.bf16_flops


HARDWARE: dict[str, Hardware] = {
    "h800": Hardware(
        name="h800",
        memory_bytes=80e9,        # datasheet: 80 GB HBM3
        bf16_flops=989 * TFLOPS,   # NVIDIA H800 SXM5 datasheet: BF16 1,979 TFLOPS with sparsity -> 989 dense
        fp8_flops=1979 * TFLOPS,   # same datasheet: FP8 3,958 TFLOPS with sparsity -> 1,979 dense
        hbm_bandwidth=3.35e12,     # same datasheet: 80 GB HBM3, 3.35 TB/s
        num_sms=132,               # GH100 in the SXM5 part: 132 SMs (NVIDIA Hopper architecture whitepaper)
        nvlink_bandwidth=200 * GBPS,  # datasheet: NVLink 400 GB/s, both directions; DeepEP measures ~160 GB/s
        nic_bandwidth=50 * GBPS,   # DeepEP README: CX7 InfiniBand 400 Gb/s per GPU (~50 GB/s)
        message_latency_s=_CX7_MESSAGE_LATENCY_S,
    ),
    "h100": Hardware(
        name="h100",
        memory_bytes=80e9,        # datasheet: 80 GB HBM3
        bf16_flops=989 * TFLOPS,   # NVIDIA H100 SXM5 datasheet: BF16 1,979 TFLOPS with sparsity -> 989 dense
        fp8_flops=1979 * TFLOPS,   # same datasheet: FP8 3,958 TFLOPS with sparsity -> 1,979 dense
        hbm_bandwidth=3.35e12,     # same datasheet: 80 GB HBM3, 3.35 TB/s
        num_sms=132,               # NVIDIA Hopper architecture whitepaper: H100 SXM5 has 132 SMs
        nvlink_bandwidth=450 * GBPS,  # datasheet: NVLink 900 GB/s, both directions
        nic_bandwidth=50 * GBPS,   # DGX H100 datasheet: 8x ConnectX-7 400 Gb/s, one per GPU
        message_latency_s=_CX7_MESSAGE_LATENCY_S,
    ),
    "h200": Hardware(
        name="h200",
        memory_bytes=141e9,        # datasheet: 141 GB HBM3e
        bf16_flops=989 * TFLOPS,   # NVIDIA H200 SXM datasheet: BF16 1,979 TFLOPS with sparsity -> 989 dense
        fp8_flops=1979 * TFLOPS,   # same datasheet: FP8 3,958 TFLOPS with sparsity -> 1,979 dense
        hbm_bandwidth=4.8e12,      # same datasheet: 141 GB HBM3e, 4.8 TB/s
        num_sms=132,               # same GH100 die as H100 SXM5: 132 SMs
        nvlink_bandwidth=450 * GBPS,  # datasheet: NVLink 900 GB/s, both directions
        nic_bandwidth=50 * GBPS,   # DGX H200 datasheet: 8x ConnectX-7 400 Gb/s, one per GPU
        message_latency_s=_CX7_MESSAGE_LATENCY_S,
    ),
    "b200": Hardware(
        name="b200",
        memory_bytes=180e9,        # datasheet: 1,440 GB HBM3e per 8 GPUs -> 180 GB
        bf16_flops=2250 * TFLOPS,  # NVIDIA HGX B200 datasheet: FP16/BF16 36 PFLOPS (sparse) per 8 GPUs -> 2.25 dense
        fp8_flops=4500 * TFLOPS,   # same datasheet: FP8 72 PFLOPS (sparse) per 8 GPUs -> 4.5 PFLOPS dense per GPU
        hbm_bandwidth=8.0e12,      # same datasheet: 64 TB/s HBM3e per 8 GPUs -> 8 TB/s per GPU
        num_sms=148,               # B200 device properties (two dies of 74 SMs), as DeepGEMM/DeepEP SM100 report
        nvlink_bandwidth=900 * GBPS,  # fifth-generation NVLink: 1.8 TB/s per GPU, both directions
        nic_bandwidth=50 * GBPS,   # DGX B200 datasheet: 8x ConnectX-7 400 Gb/s, one per GPU
        message_latency_s=_CX7_MESSAGE_LATENCY_S,
    ),
}


def get_hardware(name_or_path: str | Hardware) -> Hardware:
    """A preset by name (case-insensitive), or a Hardware JSON file for a GPU or network not listed."""
    if isinstance(name_or_path, Hardware):
        return name_or_path
    key = str(name_or_path).lower()
    if key in HARDWARE:
        return HARDWARE[key]
    path = Path(name_or_path)
    if path.suffix == ".json" and path.is_file():
        return load_json_model(Hardware, path, "hardware file")
    raise ValueError(f"unknown hardware {name_or_path!r}; known: {', '.join(sorted(HARDWARE))} "
                     "(or a JSON file with the Hardware fields)")


class Efficiency(BaseModel):
    """What share of the peaks real kernels reach: the same factors for every configuration.

    Stated from published kernel benchmarks (H800): ``gemm_mfu`` from DeepGEMM's README (FP8 GEMMs with 4096 rows
    reach 1,025-1,358 of 1,979 TFLOPS, 0.52-0.69), ``attention_mfu`` from FlashMLA's README (660 of 989 BF16 TFLOPS
    compute-bound, 0.67), ``hbm_efficiency`` from the same two (FlashMLA 3,000 of 3,350 GB/s, DeepGEMM's decode
    shapes 1.5-2.7 TB/s once the launch cost below is taken off), ``kernel_overhead_s`` the launch-to-launch gap
    and ramp of one short kernel (DeepGEMM's 64-row GEMMs take 1-3 us more than their bytes need).

    Fitted once, by ``benchmarks/published.py``, to DeepEP's published H800 rows: ``nic_efficiency`` and
    ``nvlink_efficiency`` (and the hardware's ``message_latency_s``). See `FITTED_FACTORS`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    gemm_mfu: float = Field(default=0.6, gt=0, le=1)
    attention_mfu: float = Field(default=0.65, gt=0, le=1)
    hbm_efficiency: float = Field(default=0.8, gt=0, le=1)
    kernel_overhead_s: float = Field(default=2e-6, ge=0, allow_inf_nan=False)
    nic_efficiency: float = Field(default=0.865, gt=0, le=1)
    nvlink_efficiency: float = Field(default=0.699, gt=0, le=1)


DEFAULT_EFFICIENCY = Efficiency()

#: The factors benchmarks/published.py fits, jointly, to the issue's ten DeepEP V1 rows on H800 (low-latency EP 8,
#: 32, 128; normal EP 8 intranode and EP 32 internode; dispatch and combine), and the rows that pin each one down.
FITTED_FACTORS = {
    "nic_efficiency": "pinned by low-latency EP32/EP128 and normal internode EP32 (H800, CX7 400 Gb/s)",
    "nvlink_efficiency": "pinned by low-latency EP8 and normal intranode EP8 (H800 NVLink)",
    "message_latency_s": "pinned by the low-latency rows (128 tokens: where a fixed cost shows)",
}
