"""Where tensors compute and in what arithmetic: device resolution and mixed precision.

Mixed precision follows the usual recipe (Micikevicius et al. 2018, with bf16
instead of fp16, so no loss scaling): master weights and AdamW state stay fp32,
matmuls and attention run in bf16 under ``torch.autocast``, and every
log-softmax / cross-entropy is computed on fp32 logits by its caller. The same
code path runs on CPU and CUDA; only the autocast device type differs.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator

import torch

from blocktrain.config import Precision
from blocktrain.errors import ConfigError

log = logging.getLogger(__name__)


def resolve_device(name: str = "auto") -> torch.device:
    """``auto`` -> cuda when available, else cpu; ``cuda`` without a GPU is an error that says so."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but this torch has no CUDA device; use --device cpu or auto")
    return dev


@functools.cache
def bf16_supported(device_type: str) -> bool:
    """True when bf16 matmuls run natively (CUDA with bf16 support; CPU with AVX512-BF16/AMX or a working fallback).

    On CPU a bf16 matmul is tried once; oneDNN runs it on any x86-64, and this
    project measures whether it pays (``blocktrain bench machine``).
    """
    if device_type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if device_type == "cpu":
        try:
            a = torch.ones(4, 4, dtype=torch.bfloat16)
            return bool(torch.isfinite((a @ a).float()).all())
        except RuntimeError:
            return False
    return False


def resolve_precision(precision: Precision, device: torch.device) -> Precision:
    """The precision actually used: bf16 falls back to fp32 (with a log line) where the device lacks it."""
    if precision is Precision.BF16 and not bf16_supported(device.type):
        log.warning("bf16 is not supported on %s; training in fp32", device)
        return Precision.FP32
    return precision


@contextlib.contextmanager
def autocast(precision: Precision, device: torch.device) -> Iterator[None]:
    """bf16 autocast on ``device`` for Precision.BF16; a no-op for fp32."""
    if precision is Precision.BF16:
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            yield
    else:
        yield
