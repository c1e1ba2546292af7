"""The B trained blocks composed into one model, and the E2E model, behind one interface.

Both expose ``log_probs(x, chains, seed) -> (chains, b, t, 256)``. The E2E model
is deterministic, so it returns one "chain".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from blocktrain.checkpoint.run import RunDir, load_model
from blocktrain.config import RunConfig
from blocktrain.data.stream import mix_seed
from blocktrain.diffusion.partition import NoisePartition
from blocktrain.diffusion.sampler import block_alone_logits, chain_logits, evaluations_per_traversal
from blocktrain.errors import CheckpointError, RunError
from blocktrain.model.block import BlockDenoiser
from blocktrain.model.e2e import E2ETransformer


class AssembledModel:
    """B independently trained blocks run as one Euler chain."""

    kind = "blocktrain"

    def __init__(self, blocks: Sequence[BlockDenoiser], cfg: RunConfig) -> None:
        if len(blocks) != cfg.model.n_blocks:
            raise RunError(f"expected {cfg.model.n_blocks} blocks, got {len(blocks)}")
        e0 = blocks[0].E
        for k, b in enumerate(blocks):
            if not torch.equal(b.E, e0):
                raise CheckpointError(f"block {k} holds a different target embedding E; blocks are from other runs")
            b.eval()
        self.blocks = list(blocks)
        self.cfg = cfg
        self.partition = NoisePartition(cfg.diffusion, cfg.model.n_blocks)

    @property
    def context(self) -> int:
        return self.cfg.model.context

    @classmethod
    def load(cls, run: RunDir, cfg: RunConfig | None = None) -> AssembledModel:
        cfg = cfg or run.load_config()
        blocks = []
        for k in range(cfg.model.n_blocks):
            path = run.block_path(k)
            if not path.is_file():
                raise RunError(f"{run.root} has no checkpoint for block {k} ({path}); train it with 'blocktrain train-block --block {k}'")
            block = BlockDenoiser(cfg.model, cfg.diffusion.sigma_data)
            load_model(path, block, cfg, "block", block_index=str(k))
            blocks.append(block)
        return cls(blocks, cfg)

    def traversal_flops_per_byte(self) -> float:
        """Forward FLOPs per scored byte of one traversal (2 x params x evaluations)."""
        params = sum(p.numel() for p in self.blocks[0].parameters())
        return 2.0 * params * evaluations_per_traversal(self.cfg.diffusion, self.cfg.model.n_blocks)

    @torch.no_grad()
    def log_probs(self, x: torch.Tensor, chains: int = 1, seed: int = 0) -> torch.Tensor:
        out = []
        for c in range(chains):
            g = torch.Generator().manual_seed(mix_seed(seed, c))
            logits = chain_logits(self.blocks, x, self.partition, self.cfg.diffusion, g)
            out.append(torch.log_softmax(logits.float(), dim=-1))
        return torch.stack(out)  # (chains, b, t, 256)

    @torch.no_grad()
    def block_alone_log_probs(self, k: int, x: torch.Tensor, seed: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(mix_seed(seed, 10_000 + k))
        logits = block_alone_logits(self.blocks[k], k, x, self.partition, g)
        return torch.log_softmax(logits.float(), dim=-1).unsqueeze(0)


class E2EModel:
    kind = "e2e"

    def __init__(self, model: E2ETransformer, cfg: RunConfig) -> None:
        self.model = model.eval()
        self.cfg = cfg

    @property
    def context(self) -> int:
        return self.cfg.model.context

    @classmethod
    def load(cls, run: RunDir, cfg: RunConfig | None = None) -> E2EModel:
        cfg = cfg or run.load_config()
        if not run.has_e2e():
            raise RunError(f"{run.root} has no E2E checkpoint; train it with 'blocktrain train-e2e'")
        model = E2ETransformer(cfg.model)
        load_model(run.e2e_path(), model, cfg, "e2e")
        return cls(model, cfg)

    def traversal_flops_per_byte(self) -> float:
        return 2.0 * sum(p.numel() for p in self.model.parameters())

    @torch.no_grad()
    def log_probs(self, x: torch.Tensor, chains: int = 1, seed: int = 0) -> torch.Tensor:
        return torch.log_softmax(self.model(x).float(), dim=-1).unsqueeze(0)


def load_model_from_run(run: RunDir, which: str = "auto") -> AssembledModel | E2EModel:
    """``which``: "blocktrain", "e2e" or "auto" (blocks if present, else E2E)."""
    cfg = run.load_config()
    if which == "blocktrain" or (which == "auto" and run.has_blocks(cfg.model.n_blocks)):
        return AssembledModel.load(run, cfg)
    if which in ("e2e", "auto"):
        return E2EModel.load(run, cfg)
    raise RunError(f"unknown model kind {which!r}; use blocktrain, e2e or auto")
