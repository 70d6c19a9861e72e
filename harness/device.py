"""
device.py -- the machine a command runs on: which device and dtype (pick_device, pick_dtype: every command's --device
and --dtype), the datasheet peaks of known CUDA cards (train.py's MFU, serve.py's and bench.py's bandwidth columns),
and the one clock of the benchmarks (sync, timeit: a reading of the clock between two synchronisations of the device).
"""
from __future__ import annotations

import time

import torch

from model import check

# Known CUDA cards: (a part of torch.cuda.get_device_name, dense bf16 tensor FLOP/s, memory bandwidth in bytes/s), the
# vendors' datasheet peaks. train.py's step line reports MFU against the first, serve.py's table the bandwidth against
# the second. A device takes the first row whose name part its name contains: the more specific names come first.
PEAK = [("H200", 989e12, 4.8e12), ("H100 PCIe", 756e12, 2.0e12), ("H100", 989e12, 3.35e12),
        ("A100-SXM4-40GB", 312e12, 1.555e12), ("A100-PCIE-40GB", 312e12, 1.555e12), ("A100", 312e12, 2.039e12),
        ("L40S", 362e12, 0.864e12), ("A10G", 125e12, 0.6e12), ("4090", 165e12, 1.008e12)]


def _peak(device: torch.device) -> tuple[float, float] | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next(((flops, bw) for part, flops, bw in PEAK if part in name), None)


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak FLOP/s of a known CUDA device (for MFU), None elsewhere."""
    peak = _peak(device)
    return peak[0] if peak else None


def peak_bandwidth(device: torch.device) -> float | None:
    """Peak memory bandwidth (bytes/s) of a known CUDA device, None elsewhere."""
    peak = _peak(device)
    return peak[1] if peak else None


def pick_device(flag: str = "auto") -> torch.device:
    """cuda > mps > cpu unless a device is named."""
    if flag != "auto":
        return torch.device(flag)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def pick_dtype(device: torch.device, flag: str = "auto") -> torch.dtype:
    """bf16 where the device supports it (CUDA with bf16, MPS), else fp32; or the named dtype."""
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if flag != "auto":
        check(flag in names, f"unknown dtype {flag!r}; choose auto or one of {sorted(names)}", "--dtype")
        return names[flag]
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    if device.type == "mps":
        return torch.bfloat16
    return torch.float32


def sync(device):
    """Wait for the device's queued work (CUDA is asynchronous; the CPU is not): call before reading a clock."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def timeit(fn, device, warmup: int = 1, repeats: int = 5) -> list[float]:
    """Seconds per call of fn() for `repeats` timed calls after `warmup` untimed ones, the device synchronised around
    each call. The one timing helper of the benchmarks (they report the median and the spread of this list)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times

