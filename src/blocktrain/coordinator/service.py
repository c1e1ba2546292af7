"""The coordinator service: a thin front over the parts that each own their state, independent of HTTP.

:class:`Coordinator` builds the parts, holds the one lock they share, and exposes what the HTTP layer
(:mod:`.app`) calls. The parts, none of which inherits from another:

* :class:`.auth.Tokens`: bearer tokens, authentication, unauthenticated refusals.
* :class:`.roster.Roster`: registration, leases, assignment to blocks, the work answer.
* :class:`.uploads.Uploads`: update pushes through the :class:`.intake.Intake` to a stored update; audits
  (:class:`.audit.Auditor`); refusals, with their consequences (:class:`.conduct.Conduct`).
* :class:`.rounds.Rounds`: block states, round open and close, aggregation, the progressive schedule.
* :class:`.checkpoints.Checkpoints`: the published weights, the checkpoint mirror, downloads, evaluation.
* :class:`.observe.Traffic`: byte counting; :func:`.observe.status` reads the parts for ``/v1/status``.
* :class:`.groups.PeerHub`: the hivemind engine's authority and bootstrap peer (``--hivemind``).

Durable state is the :class:`.store.Store`'s, one accessor per table owner.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from blocktrain.checkpoint.run import RunDir
from blocktrain.config import RunConfig
from blocktrain.coordinator.audit import Auditor
from blocktrain.coordinator.auth import Tokens
from blocktrain.coordinator.checkpoints import Checkpoints
from blocktrain.coordinator.conduct import Conduct
from blocktrain.coordinator.evaluation import Evaluator
from blocktrain.coordinator.groups import PeerHub
from blocktrain.coordinator.intake import Intake
from blocktrain.coordinator.observe import Traffic
from blocktrain.coordinator.roster import Roster
from blocktrain.coordinator.rounds import Rounds, progressive_schedule
from blocktrain.coordinator.settings import CoordinatorSettings
from blocktrain.coordinator.store import Store
from blocktrain.coordinator.uploads import Uploads
from blocktrain.data.dataset import DataDir
from blocktrain.errors import ProtocolError
from blocktrain.objectives import get_objective

log = logging.getLogger(__name__)


class Coordinator:
    """All coordinator logic, independent of HTTP (the app in :mod:`.app` is a thin layer)."""

    def __init__(
        self,
        run_dir: Path,
        cfg: RunConfig,
        settings: CoordinatorSettings,
        data: DataDir | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.run = RunDir(run_dir)
        self.cfg = self.run.init(cfg, data.root if data is not None else None)
        self.objective = get_objective(self.cfg)
        self.settings = settings.for_objective(self.objective.outer_step())
        self.clock = clock
        self.store = Store(self.run.root, fsync=settings.fsync)
        self.lock = threading.RLock()  # serialises every state change, and every use of the store
        self.n_blocks = self.cfg.model.n_blocks
        progressive = progressive_schedule(self.cfg, settings)
        self.evaluator = Evaluator(self.cfg, settings, data)
        self.checkpoints = Checkpoints(self.run, self.cfg, self.settings, self.objective, self.store, self.evaluator, self.lock, clock)
        self.intake = Intake(self.settings, self.checkpoints.block_shapes, self.evaluator)  # what every update passes
        self.conduct = Conduct(self.settings, self.store)  # rate limit and quarantine
        if self.settings.gate and not self.intake.gating:
            log.warning("no validation data: the loss gate is off (give the coordinator --data to turn it on)")
        self.auditor = Auditor(self.cfg, self.settings, data)  # replays a sampled fraction of accepted pushes
        self.rounds = Rounds(self.cfg, self.settings, progressive, self.store, self.checkpoints, self.intake, self.conduct,
                             self.lock, audits_pending=self.auditor.holds)  # a round waits for its audits
        with self.lock:
            self.rounds.start(self.clock())
        self.tokens = Tokens(self.store, self.conduct, self.lock, clock)
        # the hivemind engine's authority and bootstrap peer (coordinator.groups)
        self.hub: PeerHub | None = PeerHub(self.run.root, self.store, settings.hivemind_host) if settings.hivemind else None
        self.roster = Roster(self.cfg, self.settings, self.store, self.rounds, self.conduct, self.hub, self.lock, clock)
        self.uploads = Uploads(self.roster, self.intake, self.auditor, self.conduct, self.hub)
        self.traffic = Traffic(self.store, self.lock)
        # Read-only views of the parts' state (the same objects, updated in place): tests and benchmarks read them.
        ck = self.checkpoints
        self.version, self.weights, self.weights_sha, self.outer = ck.version, ck.weights, ck.weights_sha, ck.outer
        self.block_shapes, self.shapes, self.E = ck.block_shapes, ck.shapes, ck.E
        self.block_fp32_bytes, self.max_body_bytes = ck.block_fp32_bytes, ck.max_body_bytes
        self.state = self.rounds.state
        # What the HTTP layer calls, each the method of the part that owns it.
        self.worker_for_token, self.authenticate, self.add_token = (self.tokens.worker_for_token, self.tokens.authenticate,
                                                                    self.tokens.add_token)
        self.unauthenticated_rejections = self.tokens.unauthenticated_rejections
        self.register, self.heartbeat, self.leave, self.work = (self.roster.register, self.roster.heartbeat,
                                                                self.roster.leave, self.roster.work)
        self.live_replicas = self.roster.live_replicas
        self.submit, self.audit = self.uploads.submit, self.uploads.audit
        self.weights_bytes, self.step_bytes = ck.weights_bytes, ck.step_bytes
        self.frozen_bytes, self.block_rounds, self.finished = (self.rounds.frozen_bytes, self.rounds.block_rounds, self.rounds.finished)
        self.maybe_evaluate = ck.maybe_evaluate
        self.count_bytes, self.flush_bytes = self.traffic.count_bytes, self.traffic.flush_bytes

    def record_rejection(self, name: str | None, k: int | None, exc: ProtocolError) -> None:
        """Log and count a refused update; durably (a ``rejections`` row) only for an authenticated worker.

        ``name`` None means the request carried no valid token: it is counted in memory and its log
        line rate-limited, so unauthenticated traffic takes no lock and writes nothing to disk.
        """
        if name is None:
            self.tokens.refused(k, exc)
        else:
            self.uploads.record_rejection(name, k, exc)

    def tick(self) -> None:
        """Lapse expired leases, close rounds at quorum or deadline, flush byte counters."""
        with self.lock:
            now = self.clock()
            self.roster.lapse(now)
            self.uploads.overdue_audits(now)
            self.rounds.check_quorum(now)
            self.rounds.close_due_rounds(now)
            self.flush_bytes()

    def close(self) -> None:
        self.flush_bytes()
        if self.hub is not None:
            self.hub.close()
        self.store.close()
