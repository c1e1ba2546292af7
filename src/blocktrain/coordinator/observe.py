"""Observability: byte counting (:class:`Traffic`), the ``/v1/status`` document (:class:`Observed`) and Prometheus
text for ``/metrics``.

The status is read from the coordinator's parts through their public methods and tables, under its lock (the HTTP
routes serve it through :class:`.polls.Snapshot`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from blocktrain.config import RunConfig
from blocktrain.coordinator.audit import Auditor
from blocktrain.coordinator.auth import Tokens
from blocktrain.coordinator.checkpoints import Checkpoints
from blocktrain.coordinator.conduct import Conduct
from blocktrain.coordinator.groups import PeerHub
from blocktrain.coordinator.intake import Intake
from blocktrain.coordinator.rounds import Rounds
from blocktrain.coordinator.settings import CoordinatorSettings, OuterOptimizer
from blocktrain.coordinator.store import Store
from blocktrain.protocol.codes import BlockState
from blocktrain.protocol.status import BlockStatus, EvalStatus, OuterStatus, RoundStatus, Status, WorkerStatus


class Traffic:
    """Body bytes of every request, counted as they cross the wire (from the HTTP layer's threads, unlocked: each count
    is one append to a queue) and flushed to the store on each tick (under the coordinator's lock)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._counts: deque[tuple[str | None, int, int, str]] = deque()  # (worker, in, out, route), not yet stored

    def count_bytes(self, name: str | None, n_in: int, n_out: int, route: str = "control") -> None:
        """Body bytes of one request; ``route``: "updates", "weights" (weights, steps, frozen blocks) or "control".
        By route only for workers' requests: traffic without a valid token adds no row to the database."""
        self._counts.append((name, n_in, n_out, route))

    def flush_bytes(self) -> None:
        """Store the counts queued so far (call under the lock)."""
        pending: dict[str | None, list[int]] = {}
        routes: dict[str, list[int]] = {}
        while self._counts:
            name, n_in, n_out, route = self._counts.popleft()
            acc = pending.setdefault(name, [0, 0])
            acc[0] += n_in
            acc[1] += n_out
            if name is not None:
                by_route = routes.setdefault(route, [0, 0])
                by_route[0] += n_in
                by_route[1] += n_out
        if not pending:
            return
        with self.store.tx():
            for who, (n_in, n_out) in pending.items():
                self.store.workers.add_bytes(who, n_in, n_out)
            for route, (n_in, n_out) in routes.items():
                self.store.meta.add_counter(f"bytes_in:{route}", n_in)
                self.store.meta.add_counter(f"bytes_out:{route}", n_out)


@dataclass(frozen=True)
class Observed:
    """The parts the status document reads (through their own methods and tables, under the coordinator's lock)."""

    cfg: RunConfig  # the run's config
    settings: CoordinatorSettings  # the coordinator's settings
    store: Store  # the durable state
    checkpoints: Checkpoints  # the published versions
    rounds: Rounds  # block states and rounds
    conduct: Conduct  # quarantine and the rate limit
    intake: Intake  # the intake's cost and the gate's tolerances
    auditor: Auditor  # the audits
    tokens: Tokens  # unauthenticated refusals
    hub: PeerHub | None  # the hivemind engine (None: off)

    def status(self, now: float, recent_rounds: int = 50) -> Status:
        """Everything the dashboard shows (call under the lock, after the byte counters were flushed)."""
        s, ck, st = self.store, self.checkpoints, self.settings
        live = s.workers.live_by_block(self.cfg.model.n_blocks, now)
        outer = OuterStatus(method=st.outer.value if st.outer else None, lr=st.outer_lr,
                            momentum=st.outer_momentum if st.outer is OuterOptimizer.NESTEROV else None,
                            step_encoding=st.step_compression.value, aggregation=st.aggregation.value,
                            inner_start=st.inner_start.value)
        blocks = []
        for k in range(self.cfg.model.n_blocks):
            current = ck.current(k)
            rnd = s.rounds.round(k, current.version)
            state = self.rounds.state[k]
            blocks.append(BlockStatus(
                block=k, state=state, version=current.version, weights_sha=current.sha,
                round_state=self.rounds.round_state(k, rnd),
                deadline_in=(rnd.deadline - now) if rnd is not None else 0.0,
                updates_in_round=rnd.n_updates if rnd is not None else 0, live_replicas=len(live[k]), outer=outer))
        workers = [WorkerStatus(name=w.name, block=w.block, pinned=w.pinned, state=w.state.value, live=w.live(now),
                                lease_in=w.lease_until - now, bytes_in=w.bytes_in, bytes_out=w.bytes_out,
                                updates_accepted=w.accepted, updates_rejected=w.rejected) for w in s.workers.workers()]
        rounds = []
        for r in s.rounds.closed_rounds(recent_rounds):
            moved = s.rounds.round_traffic(r.block, r.version, r.opened, r.closed if r.closed is not None else now)
            rounds.append(RoundStatus(
                block=r.block, version=r.version, state=r.state, opened=r.opened, closed=r.closed,
                close_reason=r.close_reason.value if r.close_reason is not None else None, updates=r.n_updates,
                push_bytes=moved.push_bytes, step_bytes=moved.step_bytes, rejected=moved.rejected,
                groups=[len(m) for m in s.updates.groups(r.block, r.version).values()]))  # group sizes (hivemind)
        evals = [EvalStatus(epoch=e.epoch, versions=e.versions, ce_nats_per_byte=e.ce, bytes=e.bytes, at=e.at)
                 for e in s.evals.evals()]
        counters = s.meta.counters()
        rejections = {key.split(":", 1)[1]: n for key, n in counters.items() if key.startswith("rejected:")}
        for reason, n in self.tokens.unauthenticated_rejections().items():  # in memory only: since this process started
            rejections[reason] = rejections.get(reason, 0) + n
        return Status(
            preset=self.cfg.name,
            objective=str(self.cfg.objective),
            dataset=self.cfg.dataset or None,  # the fingerprint every worker's data must have
            n_blocks=self.cfg.model.n_blocks,
            block_fp32_bytes=ck.block_fp32_bytes,
            finished=self.rounds.finished(),
            rounds_closed=counters.get("rounds_closed", 0),
            updates_accepted=counters.get("updates_accepted", 0),
            rejections=rejections,
            rate_limited=self.conduct.rate_limited,  # update requests answered 429 since start-up (kept in memory)
            quarantined=s.conduct.quarantined_workers(),  # worker -> why
            intake=self.intake.summary(),  # its cost per update and the loss gate's current tolerance per block
            audits=self.auditor.summary(),  # replays passed, failed, awaiting their upload, median replay seconds
            bytes_in=counters.get("bytes_in", 0),
            bytes_out=counters.get("bytes_out", 0),
            # workers' bytes by what they moved: deltas in, weights and steps out, control (register, work, heartbeats)
            bytes_by_route={r: {"in": counters.get(f"bytes_in:{r}", 0), "out": counters.get(f"bytes_out:{r}", 0)}
                            for r in ("updates", "weights", "control")},
            latest_eval_ce=evals[-1].ce_nats_per_byte if evals else None,
            blocks=blocks, workers=workers, rounds=rounds, evals=evals,
            # the hivemind engine: the DHT workers join first, the authority that signs their tokens (--hivemind)
            p2p=self.hub.status() if self.hub is not None else None,
        )


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus(status: Status) -> str:
    """Prometheus text exposition format 0.0.4 of a status document."""
    st = status.model_dump(mode="json")
    out: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[dict[str, str], float]]) -> None:
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lab = ",".join(f'{k}="{_esc(str(v))}"' for k, v in labels.items())
            out.append(f"{name}{{{lab}}} {value}" if lab else f"{name} {value}")

    metric("blocktrain_rounds_closed_total", "counter", "Rounds closed over all blocks.", [({}, st["rounds_closed"])])
    metric("blocktrain_updates_accepted_total", "counter", "Updates accepted.", [({}, st["updates_accepted"])])
    metric("blocktrain_updates_rejected_total", "counter",
           "Updates rejected, by reason (reason auth: without a valid token, counted since the process started).",
           [({"reason": r}, n) for r, n in sorted(st["rejections"].items())])
    metric("blocktrain_bytes_received_total", "counter", "Request body bytes received.", [({}, st["bytes_in"])])
    metric("blocktrain_bytes_sent_total", "counter", "Response body bytes sent.", [({}, st["bytes_out"])])
    metric("blocktrain_worker_bytes_received_total", "counter", "Request body bytes received per worker.",
           [({"worker": w["name"]}, w["bytes_in"]) for w in st["workers"]])
    metric("blocktrain_worker_bytes_sent_total", "counter", "Response body bytes sent per worker.",
           [({"worker": w["name"]}, w["bytes_out"]) for w in st["workers"]])
    metric("blocktrain_worker_live", "gauge", "1 if the worker holds a lease.",
           [({"worker": w["name"], "block": str(w["block"])}, int(w["live"])) for w in st["workers"]])
    metric("blocktrain_block_version", "gauge", "Published version of each block.",
           [({"block": str(b["block"])}, b["version"]) for b in st["blocks"]])
    metric("blocktrain_block_state", "gauge", "1 for the state each block is in (waiting, open, finished), else 0.",
           [({"block": str(b["block"]), "state": s.value}, int(b["state"] == s.value))
            for b in st["blocks"] for s in BlockState])
    metric("blocktrain_block_live_replicas", "gauge", "Live workers on each block.",
           [({"block": str(b["block"])}, b["live_replicas"]) for b in st["blocks"]])
    if st["latest_eval_ce"] is not None:
        metric("blocktrain_eval_ce_nats_per_byte", "gauge", "Latest validation CE of the assembled model.",
               [({}, st["latest_eval_ce"])])
    return "\n".join(out) + "\n"
