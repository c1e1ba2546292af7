"""Model FLOPs: what a step of training or one forward pass costs, by the usual convention.

Per token, a forward pass costs 2 FLOPs per weight of every matmul it runs and
a backward pass twice that (Kaplan et al. 2020, Sec. 2.1: C = 6N per token).
Attention adds 4 T d per layer forward (QK^T and AV over T keys; Chowdhery et
al. 2022, App. B, counted without the causal halving). Embedding look-ups are
not matmuls and are not counted. Conditioning matmuls that run once per
sequence rather than once per token (the diffusion block's sigma embedding and
adaLN modulation) are negligible and left out.
"""

from __future__ import annotations

from torch import nn

PER_SEQUENCE_MODULES = ("sigma_emb", "mod")  # top-level children applied to (b, 1, .) tensors


def matmul_params(module: nn.Module) -> int:
    """Weights of the Linear layers a token passes through (biases are not matmuls)."""
    total = 0
    for name, m in module.named_modules():
        if isinstance(m, nn.Linear) and name.split(".")[0] not in PER_SEQUENCE_MODULES:
            total += m.weight.numel()
    return total


def attention_layers(module: nn.Module) -> int:
    """Number of self-attention layers in ``module``."""
    from blocktrain.model.layers import CausalSelfAttention

    return sum(1 for m in module.modules() if isinstance(m, CausalSelfAttention))


def forward_flops_per_token(module: nn.Module, d_model: int, context: int) -> float:
    """2 N + 4 L T d: one forward pass, per token."""
    return 2.0 * matmul_params(module) + 4.0 * attention_layers(module) * context * d_model


def train_flops_per_token(module: nn.Module, d_model: int, context: int) -> float:
    """6 N + 12 L T d: forward and backward, per token (Chowdhery et al. 2022, App. B); plus one more forward of
    every layer that recomputes its activations in the backward (``train.recompute``)."""
    again = sum(forward_flops_per_token(m, d_model, context) for m in module.modules() if getattr(m, "recompute", False))
    return 3.0 * forward_flops_per_token(module, d_model, context) + again
