"""Per-block state of the coordinator: published versions, rounds, aggregation, evaluation.

One round per block. Round v of block k publishes weights W_v; workers send
deltas against v; the round closes when every live replica of k has reported
(quorum) or at its deadline, whichever comes first. A round that reaches its
deadline with no delta is extended rather than closed, so version v+1 always
contains at least one update. State is durable (see :mod:`.store`); this class
holds a cache of it and a lock that serialises every state change. Worker
handling and update intake live in :mod:`.service`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from blocktrain.checkpoint.run import RunDir
from blocktrain.checkpoint.safetensors_io import pack, save_file, tensors_sha256, unpack
from blocktrain.config import RunConfig
from blocktrain.coordinator.aggregate import aggregate, apply_step, outer_step
from blocktrain.coordinator.evaluation import Evaluator
from blocktrain.coordinator.settings import (
    CloseReason,
    CoordinatorSettings,
    RoundState,
    UpdateState,
    WorkerState,
)
from blocktrain.coordinator.store import Store
from blocktrain.coordinator.wire import Compression, block_schema, decode_delta, trainable_state
from blocktrain.data.dataset import DataDir
from blocktrain.errors import ProtocolError
from blocktrain.model.block import BlockDenoiser
from blocktrain.train.block import block_save_meta

log = logging.getLogger(__name__)



class BlockRounds:
    """Versions, rounds and aggregation of every block (no HTTP, no worker identities)."""

    def __init__(
        self,
        run_dir: Path,
        cfg: RunConfig,
        settings: CoordinatorSettings,
        data: DataDir | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.run = RunDir(run_dir)
        self.cfg = self.run.init(cfg)
        self.settings = settings
        self.clock = clock
        self.store = Store(self.run.root, fsync=settings.fsync)
        self.lock = threading.RLock()
        self.n_blocks = self.cfg.model.n_blocks
        template = BlockDenoiser(self.cfg.model, self.cfg.diffusion.sigma_data)
        self.E = template.E.detach().clone()
        self.shapes = block_schema(template)
        fp32_bytes = sum(4 * int(torch.Size(s).numel()) for s in self.shapes.values())
        self.block_fp32_bytes = fp32_bytes
        self.max_body_bytes = settings.max_body_bytes or 2 * fp32_bytes + 65536
        self.evaluator = Evaluator(self.cfg, settings, data)
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self.weights_payload: dict[int, bytes] = {}
        self.weights_sha: dict[int, str] = {}
        self.version: dict[int, int] = {}
        self.momentum: dict[int, dict[str, torch.Tensor] | None] = {}
        self.norms: dict[int, deque[float]] = {k: deque(maxlen=settings.norm_history) for k in range(self.n_blocks)}
        with self.lock:
            self._init_or_resume()


    # --- start-up -------------------------------------------------------------
    def _init_or_resume(self) -> None:
        s = self.store
        stored = s.get_meta("config")
        if stored is None:
            s.set_meta("config", self.cfg.to_json())
        now = self.clock()
        for k in range(self.n_blocks):
            row = s.q1("SELECT * FROM versions WHERE block=? ORDER BY version DESC LIMIT 1", k)
            if row is None:
                torch.manual_seed(self.cfg.train.seed * 1009 + k)  # same init as 'blocktrain train-block'
                w = trainable_state(BlockDenoiser(self.cfg.model, self.cfg.diffusion.sigma_data))
                payload = self._weights_payload(k, 0, w)
                digest = s.put_blob(payload)
                with s.tx() as db:
                    db.execute(
                        "INSERT INTO versions(block, version, weights_blob, weights_sha, created) VALUES(?,?,?,?,?)",
                        (k, 0, digest, tensors_sha256(w), now),
                    )
                    self._open_round(db, k, 0, now, self.settings.round_seconds)
                self._set_weights(k, 0, w, payload)
                self._save_checkpoint(k)
                continue
            v = int(row["version"])
            payload = s.get_blob(row["weights_blob"])
            w, _ = unpack(payload, source=f"block {k} version {v}")
            self._set_weights(k, v, w, payload)
            if row["momentum_blob"]:
                self.momentum[k] = unpack(s.get_blob(row["momentum_blob"]), source="momentum")[0]
            for r in s.q(
                "SELECT norm FROM updates WHERE block=? ORDER BY id DESC LIMIT ?", k, self.settings.norm_history
            ):
                self.norms[k].appendleft(float(r["norm"]))
            log.info("block %d: resumed at version %d", k, v)

    def _weights_payload(self, k: int, v: int, w: dict[str, torch.Tensor]) -> bytes:
        return pack(w, {"kind": "weights", "block_index": str(k), "version": str(v), "config": self.cfg.to_json()})

    def _set_weights(self, k: int, v: int, w: dict[str, torch.Tensor], payload: bytes) -> None:
        self.weights[k] = w
        self.version[k] = v
        self.weights_payload[k] = payload
        self.weights_sha[k] = tensors_sha256(w)
        self.momentum.setdefault(k, None)

    def _save_checkpoint(self, k: int) -> None:
        """Mirror the current weights as an ordinary block checkpoint, so 'blocktrain eval RUN' works."""
        meta = {**block_save_meta(self.cfg, k), "config": self.cfg.to_json(), "step": str(self.version[k])}
        save_file(self.run.block_path(k), {**self.weights[k], "target_embedding": self.E}, meta)

    def _open_round(self, db: Any, k: int, v: int, now: float, seconds: float) -> None:
        db.execute(
            "INSERT OR REPLACE INTO rounds(block, version, state, opened, deadline) VALUES(?,?,?,?,?)",
            (k, v, RoundState.OPEN.value, now, now + seconds),
        )

    # --- replicas ---------------------------------------------------------------

    def _live(self, now: float) -> dict[int, set[str]]:
        live: dict[int, set[str]] = {k: set() for k in range(self.n_blocks)}
        for r in self.store.q(
            "SELECT name, block FROM workers WHERE state=? AND lease_until>=?", WorkerState.ACTIVE.value, now
        ):
            if r["block"] is not None and 0 <= r["block"] < self.n_blocks:
                live[int(r["block"])].add(r["name"])
        return live


    def finished(self) -> bool:
        r = self.settings.rounds
        return r > 0 and all(self.version[k] >= r for k in range(self.n_blocks))

    # --- weights ---------------------------------------------------------------
    def weights_bytes(self, k: int) -> tuple[int, bytes]:
        self._check_block(k)
        with self.lock:
            return self.version[k], self.weights_payload[k]

    def step_bytes(self, k: int, from_version: int) -> bytes:
        """The published bf16 step from ``from_version`` to ``from_version + 1``."""
        self._check_block(k)
        if not 0 <= from_version < self.version[k]:
            raise ProtocolError(
                404, f"block {k} has no step from version {from_version}; pull the full weights instead", "no_step"
            )
        with self.lock:
            row = self.store.q1("SELECT step_blob FROM versions WHERE block=? AND version=?", k, from_version + 1)
            if row is None or not row["step_blob"]:
                raise ProtocolError(
                    404, f"block {k} has no step from version {from_version}; pull the full weights instead", "no_step"
                )
            return self.store.get_blob(row["step_blob"])

    def _check_block(self, k: int) -> None:
        if not 0 <= k < self.n_blocks:
            raise ProtocolError(404, f"block {k} does not exist; this run has blocks 0..{self.n_blocks - 1}", "block")

    # --- rounds ------------------------------------------------------------------
    def _check_quorum(self, now: float) -> list[int]:
        live = self._live(now)
        closed = []
        for k in range(self.n_blocks):
            v = self.version[k]
            reported = {
                r["worker"] for r in self.store.q("SELECT worker FROM updates WHERE block=? AND version=?", k, v)
            }
            rnd = self.store.q1("SELECT state FROM rounds WHERE block=? AND version=?", k, v)
            enough = len(reported) >= self.settings.min_updates
            if rnd is not None and rnd["state"] == RoundState.OPEN.value and enough and live[k] <= reported:
                self._close_round(k, CloseReason.QUORUM, now)
                closed.append(k)
        return closed


    def _close_due_rounds(self, now: float) -> None:
        """Close rounds past their deadline; extend those that received nothing."""
        for k in range(self.n_blocks):
            rnd = self.store.q1("SELECT * FROM rounds WHERE block=? AND version=?", k, self.version[k])
            if rnd is None or rnd["state"] != RoundState.OPEN.value or float(rnd["deadline"]) > now:
                continue
            if int(rnd["n_updates"]) > 0:
                self._close_round(k, CloseReason.DEADLINE, now)
            else:  # nobody delivered: keep the round open for another period
                with self.store.tx() as db:
                    db.execute(
                        "UPDATE rounds SET deadline=? WHERE block=? AND version=?",
                        (now + self.settings.round_seconds, k, self.version[k]),
                    )

    def _close_round(self, k: int, reason: CloseReason, now: float) -> None:
        s = self.store
        v = self.version[k]
        rows = s.q("SELECT * FROM updates WHERE block=? AND version=? AND state=? ORDER BY id", k, v,
                   UpdateState.ACCEPTED.value)
        deltas, samples = [], []
        for r in rows:
            tensors, _ = unpack(s.get_blob(r["blob"]), source=f"update {r['id']}")
            deltas.append(decode_delta(tensors, Compression(r["compression"])))
            samples.append(int(r["samples"]))
        cfg = self.settings
        delta_bar = aggregate(deltas, samples, cfg.aggregation, cfg.trim_fraction)
        step, buf = outer_step(delta_bar, cfg.outer, cfg.outer_lr, cfg.outer_momentum, self.momentum.get(k))
        w = apply_step(self.weights[k], step)
        payload = self._weights_payload(k, v + 1, w)
        w_digest = s.put_blob(payload)
        sha = tensors_sha256(w)
        step_digest = s.put_blob(
            pack(step, {"kind": "step", "block_index": str(k), "from_version": str(v), "weights_sha": sha})
        )
        m_digest = s.put_blob(pack(buf, {"kind": "momentum", "block_index": str(k)})) if buf is not None else None
        slowest = max(float(r["arrival_s"]) for r in rows)
        seconds = cfg.round_seconds
        if cfg.adaptive_deadline:
            seconds = min(cfg.round_seconds, max(cfg.min_round_seconds, cfg.deadline_slack * slowest))
        with s.tx() as db:
            db.execute(
                "INSERT INTO versions(block, version, weights_blob, step_blob, momentum_blob, weights_sha, created) "
                "VALUES(?,?,?,?,?,?,?)",
                (k, v + 1, w_digest, step_digest, m_digest, sha, now),
            )
            db.execute(
                "UPDATE rounds SET state=?, closed=?, close_reason=? WHERE block=? AND version=?",
                (RoundState.CLOSED.value, now, reason.value, k, v),
            )
            db.execute("UPDATE updates SET state=? WHERE block=? AND version=?", (UpdateState.APPLIED.value, k, v))
            if cfg.rounds and v + 1 >= cfg.rounds:
                db.execute(
                    "INSERT OR REPLACE INTO rounds(block, version, state, opened, deadline) VALUES(?,?,?,?,?)",
                    (k, v + 1, RoundState.FINISHED.value, now, now),
                )
            else:
                self._open_round(db, k, v + 1, now, seconds)
            s.add_counter("rounds_closed", 1)
        self._set_weights(k, v + 1, w, payload)
        self.momentum[k] = buf
        self._save_checkpoint(k)
        log.info("block %d: round %d closed by %s with %d updates -> version %d", k, v, reason.value, len(rows), v + 1)

    # --- evaluation ------------------------------------------------------------------
    def maybe_evaluate(self, force: bool = False) -> float | None:
        """Evaluate the assembled model if an epoch (min version over blocks) is due."""
        every = self.settings.eval_every
        if not self.evaluator.enabled or (every == 0 and not force):
            return None
        with self.lock:
            epoch = min(self.version.values())
            last = self.store.q1("SELECT epoch FROM evals ORDER BY id DESC LIMIT 1")
            due = last is None or epoch >= int(last["epoch"]) + max(every, 1) or (force and epoch != int(last["epoch"]))
            if not due:
                return None
            versions = dict(self.version)
            snapshot = {k: self.weights[k] for k in range(self.n_blocks)}
        ce, n = self.evaluator.evaluate(snapshot, self.E)
        with self.lock, self.store.tx() as db:
            db.execute(
                "INSERT INTO evals(epoch, versions, ce, bytes, at) VALUES(?,?,?,?,?)",
                (epoch, json.dumps(versions), ce, n, self.clock()),
            )
        log.info("eval at epoch %d (versions %s): CE %.4f nats/byte on %d bytes", epoch, versions, ce, n)
        return ce

