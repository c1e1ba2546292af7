"""Load: 50 concurrent simulated workers push small updates for several rounds over loopback HTTP.

Every accepted update must be counted exactly once: in the updates table, in the
rounds' counts, in the status document, and in the aggregates (applied once).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import torch

from blocktrain.protocol.delta import Compression, pack_delta
from tests.distributed_utils import ThreadServer, make_coordinator, one_row

N_WORKERS = 50
ROUNDS = 3


def test_fifty_concurrent_workers_every_update_counted_once(tmp_path: Path) -> None:
    c = make_coordinator(tmp_path / "run", None, round_seconds=60, lease_seconds=60, rounds=ROUNDS, tick_seconds=0.2)
    tokens = {f"w{i:02d}": c.add_token(f"w{i:02d}") for i in range(N_WORKERS)}
    accepted: dict[str, int] = {}
    duplicates: list[str] = []
    errors: list[str] = []
    barrier = threading.Barrier(N_WORKERS)

    def worker(name: str, token: str, url: str) -> None:
        g = torch.Generator().manual_seed(hash(name) % 2**31)
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as h:
            # pinned to the block it is given (an unpinned one moves on once its block finishes): one replica count
            k = h.post("/v1/register", json={"block": int(name[1:]) % 4}).json()["block"]
            barrier.wait(timeout=60)  # all registered before anyone pushes: quorum = every replica
            done = 0
            while True:
                w = h.get("/v1/work").json()
                if w["finished"]:
                    break
                if w["submitted"] or w["round_state"] != "open":
                    time.sleep(0.05)
                    continue
                delta = {n: 1e-3 * torch.randn(s, generator=g) for n, s in c.shapes.items()}
                body = pack_delta(delta, Compression.BF16, block=k, base_version=w["version"], base_sha=w["weights_sha"], samples=1)
                r = h.post(f"/v1/blocks/{k}/updates", content=body)
                if r.status_code != 202:
                    errors.append(f"{name}: {r.status_code} {r.text}")
                    return
                done += 1
                # a retry of the same body (as after a dropped connection) must not count twice
                r2 = h.post(f"/v1/blocks/{k}/updates", content=body)
                if r2.status_code == 202 and r2.json()["duplicate"]:
                    duplicates.append(name)
                elif r2.status_code != 409:
                    errors.append(f"{name}: retry answered {r2.status_code} {r2.text}")
            accepted[name] = done

    with ThreadServer(c) as srv:
        threads = [threading.Thread(target=worker, args=(n, t, srv.url)) for n, t in tokens.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads), "workers hung"
        status = httpx.get(f"{srv.url}/v1/status", timeout=30).json()
    assert errors == []
    assert accepted == {n: ROUNDS for n in tokens}
    total = N_WORKERS * ROUNDS
    assert status["updates_accepted"] == total
    assert all(b["version"] == ROUNDS for b in status["blocks"])
    s = c.store
    assert one_row(s, "SELECT COUNT(*) AS n FROM updates")["n"] == total
    assert one_row(s, "SELECT COUNT(*) AS n FROM updates WHERE state='applied'")["n"] == total
    assert one_row(s, "SELECT SUM(n_updates) AS n FROM rounds")["n"] == total
    per_block = {r["block"]: r["n"] for r in s.q("SELECT block, COUNT(*) AS n FROM workers GROUP BY block")}
    for r in s.q("SELECT block, n_updates FROM rounds WHERE state='closed'"):
        assert r["n_updates"] == per_block[r["block"]]  # each replica exactly once per round
    assert len(duplicates) + one_row(s, "SELECT COUNT(*) AS n FROM rejections WHERE reason='stale'")["n"] == total
    c.close()
