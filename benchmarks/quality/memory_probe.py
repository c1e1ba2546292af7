"""Training-memory probe: how much checkpoint serialisation adds to a run's peak RSS.

Trains E2E or block 3 of ``cpu-small`` for 40 steps with a given checkpoint interval
and prints its training memory (peak RSS minus the pre-model baseline).

    python benchmarks/quality/memory_probe.py block 10     # checkpoint every 10 steps
    python benchmarks/quality/memory_probe.py block 1000   # no intermediate checkpoint

The allocator effect is measured with the CLI directly, e.g.
    MALLOC_MMAP_THRESHOLD_=1048576 blocktrain train-block --preset cpu-small --steps 40 --block 3 --out /tmp/p
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from blocktrain.data.dataset import resolve_data_dir
from blocktrain.presets import cpu_small
from blocktrain.train.block import train_block
from blocktrain.train.e2e import train_e2e


def main() -> int:
    which, every = sys.argv[1], int(sys.argv[2])
    cfg = cpu_small().with_train(steps=40, checkpoint_every=every, eval_bytes=0)
    data = resolve_data_dir(sys.argv[3] if len(sys.argv) > 3 else None)
    out = Path(tempfile.mkdtemp(prefix="memprobe-"))
    s = train_block(cfg, data, out, 3, progress=False) if which == "block" else train_e2e(cfg, data, out, progress=False)
    sys.stdout.write(f"{which} checkpoint_every={every} train_mem={s.train_mem_bytes / 2**20:.1f} MiB\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
