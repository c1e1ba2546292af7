"""How long a coordinator takes to restart once a run has accepted many updates: reading each update's stored count
sketch (what it does now) against decoding and sketching each delta (what it did, and still does for rows stored
before sketches were).

A coordinator of ``--preset`` is started in a scratch run directory, ``--updates`` int8 deltas of block 0 (random, at
an honest push's scale) are stored as accepted updates with their sketches, and the coordinator is restarted
``--repeats`` times each way (the sketch column cleared for the second); the replay check must hold the same sketches
both ways. Nothing trains; no data is read.

    flock /tmp/blocktrain-cpu.lock python -m benchmarks.distributed.restart_time --preset cpu-small --updates 400 \\
        --json benchmarks/results/restart-time.json
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from blocktrain.checkpoint.safetensors_io import unpack
from blocktrain.coordinator.intake import pack_sketch
from blocktrain.coordinator.service import Coordinator
from blocktrain.coordinator.settings import CoordinatorSettings, UpdateState
from blocktrain.presets import get_preset
from blocktrain.protocol.delta import Compression, decode_delta, pack_delta


def restart(run: Path, preset: str, settings: CoordinatorSettings) -> tuple[float, torch.Tensor]:
    """Seconds a coordinator of the run takes to start, and block 0's sketches it restored."""
    t0 = time.perf_counter()
    c = Coordinator(run, get_preset(preset), settings)
    seconds = time.perf_counter() - t0
    rows = c.intake._sketches[0].rows()
    c.close()
    assert rows is not None
    return seconds, rows.clone()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="cpu-small")
    ap.add_argument("--updates", type=int, default=400, help="accepted updates of block 0 the run holds")
    ap.add_argument("--repeats", type=int, default=3, help="restarts timed each way")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    settings = CoordinatorSettings(gate=False, audit_fraction=0.0, eval_every=0, fsync=False, rounds=1000)
    with tempfile.TemporaryDirectory(prefix="restart-time-") as tmp:
        run = Path(tmp) / "run"
        c = Coordinator(run, get_preset(args.preset), settings)
        shapes, sha = c.block_shapes[0], c.weights_sha[0]
        g = torch.Generator().manual_seed(0)
        t0 = time.perf_counter()
        with c.lock, c.store.tx():
            for i in range(args.updates):
                delta = {n: 1e-3 * torch.randn(s, generator=g) for n, s in shapes.items()}
                payload = pack_delta(delta, Compression.INT8, block=0, base_version=0, base_sha=sha, samples=1)
                blob = c.store.blobs.put_blob(payload)
                received = decode_delta(unpack(payload)[0], Compression.INT8)  # as the coordinator decodes a push
                sketch = c.store.blobs.put_blob(pack_sketch(0, c.intake.sketch(0, received)))
                c.store.updates.record_update(0, 0, f"w{i}", samples=1, norm=1.0, compression="int8", blob=blob,
                                              arrived=0.0, arrival_s=0.0, counted=False, sketch=sketch)
            ids = [int(r["id"]) for r in c.store.q("SELECT id FROM updates")]
            c.store.updates.set_update_state(ids, UpdateState.DROPPED)  # restored for the replay check, never applied
        stored_s = time.perf_counter() - t0
        blob_bytes = sum(p.stat().st_size for p in c.store.blobs.blob_dir.glob("*.safetensors"))
        c.close()
        timed: dict[str, list[float]] = {"stored sketches": [], "decoded deltas": []}
        sketches: dict[str, torch.Tensor] = {}
        for way in timed:
            if way == "decoded deltas":  # as a run stored before sketches were
                c = Coordinator(run, get_preset(args.preset), settings)
                with c.lock, c.store.tx():
                    c.store.db.execute("UPDATE updates SET sketch=NULL", ())
                c.close()
            for _ in range(args.repeats):
                seconds, sketches[way] = restart(run, args.preset, settings)
                timed[way].append(seconds)
        assert torch.allclose(sketches["stored sketches"], sketches["decoded deltas"], atol=1e-6)
    rows: list[dict[str, Any]] = [
        {"way": way, "restart_s": min(s), "restart_s_all": s, "updates": args.updates} for way, s in timed.items()]
    print(f"| restart of a {args.preset} coordinator holding {args.updates} accepted updates of block 0 | seconds |")
    print("|---|---|")
    for r in rows:
        print(f"| {r['way']} | {r['restart_s']:.2f} |")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    doc = {"what": " ".join(__doc__.split("\n\n")[0].split()), "preset": args.preset, "updates": args.updates, "repeats": args.repeats,
           "threads": args.threads, "blob_bytes": blob_bytes, "store_s": stored_s, "rows": rows,
           "command": "python -m benchmarks.distributed.restart_time " + " ".join(sys.argv[1:]), "commit": commit}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
