"""The coordinator's evaluations: assembled-model CE and the per-block loss gate.

Both are cheap because blocks are independent: the gate runs one block on one
held-out batch; the periodic eval runs the Euler chain over a validation slice.
"""

from __future__ import annotations

import threading

import torch

from blocktrain.config import RunConfig
from blocktrain.coordinator.settings import CoordinatorSettings
from blocktrain.coordinator.wire import load_trainable
from blocktrain.data.dataset import ByteSplit, DataDir
from blocktrain.data.stream import TrainStream, mix_seed
from blocktrain.diffusion.loss import block_loss
from blocktrain.diffusion.partition import NoisePartition
from blocktrain.errors import ConfigError
from blocktrain.evaluate.assembled import AssembledModel
from blocktrain.evaluate.scoring import score_split
from blocktrain.model.block import BlockDenoiser

GATE_STREAM = 7_777  # stream id of the gate's held-out batch


class Evaluator:
    """Holds the validation split and scratch modules; thread-safe via its own lock."""

    def __init__(self, cfg: RunConfig, settings: CoordinatorSettings, data: DataDir | None) -> None:
        self.cfg = cfg
        self.settings = settings
        self.valid: ByteSplit | None = data.open("valid") if data is not None else None
        self.partition = NoisePartition(cfg.diffusion, cfg.model.n_blocks)
        self._lock = threading.Lock()
        self._gate_block: BlockDenoiser | None = None
        if settings.gate_tolerance is not None and self.valid is None:
            raise ConfigError("the loss gate needs validation data; pass --data DIR")

    @property
    def enabled(self) -> bool:
        return self.valid is not None and self.settings.eval_bytes > 0

    def gate_loss(self, k: int, weights: dict[str, torch.Tensor]) -> float:
        """Block k's weighted loss on a fixed held-out validation batch with fixed noise."""
        assert self.valid is not None
        with self._lock:
            if self._gate_block is None:
                self._gate_block = BlockDenoiser(self.cfg.model, self.cfg.diffusion.sigma_data)
            block = self._gate_block
            load_trainable(block, weights)
            block.eval()
            stream = TrainStream(
                self.valid.data, self.cfg.model.context, self.settings.gate_batch, self.cfg.train.seed,
                stream=mix_seed(GATE_STREAM, k),
            )
            x, y = stream.batch(0)
            with torch.no_grad():
                out = block_loss(block, k, x, y, self.partition, self.cfg.diffusion, stream.generator(0, purpose=1))
            return float(out.loss)

    def evaluate(self, weights: dict[int, dict[str, torch.Tensor]], E: torch.Tensor) -> tuple[float, int]:
        """CE (nats/byte) of the assembled chain on the first eval_bytes of validation."""
        assert self.valid is not None
        blocks = []
        for k in range(self.cfg.model.n_blocks):
            b = BlockDenoiser(self.cfg.model, self.cfg.diffusion.sigma_data)
            load_trainable(b, weights[k])
            b.E.copy_(E)
            blocks.append(b)
        model = AssembledModel(blocks, self.cfg)
        seed = self.cfg.train.seed

        def lp(x: torch.Tensor) -> torch.Tensor:
            return model.log_probs(x, chains=1, seed=seed)

        res = score_split(lp, self.valid.data, self.cfg.model.context, max_bytes=self.settings.eval_bytes)
        return res.ce_nats_per_byte, res.bytes_scored
