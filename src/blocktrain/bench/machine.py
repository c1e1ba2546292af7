"""A description of the machine a benchmark ran on."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch


def machine_info() -> dict[str, Any]:
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
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_bytes": mem,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cuda": torch.cuda.is_available(),
    }
