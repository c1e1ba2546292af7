"""The serving benchmark's scale row: random weights of the largest shape that fits, and the paper's model extrapolated.

    python -m benchmarks.serving.serve_scale --json benchmarks/results/serve-scale.json [--shape NAME=INT,...] [--netns]

It runs the product's serve bench pieces (:mod:`blocktrain.bench.serve_pipeline`): three ``blocktrain serve``
stages with random diffusion blocks of the largest shape (L=16, B=4, heads of 128) whose fp32 weights fit the
budget, one sweep (k=1) timed, then the E2E reference of the same shape split by layers for the AR baseline; two
threads per stage. From the sweep's FLOP rate it extrapolates the paper's 75.8B-parameter model: its fp16 weights,
the machines like this one they need, and one sweep's time. On loopback the stages inject the per-hop delay;
``--netns`` (root) runs them in the namespace ring of :mod:`netns`. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.distributed.netns import Topology, netns_available
from blocktrain.bench.machine import machine_info
from blocktrain.bench.serve_options import ServeBenchOptions
from blocktrain.bench.serve_pipeline import Pipeline, Placement, split_blocks, split_layers
from blocktrain.cli.fields import Flags
from blocktrain.errors import BlockTrainError, ConfigError
from blocktrain.model.block import BlockDenoiser
from blocktrain.model.e2e import E2ETransformer
from blocktrain.serve.runtime.loading import parse_shape

log = logging.getLogger("serve_scale")
_BENCH = ServeBenchOptions()  # the sampling, delay and ports of `blocktrain bench serve`, as defaults here


@dataclass(frozen=True)
class ScaleOptions:
    shape: str = "auto"  # auto (the largest that fits the budget), or NAME=INT,... as for 'blocktrain serve --random'
    budget_gib: float | None = None  # GiB: memory for the weights (None: memory_fraction of what is available)
    memory_fraction: float = 0.45  # fraction of available memory for the weights (headroom for the rest)
    output_bytes: int = _BENCH.output_bytes  # bytes per output
    hop_delay_ms: float = _BENCH.hop_delay_ms  # ms: one-way delay per hop
    temperature: float = _BENCH.temperature  # sampling temperature
    top_k: int = _BENCH.top_k  # sampling top-k
    base_port: int = _BENCH.base_port  # port of stage 0; stage i listens on base_port + i
    paper_params: float = 75.8e9  # parameters of the paper's model, for the extrapolation
    machine_memory_gib: float | None = None  # GiB of memory per machine in that extrapolation (None: this machine's)
    json: Path | None = None  # write the result JSON here, and its markdown summary beside it (None: stdout only)

    def __post_init__(self) -> None:
        if self.output_bytes < 1:
            raise ConfigError(f"output_bytes must be at least 1, got {self.output_bytes}; set --output-bytes")
        if not 0 < self.memory_fraction <= 1:
            raise ConfigError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}; set --memory-fraction")
        for name in ("budget_gib", "machine_memory_gib", "paper_params", "hop_delay_ms", "temperature"):
            value, least = getattr(self, name), "0 or more" if name in ("hop_delay_ms", "temperature") else "positive"
            if value is not None and not (math.isfinite(value) and (value >= 0 if least == "0 or more" else value > 0)):
                raise ConfigError(f"{name} must be a finite number, {least}, got {value!r}; set --{name.replace('_', '-')}")
        if not 1 <= self.base_port <= 65535 - 2:
            raise ConfigError(f"base_port must leave room for three ports below 65536, got {self.base_port}; "
                              "set --base-port")


FLAGS = Flags(ScaleOptions, "scale__")


def scale_shape(budget_bytes: float) -> str:
    """Largest d (multiple of 256, L=16, B=4, heads of 128) whose block stack fits ``budget_bytes`` in fp32."""
    best = 256
    for d in range(256, 16385, 256):
        params = 16 * (16 * d * d) + 4 * (3 * d * d + 2 * 256 * d + 256 * d)
        if 4 * params <= budget_bytes:
            best = d
    return f"d_model={best},n_heads={best // 128},n_layers=16,n_blocks=4,context=256"


def run_scale(opts: ScaleOptions, pipe: Pipeline) -> dict[str, Any]:
    avail = _mem_available()
    fraction = None if opts.budget_gib else opts.memory_fraction
    budget = opts.budget_gib * 2**30 if opts.budget_gib else opts.memory_fraction * avail
    shape = scale_shape(budget) if opts.shape == "auto" else opts.shape
    m = parse_shape(shape).model
    n_out = opts.output_bytes
    p_len = max(1, min(32, m.context - n_out))
    with torch.device("meta"):
        bt_params = m.n_blocks * sum(p.numel() for p in BlockDenoiser(m, 0.5).parameters())
        e2e_params = sum(p.numel() for p in E2ETransformer(m).parameters())
    log.info("scale run: %s, blocks %.2fB params, E2E %.2fB params", shape, bt_params / 1e9, e2e_params / 1e9)
    prompt = list(b"\n = Valkyria Chronicles III = \n \n Senjo no Valkyria"[:p_len])
    base = {"output_bytes": n_out, "temperature": opts.temperature, "top_k": opts.top_k, "seed": 0,
            "prompts": [prompt], "ready_s": 900, "timeout_s": 1800}
    src = ["--random", shape, "--seed", "0"]

    def timed(family: str, spans: list[tuple[int, int]], task: dict[str, Any]) -> dict[str, Any]:
        """One task on a freshly started pipeline of ``family``, stopped afterwards."""
        pipe.start(family, spans, src, threads=2)
        try:
            return pipe.client({**base, "tasks": [task]}, timeout_s=3600)
        finally:
            pipe.stop()

    bt = timed("blocktrain", split_blocks(m.n_blocks), {"name": "sweep_k1", "mode": "sweep", "repeat": 2, "quality": False})
    bl = timed("e2e", split_layers(m.n_layers), {"name": "baseline", "mode": "baseline", "repeat": 1, "quality": False})
    sweep_s, base_s = bt["tasks"]["sweep_k1"]["seconds"], bl["tasks"]["baseline"]["seconds"]
    flops = 2.0 * bt_params * (p_len + n_out)  # one evaluation of every block at every position
    return {
        "logical_shape": shape, "blocktrain_params": bt_params, "e2e_params": e2e_params,
        "weights_bytes_fp32": 4 * bt_params, "memory_available_bytes": avail, "weights_budget_bytes": budget,
        "weights_budget_fraction": fraction, "prompt_bytes": p_len,
        "output_bytes": n_out, "stage_threads": 2,
        "sweep_seconds": sweep_s, "ar_baseline_seconds": base_s, "speedup_sweep_vs_baseline": base_s / sweep_s,
        "sweep": bt["tasks"]["sweep_k1"], "baseline": bl["tasks"]["baseline"],
        "sweep_flops": flops, "sweep_flops_per_s": flops / sweep_s, "ar_mode": "not run at scale (one full traversal "
        "of all positions per byte: ~output_bytes x the sweep time)",
        "paper_shape": paper_shape(opts, p_len + n_out, flops / sweep_s),
    }


def paper_shape(opts: ScaleOptions, positions: int, flops_per_s: float) -> dict[str, float]:
    """The paper's model (``opts.paper_params``) in fp16 over three stages, on machines like this one.

    ``positions``: prompt + output bytes of one sweep; ``flops_per_s``: the sweep's measured FLOP rate.
    Machine memory: ``opts.machine_memory_gib``, else this machine's (/proc/meminfo).
    """
    paper = opts.paper_params
    machine = opts.machine_memory_gib * 2**30 if opts.machine_memory_gib else _mem_total()
    return {
        "params": paper, "weights_bytes_fp16": 2 * paper, "per_stage_bytes_fp16": 2 * paper / 3,
        "machine_memory_bytes": machine, "machines_like_this_for_fp16_weights": math.ceil(2 * paper / machine),
        "sweep_seconds_at_measured_flops": 2 * paper * positions / flops_per_s,
    }


def _mem_available() -> int:
    """Bytes of memory available now (MemAvailable of /proc/meminfo)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    raise ConfigError("cannot read MemAvailable from /proc/meminfo; give the weights' memory with --budget-gib "
                      "and the machine's with --machine-memory-gib")


def _mem_total() -> int:
    """Bytes of memory of this machine (from :func:`blocktrain.bench.machine.machine_info`)."""
    mem = machine_info()["memory_bytes"]
    if not mem:
        raise ConfigError("cannot read this machine's memory from /proc/meminfo; set --machine-memory-gib")
    return int(mem)


def render_markdown(r: dict[str, Any]) -> str:
    """A short human-readable summary of a serve-scale result."""
    s, paper, net = r["scale"], r["scale"]["paper_shape"], r["network"]
    budget = (f"{s['weights_budget_fraction']:.0%} of the available memory" if s["weights_budget_fraction"] is not None
              else f"{s['weights_budget_bytes'] / 2**30:.1f} GiB (--budget-gib)")
    return "\n".join([
        "# Pipelined serving at scale (random weights)",
        "",
        f"Three stages, {r['hop_delay_ms']:.0f} ms one way per hop ({net['delay']}; namespaces: {net['namespaces']}), "
        f"temperature {r['temperature']}, top-k {r['top_k']}.",
        "",
        f"Logical shape `{s['logical_shape']}`: {s['blocktrain_params'] / 1e9:.2f}B "
        f"block parameters ({s['weights_bytes_fp32'] / 2**30:.1f} GiB fp32) over three stages, E2E "
        f"{s['e2e_params'] / 1e9:.2f}B. {s['output_bytes']} bytes after a {s['prompt_bytes']}-byte prompt: sweep "
        f"{s['sweep_seconds']:.1f} s, AR baseline {s['ar_baseline_seconds']:.1f} s "
        f"(**{s['speedup_sweep_vs_baseline']:.1f}x**). The paper's {paper['params'] / 1e9:.1f}B fp16 shape needs "
        f"{paper['weights_bytes_fp16'] / 1e9:.0f} GB of weights ({paper['per_stage_bytes_fp16'] / 1e9:.0f} GB per "
        f"stage), at least {paper['machines_like_this_for_fp16_weights']} machines of "
        f"{paper['machine_memory_bytes'] / 2**30:.0f} GiB like this one, and one sweep would take about "
        f"{paper['sweep_seconds_at_measured_flops']:.0f} s at the FLOP rate measured here.",
        "",
        f"Caveats: the run budgets {budget} for the block weights (headroom for the other processes of the machine), "
        "random weights, two threads per stage; ar mode was not run at scale.",
        "",
        "Command: `" + r["commands"]["bench"] + "`",
        "",
    ])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    FLAGS.add(p)
    p.add_argument("--netns", action="store_true", help="the stages in three network namespaces (root, 'ip netns')")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.netns and not netns_available():
        sys.stderr.write("error: network namespaces are unavailable: run as root on a machine with 'ip netns' "
                         "(or leave out --netns to run on loopback)\n")
        return 2
    t0, command = time.time(), shlex.join(["python", "-m", "benchmarks.serving.serve_scale", *argv])
    try:
        opts = FLAGS.build(args)
        topo = Topology(opts.hop_delay_ms).setup() if args.netns else None
        placement = topo or Placement()
        try:
            with tempfile.TemporaryDirectory(prefix="bt-serve-scale-") as tmp:
                pipe = Pipeline(placement, opts.hop_delay_ms, opts.base_port, Path(tmp))
                try:
                    scale = run_scale(opts, pipe)
                finally:
                    pipe.stop()
        finally:
            if topo is not None:
                topo.teardown()
    except BlockTrainError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    result = {"hop_delay_ms": opts.hop_delay_ms, "temperature": opts.temperature, "top_k": opts.top_k,
              "network": placement.describe(), "scale": scale, "options": {**asdict(opts), "json": str(opts.json)},
              "wall_seconds": time.time() - t0, "machine": machine_info(), "commands": {"bench": command}}
    text = json.dumps(result, indent=2)
    if opts.json is not None:
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(text + "\n")
        opts.json.with_suffix(".md").write_text(render_markdown(result))
    sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
