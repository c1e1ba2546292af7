"""Process memory: current and peak resident set size (Linux /proc and getrusage)."""

from __future__ import annotations

import os
import resource
import sys


def rss_bytes() -> int:
    """Current RSS of this process in bytes."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # non-Linux: fall back to the peak
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """Peak RSS of this process in bytes (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def warm_runtime() -> None:
    """Run one tiny training step on a throwaway module.

    PyTorch loads kernels, thread pools and optimiser code lazily on first use
    (about 80 MiB of RSS on CPU). Doing that before the memory baseline is taken
    keeps the runtime out of the "training memory" of the model being measured.
    """
    import torch
    import torch.nn.functional as F
    from torch import nn

    from blocktrain.model.layers import causal_attention

    layer = nn.Sequential(nn.Embedding(4, 8), nn.LayerNorm(8), nn.Linear(8, 8))
    opt = torch.optim.AdamW(layer.parameters(), fused=True)
    for bf16 in (False, True):  # both arithmetics' kernels (bf16 autocast loads oneDNN's)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            h = layer(torch.zeros(2, 4, dtype=torch.long))  # (2, 4, 8)
            h = causal_attention(h[:, None], h[:, None], h[:, None])  # (2, 1, 4, 8)
        F.cross_entropy(F.gelu(h).float().reshape(-1, 8), torch.zeros(8, dtype=torch.long)).backward()
        nn.utils.clip_grad_norm_(layer.parameters(), 1.0, foreach=True)
        opt.step()
