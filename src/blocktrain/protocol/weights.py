"""Block weights on the wire: which parameters travel and how a published step is applied.

Only *trainable* parameters travel; the frozen target embedding E is rebuilt
from ``embed_seed`` on each side and never sent. The coordinator publishes the
encoded outer step (:mod:`blocktrain.protocol.delta`), and both coordinator and
workers compute ``W_{v+1} = W_v + decode(step)`` with :func:`apply_step` on the
decoded float32 step, so they hold bit-identical weights.
"""

from __future__ import annotations

import torch
from torch import nn


def trainable_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Detached float32 copies of the trainable parameters (never the frozen E)."""
    return {n: p.detach().float().cpu().clone() for n, p in module.named_parameters() if p.requires_grad}


def load_trainable(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` into the module's parameters in place (keeps optimiser state bound)."""
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value)


def block_schema(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the trainable parameters of a block."""
    return {n: tuple(p.shape) for n, p in module.named_parameters() if p.requires_grad}


def schema_fp32_bytes(schema: dict[str, tuple[int, ...]]) -> int:
    """Bytes of a block's trainable tensors (:func:`block_schema`) in fp32."""
    return sum(4 * int(torch.Size(shape).numel()) for shape in schema.values())


def apply_step(weights: dict[str, torch.Tensor], step: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """W_{v+1} = W_v + step (the decoded float32 step); the same code runs on both sides of the wire."""
    return {n: (w + step[n].float()).contiguous() for n, w in weights.items()}
