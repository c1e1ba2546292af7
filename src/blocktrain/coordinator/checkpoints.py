"""The published weights of every block: versions, payloads, the checkpoint mirror, downloads, evaluations' inputs.

:class:`Checkpoints` holds one :class:`BlockVersion` per block, what the coordinator publishes now: W_v, the
safetensors payload workers download, its sha256, and the outer optimiser state carried to the next round. It serves
the encoded steps between versions and the frozen download of a finished block (built once). Every version is
mirrored as an ordinary block checkpoint of the run directory, so ``blocktrain eval RUN`` works on a live run. A stack
block that opens after its predecessors finished is warm-started from them (``stack.init``). Which version comes
next is decided by :mod:`.rounds`. Every method is called under the coordinator's lock.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from blocktrain.checkpoint.blocks import block_save_meta
from blocktrain.checkpoint.run import RunDir
from blocktrain.checkpoint.safetensors_io import pack, save_file, tensors_sha256, unpack
from blocktrain.config import RunConfig
from blocktrain.coordinator.aggregate import OuterState
from blocktrain.coordinator.intake import Published
from blocktrain.coordinator.rows import VersionRow
from blocktrain.coordinator.settings import CoordinatorSettings
from blocktrain.coordinator.store import Store
from blocktrain.errors import ProtocolError
from blocktrain.objectives.base import Objective, whole_blocks
from blocktrain.protocol.codes import Reason
from blocktrain.protocol.weights import block_schema, schema_fp32_bytes, trainable_state
from blocktrain.seeds import init_seed

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockVersion:
    """What one block publishes now."""

    version: int  # v
    weights: dict[str, torch.Tensor]  # W_v, float32 on the host
    payload: bytes  # W_v as the safetensors workers download
    sha: str  # tensors_sha256(W_v): what an update names as its base
    outer: OuterState = field(default_factory=OuterState)  # what the outer step carries from round v to v + 1


class Checkpoints:
    """The current version of every block and what is served or saved of it."""

    def __init__(self, run: RunDir, cfg: RunConfig, settings: CoordinatorSettings, objective: Objective,
                 store: Store) -> None:
        self.run, self.cfg, self.settings, self.objective, self.store = run, cfg, settings, objective, store
        self.n_blocks = cfg.model.n_blocks
        template = objective.build_block(0)
        E = getattr(template, "E", None)  # diffusion: the frozen target embedding, saved with every checkpoint
        self.E: torch.Tensor | None = E.detach().clone() if isinstance(E, torch.Tensor) else None
        with torch.device("meta"):  # names and shapes only: stack blocks differ (block 0 embeds)
            self.block_shapes = {k: block_schema(objective.build_block(k)) for k in range(self.n_blocks)}
        self.shapes = self.block_shapes[0]  # every block's schema for diffusion
        fp32_bytes = max(schema_fp32_bytes(sh) for sh in self.block_shapes.values())
        self.block_fp32_bytes = fp32_bytes  # of the largest block
        tensors = 1 + len(settings.inner_start.shares)  # the delta, and the moments pushed with it
        self.max_body_bytes = settings.max_body_bytes or 2 * tensors * fp32_bytes + 65536
        self._current: dict[int, BlockVersion] = {}  # block -> what it publishes now
        self._frozen_payload: dict[int, bytes] = {}  # finished block -> its frozen download (built once)
        self._served: dict[int, str] = {}  # block -> sha256 of the last weights someone fetched or was told to fetch

    def check_block(self, k: int) -> None:
        if not 0 <= k < self.n_blocks:
            raise ProtocolError(404, f"block {k} does not exist; this run has blocks 0..{self.n_blocks - 1}", Reason.BLOCK)

    # --- versions -------------------------------------------------------------------
    def initial(self, k: int) -> tuple[str, dict[str, torch.Tensor], bytes]:
        """(blob digest, weights, payload) of block k's version 0, stored: the same init as 'blocktrain train-block'."""
        torch.manual_seed(init_seed(self.cfg.train.seed, k))
        w = trainable_state(self.objective.build_block(k))
        payload = self.payload(k, 0, w)
        return self.store.blobs.put_blob(payload), w, payload

    def resume(self, k: int, row: VersionRow) -> int:
        """Load block k's newest stored version and its outer state; returns the version."""
        v = row.version
        payload = self.store.blobs.get_blob(row.weights_blob)
        w, _ = unpack(payload, source=f"block {k} version {v}")
        outer = OuterState()
        if row.momentum_blob:
            outer = OuterState.from_tensors(unpack(self.store.blobs.get_blob(row.momentum_blob), source="outer state")[0])
        self.publish(k, v, w, payload, outer)
        return v

    def payload(self, k: int, v: int, w: dict[str, torch.Tensor]) -> bytes:
        return pack(w, {"kind": "weights", "block_index": str(k), "version": str(v), "config": self.cfg.to_json()})

    def publish(self, k: int, v: int, w: dict[str, torch.Tensor], payload: bytes, outer: OuterState | None = None) -> None:
        """Version v of block k is the current one (its row is stored); ``outer``: the outer state it carries (None:
        the current one's, as a warm start keeps it)."""
        if outer is None:
            outer = self._current[k].outer if k in self._current else OuterState()
        self._current[k] = BlockVersion(v, w, payload, tensors_sha256(w), outer)

    def current(self, k: int) -> BlockVersion:
        """What block k publishes now."""
        return self._current[k]

    def versions(self) -> dict[int, int]:
        """Block -> its published version."""
        return {k: b.version for k, b in self._current.items()}

    def save_checkpoint(self, k: int) -> None:
        """Mirror the current weights as an ordinary block checkpoint, so 'blocktrain eval RUN' works."""
        now = self._current[k]
        meta = {**block_save_meta(self.cfg, k), "config": self.cfg.to_json(), "step": str(now.version)}
        extra = {"target_embedding": self.E} if self.E is not None else {}
        if self.objective.inherits():  # what block k takes from blocks 0..k-1 (frozen heads) is part of its checkpoint
            whole = whole_blocks(self.objective, [self._current[j].weights for j in range(k + 1)])[k]
            extra.update({n: t.detach().clone() for n, t in whole.state_dict().items() if n not in now.weights})
        save_file(self.run.block_path(k), {**now.weights, **extra}, meta)

    def warm_start(self, k: int) -> None:
        """Re-initialise waiting block k from the finished blocks before it (``stack.init``), as version 0. Its
        run-directory copy is the caller's to write (its frozen heads now come from the finished blocks)."""
        whole = whole_blocks(self.objective, [self._current[j].weights for j in range(k + 1)])
        self.objective.inherit(whole[k], k, whole[:k], at_init=True)
        w = trainable_state(whole[k])
        if all(torch.equal(w[n], self._current[k].weights[n]) for n in w):
            return
        payload = self.payload(k, 0, w)
        digest = self.store.blobs.put_blob(payload)
        with self.store.tx():
            self.store.rounds.replace_weights(k, 0, digest, tensors_sha256(w))
        self.publish(k, 0, w, payload)
        log.info("block %d: warm-started from block %d (%s)", k, k - 1, self.cfg.stack.init.value)

    def published(self, k: int) -> Published:
        """Block k's open round as the intake checks updates against it."""
        now = self._current[k]
        frozen = [(self._current[j].sha, self._current[j].weights) for j in range(self.objective.frozen_inputs(k))]
        return Published(k, now.version, now.sha, now.weights, frozen)

    # --- downloads ------------------------------------------------------------------
    def weights_bytes(self, k: int) -> tuple[int, bytes]:
        self.check_block(k)
        now = self._current[k]
        self._served[k] = now.sha
        return now.version, now.payload

    def take_first_fetch(self, k: int) -> bool:
        """Whether the asking worker is the first to learn of block k's current version (nobody fetched it or was
        told to): it fetches from the coordinator at once, and later hivemind workers wait for a peer (issue 23)."""
        sha = self._current[k].sha
        first = self._served.get(k) != sha
        self._served[k] = sha
        return first

    def step_bytes(self, k: int, from_version: int) -> bytes:
        """The published step (encoded as --step-compression says) from ``from_version`` to ``from_version + 1``."""
        self.check_block(k)
        missing = ProtocolError(404, f"block {k} has no step from version {from_version}; pull the full weights instead", Reason.NO_STEP)
        now = self._current[k]
        if not 0 <= from_version < now.version:
            raise missing
        digest = self.store.rounds.step_blob(k, from_version + 1)
        if digest is None:
            raise missing
        if from_version + 1 == now.version:
            self._served[k] = now.sha
        return self.store.blobs.get_blob(digest)

    def moments_bytes(self, k: int, v: int) -> bytes:
        """The inner moments published with version v of block k (shared moments: ``inner_start``)."""
        self.check_block(k)
        digest = self.store.rounds.moments_blob(k, v) if 0 <= v <= self._current[k].version else None
        if digest is None:
            raise ProtocolError(404, f"block {k} published no inner moments with version {v}; start the round from "
                                "the worker's own state", Reason.NO_MOMENTS)
        return self.store.blobs.get_blob(digest)

    def frozen_payload(self, k: int) -> bytes:
        """The frozen download of finished block k (built once: a finished block never changes)."""
        if k not in self._frozen_payload:
            now = self._current[k]
            meta = {"kind": "frozen", "block_index": str(k), "version": str(now.version),
                    "weights_sha": now.sha, "objective": str(self.cfg.objective), "config": self.cfg.to_json()}
            self._frozen_payload[k] = pack(now.weights, meta)
        return self._frozen_payload[k]

    # --- evaluation -----------------------------------------------------------------
    def eval_due(self, force: bool = False) -> tuple[int, dict[int, int], dict[int, dict[str, torch.Tensor]]] | None:
        """(epoch, versions, weights) to evaluate if an epoch (the least version over the blocks) is due, else None."""
        every = self.settings.eval_every
        if every == 0 and not force:
            return None
        versions = self.versions()
        epoch = min(versions.values())
        last = self.store.evals.last_eval_epoch()
        if not (last is None or epoch >= last + max(every, 1) or (force and epoch != last)):
            return None
        return epoch, versions, {k: self._current[k].weights for k in range(self.n_blocks)}
