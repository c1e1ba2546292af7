"""The in-process rounds' records of one block (:mod:`.simulate`): what a coordinator's store holds that an audit's
lineage reads (:class:`.lineage.Records`), kept in memory and pruned to what a trace can reach.

A live coordinator derives an audited round's AdamW moments from its store (:func:`.lineage.trace`,
:func:`.lineage.derive`): the weights it published with each version, the moments published with a sharing
version, and each worker's kept rounds (their bodies name the arithmetic each claimed). The in-process rounds keep
the same records here, as the same safetensors bodies, so their audits judge a replica's push by the one
:meth:`.audit.Auditor.judge` the coordinator runs (a moment forger fails here as it fails over HTTP). Every replica
is one worker, registered once: one session, never in a group.
"""

from __future__ import annotations

import hashlib

import torch

from blocktrain.checkpoint.safetensors_io import pack
from blocktrain.coordinator.lineage import MAX_ROUNDS
from blocktrain.coordinator.rows import KeptRound

__all__ = ["LocalRecords"]

KEEP_ROUNDS = MAX_ROUNDS + 2  # kept rounds per worker: a trace asks for at most MAX_ROUNDS + 1 of them


class LocalRecords:
    """One block's records in process (see the module docstring); a :class:`.lineage.Records`."""

    def __init__(self, k: int, workers: dict[str, int], every: int) -> None:
        self.k = k  # the block
        self.every = every  # moments are published with every every-th version (a round loads the newest at or before)
        self.ids = dict(workers)  # worker name -> its number (it names its streams)
        self.blobs: dict[str, bytes] = {}  # sha256 hex -> body
        self.weights: dict[int, str] = {}  # version -> digest of its published weights
        self.moments: dict[int, str] = {}  # version -> digest of the moments published with it
        self.kept: dict[str, list[KeptRound]] = {name: [] for name in workers}  # each worker's kept rounds, oldest first

    # --- what the rounds record ----------------------------------------------------------------
    def publish(self, v: int, weights: dict[str, torch.Tensor]) -> None:
        """Block k's weights published as version v (and what no trace can reach any more pruned)."""
        self.weights[v] = self._put(pack(weights, {"kind": "weights", "block_index": str(self.k), "version": str(v)}))
        self._prune(v)

    def publish_moments(self, v: int, body: bytes) -> None:
        """The moments published with version v, as the workers download them."""
        self.moments[v] = self._put(body)

    def keep(self, worker: str, v: int, body: bytes, samples: int) -> None:
        """``worker``'s push against version v was accepted: its round counts (its inner state went on from it)."""
        rounds = self.kept[worker]
        rounds.append(KeptRound(v, self._put(body), samples))
        del rounds[:-KEEP_ROUNDS]

    def forget(self, worker: str) -> None:
        """A quarantined worker: its rounds are never traced again (nor do they hold old versions in memory)."""
        self.kept.pop(worker, None)
        self.ids.pop(worker, None)

    def get_blob(self, digest: str) -> bytes:
        return self.blobs[digest]

    # --- lineage.Records --------------------------------------------------------------------------
    def worker_id(self, worker: str) -> int | None:
        return self.ids.get(worker)

    def traceable(self, worker: str) -> bool:
        return worker in self.ids  # one session each, no groups

    def last_kept(self, k: int, worker: str, before: int) -> KeptRound | None:
        rounds = [r for r in self.kept.get(worker, ()) if r.version < before] if k == self.k else []
        return rounds[-1] if rounds else None

    def grouped(self, k: int, worker: str, low: int, high: int) -> bool:
        return False

    def moments_blob(self, k: int, v: int) -> str | None:
        return self.moments.get(v) if k == self.k else None

    def weights_blob(self, k: int, v: int) -> str | None:
        return self.weights.get(v) if k == self.k else None

    # --- internals ------------------------------------------------------------------------------
    def _put(self, body: bytes) -> str:
        digest = hashlib.sha256(body).hexdigest()
        self.blobs[digest] = body
        return digest

    def _prune(self, newest: int) -> None:
        """Forget the versions no trace can reach, and every body nothing names any more. A trace starts at a round
        no older than a worker's oldest kept round still held (or the newest version, for a worker with none) and
        may load the moments published up to ``every`` versions before it: a version below that is never asked for,
        so a missing one always means none was published, as in the store."""
        floor = min([rounds[0].version for rounds in self.kept.values() if rounds] + [newest]) - self.every
        for table in (self.weights, self.moments):
            for v in [v for v in table if v < floor]:
                del table[v]
        named = {*self.weights.values(), *self.moments.values(), *(r.blob for rs in self.kept.values() for r in rs)}
        for digest in [d for d in self.blobs if d not in named]:
            del self.blobs[digest]
