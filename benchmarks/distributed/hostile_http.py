"""Hostile workers against the live coordinator over HTTP: each attack's final CE beside the runs without it.

Every row is a whole stack run on this machine: ``blocktrain coordinator`` with its default defences and six workers
as processes, ``--colluders`` of them hostile. A hostile worker is the product's own :class:`Worker` (its HTTP client,
its training loop, its registration and streams) that changes one thing:

* ``inflated_claim``: trains honestly and claims 2^30 samples, the most the message format takes;
* ``replay``: pushes its first accepted delta again every round, relabelled with the current version and sha256;
* ``toward_zero``: pushes -W_v scaled to the norm of its honest delta (pulls the weights toward zero);
* ``scaled_random``: Gaussian noise at 100x its honest delta's norm;
* ``sign_flip``: minus its honest delta;
* ``shuffled_labels``: trains on targets shuffled within each batch;
* ``lazy``: pushes a zero delta and claims its whole budget;
* ``stale``: never moves past the first version it fetched: trains from it and pushes against the current one;
* ``forged_moments``: trains and pushes honestly from AdamW moments of its own choosing (m negated at every round's
  start), committing to them: an audit that replayed from the uploaded state passed it; one that derives the moments
  from the worker's earlier rounds (``coordinator.lineage``) does not.

Rows ``honest6`` and ``honest5`` are the references: six honest workers, and five (the run without the hostile one).
The final CE of the composed stack is scored by ``blocktrain eval`` on the first ``--eval-bytes`` test bytes. Each
row records the coordinator's refusals by reason, every refusal of an honest worker's update, the quarantined
workers and the intake's time per update.

    flock /tmp/blocktrain-cpu.lock .venv/bin/python benchmarks/distributed/hostile_http.py --rows all \\
        --out benchmarks/results/hostile-peers.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import torch

from blocktrain.checkpoint.safetensors_io import tensors_sha256
from blocktrain.coordinator.conduct import COUNTED
from blocktrain.coordinator.store import Store
from blocktrain.data.dataset import resolve_data_dir
from blocktrain.protocol.delta import delta_norm
from blocktrain.train.inner import InnerRounds
from blocktrain.train.metrics import write_json
from blocktrain.worker.loop import Worker
from blocktrain.worker.options import WorkerOptions

ATTACKS = ("inflated_claim", "replay", "toward_zero", "scaled_random", "sign_flip", "shuffled_labels", "lazy", "stale",
           "forged_moments")
ROWS = ("honest6", "honest5", *ATTACKS, "collude_sign_flip", "collude_toward_zero")
BT = [sys.executable, "-m", "blocktrain"]
SHARED_WIKITEXT = Path(__file__).resolve().parents[3] / "shared" / "data" / "wikitext" / "wikitext-2-v1-tokens"


class HostileWorker(Worker):
    """A worker of the product that lies in one way (``attack``)."""

    def __init__(self, attack: str, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.attack = attack
        self.first: dict[str, torch.Tensor] | None = None  # replay: the first delta it pushed
        self.g = torch.Generator().manual_seed(1234)

    def _setup(self, reg: Any) -> None:
        super()._setup(reg)
        if self.attack == "shuffled_labels":
            self.objective = _ShuffledTargets(self.objective, self.g)
        if self.attack == "forged_moments":
            self.inner = _NegatedMoments(self.block, self.cfg.train, self.inner_start)

    def _set_base(self, weights: dict[str, torch.Tensor], version: int) -> None:
        if self.attack == "stale" and self.base is not None:  # keeps training from the first version it fetched
            self.base_version, self.base_sha = version, tensors_sha256(weights)
            return
        super()._set_base(weights, version)

    def _delta(self) -> tuple[dict[str, torch.Tensor], int]:
        delta, samples = super()._delta()
        assert self.base is not None
        norm = delta_norm(delta)
        if self.attack == "inflated_claim":
            return delta, 1 << 30
        if self.attack == "replay":
            self.first = self.first or delta
            return self.first, samples
        if self.attack == "toward_zero":
            scale = norm / max(delta_norm(self.base), 1e-12)
            return {n: -scale * w for n, w in self.base.items()}, samples
        if self.attack == "scaled_random":
            noise = {n: torch.randn(d.shape, generator=self.g) for n, d in delta.items()}
            s = 100.0 * norm / max(delta_norm(noise), 1e-12)
            return {n: s * t for n, t in noise.items()}, samples
        if self.attack == "sign_flip":
            return {n: -d for n, d in delta.items()}, samples
        if self.attack == "lazy":
            return {n: torch.zeros_like(d) for n, d in delta.items()}, samples
        return delta, samples  # shuffled_labels and stale lie in what they train on


class _NegatedMoments(InnerRounds):
    """A round's inner optimiser whose m is negated once the round has started (steering its steps)."""

    def begin(self, published: Mapping[str, torch.Tensor] | None = None) -> None:
        super().begin(published)
        for st in self.opt.state.values():
            if "exp_avg" in st:
                st["exp_avg"].neg_()


class _ShuffledTargets:
    """The run's objective, with each batch's targets shuffled before the loss."""

    def __init__(self, inner: Any, g: torch.Generator) -> None:
        self.inner = inner
        self.g = g

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def block_loss(self, block: Any, k: int, x: torch.Tensor, y: torch.Tensor, *args: Any, **kw: Any) -> Any:
        perm = torch.randperm(y.numel(), generator=self.g)
        return self.inner.block_loss(block, k, x, y.reshape(-1)[perm].reshape(y.shape), *args, **kw)  # (b*t,) -> (b, t)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _plan(row: str, colluders: int) -> tuple[int, int, str | None]:
    """(honest workers, hostile workers, attack) of a row."""
    if row == "honest6":
        return 6, 0, None
    if row == "honest5":
        return 5, 0, None
    if row.startswith("collude_"):
        return 6 - colluders, colluders, row.removeprefix("collude_")
    return 5, 1, row


def run_row(row: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    n_honest, n_bad, attack = _plan(row, args.colluders)
    run = root / row
    shutil.rmtree(run, ignore_errors=True)  # a fresh run: a row cut short before left a store a coordinator would resume
    store = Store(run)
    names = [f"h{i}" for i in range(n_honest)] + [f"x{i}" for i in range(n_bad)]
    tokens = {n: store.tokens.add_token(n, time.time()) for n in names}
    store.close()
    port = _port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    coord = subprocess.Popen(
        [*BT, "coordinator", "--run-dir", str(run), "--preset", args.preset, "--steps", str(args.steps), "--data",
         str(args.data), "--port", str(port), "--rounds", str(args.steps // args.h), "--local-steps", str(args.h),
         "--round-seconds", "300", "--lease-seconds", "120", "--eval-every", "0", "--threads", "1", "--device", "cpu"],
        env=env, stdout=subprocess.DEVNULL, stderr=open(logs / f"{row}-coordinator.log", "w"))  # noqa: SIM115
    t0 = time.time()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        while True:
            try:
                httpx.get(f"{url}/v1/status", timeout=5).raise_for_status()
                break
            except httpx.HTTPError:
                if coord.poll() is not None or time.time() - t0 > 120:
                    raise RuntimeError(f"the coordinator did not start; see {logs}/{row}-coordinator.log") from None
                time.sleep(0.5)
        common = ["--coordinator", url, "--data", str(args.data), "--threads", "1", "--no-progress", "--frozen-cache",
                  str(root / "frozen-cache" / row), "--device", args.device]
        for n in names:
            cmd = ([*BT, "worker", *common] if n.startswith("h")
                   else [sys.executable, __file__, "worker", "--attack", str(attack), *common])
            procs.append(subprocess.Popen(cmd, env={**env, "BLOCKTRAIN_TOKEN": tokens[n]}, stdout=subprocess.DEVNULL,
                                          stderr=open(logs / f"{row}-{n}.log", "w")))  # noqa: SIM115
        for p, n in zip(procs, names, strict=True):
            rc = p.wait(timeout=args.timeout_s)
            if n.startswith("h") and rc != 0:
                raise RuntimeError(f"honest worker {n} exited with {rc}; see {logs}/{row}-{n}.log")
        wall = time.time() - t0
        status = httpx.get(f"{url}/v1/status", timeout=30).json()
    finally:
        for p in [*procs, coord]:
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=60)
    eval_doc = json.loads(subprocess.run(
        [*BT, "eval", str(run), "--model", "blocktrain", "--split", "test", "--data", str(args.data), "--max-bytes",
         str(args.eval_bytes), "--json", "--no-progress"], env={**os.environ, "OMP_NUM_THREADS": "2"}, check=True,
        capture_output=True, text=True).stdout)
    con = sqlite3.connect(f"file:{run / 'coordinator' / 'state.sqlite3'}?mode=ro", uri=True)
    refused = con.execute("SELECT worker, reason, COUNT(*) FROM rejections GROUP BY worker, reason").fetchall()
    con.close()
    honest_refused = {f"{w}:{r}": int(n) for w, r, n in refused if str(w).startswith("h") and r in COUNTED}
    return {
        "row": row, "attack": attack, "honest_workers": n_honest, "hostile_workers": n_bad,
        "ce_nats_per_byte": float(eval_doc["ce_nats_per_byte"]), "eval_bytes": args.eval_bytes, "wall_s": wall,
        "updates_accepted": status["updates_accepted"], "rejections": status["rejections"],
        "quarantined": status["quarantined"], "rate_limited": status["rate_limited"],
        "honest_refused": honest_refused,  # honest updates refused for what they are or do (must stay empty)
        "intake_ms_per_update": status["intake"]["ms_per_update"],
        "command": f"python benchmarks/distributed/hostile_http.py --rows {row} --preset {args.preset} --steps {args.steps} "
                   f"--h {args.h} --colluders {args.colluders} --eval-bytes {args.eval_bytes} --device {args.device} "
                   f"--data {args.data_given}",
    }


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table, each CE beside the run without the hostile workers (honest5, or honest4)."""
    by = {r["row"]: r for r in rows}
    out = ["| row | final CE | vs the run without it | refusals by reason | quarantined | honest updates refused | "
           "intake ms/update |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        ref = by.get("honest5") if r["hostile_workers"] <= 1 else None
        gap = f"{r['ce_nats_per_byte'] - ref['ce_nats_per_byte']:+.4f}" if ref is not None and r["row"] != "honest5" else ""
        bad = {k: v for k, v in r["rejections"].items() if k not in ("stale", "duplicate", "base", "finished", "waiting")}
        out.append(f"| {r['row']} | {r['ce_nats_per_byte']:.4f} | {gap} | {bad or ''} | {', '.join(r['quarantined']) or ''} "
                   f"| {sum(r['honest_refused'].values())} | {r['intake_ms_per_update']:.0f} |")
    return "\n".join(out)


def hostile_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description="one hostile worker (run by this script's table)")
    ap.add_argument("--attack", choices=ATTACKS, required=True)
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--frozen-cache", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(a.threads)
    opts = WorkerOptions(url=a.coordinator, token=os.environ["BLOCKTRAIN_TOKEN"], progress=False,
                         frozen_cache=a.frozen_cache, max_rejections=1 << 20, give_up_s=60, device=a.device)
    w = HostileWorker(a.attack, opts, resolve_data_dir(str(a.data)))
    try:
        w.run()
    except Exception as exc:  # quarantined: its token is revoked, and it stops here
        logging.warning("hostile worker stopped: %s", exc)
    return 0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        return hostile_main(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="all", help=f"comma-separated rows, or all: {', '.join(ROWS)}")
    ap.add_argument("--preset", default="cpu-mini")
    ap.add_argument("--steps", type=int, default=400, help="inner steps per block (rounds = steps / h)")
    ap.add_argument("--h", type=int, default=25, help="H: inner steps per round, the coordinator's budget")
    ap.add_argument("--colluders", type=int, default=2, help="hostile workers in the collude_* rows")
    ap.add_argument("--eval-bytes", type=int, default=32768)
    ap.add_argument("--data", default=str(SHARED_WIKITEXT), help="data dir (default: the shared byte-level WikiText-2)")
    ap.add_argument("--timeout-s", type=float, default=3600.0)
    ap.add_argument("--work", type=Path, default=Path("runs/hostile-http"))
    ap.add_argument("--device", default="cpu", help="the workers' --device (the coordinator's replays stay on the CPU)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/hostile-peers.json"))
    ap.add_argument("--skip-done", action="store_true", help="skip the rows --out holds already (a run that resumes)")
    args = ap.parse_args()
    args.data_given = args.data  # as written, for the recorded command
    args.data = resolve_data_dir(args.data).root
    rows = list(ROWS) if args.rows == "all" else [r.strip() for r in args.rows.split(",")]
    unknown = set(rows) - set(ROWS)
    if unknown:
        ap.error(f"unknown rows {sorted(unknown)}; choose from {', '.join(ROWS)}")
    doc: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {}
    if "http" not in doc:
        doc["http"] = {"what": __doc__.split("\n\n")[0], "rows": []}
    for row in rows:
        if args.skip_done and any(r["row"] == row for r in doc["http"]["rows"]):
            print(f"== {row}: in {args.out} already, skipped", flush=True)
            continue
        print(f"== {row}", flush=True)
        result = run_row(row, args, args.work)
        print(json.dumps({k: result[k] for k in ("row", "ce_nats_per_byte", "quarantined", "honest_refused",
                                                 "intake_ms_per_update", "wall_s")}), flush=True)
        doc["http"]["rows"] = [r for r in doc["http"]["rows"] if r["row"] != row] + [result]
        write_json(args.out, doc)
    print(table(doc["http"]["rows"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
