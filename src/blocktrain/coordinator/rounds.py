"""Per-block rounds of the coordinator: block states, round open and close, aggregation, the progressive schedule.

One round per block. Round v of block k publishes weights W_v; workers send deltas against v; the round closes when
every live replica of k has reported and it holds ``--min-updates`` counted deltas (quorum;
:meth:`Rounds.check_quorum`), or at its deadline, whichever comes first. A round that reaches its deadline with no
delta is extended rather than closed, so version v+1 always contains at least one update. State is durable (see
:mod:`.store`); :class:`Rounds` holds a cache of the block states, and every method of it is called under the
coordinator's lock. The published weights are :mod:`.checkpoints`'s, the aggregation :mod:`.aggregate`'s; workers
are the :mod:`.roster`'s, and update intake is :mod:`.uploads`'s.

Every block is ``waiting``, ``open`` or ``finished`` (:class:`.settings.BlockState`,
stored in the ``block_states`` table). Diffusion blocks are all open from the
start. Under the progressive schedule of the ``stack`` objective only block 0
opens at first and block k opens when block k-1 has finished its rounds; a
finished block is then served as a frozen input of the later blocks
(:meth:`Rounds.frozen_bytes`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch

from blocktrain.checkpoint.safetensors_io import pack, tensors_sha256, unpack
from blocktrain.config import RunConfig, Schedule
from blocktrain.coordinator.aggregate import RoundResult, carried_share, next_version
from blocktrain.coordinator.checkpoints import Checkpoints
from blocktrain.coordinator.conduct import Conduct
from blocktrain.coordinator.intake import Intake, unpack_sketch
from blocktrain.coordinator.rows import RoundRow, UpdateRow
from blocktrain.coordinator.settings import CloseReason, CoordinatorSettings, UpdateState, per_block_h
from blocktrain.coordinator.store import Store
from blocktrain.coordinator.validate import parse_update
from blocktrain.errors import ConfigError, ProtocolError
from blocktrain.objectives import get_objective
from blocktrain.protocol.codes import BlockState, Reason, RoundState
from blocktrain.protocol.delta import decode_delta
from blocktrain.protocol.messages import FrozenRef
from blocktrain.protocol.moments import split_moments
from blocktrain.train.step import round_lr_scale

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
        raise ConfigError("a stack run opens block k only when block k-1 has finished its rounds; pass --rounds N (N > 0)")
    return True


class Rounds:
    """Block states and the rounds of every block: quorum, deadlines, aggregation into the next version."""

    def __init__(self, cfg: RunConfig, settings: CoordinatorSettings, progressive: bool, store: Store,
                 checkpoints: Checkpoints, intake: Intake, conduct: Conduct,
                 audits_pending: Callable[[int, int], bool] = lambda k, v: False) -> None:
        self.cfg, self.settings, self.progressive, self.store = cfg, settings, progressive, store
        self.checkpoints, self.intake, self.conduct = checkpoints, intake, conduct
        # (block, version) -> whether an update of that round awaits its audit: the round does not close before
        # every audit of it is decided (a pass keeps the update, a failure quarantines its worker and drops it)
        self.audits_pending = audits_pending
        self.objective = get_objective(cfg)
        self.n_blocks = cfg.model.n_blocks
        self.state: dict[int, BlockState] = {}
        self._copies_due: set[int] = set()  # blocks whose run-directory checkpoint copy failed (a full disk): due again
        self._close_failed: dict[int, tuple[int, str]] = {}  # block -> (version, error kind) of its last failed close
        self._warm_due: set[int] = set()  # opened blocks whose warm start failed (a full disk): tried again each tick

    # --- start-up -------------------------------------------------------------
    def start(self, now: float) -> None:
        """Create every block's version 0 and first round, or resume them from the store."""
        s, ck = self.store, self.checkpoints
        if s.meta.get_meta("config") is None:
            s.meta.set_meta("config", self.cfg.to_json())
        with s.tx():  # a restart: no worker could heartbeat while it was down, so none lapses at the first tick
            s.workers.extend_leases(now + self.settings.lease_seconds)
        for k in range(self.n_blocks):
            row = s.rounds.latest_version(k)
            if row is None:
                digest, w, payload = ck.initial(k)
                initial = BlockState.OPEN if k == 0 or not self.progressive else BlockState.WAITING
                with s.tx():
                    s.rounds.add_version(k, 0, digest, tensors_sha256(w), now)
                    if initial is BlockState.OPEN:
                        s.rounds.open_round(k, 0, now, now + self.settings.round_seconds)
                    s.rounds.set_block_state(k, initial, now)
                self.state[k] = initial
                ck.publish(k, 0, w, payload)
                ck.save_checkpoint(k)
                continue
            v = ck.resume(k, row)
            self._copy(k, v)  # a crash, or a full disk, between a close's commit and its copy left the copy behind
            norms, rises = self._histories(k, grouped=False)
            group_norms, group_rises = self._histories(k, grouped=True)
            self.intake.restore(k, norms, self._sketches(k), rises,  # the replay check knows every accepted delta again
                                group_norms, group_rises)
            self.state[k] = self._resumed_state(k, v, now)
            log.info("block %d: resumed at version %d (%s)", k, v, self.state[k].value)
            self._grace(k, v, now)
            if (self.progressive and k > 0 and v == 0 and self.state[k] is BlockState.OPEN and self.objective.inherits()
                    and not s.updates.accepted_updates(k, 0)):  # with pushes, its weights are what they were made from
                self._warm(k)  # a no-op unless a crash came between opening block k and its warm start

    def _histories(self, k: int, grouped: bool) -> tuple[list[float], list[float]]:
        """Block k's recent norms per unit of lr and loss rises, oldest first, of single workers' pushes or of group
        means: what the intake judged the next ones by before a restart."""
        s, cfg = self.store.updates, self.settings
        norms = [n / self.lr_scale(k, v) for v, n in s.recent_norms(k, cfg.norm_history, grouped)[::-1]]
        return norms, s.recent_rises(k, cfg.gate_history, grouped)[::-1]

    def _sketches(self, k: int) -> Iterator[torch.Tensor]:
        """The count sketch of every update of block k ever accepted, oldest first: its stored sketch, else (a row from
        before sketches were stored, or of another --sketch-dim) its delta decoded and sketched, one at a time."""
        s = self.store
        for digest, compression, sketched in s.updates.update_blobs(k):
            if sketched is not None:
                sketch = unpack_sketch(s.blobs.get_blob(sketched), k, self.settings.sketch_dim, f"sketch {sketched[:12]}")
                if sketch is not None:
                    yield sketch
                    continue
            tensors, _ = unpack(s.blobs.get_blob(digest), source=f"update {digest[:12]}")
            yield self.intake.sketch(k, decode_delta(split_moments(tensors)[0], compression))  # the delta, not moments

    def _grace(self, k: int, v: int, now: float) -> None:
        """A round whose deadline passed (or nearly) while the coordinator was down stays open a lease longer (its
        workers' leases are renewed as long): they could not push meanwhile, and closed at the first tick it
        refused their retries as stale."""
        rnd = self.store.rounds.round(k, v)
        grace = now + min(self.settings.round_seconds, self.settings.lease_seconds)
        if self.state[k] is BlockState.OPEN and rnd is not None and rnd.state is RoundState.OPEN and rnd.deadline < grace:
            with self.store.tx():
                self.store.rounds.extend_round(k, v, grace)
            log.info("block %d: round %d's deadline passed while the coordinator was down; open %.0f s more for the "
                     "pushes its workers retry", k, v, grace - now)

    def _resumed_state(self, k: int, v: int, now: float) -> BlockState:
        """The stored state of block k; derived from its rounds for a store written before states existed."""
        stored = self.store.rounds.block_state(k)
        if stored is not None:
            return stored
        rnd = self.store.rounds.round(k, v)
        if rnd is None:
            state = BlockState.WAITING
        else:
            state = BlockState.FINISHED if rnd.state is RoundState.FINISHED else BlockState.OPEN
        with self.store.tx():
            self.store.rounds.set_block_state(k, state, now)
        return state

    # --- the schedule -----------------------------------------------------------
    def block_rounds(self, k: int) -> int:
        """Rounds of block k: --rounds, split across blocks as the objective splits its steps (0: no limit); with H
        per block (--local-steps 0) all of block k's steps in rounds of its H, so at least --rounds rounds."""
        r = self.settings.rounds
        if r > 0 and self.settings.local_steps == 0:
            return self.objective.block_steps(k) // self.local_steps(k)
        if r <= 0 or self.cfg.train.steps <= 0:
            return r
        return max(1, round(r * self.objective.block_steps(k) / self.cfg.train.steps))

    def lr_scale(self, k: int, v: int) -> float:
        """s_v of block k's round v: its inner steps' mean lr over the peak, on the schedule the workers follow (the
        block's rounds x H steps, or train.steps without a round limit)."""
        h, rounds = self.local_steps(k), self.block_rounds(k)
        schedule = replace(self.cfg.train, steps=max(1, rounds * h if rounds else self.cfg.train.steps))
        return round_lr_scale(schedule, v * h, h)

    def local_steps(self, k: int) -> int:
        """H of block k: --local-steps, or with --local-steps 0 its :func:`per_block_h` for --rounds rounds."""
        if self.settings.local_steps:
            return self.settings.local_steps
        return per_block_h(self.objective.block_steps(k), self.settings.rounds)

    def finished(self) -> bool:
        version = self.checkpoints.versions()
        return self.settings.rounds > 0 and all(version[k] >= self.block_rounds(k) for k in range(self.n_blocks))

    def state_message(self, k: int) -> str:
        """What a worker on block k should know about its state ('' while it is open)."""
        state = self.state[k]
        if self.warming(k):
            return (f"block {k} is open, but its warm start from block {k - 1} failed (see the coordinator's log: a full "
                    "disk?) and is tried again each tick; this worker waits until it is done")
        if state is BlockState.WAITING:
            rounds = ", ".join(str(self.block_rounds(j)) for j in range(k))
            return (f"block {k} is waiting: it opens once blocks 0..{k - 1} have finished their rounds ({rounds}); "
                    f"this worker waits until then (omit --block to be assigned an open block)")
        if state is BlockState.FINISHED:
            return f"block {k} has finished its rounds; it takes no more updates"
        return ""

    def warming(self, k: int) -> bool:
        """Whether open block k awaits a warm start that failed: it hands out no work and takes no pushes until then,
        since a push made from its first weights would make the warm start moot for good."""
        return k in self._warm_due

    def round_state(self, k: int, rnd: RoundRow | None) -> RoundState:
        """Block k's round state as workers and the status see it: a waiting or warming block has no round yet."""
        if self.state[k] is BlockState.WAITING or self.warming(k):
            return RoundState.WAITING
        return rnd.state if rnd is not None else RoundState.FINISHED

    def open_blocks(self) -> list[int]:
        return [k for k in range(self.n_blocks) if self.state[k] is BlockState.OPEN]

    def frozen_bytes(self, k: int) -> tuple[int, str, bytes]:
        """(version, weights sha256, safetensors) of finished block k, the frozen input of later blocks."""
        self.checkpoints.check_block(k)
        state = self.state[k]
        if state is not BlockState.FINISHED:
            raise ProtocolError(
                409, f"block {k} is {state.value}, not finished; only a finished block is served as a frozen input "
                f"(it finishes after {self.block_rounds(k)} rounds); wait and retry, see GET /v1/status", Reason.NOT_FINISHED,
            )
        now = self.checkpoints.current(k)
        return now.version, now.sha, self.checkpoints.frozen_payload(k)

    def frozen_refs(self, k: int) -> tuple[FrozenRef, ...]:
        """Version and sha256 of each frozen input of block k (empty until all of them have finished)."""
        needed = range(self.objective.frozen_inputs(k))
        if any(self.state[j] is not BlockState.FINISHED for j in needed):
            return ()
        current = self.checkpoints.current
        return tuple(FrozenRef(block=j, version=current(j).version, weights_sha=current(j).sha) for j in needed)

    def check_version(self, k: int, base: int) -> None:
        """409 unless block k's round at version ``base`` is open and takes updates."""
        v = self.checkpoints.current(k).version
        rnd = self.store.rounds.round(k, v)
        if base != v:
            raise ProtocolError(
                409, f"the delta is against version {base} but block {k} is at version {v}; pull the new version",
                Reason.STALE,
            )
        if self.round_state(k, rnd) is RoundState.WAITING:  # waiting for earlier blocks, or for its warm start
            raise ProtocolError(409, f"{self.state_message(k)}; it takes no updates yet", Reason.WAITING)
        if rnd is None or rnd.state is not RoundState.OPEN:
            why = ("the run finished" if all(st is BlockState.FINISHED for st in self.state.values()) else
                   "it has trained its rounds; register again for a block still training")
            raise ProtocolError(409, f"block {k} takes no more updates ({why})", Reason.FINISHED)

    # --- rounds ------------------------------------------------------------------
    def check_quorum(self, now: float) -> list[int]:
        """Close every open round that has its floor of counted deltas and that each live replica of its block has
        reported to (or was refused in); returns their blocks.

        The floor is ``min_updates`` (per block), less one for each worker of the block that can no longer count in
        this round: refused in it (and not since accepted), or quarantined since the round opened (its update, if
        any, dropped). So a refused or quarantined worker never holds its round to the deadline, while a worker that
        has not registered yet is waited for, up to the deadline: ``min_updates`` is a floor the operator sets, not
        the number of workers there when the first push lands. A worker that left or
        crashed, or was quarantined in an earlier round, does not lower it: with fewer than ``min_updates`` workers
        left on a block, its rounds close at their deadlines."""
        live = self.store.workers.live_by_block(self.n_blocks, now)
        closed = []
        for k in range(self.n_blocks):
            v = self.checkpoints.current(k).version
            rnd = self.store.rounds.round(k, v)
            if rnd is None or rnd.state is not RoundState.OPEN:
                continue
            reported = self.store.updates.reporters(k, v)
            refused = self.store.rounds.refused(k, v)  # a refused worker waits for the next version
            gone = self.store.conduct.quarantined_on_block(k, rnd.opened)  # left; its update was dropped
            counted = reported - gone
            if refused:  # a refused group's members from other blocks do not count
                refused = refused & self.store.workers.registered_on(k)
            excluded = (refused - reported) | gone
            required = max(1, self.settings.min_updates - len(excluded))
            if (len(counted) >= required and live[k] <= reported | refused
                    and rnd.n_updates > 0  # 0: every update it had was dropped (a quarantined worker's)
                    and not self.audits_pending(k, v)) and self._close(k, CloseReason.QUORUM, now):
                closed.append(k)
        return closed

    def _warm(self, k: int) -> None:
        """Warm-start opened block k (:meth:`Checkpoints.warm_start`) and copy it, unless its first round already holds
        pushes: they were trained from the weights it opened with, and would be applied to others. A failure (a full
        disk) leaves it due again at the next tick, where it had left the block at its cold weights for good, and
        a restart then warm-started it under the pushes made since; until then the block hands out no round and takes
        no push (:meth:`warming`)."""
        failed = k in self._warm_due
        self._warm_due.add(k)  # until it is done, or moot
        try:
            if self.checkpoints.current(k).version != 0 or self.store.updates.accepted_updates(k, 0):
                self._warm_due.discard(k)
                log.warning("block %d: not warm-started: pushes were made from the weights it opened with", k)
                return
            self.checkpoints.warm_start(k)
        except Exception as exc:  # its round stays open on the first weights meanwhile
            if not failed:
                log.error("block %d: warm start failed, tried again each tick: %s", k, exc)
            return
        self._warm_due.discard(k)
        self._copy(k, 0)

    def close_due_rounds(self, now: float) -> None:
        """Close rounds past their deadline; extend those that received nothing (and warm-start a block whose warm
        start failed)."""
        for k in sorted(self._warm_due):
            self._warm(k)
        for k in range(self.n_blocks):
            v = self.checkpoints.current(k).version
            rnd = self.store.rounds.round(k, v)
            if rnd is None or rnd.state is not RoundState.OPEN or rnd.deadline > now:
                continue
            if self.audits_pending(k, v):  # past its deadline, the round waits for its audits (each within
                continue                   # --audit-timeout, else its worker is quarantined and its update dropped)
            if rnd.n_updates > 0:
                self._close(k, CloseReason.DEADLINE, now)
            else:  # nobody delivered: keep the round open for another period
                with self.store.tx():
                    self.store.rounds.extend_round(k, v, now + self.settings.round_seconds)

    def _close(self, k: int, reason: CloseReason, now: float) -> bool:
        """:meth:`close_round`, its failure block k's own: logged (once per version and error), the round left open
        for the next tick. Raised, it reached whoever came in (a push to any block answered 422 and counted against
        its worker, a leave refused after it was committed) and stopped the tick before the other blocks."""
        v = self.checkpoints.current(k).version
        try:
            self.close_round(k, reason, now)
        except Exception as exc:  # any failure of this block's close: the others go on
            if self.checkpoints.current(k).version != v:  # committed and published: what follows it failed
                log.error("block %d: round v%d closed, but what follows its close failed: %s", k, v, exc, exc_info=exc)
                return True
            key = (v, f"{type(exc).__name__}:{getattr(exc, 'errno', None)}")  # not the message: it may name a temp file
            if self._close_failed.get(k) != key:
                log.error("block %d: closing round v%d failed, it stays open and is tried again each tick: %s", k, v,
                          exc, exc_info=exc)
            self._close_failed[k] = key
            return False
        self._close_failed.pop(k, None)
        return True

    def close_round(self, k: int, reason: CloseReason, now: float) -> None:
        """Collect the round's updates, make the next version, persist it, advance the schedule."""
        v = self.checkpoints.current(k).version
        rows, result = self._next_version(k, v)
        screened = [r for i, r in enumerate(rows) if i not in result.kept]
        changed, warm = self._persist(k, v, rows, screened, result, reason, now)
        self._advance(k, v, len(rows), screened, changed, warm, reason, now)

    def _next_version(self, k: int, v: int) -> tuple[list[UpdateRow], RoundResult]:
        """The round's accepted updates, and :func:`.aggregate.next_version` of them. They are read back from the
        store, not kept from their intake: a round closes from what is durable, whether or not a restart came
        between (decoding an accepted update costs less than keeping every one in memory)."""
        s, shares, every = self.store, self.settings.inner_start.shares, self.settings.moment_every
        rows = s.updates.accepted_updates(k, v)
        shapes = self.checkpoints.block_shapes[k]
        updates = [parse_update(s.blobs.get_blob(r.blob), k, shapes, shares, every) for r in rows]
        moments = [u.moments for u in updates if u.moments is not None]
        current = self.checkpoints.current(k)
        return rows, next_version(current.weights, [u.delta for u in updates], [u.samples for u in updates],
                                  self.settings, current.outer, moments or None, self.lr_scale(k, v),
                                  [max(1, len(u.group)) for u in updates],  # a group mean stands for its members
                                  carried_share(self.local_steps(k), every))

    def _persist(self, k: int, v: int, rows: list[UpdateRow], screened: list[UpdateRow], result: RoundResult,
                 reason: CloseReason, now: float) -> tuple[dict[int, BlockState], int | None]:
        """Store version v + 1 (weights, step, outer state), close round v, open the next round or block; returns the
        blocks whose state changed and the block to warm-start (None: none)."""
        s, ck, cfg = self.store, self.checkpoints, self.settings
        w = result.weights
        payload = ck.payload(k, v + 1, w)
        w_digest = s.blobs.put_blob(payload)
        sha = tensors_sha256(w)
        step_digest = s.blobs.put_blob(
            pack(result.step, {"kind": "step", "block_index": str(k), "from_version": str(v), "weights_sha": sha,
                               "compression": cfg.step_compression.value})
        )
        carried = result.state.tensors()
        m_digest = s.blobs.put_blob(pack(carried, {"kind": "outer_state", "block_index": str(k)})) if carried else None
        moments_digest = None
        if result.moments is not None:  # what the workers load at the start of round v + 1
            moments_digest = s.blobs.put_blob(pack(result.moments, {"kind": "moments", "block_index": str(k),
                                                                    "version": str(v + 1),
                                                                    "codec": cfg.moment_codec.value}))
        arrivals = sorted(r.arrival_s for r in rows)
        paced = arrivals[max(0, math.ceil(cfg.deadline_quantile * len(arrivals)) - 1)]  # 1.0: the slowest
        seconds = cfg.round_seconds
        if cfg.adaptive_deadline:
            seconds = min(cfg.round_seconds, max(cfg.min_round_seconds, cfg.deadline_slack * paced))
        changed: dict[int, BlockState] = {}
        warm: int | None = None  # the block that opens now and starts from this one (stack.init)
        with s.tx():
            s.rounds.add_version(k, v + 1, w_digest, sha, now, step_blob=step_digest, momentum_blob=m_digest,
                                 moments_blob=moments_digest)
            # the outer state of the versions before: 8 of the ~13 bytes a parameter stored per round, never read again
            unnamed = s.rounds.drop_outer_states(k, v + 1)
            s.rounds.close_round(k, v, now, reason)  # its updates are applied
            s.updates.set_update_state([r.id for r in screened], UpdateState.SCREENED)
            for r in screened:
                s.conduct.record_rejection(r.worker, k, 422, Reason.SCREENED, f"dropped at the close of round {v}: "
                                           "it points away from what the round's other updates agree on", now)
            if cfg.rounds and v + 1 >= self.block_rounds(k):
                s.rounds.finish_round(k, v + 1, now)
                changed[k] = BlockState.FINISHED
                nxt = k + 1
                if self.progressive and nxt < self.n_blocks and self.state[nxt] is BlockState.WAITING:
                    warm = nxt if self.objective.inherits() and ck.current(nxt).version == 0 else None
                    s.rounds.open_round(nxt, ck.current(nxt).version, now, now + cfg.round_seconds)
                    changed[nxt] = BlockState.OPEN
                for j, state in changed.items():
                    s.rounds.set_block_state(j, state, now)
            else:
                s.rounds.open_round(k, v + 1, now, now + seconds)
        ck.publish(k, v + 1, w, payload, result.state)  # memory follows what is committed before anything can fail
        for j, state in changed.items():
            self.state[j] = state
        try:  # after the commit: a crash before leaves a file no row names, not a row without its file
            for digest in unnamed:
                s.blobs.delete_blob(digest)
        except OSError as exc:
            log.warning("block %d: an old outer state's blob could not be deleted (%s); it stays, unused", k, exc)
        for j in sorted(self._copies_due | {k}):  # this block's copy, and any a full disk held back before
            self._copy(j, ck.current(j).version)
        return changed, warm

    def _copy(self, k: int, v: int) -> None:
        """Mirror block k's current version (v) into the run directory (``blocktrain eval RUN``): the files beside the
        store. A failure (a full disk) leaves the run as stored, and the copy is tried again at the next close of any
        block and at a restart."""
        try:
            self.checkpoints.save_checkpoint(k)
            self._copies_due.discard(k)
        except OSError as exc:
            self._copies_due.add(k)
            log.error("block %d: version %d is stored, but its checkpoint copy in the run directory failed (%s); it is "
                      "tried again at the next close and at a restart", k, v, exc)

    def _advance(self, k: int, v: int, n_updates: int, screened: list[UpdateRow], changed: dict[int, BlockState],
                 warm: int | None, reason: CloseReason, now: float) -> None:
        """What follows a stored close: the warm start of a block that opened, screened workers' refusals, states."""
        if warm is not None:
            self._warm(warm)
        log.info("block %d: round %d closed by %s with %d updates -> version %d", k, v, reason.value, n_updates, v + 1)
        for r in screened:
            log.warning("block %d v%d: dropped the update of %s at the round's close: it disagreed with the others", k, v, r.worker)
            self.conduct.refused(r.worker, Reason.SCREENED, now)
        for j, state in changed.items():  # (self.state took them as they were committed)
            log.info("block %d is now %s", j, state.value)
