"""``blocktrain bench serve``: BlockTrain sweep and ar against the AR baseline over three stages.

Setup: three stage processes in three network namespaces joined by veth in a
ring (see :mod:`blocktrain.serve.netns`), 25 ms one way per hop: netem where the
kernel has it, else injected by the stages on their forward link. Without
namespaces (not root, no ``ip``) everything runs on loopback with the injected
delay. The client runs beside stage 0, so one traversal crosses three hops.

Measured per mode: time to a full output, bytes/s, bytes written by the stages
(frames, acks and results; application bytes, not TCP/IP headers). Quality:
generative CE of the outputs under the E2E model and teacher-forced CE.
Then a scale run with random weights of the largest shape that fits.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import torch

from blocktrain.bench.machine import machine_info
from blocktrain.checkpoint.run import RunDir
from blocktrain.config import RunConfig
from blocktrain.data.dataset import resolve_data_dir
from blocktrain.errors import BlockTrainError, ServeError
from blocktrain.evaluate.assembled import AssembledModel, E2EModel
from blocktrain.evaluate.scoring import score_split
from blocktrain.serve.benchspec import run_spec, spec_markdown
from blocktrain.serve.loading import parse_shape
from blocktrain.serve.netns import Topology, netns_available

log = logging.getLogger(__name__)

BLOCK_SPANS = ((0, 1), (2, 2), (3, 3))  # B=4 over three stages: two light, one double


def split_layers(n_layers: int, n_stages: int = 3) -> list[tuple[int, int]]:
    """Contiguous, nearly equal layer spans; the first stage (with the embeddings) gets any extra."""
    base, extra = divmod(n_layers, n_stages)
    spans, lo = [], 0
    for i in range(n_stages):
        size = base + (1 if i < extra else 0)
        spans.append((lo, lo + size - 1))
        lo += size
    return spans


def split_blocks(n_blocks: int, n_stages: int = 3) -> list[tuple[int, int]]:
    return split_layers(n_blocks, n_stages)


class Pipeline:
    """Three `blocktrain serve` processes, in namespaces or on loopback."""

    def __init__(self, topo: Topology | None, delay_ms: float, base_port: int, log_dir: Path) -> None:
        self.topo = topo
        self.inject_ms = delay_ms if topo is None or not topo.netem else 0.0
        self.base_port = base_port
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, model: str, spans: list[tuple[int, int]], source: list[str], threads: int) -> None:
        flag = "--layers" if model == "e2e" else "--blocks"
        n = len(spans)
        for i, (lo, hi) in enumerate(spans):
            port, nxt = self.base_port + i, self.base_port + (i + 1) % n
            if self.topo is not None:
                listen, prefix = f"0.0.0.0:{port}", self.topo.exec_prefix(i)
                nxt_host = self.topo.stage_host[(i + 1) % n]
            else:
                listen, nxt_host, prefix = f"127.0.0.1:{port}", "127.0.0.1", []
            cmd = [*prefix, sys.executable, "-m", "blocktrain", "serve", "--model", model, flag, f"{lo}-{hi}",
                   "--listen", listen, "--next", f"{nxt_host}:{nxt}", "--delay-ms", str(self.inject_ms),
                   "--threads", str(threads), "--timeout", "900", "--max-frame-mib", "512", *source]
            logf = (self.log_dir / f"{model}-stage{i}.log").open("wb")
            log.info("starting: %s", shlex.join(cmd))
            env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
            self.procs.append(subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env))

    def addresses(self) -> tuple[list[int], list[list[Any]]]:
        n = len(self.procs)
        if self.topo is not None:
            return [0], [[self.topo.stats_host(i), self.base_port + i] for i in range(n)]
        return [0], [["127.0.0.1", self.base_port + i] for i in range(n)]

    def client(self, plan: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        _, stages = self.addresses()
        plan = {**plan, "entry": stages[0], "stages": stages}
        plan_path, out_path = self.log_dir / "plan.json", self.log_dir / "client-out.json"
        plan_path.write_text(json.dumps(plan))
        out_path.unlink(missing_ok=True)
        prefix = self.topo.exec_prefix(0) if self.topo is not None else []
        cmd = [*prefix, sys.executable, "-m", "blocktrain.serve.benchclient", str(plan_path), str(out_path)]
        log.info("client: %s", shlex.join(cmd))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        rc = subprocess.run(cmd, timeout=timeout_s, env=env).returncode
        for i, p in enumerate(self.procs):
            if p.poll() is not None:
                raise ServeError(f"stage {i} exited with {p.returncode}; see {self.log_dir}")
        if rc != 0 or not out_path.is_file():
            raise ServeError(f"bench client failed (exit {rc}); stage logs are in {self.log_dir}")
        return json.loads(out_path.read_text())  # type: ignore[no-any-return]

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []


def generative_ce(e2e: E2EModel, prompt: bytes, output: bytes) -> float:
    """CE (nats/byte) of ``output`` under the E2E model, given ``prompt``."""
    seq = (prompt + output)[-(e2e.context + 1) :]
    x = torch.tensor(list(seq[:-1]), dtype=torch.uint8).unsqueeze(0)
    y = torch.tensor(list(seq[1:]), dtype=torch.long)
    logp = e2e.log_probs(x)[0, 0]
    n = len(output)
    return float(-logp[-n:].gather(-1, y[-n:].unsqueeze(-1)).mean())


def repeat_fraction(text: bytes, n: int = 4) -> float:
    """Fraction of n-grams of ``text`` that already occurred earlier in it (1.0 = all repeats)."""
    seen, rep, total = set(), 0, 0
    for i in range(len(text) - n + 1):
        g = text[i : i + n]
        rep += g in seen
        seen.add(g)
        total += 1
    return rep / max(total, 1)


def traversal_compute_s(cfg: RunConfig, model: AssembledModel, t: int, repeat: int = 5) -> float:
    """Median wall time of one traversal of the block stack on (1, t) bytes, one thread (as a stage)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randint(0, 256, (1, t), dtype=torch.uint8)
        times = []
        for i in range(repeat + 1):
            t0 = time.perf_counter()
            model.log_probs(x, seed=i)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])
    finally:
        torch.set_num_threads(threads)


def _prompts(data: np.ndarray, k: int, p_len: int, n: int) -> list[tuple[bytes, bytes]]:
    """k (prompt, true continuation) pairs starting at line starts spread over the split."""
    out = []
    for j in range(k):
        start = int(len(data) * (j + 0.5) / (k + 1))
        while start < len(data) - 1 and data[start - 1] != 10:
            start += 1
        seg = bytes(data[start : start + p_len + n])
        out.append((seg[:p_len], seg[p_len:]))
    return out


def _mode_tasks(sweeps: list[int]) -> list[dict[str, Any]]:
    tasks = [{"name": f"sweep_k{k}", "mode": "sweep", "sweeps": k, "repeat": 5} for k in sweeps]
    return [*tasks, {"name": "ar", "mode": "ar", "repeat": 1}]


def run_main_comparison(args: argparse.Namespace, pipe: Pipeline, run: RunDir) -> dict[str, Any]:
    cfg = run.load_config()
    data = resolve_data_dir(args.data).open("test").data
    pairs = _prompts(np.asarray(data), args.prompts, args.prompt_bytes, args.output_bytes)
    sweeps = [int(k) for k in args.sweeps.split(",")]
    base = {"output_bytes": args.output_bytes, "temperature": args.temperature, "top_k": args.top_k, "seed": 0,
            "prompts": [list(p) for p, _ in pairs]}
    test_path = str(resolve_data_dir(args.data).open("test").path)
    pipe.start("blocktrain", split_blocks(cfg.model.n_blocks), ["--run", str(run.root)], threads=1)
    try:
        bt = pipe.client({**base, "tasks": _mode_tasks(sweeps), "teacher_forced_path": test_path,
                          "teacher_forced_bytes": args.tf_bytes}, timeout_s=3600)
    finally:
        pipe.stop()
    pipe.start("e2e", split_layers(cfg.model.n_layers), ["--run", str(run.root)], threads=1)
    try:
        bl = pipe.client({**base, "tasks": [{"name": "baseline", "mode": "baseline", "repeat": 1}]}, timeout_s=3600)
    finally:
        pipe.stop()

    e2e = E2EModel.load(run, cfg)
    assembled = AssembledModel.load(run, cfg)
    tasks = {**bt["tasks"], **bl["tasks"]}
    quality: dict[str, Any] = {}
    for name, res in tasks.items():
        outs = [bytes(o) for o in res["quality_outputs"]]
        ces = [generative_ce(e2e, p, o) for (p, _), o in zip(pairs, outs, strict=True)]
        quality[name] = {
            "generative_ce": statistics.mean(ces), "generative_ce_per_prompt": ces,
            "repeat_4gram_fraction": statistics.mean(repeat_fraction(o) for o in outs),
            "sample": outs[0].decode("utf-8", errors="replace"),
        }
    reference = statistics.mean(generative_ce(e2e, p, c) for p, c in pairs)
    torch.set_num_threads(1)
    tf_local = score_split(lambda x: assembled.log_probs(x, seed=0), data, cfg.model.context,
                           max_bytes=args.tf_bytes, batch_size=8).ce_nats_per_byte
    tf_e2e = score_split(e2e.log_probs, data, cfg.model.context, max_bytes=args.tf_bytes, batch_size=8).ce_nats_per_byte
    compute_s = traversal_compute_s(cfg, assembled, args.prompt_bytes + args.output_bytes)
    return {"tasks": tasks, "quality": quality, "reference_continuation_ce": reference,
            "teacher_forced": {"blocktrain_pipeline_score": bt.get("teacher_forced_ce_pipeline"),
                               "blocktrain_local": tf_local, "e2e_local": tf_e2e, "bytes": args.tf_bytes,
                               "pipeline_seconds": bt.get("teacher_forced_seconds")},
            "traversal_compute_s": compute_s, "model": {"run": str(run.root), **cfg.to_dict()["model"]}}


def scale_shape(budget_bytes: float) -> str:
    """Largest d (multiple of 256, L=16, B=4, heads of 128) whose block stack fits ``budget_bytes`` in fp32."""
    best = 256
    for d in range(256, 16385, 256):
        params = 16 * (16 * d * d) + 4 * (3 * d * d + 2 * 256 * d + 256 * d)
        if 4 * params <= budget_bytes:
            best = d
    return f"d_model={best},n_heads={best // 128},n_layers=16,n_blocks=4,context=256"


def run_scale(args: argparse.Namespace, pipe: Pipeline) -> dict[str, Any]:
    avail = _mem_available()
    budget = (args.scale_budget_gib * 2**30) if args.scale_budget_gib else 0.45 * avail
    shape = scale_shape(budget) if args.scale == "auto" else args.scale
    cfg = parse_shape(shape)
    m = cfg.model
    n_out = args.scale_output_bytes or args.output_bytes
    p_len = max(1, min(32, m.context - n_out))
    from blocktrain.model.block import BlockDenoiser
    from blocktrain.model.e2e import E2ETransformer

    with torch.device("meta"):
        bt_params = m.n_blocks * sum(p.numel() for p in BlockDenoiser(m, 0.5).parameters())
        e2e_params = sum(p.numel() for p in E2ETransformer(m).parameters())
    log.info("scale run: %s, blocks %.2fB params, E2E %.2fB params", shape, bt_params / 1e9, e2e_params / 1e9)
    prompt = list(b"\n = Valkyria Chronicles III = \n \n Senjo no Valkyria"[:p_len])
    base = {"output_bytes": n_out, "temperature": args.temperature, "top_k": args.top_k, "seed": 0,
            "prompts": [prompt], "ready_s": 900, "timeout_s": 1800}
    src = ["--random", shape, "--seed", "0"]
    pipe.start("blocktrain", split_blocks(m.n_blocks), src, threads=2)
    try:
        bt = pipe.client({**base, "tasks": [{"name": "sweep_k1", "mode": "sweep", "repeat": 2, "quality": False}]},
                         timeout_s=3600)
    finally:
        pipe.stop()
    pipe.start("e2e", split_layers(m.n_layers), src, threads=2)
    try:
        bl = pipe.client({**base, "tasks": [{"name": "baseline", "mode": "baseline", "repeat": 1, "quality": False}]},
                         timeout_s=3600)
    finally:
        pipe.stop()
    sweep_s, base_s = bt["tasks"]["sweep_k1"]["seconds"], bl["tasks"]["baseline"]["seconds"]
    flops = 2.0 * bt_params * (p_len + n_out)  # one evaluation of every block at every position
    paper = 75.8e9
    return {
        "logical_shape": shape, "blocktrain_params": bt_params, "e2e_params": e2e_params,
        "weights_bytes_fp32": 4 * bt_params, "memory_available_bytes": avail, "prompt_bytes": p_len,
        "output_bytes": n_out, "stage_threads": 2,
        "sweep_seconds": sweep_s, "ar_baseline_seconds": base_s, "speedup_sweep_vs_baseline": base_s / sweep_s,
        "sweep": bt["tasks"]["sweep_k1"], "baseline": bl["tasks"]["baseline"],
        "sweep_flops": flops, "sweep_flops_per_s": flops / sweep_s, "ar_mode": "not run at scale (one full traversal "
        "of all positions per byte: ~output_bytes x the sweep time)",
        "paper_shape": {
            "params": paper, "weights_bytes_fp16": 2 * paper, "per_stage_bytes_fp16": 2 * paper / 3,
            "machines_like_this_for_fp16_weights": math.ceil(2 * paper / (24 * 2**30)),
            "sweep_seconds_at_measured_flops": 2 * paper * (p_len + n_out) / (flops / sweep_s),
        },
    }


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable"):
                return int(line.split()[1]) * 1024
    return 8 * 2**30


def summarise(args: argparse.Namespace, main: dict[str, Any], topo: Topology | None) -> dict[str, Any]:
    t, q = main["tasks"], main["quality"]
    n, hops = args.output_bytes, 3
    sweep, ar, base = t["sweep_k1"], t["ar"], t["baseline"]
    floor = hops * args.hop_delay_ms / 1000 + main["traversal_compute_s"]
    return {
        "hop_delay_ms": args.hop_delay_ms, "hops_per_traversal": hops, "output_bytes": n,
        "prompt_bytes": args.prompt_bytes, "temperature": args.temperature, "top_k": args.top_k,
        "network": {"namespaces": topo is not None,
                    "delay": "netem" if topo is not None and topo.netem else "injected on each stage's forward link",
                    "client": "in stage 0's namespace, over its loopback (no delay)"},
        "sweep_seconds": sweep["seconds"], "ar_seconds": ar["seconds"], "ar_baseline_seconds": base["seconds"],
        "sweep_bytes_per_s": n / sweep["seconds"], "ar_bytes_per_s": n / ar["seconds"],
        "ar_baseline_bytes_per_s": n / base["seconds"],
        "sweep_wire_bytes": sweep["stage_bytes_out"], "ar_wire_bytes": ar["stage_bytes_out"],
        "ar_baseline_wire_bytes": base["stage_bytes_out"],
        "speedup_sweep_vs_baseline": base["seconds"] / sweep["seconds"],
        "speedup_sweep_vs_ar": ar["seconds"] / sweep["seconds"],
        "floor_seconds": floor, "floor_compute_seconds": main["traversal_compute_s"],
        "sweep_over_floor": sweep["seconds"] / floor,
        "sweep_generative_ce": q["sweep_k1"]["generative_ce"], "ar_generative_ce": q["ar"]["generative_ce"],
        "baseline_generative_ce": q["baseline"]["generative_ce"],
        "reference_continuation_ce": main["reference_continuation_ce"],
        "sweeps": {name: {"seconds": t[name]["seconds"], "wire_bytes": t[name]["stage_bytes_out"],
                          "generative_ce": q[name]["generative_ce"],
                          "repeat_4gram_fraction": q[name]["repeat_4gram_fraction"]}
                   for name in t if name.startswith("sweep_")},
        "quality": q, "teacher_forced_ce": main["teacher_forced"], "model": main["model"],
        "timings": {k: {"seconds_all": v["seconds_all"], "client_bytes_out": v["client_bytes_out"]}
                    for k, v in t.items()},
    }


def render_markdown(r: dict[str, Any]) -> str:
    """A short human-readable summary of a serve.json result."""
    n = r["output_bytes"]
    sweeps = sorted(r["sweeps"].items(), key=lambda kv: int(kv[0].split("_k")[1]))
    rows = [(f"BlockTrain sweep (k={name.split('_k')[1]})", v["seconds"], v["wire_bytes"], v["generative_ce"])
            for name, v in sweeps]
    rows += [
        ("BlockTrain ar", r["ar_seconds"], r["ar_wire_bytes"], r["ar_generative_ce"]),
        ("AR baseline (E2E, KV cache)", r["ar_baseline_seconds"], r["ar_baseline_wire_bytes"],
         r["baseline_generative_ce"]),
    ]
    net = r["network"]
    lines = [
        "# Pipelined serving benchmark",
        "",
        f"Three stages, {r['hop_delay_ms']:.0f} ms one way per hop ({net['delay']}; namespaces: {net['namespaces']}),"
        f" {r['hops_per_traversal']} hops per traversal, client beside stage 0. Output: {n} bytes after a "
        f"{r['prompt_bytes']}-byte prompt, temperature {r['temperature']}, top-k {r['top_k']}.",
        "",
        "| mode | time to full output (s) | bytes/s | bytes written by stages | generative CE (nats/byte) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    lines += [f"| {a} | {s:.3f} | {n / s:.1f} | {w:,} | {ce:.3f} |" for a, s, w, ce in rows]
    lines += spec_markdown(r)
    tf = r["teacher_forced_ce"]
    lines += [
        "",
        f"- Speedup of sweep over the AR baseline: **{r['speedup_sweep_vs_baseline']:.1f}x**; over BlockTrain ar: "
        f"{r['speedup_sweep_vs_ar']:.1f}x.",
        f"- Floor: {r['hops_per_traversal']} x {r['hop_delay_ms']:.0f} ms + one pass of block compute "
        f"({r['floor_compute_seconds']:.3f} s) = {r['floor_seconds']:.3f} s; sweep takes "
        f"{r['sweep_over_floor']:.2f}x the floor.",
        f"- Reference: the true test continuations score {r['reference_continuation_ce']:.3f} nats/byte under the E2E "
        "model. Generative CE is measured under the E2E model, which favours the baseline's own samples.",
        f"- Teacher-forced CE on {tf['bytes']:,} test bytes: BlockTrain through the pipeline (score) "
        f"{tf['blocktrain_pipeline_score']:.4f}, BlockTrain local {tf['blocktrain_local']:.4f}, "
        f"E2E {tf['e2e_local']:.4f} nats/byte.",
    ]
    if "scale" in r:
        s = r["scale"]
        lines += [
            "",
            f"Scale run (random weights), logical shape `{s['logical_shape']}`: {s['blocktrain_params'] / 1e9:.2f}B "
            f"block parameters ({s['weights_bytes_fp32'] / 2**30:.1f} GiB fp32) over three stages, E2E "
            f"{s['e2e_params'] / 1e9:.2f}B. {s['output_bytes']} bytes after a {s['prompt_bytes']}-byte prompt: sweep "
            f"{s['sweep_seconds']:.1f} s, AR baseline {s['ar_baseline_seconds']:.1f} s "
            f"(**{s['speedup_sweep_vs_baseline']:.1f}x**). The paper's 75.8B fp16 shape needs "
            f"{s['paper_shape']['weights_bytes_fp16'] / 1e9:.0f} GB of weights "
            f"({s['paper_shape']['per_stage_bytes_fp16'] / 1e9:.0f} GB per stage), at least "
            f"{s['paper_shape']['machines_like_this_for_fp16_weights']} machines of this one's 24 GiB, and one sweep "
            f"would take about {s['paper_shape']['sweep_seconds_at_measured_flops']:.0f} s at the FLOP rate measured here.",
        ]
    lines += [
        "",
        "Caveats:",
        "- Where the kernel lacks netem (as here), the delay is injected per frame by each stage on its forward link:",
        "  propagation delay is modelled, TCP window growth over a long-RTT path is not.",
        "- Bytes are application bytes written by the stages (frames, custody ACKs, results), not TCP/IP headers.",
        f"- Sweep text is {'worse' if r['sweep_generative_ce'] > r['ar_generative_ce'] else 'not worse'} than ar "
        f"({r['sweep_generative_ce']:.2f} vs {r['ar_generative_ce']:.2f} nats/byte generative CE; baseline "
        f"{r['baseline_generative_ce']:.2f}); best sweep k: {min(r['sweeps'], key=lambda k: r['sweeps'][k]['generative_ce'])}.",
        "- The scale run uses 45% of the available memory for the block weights (headroom for the other processes",
        "  of this shared machine), random weights, two threads per stage; ar mode was not run at scale.",
        "",
        "Command: `" + r["commands"]["bench"] + "`",
        "",
    ]
    return "\n".join(lines)


def run_serve_bench(args: argparse.Namespace) -> dict[str, Any]:
    run = RunDir(Path(args.run))
    cfg = run.load_config()
    if not run.has_blocks(cfg.model.n_blocks) or not run.has_e2e():
        raise BlockTrainError(f"{run.root} needs all {cfg.model.n_blocks} blocks and the E2E model; "
                              "train them with 'blocktrain bench quality'")
    use_ns = args.network == "netns" or (args.network == "auto" and netns_available())
    if args.network == "netns" and not netns_available():
        raise ServeError("network namespaces are unavailable (need root and 'ip netns'); use --network loopback")
    t0 = time.time()
    with ExitStack() as stack:
        log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bt-serve-bench-")))
        topo = Topology(args.hop_delay_ms).setup() if use_ns else None
        if topo is not None:
            stack.callback(topo.teardown)
        pipe = Pipeline(topo, args.hop_delay_ms, args.base_port, log_dir)
        stack.callback(pipe.stop)
        main = run_main_comparison(args, pipe, run)
        result = summarise(args, main, topo)
        if getattr(args, "stack_run", None):
            result["spec"] = run_spec(args, pipe, run, result["ar_baseline_seconds"])  # serve.benchspec
            result.update({k: v for k, v in result["spec"].items() if k.startswith(("spec_", "speedup_spec"))})
        _finish(args, result, t0)  # written now too, in case the scale run is interrupted
        if args.scale != "off":
            result["scale"] = run_scale(args, pipe)
    return _finish(args, result, t0, echo=True)


def _finish(args: argparse.Namespace, result: dict[str, Any], t0: float, echo: bool = False) -> dict[str, Any]:
    result["wall_seconds"] = time.time() - t0
    result["machine"] = machine_info()
    result["commands"] = {
        "bench": "flock /tmp/blocktrain-cpu.lock " + shlex.join(["blocktrain", *sys.argv[1:]]),
        "stage": "blocktrain serve --run RUN --blocks 0-1 --listen 0.0.0.0:47100 --next HOST1:47101 [--delay-ms 25]",
        "client": "blocktrain generate --pipeline 127.0.0.1:47100 --mode sweep --bytes 128",
    }
    text = json.dumps(result, indent=2)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
        Path(args.json).with_suffix(".md").write_text(render_markdown(result))
    if echo:
        sys.stdout.write(text + "\n")
    return result
