"""The one optimiser step that every trainer calls (block, E2E, worker, ablation harness).

    set lr -> backward -> clip the global gradient norm -> AdamW step -> free gradients

AdamW keeps fp32 master weights and fp32 moments whatever the forward
precision; it is the fused implementation where this torch has one for the
parameters' device (one kernel per step instead of one per tensor).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from blocktrain.config import TrainConfig

ADAMW_BETAS = (0.9, 0.95)  # (beta1, beta2) of every inner AdamW: the trainers', the workers' (RoundAdamW)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up then cosine decay to min_lr_ratio * lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    frac = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def round_lr_scale(schedule: TrainConfig, offset: int, steps: int) -> float:
    """The mean lr of schedule steps ``offset .. offset + steps - 1`` over the peak lr: how far, relative to the peak,
    a round of ``steps`` inner steps at that place of the schedule moves its block (an Adam step is about lr long)."""
    last = schedule.steps - 1
    return sum(lr_at(min(offset + i, last), schedule) for i in range(max(1, steps))) / (max(1, steps) * schedule.lr)


def _decays(name: str, p: torch.Tensor) -> bool:
    """Weight decay on matrices, not on biases, norms or embedding tables."""
    return p.dim() >= 2 and "emb" not in name


def decay_groups(module: nn.Module, cfg: TrainConfig) -> tuple[list[dict], dict[int, str]]:
    """The trainable parameters as AdamW's two groups (weight decay on matrices, none elsewhere), plus the
    index -> parameter-name map that checkpoints and pushed moments use."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    decay = [p for n, p in named if _decays(n, p)]
    no_decay = [p for n, p in named if not _decays(n, p)]
    order = [id(p) for p in decay + no_decay]
    by_id = {id(p): n for n, p in named}
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return groups, {i: by_id[pid] for i, pid in enumerate(order)}


def make_optimizer(module: nn.Module, cfg: TrainConfig) -> tuple[torch.optim.AdamW, dict[int, str]]:
    """AdamW over the trainable parameters, plus the index -> parameter-name map that checkpoints use."""
    groups, names = decay_groups(module, cfg)
    params = [p for g in groups for p in g["params"]]
    devices = {p.device.type for p in params}
    fused = bool(params) and devices <= {"cpu", "cuda"} and all(p.dtype == torch.float32 for p in params)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=ADAMW_BETAS, fused=fused or None), names


class MuonAdamW(torch.optim.Optimizer):
    """Muon (Jordan et al. 2024) on a block's hidden matrices, AdamW on the rest (embeddings, head, biases, norms).

    The inner optimiser MuLoCo (Therien et al. 2025) pairs with DiLoCo's outer step. Muon's lr is matched to AdamW's
    update RMS (``adjust_lr_fn="match_rms_adamw"``, Liu et al. 2025), so both halves follow the one lr schedule that
    :func:`optimizer_step` sets on every group. A measured lever (benchmarks/distributed/averaging_scaling.py ``--inner muon``),
    not a default: audits and checkpoints read AdamW's state.
    """

    def __init__(self, module: nn.Module, cfg: TrainConfig) -> None:
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        hidden = [p for n, p in named if p.dim() == 2 and "emb" not in n and not n.startswith("head")]
        ids = {id(p) for p in hidden}
        rest = [p for _, p in named if id(p) not in ids]
        self.parts: list[torch.optim.Optimizer] = [
            torch.optim.Muon(hidden, lr=cfg.lr, weight_decay=cfg.weight_decay, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW(rest, lr=cfg.lr, betas=ADAMW_BETAS, weight_decay=0.0),
        ]
        super().__init__([{"params": hidden}, {"params": rest}], {"lr": cfg.lr})
        self.param_groups = [g for part in self.parts for g in part.param_groups]  # optimizer_step sets their lr

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)


def optimizer_step(
    module: nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor, lr: float, grad_clip: float,
    stepped: Callable[[], object] | None = None,
) -> torch.Tensor:
    """One update of ``module`` from ``loss``; returns the global gradient norm before clipping, a scalar on the
    parameters' device (reading it waits for the device, so the loop leaves that to whoever logs it). ``stepped`` is
    called as soon as the optimiser has stepped: the loop counts the step there, so a Ctrl-C after it saves the
    weights under the step that made them (one later resumed would apply that step again)."""
    for group in opt.param_groups:
        group["lr"] = lr
    loss.backward()
    gnorm = nn.utils.clip_grad_norm_(module.parameters(), grad_clip or float("inf"), foreach=True)
    opt.step()
    if stepped is not None:
        stepped()
    # Free the gradients now, not before the next backward: alive through the
    # next forward they sit between its activations and fragment the heap.
    opt.zero_grad(set_to_none=True)
    return gnorm.detach()


def optimizer_bytes(module: nn.Module) -> int:
    """AdamW keeps two fp32 moments per trainable parameter."""
    return 2 * sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
