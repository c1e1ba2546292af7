"""Observability: byte counting (:class:`Traffic`), the ``/v1/status`` document and Prometheus text for ``/metrics``.

The status is read from the coordinator's parts through their public methods and tables, under its lock.
"""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING, Any

from blocktrain.coordinator.settings import BlockState, OuterOptimizer, RoundState, WorkerState
from blocktrain.coordinator.store import Store
from blocktrain.protocol.messages import Status

if TYPE_CHECKING:
    from blocktrain.coordinator.service import Coordinator


class Traffic:
    """Body bytes of every request, counted in memory as they cross the wire and flushed to the store on each tick."""

    def __init__(self, store: Store, lock: threading.RLock) -> None:
        self.store, self.lock = store, lock
        self._bytes_lock = threading.Lock()
        self._pending: dict[str | None, list[int]] = {}  # worker (None: no valid token) -> [in, out], not yet stored
        self._routes: dict[str, list[int]] = {}  # route kind -> [in, out], not yet stored

    def count_bytes(self, name: str | None, n_in: int, n_out: int, route: str = "control") -> None:
        """Body bytes of one request; ``route``: "updates", "weights" (weights, steps, frozen blocks) or "control".
        By route only for workers' requests: traffic without a valid token adds no row to the database."""
        with self._bytes_lock:
            acc = self._pending.setdefault(name, [0, 0])
            acc[0] += n_in
            acc[1] += n_out
            if name is None:
                return
            by_route = self._routes.setdefault(route, [0, 0])
            by_route[0] += n_in
            by_route[1] += n_out

    def flush_bytes(self) -> None:
        with self._bytes_lock:
            pending, self._pending = self._pending, {}
            routes, self._routes = self._routes, {}
        if not pending:
            return
        with self.lock, self.store.tx():
            for name, (n_in, n_out) in pending.items():
                self.store.workers.add_bytes(name, n_in, n_out)
            for route, (n_in, n_out) in routes.items():
                self.store.meta.add_counter(f"bytes_in:{route}", n_in)
                self.store.meta.add_counter(f"bytes_out:{route}", n_out)


def status(c: Coordinator, recent_rounds: int = 50) -> dict[str, Any]:
    """Everything the dashboard shows, as JSON-ready data."""
    c.traffic.flush_bytes()
    with c.lock:
        now = c.clock()
        s, ck = c.store, c.checkpoints
        live = c.roster.live_replicas(now)
        blocks = []
        st = c.settings
        outer = {"method": st.outer.value if st.outer else None, "lr": st.outer_lr,
                 "momentum": st.outer_momentum if st.outer is OuterOptimizer.NESTEROV else None,
                 "step_encoding": st.step_compression.value, "aggregation": st.aggregation.value}
        for k in range(c.n_blocks):
            v = ck.version[k]
            rnd = s.rounds.round(k, v)
            state = c.rounds.state[k]
            blocks.append({
                "block": k,
                "state": state.value,  # waiting, open or finished
                "version": v,
                "weights_sha": ck.weights_sha[k],
                "round_state": (
                    BlockState.WAITING.value if state is BlockState.WAITING
                    else rnd["state"] if rnd is not None else RoundState.FINISHED.value
                ),
                "deadline_in": (float(rnd["deadline"]) - now) if rnd is not None else 0.0,
                "updates_in_round": int(rnd["n_updates"]) if rnd is not None else 0,
                "live_replicas": len(live[k]),
                "outer": outer,  # the outer step in use on this block
            })
        workers = [
            {
                "name": r["name"],
                "block": r["block"],
                "pinned": bool(r["pinned"]),
                "state": r["state"],
                "live": r["state"] == WorkerState.ACTIVE.value and float(r["lease_until"]) >= now,
                "lease_in": float(r["lease_until"]) - now,
                "bytes_in": int(r["bytes_in"]),
                "bytes_out": int(r["bytes_out"]),
                "updates_accepted": int(r["accepted"]),
                "updates_rejected": int(r["rejected"]),
            }
            for r in s.workers.workers()
        ]
        rounds = [
            {
                "block": int(r["block"]),
                "version": int(r["version"]),
                "state": r["state"],
                "opened": float(r["opened"]),
                "closed": None if r["closed"] is None else float(r["closed"]),
                "close_reason": r["close_reason"],
                "updates": int(r["n_updates"]),  # accepted and applied
                # refused while the round was open, by reason; the accepted updates' and the published step's bytes
                **s.rounds.round_traffic(int(r["block"]), int(r["version"]), float(r["opened"]), float(r["closed"])),
                "groups": [len(m) for m in s.updates.groups(int(r["block"]), int(r["version"])).values()],  # sizes (hivemind)
            }
            for r in s.rounds.closed_rounds(recent_rounds)
        ]
        evals = [
            {"epoch": int(r["epoch"]), "versions": json.loads(r["versions"]), "ce_nats_per_byte": float(r["ce"]),
             "bytes": int(r["bytes"]), "at": float(r["at"])}
            for r in s.evals.evals()
        ]
        counters = s.meta.counters()
        quarantined = s.conduct.quarantined_workers()
        intake = c.intake.summary()
    rejections = {k.split(":", 1)[1]: v for k, v in counters.items() if k.startswith("rejected:")}
    for reason, n in c.tokens.unauthenticated_rejections().items():  # in memory only: since this process started
        rejections[reason] = rejections.get(reason, 0) + n
    return Status(
        preset=c.cfg.name,
        objective=str(c.cfg.objective),
        dataset=c.cfg.dataset or None,  # the fingerprint every worker's data must have
        n_blocks=c.n_blocks,
        block_fp32_bytes=ck.block_fp32_bytes,
        finished=c.rounds.finished(),
        rounds_closed=counters.get("rounds_closed", 0),
        updates_accepted=counters.get("updates_accepted", 0),
        rejections=rejections,
        rate_limited=c.conduct.rate_limited,  # update requests answered 429 since start-up (kept in memory)
        quarantined=quarantined,  # worker -> why
        intake=intake,  # its cost per update and the loss gate's current tolerance per block
        audits=c.auditor.summary(),  # replays passed, failed, awaiting their upload, median replay seconds
        bytes_in=counters.get("bytes_in", 0),
        bytes_out=counters.get("bytes_out", 0),
        # workers' bytes by what they moved: deltas in, weights and steps out, control (register, work, heartbeats)
        bytes_by_route={r: {"in": counters.get(f"bytes_in:{r}", 0), "out": counters.get(f"bytes_out:{r}", 0)}
                        for r in ("updates", "weights", "control")},
        latest_eval_ce=evals[-1]["ce_nats_per_byte"] if evals else None,
        blocks=blocks,
        workers=workers,
        rounds=rounds,
        evals=evals,
        # the hivemind engine: the DHT workers join first, the authority that signs their tokens (--hivemind)
        p2p=c.hub.status() if c.hub is not None else None,
    ).model_dump(mode="json")


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus(c: Coordinator) -> str:
    """Prometheus text exposition format 0.0.4."""
    st = status(c, recent_rounds=0)
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
