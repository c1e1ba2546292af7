"""The published weights of every block: versions, payloads, the checkpoint mirror, downloads and evaluation.

:class:`Checkpoints` holds the current weights W_v of every block (and the outer optimiser state carried between its
rounds), as the coordinator publishes them: the safetensors payload workers download, its sha256, the bf16 steps
between versions, and the frozen download of a finished block (built once). Every version is mirrored as an ordinary
block checkpoint of the run directory, so ``blocktrain eval RUN`` works on a live run. A stack block that opens
after its predecessors finished is warm-started from them (``stack.init``). The periodic evaluation of the assembled
model reads these weights too. Which version comes next is decided by :mod:`.rounds`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from blocktrain.checkpoint.blocks import block_save_meta
from blocktrain.checkpoint.run import RunDir
from blocktrain.checkpoint.safetensors_io import pack, save_file, tensors_sha256, unpack
from blocktrain.config import RunConfig
from blocktrain.coordinator.aggregate import OuterState
from blocktrain.coordinator.evaluation import Evaluator
from blocktrain.coordinator.intake import Published
from blocktrain.coordinator.settings import CoordinatorSettings
from blocktrain.coordinator.store import Store
from blocktrain.errors import ProtocolError
from blocktrain.objectives.base import Objective, whole_blocks
from blocktrain.protocol.weights import block_schema, trainable_state
from blocktrain.seeds import init_seed

log = logging.getLogger(__name__)


class Checkpoints:
    """The current weights of every block and what is served or saved of them (used under the coordinator's lock)."""

    def __init__(self, run: RunDir, cfg: RunConfig, settings: CoordinatorSettings, objective: Objective, store: Store,
                 evaluator: Evaluator, lock: threading.RLock, clock: Callable[[], float]) -> None:
        self.run, self.cfg, self.settings, self.objective, self.store = run, cfg, settings, objective, store
        self.evaluator = evaluator
        self.lock, self.clock = lock, clock
        self.n_blocks = cfg.model.n_blocks
        template = objective.build_block(0)
        E = getattr(template, "E", None)  # diffusion: the frozen target embedding, saved with every checkpoint
        self.E: torch.Tensor | None = E.detach().clone() if isinstance(E, torch.Tensor) else None
        with torch.device("meta"):  # names and shapes only: stack blocks differ (block 0 embeds)
            self.block_shapes = {k: block_schema(objective.build_block(k)) for k in range(self.n_blocks)}
        self.shapes = self.block_shapes[0]  # every block's schema for diffusion
        fp32_bytes = max(sum(4 * int(torch.Size(s).numel()) for s in sh.values()) for sh in self.block_shapes.values())
        self.block_fp32_bytes = fp32_bytes  # of the largest block
        self.max_body_bytes = settings.max_body_bytes or 2 * fp32_bytes + 65536
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self.weights_payload: dict[int, bytes] = {}
        self.weights_sha: dict[int, str] = {}
        self.version: dict[int, int] = {}
        self.outer: dict[int, OuterState] = {}  # momentum and step residual carried between rounds
        self._frozen_payload: dict[int, bytes] = {}  # finished block -> its frozen download (built once)
        self._served: dict[int, str] = {}  # block -> sha256 of the last weights someone fetched or was told to fetch

    def check_block(self, k: int) -> None:
        if not 0 <= k < self.n_blocks:
            raise ProtocolError(404, f"block {k} does not exist; this run has blocks 0..{self.n_blocks - 1}", "block")

    # --- versions -------------------------------------------------------------------
    def initial(self, k: int) -> tuple[str, dict[str, torch.Tensor], bytes]:
        """(blob digest, weights, payload) of block k's version 0, stored: the same init as 'blocktrain train-block'."""
        torch.manual_seed(init_seed(self.cfg.train.seed, k))
        w = trainable_state(self.objective.build_block(k))
        payload = self.payload(k, 0, w)
        return self.store.blobs.put_blob(payload), w, payload

    def resume(self, k: int, row: Any) -> int:
        """Load block k's newest stored version (a ``versions`` row) and its outer state; returns the version."""
        v = int(row["version"])
        payload = self.store.blobs.get_blob(row["weights_blob"])
        w, _ = unpack(payload, source=f"block {k} version {v}")
        self.publish(k, v, w, payload)
        if row["momentum_blob"]:
            tensors = unpack(self.store.blobs.get_blob(row["momentum_blob"]), source="outer state")[0]
            self.outer[k] = OuterState.from_tensors(tensors)
        return v

    def payload(self, k: int, v: int, w: dict[str, torch.Tensor]) -> bytes:
        return pack(w, {"kind": "weights", "block_index": str(k), "version": str(v), "config": self.cfg.to_json()})

    def publish(self, k: int, v: int, w: dict[str, torch.Tensor], payload: bytes) -> None:
        """Version v of block k is the current one (its row is stored)."""
        self.weights[k] = w
        self.version[k] = v
        self.weights_payload[k] = payload
        self.weights_sha[k] = tensors_sha256(w)
        self.outer.setdefault(k, OuterState())

    def save_checkpoint(self, k: int) -> None:
        """Mirror the current weights as an ordinary block checkpoint, so 'blocktrain eval RUN' works."""
        meta = {**block_save_meta(self.cfg, k), "config": self.cfg.to_json(), "step": str(self.version[k])}
        extra = {"target_embedding": self.E} if self.E is not None else {}
        if self.objective.inherits():  # what block k takes from blocks 0..k-1 (frozen heads) is part of its checkpoint
            whole = whole_blocks(self.objective, [self.weights[j] for j in range(k + 1)])[k]
            extra.update({n: t.detach().clone() for n, t in whole.state_dict().items() if n not in self.weights[k]})
        save_file(self.run.block_path(k), {**self.weights[k], **extra}, meta)

    def warm_start(self, k: int) -> None:
        """Re-initialise waiting block k from the finished blocks before it (``stack.init``), as version 0."""
        whole = whole_blocks(self.objective, [self.weights[j] for j in range(k + 1)])
        self.objective.inherit(whole[k], k, whole[:k], at_init=True)
        w = trainable_state(whole[k])
        if all(torch.equal(w[n], self.weights[k][n]) for n in w):
            self.save_checkpoint(k)  # its frozen heads now come from the finished blocks
            return
        payload = self.payload(k, 0, w)
        digest = self.store.blobs.put_blob(payload)
        with self.store.tx():
            self.store.rounds.replace_weights(k, 0, digest, tensors_sha256(w))
        self.publish(k, 0, w, payload)
        self.save_checkpoint(k)
        log.info("block %d: warm-started from block %d (%s)", k, k - 1, self.cfg.stack.init.value)

    def published(self, k: int) -> Published:
        """Block k's open round as the intake checks updates against it (call under the lock)."""
        frozen = [(self.weights_sha[j], self.weights[j]) for j in range(self.objective.frozen_inputs(k))]
        return Published(k, self.version[k], self.weights_sha[k], self.weights[k], frozen)

    # --- downloads ------------------------------------------------------------------
    def weights_bytes(self, k: int) -> tuple[int, bytes]:
        self.check_block(k)
        with self.lock:
            self._served[k] = self.weights_sha[k]
            return self.version[k], self.weights_payload[k]

    def take_first_fetch(self, k: int) -> bool:
        """Whether the asking worker is the first to learn of block k's current version (nobody fetched it or was
        told to): it fetches from the coordinator at once, and later hivemind workers wait for a peer (issue 23)."""
        first = self._served.get(k) != self.weights_sha[k]
        self._served[k] = self.weights_sha[k]
        return first

    def step_bytes(self, k: int, from_version: int) -> bytes:
        """The published bf16 step from ``from_version`` to ``from_version + 1``."""
        self.check_block(k)
        missing = ProtocolError(404, f"block {k} has no step from version {from_version}; pull the full weights instead", "no_step")
        if not 0 <= from_version < self.version[k]:
            raise missing
        with self.lock:
            digest = self.store.rounds.step_blob(k, from_version + 1)
            if digest is None:
                raise missing
            if from_version + 1 == self.version[k]:
                self._served[k] = self.weights_sha[k]
            return self.store.blobs.get_blob(digest)

    def frozen_payload(self, k: int) -> bytes:
        """The frozen download of finished block k (built once: a finished block never changes)."""
        if k not in self._frozen_payload:
            meta = {"kind": "frozen", "block_index": str(k), "version": str(self.version[k]),
                    "weights_sha": self.weights_sha[k], "objective": str(self.cfg.objective), "config": self.cfg.to_json()}
            self._frozen_payload[k] = pack(self.weights[k], meta)
        return self._frozen_payload[k]

    # --- evaluation -----------------------------------------------------------------
    def maybe_evaluate(self, force: bool = False) -> float | None:
        """Evaluate the assembled model if an epoch (min version over blocks) is due."""
        every = self.settings.eval_every
        if not self.evaluator.enabled or (every == 0 and not force):
            return None
        with self.lock:
            epoch = min(self.version.values())
            last = self.store.evals.last_eval_epoch()
            due = last is None or epoch >= last + max(every, 1) or (force and epoch != last)
            if not due:
                return None
            versions = dict(self.version)
            snapshot = {k: self.weights[k] for k in range(self.n_blocks)}
        ce, n = self.evaluator.evaluate(snapshot, self.E)
        with self.lock, self.store.tx():
            self.store.evals.record_eval(epoch, versions, ce, n, self.clock())
        log.info("eval at epoch %d (versions %s): CE %.4f nats/byte on %d bytes", epoch, versions, ce, n)
        return ce
