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
from collections.abc import Callable, Iterator

import torch
from torch import nn

from blocktrain.config import CompileMode, Precision
from blocktrain.errors import ConfigError

log = logging.getLogger(__name__)

CPU = torch.device("cpu")  # the host: bytes arrive from disks and the wire here, and leave from here


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """The one device rule: ``auto`` -> cuda when available, else cpu; ``cuda`` without a GPU is an error that says so.

    Every path that computes (training, scoring, generation, serving, the coordinator's gate, evaluation and audit
    replay, the in-process rounds) takes the device this returns, moves its weights there once and its batches
    there once, and returns to the host only at its boundary (a figure, a frame on the wire, a file).
    """
    if isinstance(name, torch.device):
        name = str(name)
    if name == "auto":  # then as if named: on CUDA TF32 is allowed too (it returned before that, so auto and cuda
        name = "cuda" if torch.cuda.is_available() else "cpu"  # computed fp32 matmuls apart on the same GPU)
    try:
        dev = torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(f"device {name!r} is not a device torch knows ({exc}); use cpu, cuda, cuda:N or auto") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but this torch has no CUDA device; use --device cpu or auto")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(f"device {name!r} requested but this machine has {torch.cuda.device_count()} CUDA device(s); "
                          "use cuda:0 up to the last, or auto")
    if dev.type == "cuda":
        _allow_tf32()
    return dev


@functools.cache
def _allow_tf32() -> None:
    """fp32 matmuls and convolutions on CUDA run on tensor cores in TF32 (10-bit mantissa products, fp32 sums): the
    fp32 arithmetic of a GPU worker, a GPU audit replay or a GPU reference. Its replay error against a CPU's fp32
    is below bf16's, which the audit tolerance was set from (benchmarks/results/audit-replay.json)."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    log.info("CUDA: fp32 matmuls use TF32")


def compile_module(module: nn.Module, mode: CompileMode) -> nn.Module:
    """``module`` with its forward compiled in place by torch.compile (the same module: parameters, buffers and
    state-dict keys unchanged); OFF leaves it eager. Compilation happens at the first call, and again for a new
    shape (evaluation batches), with shapes marked dynamic after the first change."""
    if mode is not CompileMode.OFF:
        module.compile(mode=mode.value)
    return module


def built_on_host(build: Callable[[], nn.Module], device: torch.device) -> nn.Module:
    """``build()`` run on the host, then moved to ``device`` once: a block's initial draw (and any buffer it makes) is
    the same on every device, whatever default device a caller set."""
    with torch.device(CPU):
        module = build()
    return module.to(device)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without waiting: on CUDA it is copied from pinned memory, queued behind the
    work already there (a pageable copy would wait for the device); elsewhere it is moved as usual."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a no-op on the host): a timer reads the clock only after it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@functools.cache
def bf16_supported(device_type: str) -> bool:
    """True when bf16 matmuls run natively: CUDA with bf16 support, or a CPU with AVX512-BF16 or AMX.

    oneDNN runs a bf16 matmul on any x86-64, but without those instructions it
    emulates it: on an AVX2-only CPU a bf16 matmul measured 1.3 GFLOP/s against
    74 GFLOP/s in fp32, so training would be about 60x slower than in fp32.
    """
    if device_type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if device_type == "cpu":
        return _cpu_has_native_bf16()
    return False


def _cpu_has_native_bf16() -> bool:
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if any(p is not None for p in probes):
        native = any(bool(p()) for p in probes if p is not None)
    else:  # an older torch: read the CPU's flags
        try:
            with open("/proc/cpuinfo") as f:
                flags = f.read()
        except OSError:
            return False
        native = "avx512_bf16" in flags or "amx_bf16" in flags
    if not native:
        return False
    try:
        a = torch.ones(4, 4, dtype=torch.bfloat16)
        return bool(torch.isfinite((a @ a).float()).all())
    except RuntimeError:
        return False


_WARNED_FP32: set[str] = set()  # device types whose fp32 fallback has been logged in this process


def resolve_precision(precision: Precision, device: torch.device) -> Precision:
    """The precision actually used: bf16 falls back to fp32 (with a log line) where the device lacks it."""
    if precision is Precision.BF16 and not bf16_supported(device.type):
        if device.type not in _WARNED_FP32:  # once per process and device type, not once per block or arm
            _WARNED_FP32.add(device.type)
            log.warning("bf16 is not native on %s (no AVX512-BF16/AMX on a CPU); computing in fp32", device)
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
