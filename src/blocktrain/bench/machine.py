"""A description of the machine a benchmark ran on."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from blocktrain.device import CPU, bf16_supported, synchronize


def machine_info(device: torch.device | None = None) -> dict[str, Any]:
    """The machine a benchmark ran on; with ``device``, also the device it ran on (and the GPU's name on CUDA)."""
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    where: dict[str, Any] = {}
    if device is not None:
        where["device"] = str(device)
        if device.type == "cuda":
            where["gpu"] = torch.cuda.get_device_name(device)
    return {
        **where,
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_bytes": mem,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cuda": torch.cuda.is_available(),
    }


def median_seconds(fn: Callable[[], object], device: torch.device, reps: int, warmup: int = 1) -> float:
    """Median wall seconds of ``fn()`` to its end on ``device`` over ``reps`` calls, after ``warmup`` untimed ones
    (the device synchronised around each timed call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_peak_flops(device: torch.device | None = None, n: int | None = None, seconds: float = 1.0) -> dict[str, float]:
    """Dense matmul peak of ``device`` in FLOP/s, for fp32 and bf16: the best of repeated n x n x n products.

    2 n^3 FLOPs per product; each dtype is warmed up, then timed for about
    ``seconds``. The best rate over sizes n/2 and n is reported, since small
    caches favour one or the other.
    """
    device = device or CPU
    n = n or (8192 if device.type == "cuda" else 2048)
    out: dict[str, float] = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        best = 0.0
        # An emulated bf16 (a CPU without AVX512-BF16/AMX) runs near 1 GFLOP/s: small sizes measure it in seconds, not minutes.
        sizes = (n // 2, n) if dtype is torch.float32 or bf16_supported(device.type) else (n // 16, n // 8)
        for size in sizes:
            a = torch.randn(size, size, device=device).to(dtype)
            b = torch.randn(size, size, device=device).to(dtype)
            for _ in range(2):
                a @ b
            synchronize(device)
            reps, t0 = 0, time.perf_counter()
            while True:
                a @ b
                reps += 1
                synchronize(device)
                elapsed = time.perf_counter() - t0
                if elapsed >= seconds / 2:
                    break
            best = max(best, 2.0 * size**3 * reps / elapsed)
        out[name] = best
    return out


