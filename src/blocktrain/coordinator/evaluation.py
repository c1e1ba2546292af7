"""The coordinator's evaluations: assembled-model CE and the per-block loss gate.

Both go through the run's objective (:func:`blocktrain.objectives.get_objective`)
and are cheap because blocks train locally: the gate runs one block (after the
frozen copies of the blocks it reads, for ``stack``) on one held-out batch; the
periodic eval composes every block over a validation slice. Both compute on the coordinator's ``--device``; the
weights they receive (and every figure they return) are on the host. The gate runs in the threads that check
updates, unlocked and side by side: each thread has its own scratch modules (``threading.local``), so no call
waits for another and none takes a lock.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
from torch import nn

from blocktrain.config import RunConfig
from blocktrain.coordinator.settings import CoordinatorSettings
from blocktrain.data.dataset import ByteSplit, DataDir
from blocktrain.data.stream import TrainStream
from blocktrain.device import built_on_host, resolve_device
from blocktrain.errors import ConfigError
from blocktrain.evaluate.assembled import AssembledModel
from blocktrain.evaluate.scoring import score_split
from blocktrain.objectives import get_objective
from blocktrain.objectives.base import whole_blocks
from blocktrain.protocol.weights import load_trainable
from blocktrain.seeds import gate_stream

FrozenWeights = tuple[str, dict[str, torch.Tensor]]  # (weights sha256, fp32 weights) of a finished block


class Evaluator:
    """Holds the validation split and each thread's scratch modules."""

    def __init__(self, cfg: RunConfig, settings: CoordinatorSettings, data: DataDir | None) -> None:
        self.cfg = cfg
        self.settings = settings
        self.objective = get_objective(cfg)
        self.valid: ByteSplit | None = data.open("valid") if data is not None else None
        self.device = resolve_device(settings.device)
        self._scratch = threading.local()  # per thread: .blocks (scratch block per schema), .frozen (j -> (sha, copy))
        if settings.gate_tolerance is not None and self.valid is None:
            raise ConfigError("the loss gate needs validation data; pass --data DIR")

    @property
    def enabled(self) -> bool:
        return self.valid is not None and self.settings.eval_bytes > 0

    def _mine(self) -> tuple[dict[int, nn.Module], dict[int, tuple[str, nn.Module]]]:
        """This thread's scratch blocks (one per schema) and frozen copies (block j -> (sha, fp32 frozen copy))."""
        if not hasattr(self._scratch, "blocks"):
            self._scratch.blocks, self._scratch.frozen = {}, {}
        return self._scratch.blocks, self._scratch.frozen

    def _frozen_copy(self, j: int, sha: str, weights: dict[str, torch.Tensor]) -> nn.Module:
        frozen = self._mine()[1]
        cached = frozen.get(j)
        if cached is None or cached[0] != sha:
            block = built_on_host(lambda: self.objective.build_block(j), self.device)
            load_trainable(block, weights)
            cached = (sha, self.objective.freeze(block, torch.float32))
            frozen[j] = cached
        return cached[1]

    def gate_loss(self, k: int, weights: dict[str, torch.Tensor], frozen: Sequence[FrozenWeights] = ()) -> float:
        """Block k's objective loss on a fixed held-out validation batch with fixed noise.

        ``frozen``: the finished blocks 0..k-1 that block k reads (stack); empty for diffusion.
        """
        assert self.valid is not None
        blocks = self._mine()[0]
        key = 0 if self.objective.blocks_alike else k  # one template serves blocks of one schema
        if key not in blocks:
            blocks[key] = built_on_host(lambda: self.objective.build_block(k), self.device)
        block = blocks[key]
        load_trainable(block, weights)
        if self.objective.inherits():  # the frozen heads a stack variant reads from the earlier blocks
            self.objective.inherit(block, k, whole_blocks(self.objective, [w for _, w in frozen]), at_init=False)
        block.eval()
        inputs = [self._frozen_copy(j, sha, w) for j, (sha, w) in enumerate(frozen)]
        stream = TrainStream(
            self.valid.data, self.cfg.model.context, self.settings.gate_batch, self.cfg.train.seed,
            stream=gate_stream(k),
        )
        x, y = stream.batch(0)
        with torch.no_grad():
            out = self.objective.block_loss(block, k, x.to(self.device), y.to(self.device),
                                            stream.generator(0, purpose=1), inputs)
        return float(out.loss)

    def evaluate(self, weights: dict[int, dict[str, torch.Tensor]], E: torch.Tensor | None) -> tuple[float, int]:
        """CE (nats/byte) of the assembled model on the first eval_bytes of validation."""
        assert self.valid is not None
        blocks = whole_blocks(self.objective, [weights[k] for k in range(self.cfg.model.n_blocks)])
        if E is not None:  # the diffusion blocks' shared target embedding
            for b in blocks:
                b.E.copy_(E)  # type: ignore[union-attr,operator]
        model = AssembledModel(blocks, self.cfg, device=self.device)
        seed = self.cfg.train.seed

        def lp(x: torch.Tensor) -> torch.Tensor:
            return model.log_probs(x, chains=1, seed=seed)

        res = score_split(lp, self.valid.data, self.cfg.model.context, max_bytes=self.settings.eval_bytes,
                          device=self.device)
        return res.ce_nats_per_byte, res.bytes_scored
