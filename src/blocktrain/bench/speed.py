"""``blocktrain bench speed``: seconds per step and MFU of the trainers, fp32 against bf16, side by side.

Each measurement is a short real training run (the E2E trainer, or block 0's)
in a fresh child process (:func:`blocktrain.train.child.train_arm`), one after
another, so every one has the machine to itself. Seconds per step are read the same way for every run, from the
cumulative bytes/s the trainer logs every ``log_every`` steps: the time between
the first logged step and the last, divided by the steps between them, so
start-up, the first steps' kernel set-up and compilation are left out. ``--compile MODE`` times each trainer once
more in bf16 under torch.compile (its speed-up over eager bf16 is the measurement a compile default rests on);
``--profile`` profiles each bf16 run's last PROFILE_STEPS steps (:mod:`blocktrain.train.profile`, left out of the
timing) and keeps the top operators in the result. Timing an older
commit's code beside them (a temporary git worktree) is the benchmark harness's
job: ``benchmarks/quality/speed_reference.py``.
"""

from __future__ import annotations

import json
import logging
import shlex
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from blocktrain.bench.machine import machine_info, measure_peak_flops
from blocktrain.config import CompileMode, Objective, Precision
from blocktrain.data.dataset import DataDir
from blocktrain.device import resolve_device
from blocktrain.errors import ConfigError, RunError
from blocktrain.presets import get_preset
from blocktrain.train.child import E2E, train_arm
from blocktrain.train.metrics import read_jsonl

log = logging.getLogger(__name__)

# (name in the JSON, the same run as a command line (recorded; the reference commit's harness runs it), metrics file,
# objective (None: the E2E reference), arm)
TRAINERS: tuple[tuple[str, tuple[str, ...], str, Objective | None, int], ...] = (
    ("e2e", ("train-e2e",), "e2e", None, E2E),
    ("block", ("train-block", "--block", "0", "--objective", "diffusion"), "block_0", Objective.DIFFUSION, 0),
    ("stack_block", ("train-block", "--block", "0", "--objective", "stack"), "block_0", Objective.STACK, 0),
)
LOG_EVERY = 5  # steps between the logged rates the timing is read from
PROFILE_STEPS = LOG_EVERY  # steps profiled at the end of a profiled run (after its timed steps)
PROFILE_TOP = 8  # operators of each profile kept in the result
# The directories a speed bench writes into its --out, {trainer}-{arm}: its arms, and the reference commit's runs
# (benchmarks/quality/speed_reference.py). An --out holding anything else is not deleted.
OWN_DIRS = frozenset(f"{name}-{arm}" for name, *_ in TRAINERS for arm in ("fp32", "bf16", "compiled", "reference"))


@dataclass(frozen=True)
class SpeedOptions:
    data: DataDir  # data directory
    preset: str = "cpu-small"  # configuration preset to time
    out: Path = Path("runs/bench-speed")  # scratch directory for the short runs (new, empty or an earlier bench's: replaced)
    steps: int = 30  # training steps per measurement (at least 3 x LOG_EVERY)
    json_path: Path | None = None  # write the result JSON here (and a .md table beside it)
    device: str = "auto"  # where the runs train: auto, cpu, cuda or cuda:N
    compile: CompileMode = CompileMode.OFF  # also time each trainer in bf16 under torch.compile in this mode (off: not)
    profile: bool = False  # profile each bf16 run's last PROFILE_STEPS steps and keep its top operators
    command: str = ""  # the command line, recorded in the JSON

    def __post_init__(self) -> None:
        least = 3 * LOG_EVERY + (PROFILE_STEPS if self.profile else 0)
        if self.steps < least:
            raise ConfigError(f"steps must be at least {least} to time steps after warm-up"
                              f"{' and profile the last ones' if self.profile else ''}, got {self.steps}")


def seconds_per_step(metrics: list[dict[str, Any]], bytes_per_step: int, until: int | None = None) -> float:
    """Mean seconds per step between the first and the last logged step (up to step ``until``), from the cumulative
    bytes/s."""
    pts = [(r["step"], r["step"] * bytes_per_step / r["bytes_per_s"]) for r in metrics
           if "bytes_per_s" in r and "event" not in r and (until is None or r["step"] <= until)]
    if len(pts) < 2:
        raise RunError("fewer than two logged steps; time more steps")
    (s0, t0), (s1, t1) = pts[0], pts[-1]
    return (t1 - t0) / (s1 - s0)


def common_flags(opts: SpeedOptions) -> list[str]:
    """The flags every timed run takes as a command line, whatever its code's version."""
    return ["--preset", opts.preset, "--data", str(opts.data.root), "--steps", str(opts.steps), "--no-progress"]


def bytes_per_step(preset: str) -> int:
    from blocktrain.presets import get_preset

    cfg = get_preset(preset)
    return cfg.train.batch_size * cfg.model.context


def run_speed_bench(opts: SpeedOptions) -> dict[str, Any]:
    """Time every trainer, print the table and write the result (``opts.json_path``)."""
    result = measure_speed(opts)
    write_speed(opts, result)
    return result


def clear_out(out: Path, json_path: Path | None = None) -> None:
    """``out`` new and empty: an earlier speed bench's directory is deleted (its runs, and its result where ``--json``
    writes it inside ``out``); one holding anything else is refused."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ConfigError(f"--out {out} is not a directory; pick another --out")
    own_files = set()
    if json_path is not None and json_path.resolve().parent == out.resolve():  # the result, and its table beside it
        own_files = {json_path.name, json_path.with_suffix(".md").name}
    if out.exists():
        def own(p: Path) -> bool:
            if p.is_symlink():
                return False
            return (p.name in OWN_DIRS and p.is_dir()) or (p.name in own_files and p.is_file())

        foreign = sorted(p.name for p in out.iterdir() if not own(p))
        if foreign:
            shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            raise ConfigError(f"--out {out} holds {shown}, not an earlier speed bench's runs alone, and the bench "
                              "deletes its --out: pick another --out, or delete that directory yourself")
        shutil.rmtree(out)
    out.mkdir(parents=True)


def measure_speed(opts: SpeedOptions) -> dict[str, Any]:
    """Time every trainer in fp32 and bf16 (``opts.out`` is replaced); the result, not yet written."""
    device = resolve_device(opts.device)
    step_bytes = bytes_per_step(opts.preset)
    clear_out(opts.out, opts.json_path)
    common = common_flags(opts)
    new_flags = ["--log-every", str(LOG_EVERY), "--eval-bytes", "0", "--checkpoint-every", "1000000", "--device", opts.device]
    peak = measure_peak_flops(device)
    result: dict[str, Any] = {
        "benchmark": "speed", "preset": opts.preset, "steps": opts.steps, "device": str(device),
        "machine": machine_info(device), "peak_flops": peak, "command": opts.command, "commands": {},
    }
    arms = [("fp32", "fp32", CompileMode.OFF), ("bf16", "bf16", CompileMode.OFF)]
    if opts.compile is not CompileMode.OFF:
        arms.append(("compiled", "bf16", opts.compile))
        result["compile"] = opts.compile.value
    for name, sub, metrics_name, objective, k in TRAINERS:
        entry: dict[str, Any] = {}
        for arm, precision, mode in arms:
            out = opts.out / f"{name}-{arm}"
            profiled = opts.profile and arm != "fp32"
            extra = ["--compile", mode.value] if mode is not CompileMode.OFF else []
            extra += ["--profile-steps", str(PROFILE_STEPS)] if profiled else []
            cmd = [*sub, "--out", str(out), *common, *new_flags, "--precision", precision, *extra]
            base = get_preset(opts.preset)
            cfg = replace(base, objective=objective or base.objective).with_train(
                steps=opts.steps, log_every=LOG_EVERY, eval_bytes=0, checkpoint_every=1_000_000, device=opts.device,
                precision=Precision(precision), compile=mode,
                profile_steps=PROFILE_STEPS if profiled else 0).with_dataset(opts.data.fingerprint())
            log.info("timing %s in %s%s", name, precision, f" compiled ({mode.value})" if extra else "")
            train_arm(cfg, opts.data, out, k, isolate=True, progress=False)
            metrics = read_jsonl(out / "metrics" / f"{metrics_name}.jsonl")
            summary = next(r for r in reversed(metrics) if r.get("event") == "summary")
            # a block may train more steps than opts.steps (stack.step_ratio): time every step before its profile
            sps = seconds_per_step(metrics, step_bytes, until=summary["steps"] - (PROFILE_STEPS if profiled else 0))
            entry[f"{arm}_s_per_step"] = sps
            entry[f"{arm}_median_s_per_step"] = summary["seconds_per_step"]
            entry["flops_per_step"] = summary["flops_per_step"]
            ran = summary["precision"]  # what it trained in: bf16 falls back to fp32 where the machine lacks it
            if ran != precision:
                log.warning("%s asked for %s trained in %s (this machine's fallback): its MFU is of the %s peak",
                            name, precision, ran, ran)
            entry[f"{arm}_precision"] = ran
            entry[f"{arm}_mfu_of_own_peak"] = summary["flops_per_step"] / sps / peak[ran]
            entry[f"{arm}_train_mem_bytes"] = summary["train_mem_bytes"]
            if profiled:
                report = json.loads((out / "metrics" / f"{metrics_name}.profile.json").read_text())
                entry[f"{arm}_profile"] = report["ops"][:PROFILE_TOP]
            result["commands"][f"{name}.{arm}"] = "blocktrain " + shlex.join(cmd)
        entry["mfu"] = entry["flops_per_step"] / entry["bf16_s_per_step"] / peak[entry["bf16_precision"]]
        entry["bytes_per_s"] = step_bytes / entry["bf16_s_per_step"]
        entry["speedup_bf16_over_fp32"] = entry["fp32_s_per_step"] / entry["bf16_s_per_step"]
        if "compiled_s_per_step" in entry:
            entry["compiled_mfu"] = entry["flops_per_step"] / entry["compiled_s_per_step"] / peak[entry["compiled_precision"]]
            entry["speedup_compiled_over_bf16"] = entry["bf16_s_per_step"] / entry["compiled_s_per_step"]
        result[name] = entry
    return result


def write_speed(opts: SpeedOptions, result: dict[str, Any]) -> None:
    """Print the table of ``result`` and write it (JSON and markdown) to ``opts.json_path``."""
    table = format_speed(result)
    sys.stdout.write(table + "\n")
    if opts.json_path:
        opts.json_path.parent.mkdir(parents=True, exist_ok=True)
        opts.json_path.write_text(json.dumps(result, indent=2) + "\n")
        opts.json_path.with_suffix(".md").write_text(f"# Training speed: {opts.preset}\n\n```\n{opts.command}\n```\n\n{table}\n")


def format_speed(r: dict[str, Any]) -> str:
    compiled = "compile" in r
    rows = [["trainer", "fp32 s/step", "bf16 s/step", "bf16 speed-up", "reference fp32 s/step",
             "bf16 over reference fp32", "fp32 over reference fp32", "GFLOP/step", "MFU (bf16 peak)"]]
    if compiled:
        rows[0] += [f"compiled ({r['compile']}) s/step", "compiled speed-up", "compiled MFU"]
    for name, *_ in TRAINERS:
        e = r[name]
        ref = e.get("reference_fp32_s_per_step")
        rows.append([
            name, f"{e['fp32_s_per_step']:.4f}", f"{e['bf16_s_per_step']:.4f}", f"{e['speedup_bf16_over_fp32']:.2f}x",
            f"{ref:.3f}" if ref else "", f"{e['speedup_over_reference']:.2f}x" if ref else "",
            f"{e['speedup_fp32_over_reference']:.2f}x" if ref and "speedup_fp32_over_reference" in e else "",
            f"{e['flops_per_step'] / 1e9:.1f}", f"{e['mfu']:.1%}",
        ])
        if compiled:
            rows[-1] += [f"{e['compiled_s_per_step']:.4f}", f"{e['speedup_compiled_over_bf16']:.2f}x",
                         f"{e['compiled_mfu']:.1%}"]
    width = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(width[i]) for i, c in enumerate(row)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in width) + "|")
    p = r["peak_flops"]
    lines.append(f"\nMeasured matmul peak on {r['device']}: fp32 {p['fp32'] / 1e9:,.0f} GFLOP/s, bf16 {p['bf16'] / 1e9:,.0f} GFLOP/s.")
    for name, *_ in TRAINERS:
        for arm in ("bf16", "compiled"):
            ops = r[name].get(f"{arm}_profile")
            if ops:
                top = ", ".join(f"`{o['name'][:48]}` {o['share']:.0%}" for o in ops[:5])
                lines.append(f"\n{name} {arm}, the top operators by own device time: {top}.")
    return "\n".join(lines)
