"""``blocktrain worker`` at 1/FACTOR of its speed: a slow peer for the hostile-peers study (issue 19).

After every optimiser step it sleeps (FACTOR - 1) times the wall time of that whole
step (forward included), so the worker computes exactly as before, only slower.

    python benchmarks/distributed/slow_worker.py --factor 2 -- worker --coordinator URL ...
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from blocktrain.cli.main import main as blocktrain_main
from blocktrain.train import loop


def slowed(factor: float) -> Any:
    real = loop.optimizer_step
    last = [time.perf_counter()]

    def step(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = real(*args, **kwargs)
        now = time.perf_counter()
        time.sleep((factor - 1.0) * (now - last[0]))
        last[0] = time.perf_counter()
        return out

    return step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--factor", type=float, default=2.0, help="how many times slower (2: half speed)")
    ap.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the blocktrain command line")
    args = ap.parse_args()
    if args.factor < 1:
        ap.error("--factor must be >= 1")
    loop.optimizer_step = slowed(args.factor)  # the training loop's own reference (train_steps calls it)
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    return blocktrain_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
