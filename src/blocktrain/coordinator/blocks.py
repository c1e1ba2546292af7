"""Per-block state of the coordinator: published versions, rounds, aggregation, evaluation.

One round per block. Round v of block k publishes weights W_v; workers send
deltas against v; the round closes when every live replica of k has reported
(quorum) or at its deadline, whichever comes first. A round that reaches its
deadline with no delta is extended rather than closed, so version v+1 always
contains at least one update. State is durable (see :mod:`.store`); this class
holds a cache of it and a lock that serialises every state change. Worker
handling and update intake live in :mod:`.service`.

Every block is ``waiting``, ``open`` or ``finished`` (:class:`.settings.BlockState`,
stored in the ``block_states`` table). Diffusion blocks are all open from the
start. Under the progressive schedule of the ``stack`` objective only block 0
opens at first and block k opens when block k-1 has finished its rounds; a
finished block is then served as a frozen input of the later blocks
(:meth:`BlockRounds.frozen_bytes`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from blocktrain.checkpoint.blocks import block_save_meta
from blocktrain.checkpoint.run import RunDir
from blocktrain.checkpoint.safetensors_io import pack, save_file, tensors_sha256, unpack
from blocktrain.config import RunConfig, Schedule
from blocktrain.coordinator.aggregate import OuterState, next_version
from blocktrain.coordinator.conduct import Conduct
from blocktrain.coordinator.evaluation import Evaluator
from blocktrain.coordinator.intake import Intake
from blocktrain.coordinator.settings import BlockState, CloseReason, CoordinatorSettings, RoundState, UpdateState
from blocktrain.coordinator.store import Store
from blocktrain.data.dataset import DataDir
from blocktrain.data.stream import init_seed
from blocktrain.errors import ConfigError, ProtocolError
from blocktrain.objectives import get_objective
from blocktrain.objectives.base import whole_blocks
from blocktrain.protocol.delta import Compression, decode_delta
from blocktrain.protocol.weights import block_schema, trainable_state

log = logging.getLogger(__name__)


def progressive_schedule(cfg: RunConfig, settings: CoordinatorSettings) -> bool:
    """Whether block k may open only once block k-1 has finished (a ``stack`` run); checks the settings fit."""
    if not get_objective(cfg).trains_in_order:
        return False  # blocks that never see one another: all open at once
    if cfg.train.schedule is not Schedule.PROGRESSIVE:
        raise ConfigError(
            f"the coordinator trains stack runs under the progressive schedule only, got schedule "
            f"{cfg.train.schedule.value!r}; pass --schedule progressive (or train concurrently with 'blocktrain train')"
        )
    if settings.rounds <= 0:
        raise ConfigError(
            "a stack run opens block k only when block k-1 has finished its rounds; pass --rounds N (N > 0)"
        )
    return True

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
        self.settings = settings.for_objective(get_objective(self.cfg).outer_step())
        self.clock = clock
        self.store = Store(self.run.root, fsync=settings.fsync)
        self.lock = threading.RLock()
        self.n_blocks = self.cfg.model.n_blocks
        self.objective = get_objective(self.cfg)
        self.progressive = progressive_schedule(self.cfg, settings)
        template = self.objective.build_block(0)
        E = getattr(template, "E", None)  # diffusion: the frozen target embedding, saved with every checkpoint
        self.E: torch.Tensor | None = E.detach().clone() if isinstance(E, torch.Tensor) else None
        with torch.device("meta"):  # names and shapes only: stack blocks differ (block 0 embeds)
            self.block_shapes = {k: block_schema(self.objective.build_block(k)) for k in range(self.n_blocks)}
        self.shapes = self.block_shapes[0]  # every block's schema for diffusion
        fp32_bytes = max(sum(4 * int(torch.Size(s).numel()) for s in sh.values()) for sh in self.block_shapes.values())
        self.block_fp32_bytes = fp32_bytes  # of the largest block
        self.max_body_bytes = settings.max_body_bytes or 2 * fp32_bytes + 65536
        self.evaluator = Evaluator(self.cfg, settings, data)
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self.weights_payload: dict[int, bytes] = {}
        self.weights_sha: dict[int, str] = {}
        self.version: dict[int, int] = {}
        self.outer: dict[int, OuterState] = {}  # momentum and step residual carried between rounds
        self.intake = Intake(self.settings, self.block_shapes, self.evaluator)  # the checks every update passes
        self.conduct = Conduct(self.settings, self.store)  # rate limit and quarantine
        if self.settings.gate and not self.intake.gating:
            log.warning("no validation data: the loss gate is off (give the coordinator --data to turn it on)")
        self.state: dict[int, BlockState] = {}
        self._frozen_payload: dict[int, bytes] = {}  # finished block -> its frozen download (built once)
        self._served: dict[int, str] = {}  # block -> sha256 of the last weights someone fetched or was told to fetch
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
            row = s.latest_version(k)
            if row is None:
                torch.manual_seed(init_seed(self.cfg.train.seed, k))  # same init as 'blocktrain train-block'
                w = trainable_state(self.objective.build_block(k))
                payload = self._weights_payload(k, 0, w)
                digest = s.put_blob(payload)
                initial = BlockState.OPEN if k == 0 or not self.progressive else BlockState.WAITING
                with s.tx():
                    s.add_version(k, 0, digest, tensors_sha256(w), now)
                    if initial is BlockState.OPEN:
                        s.open_round(k, 0, now, now + self.settings.round_seconds)
                    s.set_block_state(k, initial, now)
                self.state[k] = initial
                self._set_weights(k, 0, w, payload)
                self._save_checkpoint(k)
                continue
            v = int(row["version"])
            payload = s.get_blob(row["weights_blob"])
            w, _ = unpack(payload, source=f"block {k} version {v}")
            self._set_weights(k, v, w, payload)
            if row["momentum_blob"]:
                self.outer[k] = OuterState.from_tensors(unpack(s.get_blob(row["momentum_blob"]), source="outer state")[0])
            for norm in s.recent_norms(k, self.settings.norm_history):  # newest first
                self.intake.norms[k].appendleft(norm)
            for digest, compression in s.update_blobs(k):  # the replay check knows every accepted delta again
                tensors, _ = unpack(s.get_blob(digest), source=f"update {digest[:12]}")
                self.intake.remember_sketch(k, self.intake.sketch(k, decode_delta(tensors, Compression(compression))))
            self.state[k] = self._resumed_state(k, v, now)
            log.info("block %d: resumed at version %d (%s)", k, v, self.state[k].value)
            if self.progressive and k > 0 and v == 0 and self.state[k] is BlockState.OPEN and self.objective.inherits():
                self._warm_start(k)  # a no-op unless a crash came between opening block k and its warm start

    def _resumed_state(self, k: int, v: int, now: float) -> BlockState:
        """The stored state of block k; derived from its rounds for a store written before states existed."""
        stored = self.store.block_state(k)
        if stored is not None:
            return stored
        rnd = self.store.round(k, v)
        if rnd is None:
            state = BlockState.WAITING
        else:
            state = BlockState.FINISHED if rnd["state"] == RoundState.FINISHED.value else BlockState.OPEN
        with self.store.tx():
            self.store.set_block_state(k, state, now)
        return state

    def _weights_payload(self, k: int, v: int, w: dict[str, torch.Tensor]) -> bytes:
        return pack(w, {"kind": "weights", "block_index": str(k), "version": str(v), "config": self.cfg.to_json()})

    def _set_weights(self, k: int, v: int, w: dict[str, torch.Tensor], payload: bytes) -> None:
        self.weights[k] = w
        self.version[k] = v
        self.weights_payload[k] = payload
        self.weights_sha[k] = tensors_sha256(w)
        self.outer.setdefault(k, OuterState())

    def _save_checkpoint(self, k: int) -> None:
        """Mirror the current weights as an ordinary block checkpoint, so 'blocktrain eval RUN' works."""
        meta = {**block_save_meta(self.cfg, k), "config": self.cfg.to_json(), "step": str(self.version[k])}
        extra = {"target_embedding": self.E} if self.E is not None else {}
        if self.objective.inherits():  # what block k takes from blocks 0..k-1 (frozen heads) is part of its checkpoint
            whole = whole_blocks(self.objective, [self.weights[j] for j in range(k + 1)])[k]
            extra.update({n: t.detach().clone() for n, t in whole.state_dict().items() if n not in self.weights[k]})
        save_file(self.run.block_path(k), {**self.weights[k], **extra}, meta)

    def _warm_start(self, k: int) -> None:
        """Re-initialise waiting block k from the finished blocks before it (``stack.init``), as version 0."""
        whole = whole_blocks(self.objective, [self.weights[j] for j in range(k + 1)])
        self.objective.inherit(whole[k], k, whole[:k], at_init=True)
        w = trainable_state(whole[k])
        if all(torch.equal(w[n], self.weights[k][n]) for n in w):
            self._save_checkpoint(k)  # its frozen heads now come from the finished blocks
            return
        payload = self._weights_payload(k, 0, w)
        digest = self.store.put_blob(payload)
        with self.store.tx():
            self.store.replace_weights(k, 0, digest, tensors_sha256(w))
        self._set_weights(k, 0, w, payload)
        self._save_checkpoint(k)
        log.info("block %d: warm-started from block %d (%s)", k, k - 1, self.cfg.stack.init.value)

    # --- replicas ---------------------------------------------------------------
    def live_replicas(self, now: float) -> dict[int, set[str]]:
        """Block -> names of the active workers on it that hold a lease at ``now``."""
        live: dict[int, set[str]] = {k: set() for k in range(self.n_blocks)}
        for name, block in self.store.live_workers(now):
            if block is not None and 0 <= block < self.n_blocks:
                live[int(block)].add(name)
        return live


    def block_rounds(self, k: int) -> int:
        """Rounds of block k: --rounds, split across blocks as the objective splits its steps (0: no limit)."""
        r = self.settings.rounds
        if r <= 0 or self.cfg.train.steps <= 0:
            return r
        return max(1, round(r * self.objective.block_steps(k) / self.cfg.train.steps))

    def finished(self) -> bool:
        return self.settings.rounds > 0 and all(self.version[k] >= self.block_rounds(k) for k in range(self.n_blocks))

    # --- weights ---------------------------------------------------------------
    def weights_bytes(self, k: int) -> tuple[int, bytes]:
        self._check_block(k)
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
        self._check_block(k)
        if not 0 <= from_version < self.version[k]:
            raise ProtocolError(
                404, f"block {k} has no step from version {from_version}; pull the full weights instead", "no_step"
            )
        with self.lock:
            digest = self.store.step_blob(k, from_version + 1)
            if digest is None:
                raise ProtocolError(
                    404, f"block {k} has no step from version {from_version}; pull the full weights instead", "no_step"
                )
            if from_version + 1 == self.version[k]:
                self._served[k] = self.weights_sha[k]
            return self.store.get_blob(digest)

    def frozen_bytes(self, k: int) -> tuple[int, str, bytes]:
        """(version, weights sha256, safetensors) of finished block k, the frozen input of later blocks."""
        self._check_block(k)
        with self.lock:
            state = self.state[k]
            if state is not BlockState.FINISHED:
                raise ProtocolError(
                    409, f"block {k} is {state.value}, not finished; only a finished block is served as a frozen input "
                    f"(it finishes after {self.block_rounds(k)} rounds); wait and retry, see GET /v1/status", "not_finished",
                )
            v, sha = self.version[k], self.weights_sha[k]
            if k not in self._frozen_payload:
                meta = {"kind": "frozen", "block_index": str(k), "version": str(v), "weights_sha": sha,
                        "objective": str(self.cfg.objective), "config": self.cfg.to_json()}
                self._frozen_payload[k] = pack(self.weights[k], meta)
            return v, sha, self._frozen_payload[k]

    def frozen_refs(self, k: int) -> list[dict[str, Any]]:
        """Version and sha256 of each frozen input of block k (empty until all of them have finished)."""
        needed = range(self.objective.frozen_inputs(k))
        if any(self.state[j] is not BlockState.FINISHED for j in needed):
            return []
        return [{"block": j, "version": self.version[j], "weights_sha": self.weights_sha[j]} for j in needed]

    def state_message(self, k: int) -> str:
        """What a worker on block k should know about its state ('' while it is open)."""
        state = self.state[k]
        if state is BlockState.WAITING:
            rounds = ", ".join(str(self.block_rounds(j)) for j in range(k))
            return (f"block {k} is waiting: it opens once blocks 0..{k - 1} have finished their rounds ({rounds}); "
                    f"this worker waits until then (omit --block to be assigned an open block)")
        if state is BlockState.FINISHED:
            return f"block {k} has finished its rounds; it takes no more updates"
        return ""

    def open_blocks(self) -> list[int]:
        return [k for k in range(self.n_blocks) if self.state[k] is BlockState.OPEN]

    def _check_block(self, k: int) -> None:
        if not 0 <= k < self.n_blocks:
            raise ProtocolError(404, f"block {k} does not exist; this run has blocks 0..{self.n_blocks - 1}", "block")

    # --- rounds ------------------------------------------------------------------
    def _check_quorum(self, now: float) -> list[int]:
        live = self.live_replicas(now)
        closed = []
        for k in range(self.n_blocks):
            v = self.version[k]
            reported = self.store.reporters(k, v)
            rnd = self.store.round(k, v)
            enough = len(reported) >= self.settings.min_updates
            if (rnd is not None and rnd["state"] == RoundState.OPEN.value and enough and live[k] <= reported
                    and int(rnd["n_updates"]) > 0):  # 0: every update it had was dropped (a quarantined worker's)
                self._close_round(k, CloseReason.QUORUM, now)
                closed.append(k)
        return closed


    def _close_due_rounds(self, now: float) -> None:
        """Close rounds past their deadline; extend those that received nothing."""
        for k in range(self.n_blocks):
            rnd = self.store.round(k, self.version[k])
            if rnd is None or rnd["state"] != RoundState.OPEN.value or float(rnd["deadline"]) > now:
                continue
            if int(rnd["n_updates"]) > 0:
                self._close_round(k, CloseReason.DEADLINE, now)
            else:  # nobody delivered: keep the round open for another period
                with self.store.tx():
                    self.store.extend_round(k, self.version[k], now + self.settings.round_seconds)

    def _close_round(self, k: int, reason: CloseReason, now: float) -> None:
        s = self.store
        v = self.version[k]
        rows = s.accepted_updates(k, v)
        deltas, samples = [], []
        for r in rows:
            tensors, _ = unpack(s.get_blob(r["blob"]), source=f"update {r['id']}")
            deltas.append(decode_delta(tensors, Compression(r["compression"])))
            samples.append(int(r["samples"]))
        cfg = self.settings
        result = next_version(self.weights[k], deltas, samples, cfg, self.outer.get(k) or OuterState())
        screened = [r for i, r in enumerate(rows) if i not in result.kept]
        w = result.weights
        payload = self._weights_payload(k, v + 1, w)
        w_digest = s.put_blob(payload)
        sha = tensors_sha256(w)
        step_digest = s.put_blob(
            pack(result.step, {"kind": "step", "block_index": str(k), "from_version": str(v), "weights_sha": sha,
                               "compression": cfg.step_compression.value})
        )
        carried = result.state.tensors()
        m_digest = s.put_blob(pack(carried, {"kind": "outer_state", "block_index": str(k)})) if carried else None
        arrivals = sorted(float(r["arrival_s"]) for r in rows)
        paced = arrivals[max(0, math.ceil(cfg.deadline_quantile * len(arrivals)) - 1)]  # 1.0: the slowest
        seconds = cfg.round_seconds
        changed: dict[int, BlockState] = {}
        warm: int | None = None  # the block that opens now and starts from this one (stack.init)
        if cfg.adaptive_deadline:
            seconds = min(cfg.round_seconds, max(cfg.min_round_seconds, cfg.deadline_slack * paced))
        with s.tx():
            s.add_version(k, v + 1, w_digest, sha, now, step_blob=step_digest, momentum_blob=m_digest)
            s.close_round(k, v, now, reason)  # its updates are applied
            s.set_update_state([int(r["id"]) for r in screened], UpdateState.SCREENED)
            for r in screened:
                s.record_rejection(str(r["worker"]), k, 422, "screened", f"dropped at the close of round {v}: it "
                                   "points away from what the round's other updates agree on", now)
            if cfg.rounds and v + 1 >= self.block_rounds(k):
                s.finish_round(k, v + 1, now)
                changed[k] = BlockState.FINISHED
                nxt = k + 1
                if self.progressive and nxt < self.n_blocks and self.state[nxt] is BlockState.WAITING:
                    warm = nxt if self.objective.inherits() and self.version[nxt] == 0 else None
                    s.open_round(nxt, self.version[nxt], now, now + cfg.round_seconds)
                    changed[nxt] = BlockState.OPEN
                for j, state in changed.items():
                    s.set_block_state(j, state, now)
            else:
                s.open_round(k, v + 1, now, now + seconds)
        self._set_weights(k, v + 1, w, payload)
        self.outer[k] = result.state
        self._save_checkpoint(k)
        if warm is not None:
            self._warm_start(warm)
        log.info("block %d: round %d closed by %s with %d updates -> version %d", k, v, reason.value, len(rows), v + 1)
        for r in screened:
            log.warning("block %d v%d: dropped the update of %s at the round's close: it disagreed with the others", k, v,
                        r["worker"])
            self.conduct.refused(str(r["worker"]), "screened", now)
        for j, state in changed.items():
            self.state[j] = state
            log.info("block %d is now %s", j, state.value)

    # --- evaluation ------------------------------------------------------------------
    def maybe_evaluate(self, force: bool = False) -> float | None:
        """Evaluate the assembled model if an epoch (min version over blocks) is due."""
        every = self.settings.eval_every
        if not self.evaluator.enabled or (every == 0 and not force):
            return None
        with self.lock:
            epoch = min(self.version.values())
            last = self.store.last_eval_epoch()
            due = last is None or epoch >= last + max(every, 1) or (force and epoch != last)
            if not due:
                return None
            versions = dict(self.version)
            snapshot = {k: self.weights[k] for k in range(self.n_blocks)}
        ce, n = self.evaluator.evaluate(snapshot, self.E)
        with self.lock, self.store.tx():
            self.store.record_eval(epoch, versions, ce, n, self.clock())
        log.info("eval at epoch %d (versions %s): CE %.4f nats/byte on %d bytes", epoch, versions, ce, n)
        return ce

