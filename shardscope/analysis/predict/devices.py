"""Machines not owned: peak FLOP/s, memory and link bandwidths of a few GPUs, for ``predict --device``.

A what-if: compute runs at a fraction of the device's peak (the calibration's own fraction when it ran
on a GPU of known peak, else ``ASSUMED_MFU``), the optimizer at HBM bandwidth (AdamW is memory-bound),
collectives at the table's bus bandwidth (NVLink inside a node, InfiniBand across nodes), on NCCL
streams (the schedules' GPU overlap). Every assumption is listed with the prediction.

Sources (checked against the vendors' datasheets):
- bf16 dense peaks: ``traces.PEAK_TFLOPS`` (docs/REFERENCE.md, the table MFU uses).
- fp32 without tensor cores (torch leaves TF32 off for matmuls by default, so fp32 runs use it):
  A100 19.5 TFLOP/s (NVIDIA A100 datasheet), H100 SXM 67 and H200 67 (H100 / H200 datasheets),
  B200 75 (HGX B200: 600 TFLOP/s FP32 for 8 GPUs).
- HBM: A100 80GB SXM 2.04 TB/s, H100 SXM 3.35 TB/s, H200 4.8 TB/s, B200 8 TB/s (datasheets).
- NVLink: nccl-tests busbw about 360 GB/s inside an 8-GPU H100/H200 node (docs/REFERENCE.md; NVLink 4 carries
  450 GB/s per direction, so 80%); A100 NVLink 3 carries 300 GB/s per direction and B200 NVLink 5
  900 GB/s, taken at the same 80%.
- InfiniBand, one NIC per GPU: DGX A100 8x HDR 200 Gb/s (25 GB/s per GPU), DGX H100 / H200 / B200 8x
  NDR 400 Gb/s ConnectX-7 (50 GB/s per GPU); a ring across nodes runs at the NIC's rate.
- Latency per hop: 2 us over NVLink, 5 us over InfiniBand: assumed (small-message NCCL all-reduce on 8 GPUs
  takes some tens of us), not from a datasheet; a ring's steps inside a node, a tree's 2 log2(nodes) hops
  across nodes (``predict._device_comm``).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardscope.profiling.traces import peak_flops

ASSUMED_MFU = 0.4  # a well-run dense transformer's fraction of peak, when the calibration cannot say
ADAMW_BYTES_PER_ELEMENT = 28  # reads param, grad, two moments (16 B) and writes param and moments (12 B), fp32
GPUS_PER_NODE = 8


@dataclass(frozen=True)
class DeviceSpec:
    """What the what-if needs of one GPU model."""

    name: str
    product: str  # the name ``traces.peak_flops`` knows
    fp32_flops: float
    hbm_Bps: float
    nvlink_busbw_Bps: float
    ib_busbw_Bps: float
    memory_bytes: float = 80e9  # the datasheet's HBM per GPU (tune's memory limit on this device)
    nvlink_latency_s: float = 2e-6
    ib_latency_s: float = 5e-6
    gpus_per_node: int = GPUS_PER_NODE

    @property
    def bf16_flops(self) -> float:
        """Dense bf16 peak from the MFU table (``traces.PEAK_TFLOPS``)."""
        return peak_flops(self.product) or 0.0

    def link(self, n: int) -> tuple[float, float, str]:
        """(bus bandwidth, latency per ring step, link name) for a group of ``n`` GPUs."""
        if n <= self.gpus_per_node:
            return self.nvlink_busbw_Bps, self.nvlink_latency_s, "NVLink"
        return self.ib_busbw_Bps, self.ib_latency_s, "InfiniBand"


DEVICES = {  # HBM: NVIDIA's datasheets (A100 80GB SXM, H100 SXM 80 GB, H200 141 GB, HGX B200 180 GB per GPU)
    "A100": DeviceSpec("A100", "A100", 19.5e12, 2.04e12, 240e9, 25e9, memory_bytes=80e9),
    "H100": DeviceSpec("H100", "H100", 67e12, 3.35e12, 360e9, 50e9, memory_bytes=80e9),
    "H200": DeviceSpec("H200", "H200", 67e12, 4.8e12, 360e9, 50e9, memory_bytes=141e9),
    "B200": DeviceSpec("B200", "B200", 75e12, 8.0e12, 720e9, 50e9, memory_bytes=180e9),
}


def device_spec(name: str) -> DeviceSpec:
    """The table's entry for ``name`` (case-insensitive); raises KeyError naming the known devices."""
    for key, spec in DEVICES.items():
        if key.lower() == name.strip().lower():
            return spec
    raise KeyError(f"--device {name!r}: known: {', '.join(DEVICES)}")
