"""The GPUs a plan is checked against: memory, peak bf16 FLOP/s, link bandwidths, NVLink domain.

Figures are the vendors' datasheet numbers (dense, no sparsity; bandwidth per direction per GPU):
H100 SXM 80 GB and H200 141 GB (NVLink 4: 450 GB/s each way, 8-GPU HGX node), HGX B200 180 GB and
GB200 NVL72 186 GB (NVLink 5: 900 GB/s each way; the NVL72 domain spans 72 GPUs).  Between NVLink
domains each GPU has one 400 Gb/s InfiniBand NDR port (50 GB/s) on H100/H200 nodes and one 800 Gb/s
XDR/ConnectX-8 port (100 GB/s) on Blackwell systems.

`fits(peak, gpu)`: a plan fits when its peak stays under the device memory less the headroom the
allocator and the runtime take (`headroom_bytes`: the CUDA context, NCCL's buffers, the caching
allocator's fragmentation): 10% of the memory, at least 4 GiB (a plan that fits peaks at 90% or less).
"""

from __future__ import annotations

from dataclasses import dataclass

from moevlm.train.metrics import PEAK_TFLOPS

GB = 1e9


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: float
    bf16_tflops: float
    nvlink_gbps: float  # GB/s each way, per GPU, inside the NVLink domain
    network_gbps: float  # GB/s each way, per GPU, between domains
    domain: int  # GPUs one NVLink domain connects

    @property
    def headroom_bytes(self) -> float:
        return max(4 * 2**30, 0.10 * self.memory_bytes)

    def fits(self, peak_bytes: float) -> bool:
        return peak_bytes <= self.memory_bytes - self.headroom_bytes


GPUS = {
    "h100": Gpu("H100 SXM 80GB", 80 * GB, PEAK_TFLOPS["h100"]["bf16"], 450, 50, 8),
    "h200": Gpu("H200 SXM 141GB", 141 * GB, PEAK_TFLOPS["h200"]["bf16"], 450, 50, 8),
    "b200": Gpu("B200 (HGX) 180GB", 180 * GB, PEAK_TFLOPS["b200"]["bf16"], 900, 100, 8),
    "gb200": Gpu("GB200 NVL72 186GB", 186 * GB, PEAK_TFLOPS["gb200"]["bf16"], 900, 100, 72),
}


def gpu(name: str) -> Gpu:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ValueError(f"--gpu {name!r}: choose one of {', '.join(GPUS)}") from None


def recipe_gpu(experiment: str) -> str:
    """The GPU a recipe is named for (`h100_fsdp` -> h100; a recipe named for none, as a sweep over
    h100_1gpu: h100)."""
    return next((k for k in ("gb200", "b200", "h200", "h100") if experiment.startswith(k)), "h100")
