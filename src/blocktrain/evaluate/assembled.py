"""The B trained blocks composed into one model, and the E2E model, behind one interface.

Both expose ``log_probs(x, chains, seed) -> (chains, b, t, 256)``. The E2E model
and a stack are deterministic, so they return one "chain". Composition goes
through the run's :class:`~blocktrain.objectives.base.Objective`; so do the
single-block references (``reference_log_probs``: every prefix of a stack,
every diffusion block alone). ``precision`` sets the inference arithmetic and ``device`` where it runs: the
weights move there once, at construction, and ``log_probs`` moves its input there (a no-op when the caller, like
:func:`~blocktrain.evaluate.scoring.score_split`, already holds its batches on the device).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from blocktrain.checkpoint.blocks import load_block
from blocktrain.checkpoint.run import RunDir, load_model
from blocktrain.config import Precision, RunConfig
from blocktrain.device import CPU, autocast
from blocktrain.errors import RunError
from blocktrain.model.e2e import E2ETransformer
from blocktrain.model.flops import forward_flops_per_token
from blocktrain.objectives import compose_logits, get_objective
from blocktrain.seeds import Seed


class AssembledModel:
    """B independently trained blocks composed by their objective (Euler chain or residual stack)."""

    kind = "blocktrain"

    def __init__(
        self, blocks: Sequence[nn.Module], cfg: RunConfig, precision: Precision = Precision.FP32,
        device: torch.device = CPU,
    ) -> None:
        if len(blocks) != cfg.model.n_blocks:
            raise RunError(f"expected {cfg.model.n_blocks} blocks, got {len(blocks)}")
        self.objective = get_objective(cfg)
        self.objective.check_composable(blocks)
        self.blocks = [b.to(device).eval() for b in blocks]
        self.cfg = cfg
        self.precision = precision
        self.device = device

    @property
    def context(self) -> int:
        return self.cfg.model.context

    @property
    def deterministic(self) -> bool:
        """A stack draws no noise: one "chain" is all there is."""
        return self.objective.deterministic

    @classmethod
    def load(
        cls, run: RunDir, cfg: RunConfig | None = None, precision: Precision = Precision.FP32, device: torch.device = CPU,
    ) -> AssembledModel:
        cfg = cfg or run.load_config()
        return cls([load_block(run, cfg, k) for k in range(cfg.model.n_blocks)], cfg, precision, device)

    def traversal_flops_per_byte(self) -> float:
        """Forward FLOPs per scored byte of one traversal."""
        return self.objective.traversal_flops_per_byte(self.blocks)

    @torch.no_grad()
    def log_probs(self, x: torch.Tensor, chains: int = 1, seed: int = 0) -> torch.Tensor:
        x = x.to(self.device)
        out = []
        for c in range(1 if self.deterministic else chains):
            g = Seed.CHAIN.generator(seed, c)
            with autocast(self.precision, x.device):
                logits = compose_logits(self.objective, self.blocks, x, g)
            out.append(torch.log_softmax(logits.float(), dim=-1))
        return torch.stack(out)  # (chains, b, t, 256)

    @torch.no_grad()
    def reference_log_probs(self, x: torch.Tensor, seed: int = 0, only: int | None = None) -> torch.Tensor:
        """Log-probs of the single-block references, (B, b, t, 256): prefix 0..k (stack) or block k alone (diffusion).

        ``only=k``: block k alone, (1, b, t, 256) (diffusion; a stack's prefixes come in one pass).
        """
        x = x.to(self.device)
        with autocast(self.precision, x.device):
            logits = self.objective.single_block_logits(self.blocks, x, seed, only)
        return torch.stack([torch.log_softmax(lg.float(), dim=-1) for lg in logits])


class E2EModel:
    kind = "e2e"

    deterministic = True

    def __init__(
        self, model: E2ETransformer, cfg: RunConfig, precision: Precision = Precision.FP32, device: torch.device = CPU,
    ) -> None:
        self.model = model.to(device).eval()
        self.cfg = cfg
        self.precision = precision
        self.device = device

    @property
    def context(self) -> int:
        return self.cfg.model.context

    @classmethod
    def load(
        cls, run: RunDir, cfg: RunConfig | None = None, precision: Precision = Precision.FP32, device: torch.device = CPU,
    ) -> E2EModel:
        cfg = cfg or run.load_config()
        if not run.has_e2e():
            raise RunError(f"{run.root} has no E2E checkpoint; train it with 'blocktrain train-e2e'")
        model = E2ETransformer(cfg.model)
        load_model(run.e2e_path(), model, cfg, "e2e")
        return cls(model, cfg, precision, device)

    def traversal_flops_per_byte(self) -> float:
        """One forward pass per byte, counted as the stack's and the training FLOPs are (:mod:`blocktrain.model.flops`:
        matmul weights and attention; it was 2 x every parameter, embeddings and norms in, attention out)."""
        return forward_flops_per_token(self.model, self.cfg.model.d_model, self.cfg.model.context)

    @torch.no_grad()
    def log_probs(self, x: torch.Tensor, chains: int = 1, seed: int = 0) -> torch.Tensor:
        x = x.to(self.device)
        with autocast(self.precision, x.device):
            logits = self.model(x)
        return torch.log_softmax(logits.float(), dim=-1).unsqueeze(0)


def load_model_from_run(
    run: RunDir, which: str = "auto", precision: Precision = Precision.FP32, device: torch.device = CPU,
) -> AssembledModel | E2EModel:
    """``which``: "blocktrain", "e2e" or "auto" (blocks if present, else E2E), on ``device``."""
    cfg = run.load_config()
    missing = [k for k in range(cfg.model.n_blocks) if not run.block_path(k).is_file()]
    if missing and (which == "blocktrain" or (which == "auto" and len(missing) < cfg.model.n_blocks)):
        raise RunError(  # a partly trained run: say which block files are missing, not "no E2E checkpoint"
            f"{run.root} is missing {len(missing)} of its {cfg.model.n_blocks} block files "
            f"({', '.join(str(run.block_path(k)) for k in missing)}); train them with 'blocktrain train-block --out "
            f"{run.root} --preset {cfg.name} --block K' for K in {', '.join(map(str, missing))} (with any overrides "
            f"the run was created with)" + (", or evaluate its E2E model with --model e2e" if run.has_e2e() else "")
        )
    if which == "blocktrain" or (which == "auto" and run.has_blocks(cfg.model.n_blocks)):
        return AssembledModel.load(run, cfg, precision, device)
    if which in ("e2e", "auto"):
        return E2EModel.load(run, cfg, precision, device)
    raise RunError(f"unknown model kind {which!r}; use blocktrain, e2e or auto")
