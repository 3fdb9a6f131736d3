"""Device specs for the cost model: data, so a CPU machine can plan for an H200.

Peak rates are dense datasheet numbers (no sparsity); `peak_flops` maps a dtype class to FLOP/s.
The ridge point (peak FLOP/s / bandwidth) separates compute-bound from memory-bound ops.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    sms: int
    bandwidth: float  # bytes/s of main memory
    matmul_flops: dict[str, float] = field(default_factory=dict)  # dtype class -> FLOP/s on tensor cores
    vector_flops: float = 0.0  # FLOP/s for non-matmul arithmetic (fp32 CUDA cores)
    launch_us: float = 0.0  # fixed cost of one kernel, paid even by a tiny op

    def peak_flops(self, dtype: torch.dtype | None, matmul: bool) -> float:
        if not matmul:
            return self.vector_flops
        key = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
        return self.matmul_flops.get(key, self.vector_flops)

    def ridge(self, dtype: torch.dtype | None = torch.bfloat16, matmul: bool = True) -> float:
        """FLOP per byte at which an op stops being memory-bound."""
        return self.peak_flops(dtype, matmul) / self.bandwidth


_T = 1e12
DEVICE_SPECS: dict[str, DeviceSpec] = {
    # Hopper SXM: bf16 dense 989 TFLOP/s, fp32 (no TF32) 67 TFLOP/s; H200 has 4.8 TB/s HBM3e.
    "H200": DeviceSpec("H200", 132, 4.8e12, {"bf16": 989 * _T, "fp16": 989 * _T, "fp32": 67 * _T}, 67 * _T, 2.0),
    "H100": DeviceSpec("H100", 132, 3.35e12, {"bf16": 989 * _T, "fp16": 989 * _T, "fp32": 67 * _T}, 67 * _T, 2.0),
    # A100 SXM 80GB: bf16 312 TFLOP/s, fp32 19.5 TFLOP/s, 2.04 TB/s.
    "A100": DeviceSpec("A100", 108, 2.04e12, {"bf16": 312 * _T, "fp16": 312 * _T, "fp32": 19.5 * _T}, 19.5 * _T, 2.0),
    # A generic server CPU: order-of-magnitude numbers, good enough to rank ops.
    "cpu": DeviceSpec("cpu", 1, 50e9, {"bf16": 1 * _T, "fp16": 1 * _T, "fp32": 1 * _T}, 0.5 * _T, 1.0),
}


def detect_device_spec(device: torch.device | None) -> DeviceSpec:
    """The spec for `device`, by the CUDA device name; unknown GPUs plan as an H100."""
    if device is None or device.type != "cuda":
        return DEVICE_SPECS["cpu"]
    name = torch.cuda.get_device_name(device)
    for key in ("H200", "H100", "A100"):
        if key in name:
            return DEVICE_SPECS[key]
    return DEVICE_SPECS["H100"]
