"""What the device suite checks before it times anything (``scripts/device_suite.sh``, job 0): that the device
computes what a CPU computes where the project relies on it, and which speed levers it has.

- **Counter noise** (:mod:`blocktrain.noise`): the integer hashes bit for bit, and a diffusion-sized draw to fp32
  rounding, on the device against the CPU. An audit on a CPU replays a GPU worker's noise through them.
- **The workers' inner optimiser** (:class:`blocktrain.train.inner.RoundAdamW`): ten steps on the device (one launch
  per bucket on CUDA) against the CPU (a tensor at a time), to fp32 rounding. An audit on a CPU replays them.
- **TF32**: whether fp32 matmuls run in TF32 once the device is resolved (CUDA only).
- **torch.compile**: whether inductor's GPU backend (triton) imports.

    python benchmarks/quality/device_checks.py --device cuda --json device-checks.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import torch

from blocktrain.device import CPU, resolve_device
from blocktrain.noise import mix32, normal
from blocktrain.train.inner import RoundAdamW

NOISE_ATOL = 2e-6  # fp32 rounding of log, cos, sin and sqrt on two devices (tests/test_noise.py's bound)
OPTIMIZER_ATOL = 1e-6  # weights of norm ~0.1 moved ~1e-2 by ten steps: fp32 rounding of the update is ~1e-9 a step


def optimizer_steps(device: torch.device, steps: int = 10) -> list[torch.Tensor]:
    """The weights (on the CPU) after ``steps`` RoundAdamW steps on ``device`` (lr 1e-3, decay 0.1), fixed inputs."""
    g = torch.Generator().manual_seed(3)
    shapes = [(256, 64), (64,), (64, 256), (256,)]
    start = [0.1 * torch.randn(s, generator=g) for s in shapes]
    grads = [[1e-2 * torch.randn(s, generator=g) for s in shapes] for _ in range(steps)]
    params = [torch.nn.Parameter(w.to(device)) for w in start]
    opt = RoundAdamW([{"params": params, "weight_decay": 0.1}], lr=1e-3)
    for step_grads in grads:
        for p, gr in zip(params, step_grads, strict=True):
            p.grad = gr.to(device)
        opt.step()
    return [p.detach().cpu() for p in params]


def checks(device: torch.device) -> dict[str, Any]:
    """Every check on ``device`` (against the CPU); ``ok`` is True when the device agrees with the CPU."""
    ints = torch.arange(-(2**31), 2**31 - 1, 2**20 + 7, dtype=torch.int64).to(torch.int32)  # (4096,) spread over int32
    hashes_equal = bool(torch.equal(mix32(ints.to(device)).cpu(), mix32(ints)))
    shape = (8, 512, 768)
    on_cpu = normal(shape, torch.Generator().manual_seed(7))
    on_dev = normal(shape, torch.Generator().manual_seed(7), device)
    noise_diff = float((on_dev.cpu() - on_cpu).abs().max())
    opt_diff = max(float((a - b).abs().max()) for a, b in zip(optimizer_steps(device), optimizer_steps(CPU), strict=True))
    cuda = device.type == "cuda"
    out: dict[str, Any] = {
        "device": str(device), "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
        "noise_hashes_equal": hashes_equal, "noise_max_abs_diff": noise_diff, "noise_atol": NOISE_ATOL,
        "optimizer_max_abs_diff": opt_diff, "optimizer_atol": OPTIMIZER_ATOL,
        "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32) if cuda else None,
        "triton": importlib.util.find_spec("triton") is not None,
    }
    out["ok"] = hashes_equal and noise_diff <= NOISE_ATOL and opt_diff <= OPTIMIZER_ATOL
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", help="the device checked against the CPU (auto, cpu, cuda, cuda:N)")
    ap.add_argument("--json", type=Path, help="write the result here")
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    result = checks(device)
    result["command"] = "python benchmarks/quality/device_checks.py " + " ".join(argv if argv is not None else sys.argv[1:])
    width = max(len(k) for k in result)
    for k, v in result.items():
        print(f"{k.ljust(width)}  {v}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if device == CPU:
        print("(the device is the CPU: every check compares the CPU with itself)")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
