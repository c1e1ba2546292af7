"""``blocktrain`` command line. Each sub-command parses, then calls the library."""

from __future__ import annotations

import argparse
import json
import logging
import math
import shlex
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from blocktrain.bench.speed import SpeedOptions
from blocktrain.cli.common import add_run_args, config_from_args, handling_signals, interrupt
from blocktrain.cli.fields import Flags
from blocktrain.data.prepare import PrepareOptions
from blocktrain.errors import BlockTrainError

if TYPE_CHECKING:
    from blocktrain.config import RunConfig
    from blocktrain.data.dataset import DataDir

log = logging.getLogger("blocktrain")
DEVICE_HELP = "where the model computes: auto (cuda if available, else cpu), cpu, cuda or cuda:N"
PREPARE_FLAGS = Flags(PrepareOptions, "prepare__")
ISOLATE_HELP = ("train each arm in a child process, so its peak memory is its own (yes), or every arm in this process, "
                "paying torch's start-up once (no); auto: no for the tiny preset, yes otherwise")
SPEED_FLAGS = Flags(SpeedOptions, "speed__", rename={"json_path": "--json"}, skip=("data", "command"))


def run_config(args: argparse.Namespace, open_train: bool = False) -> tuple[RunConfig, DataDir]:
    """The run's config tagged with its data's fingerprint, and the data directory (``--data`` or the default)."""
    from blocktrain.data.dataset import resolve_data_dir
    from blocktrain.device import resolve_device

    cfg = config_from_args(args)  # a bad preset or flag fails before any data is looked for
    resolve_device(cfg.train.device)  # so does a device this machine lacks, before any child process starts
    data = resolve_data_dir(args.data)
    if open_train:
        data.open("train")
    return cfg.with_dataset(data.fingerprint()), data


def cmd_train_one(args: argparse.Namespace) -> int:
    """``train-block`` (one block alone) or ``train-e2e`` (the end-to-end reference)."""
    from blocktrain.checkpoint.blocks import check_block_index
    from blocktrain.train.child import E2E, train_arm

    cfg, data = run_config(args)
    if args.command == "train-block":  # before train_arm, which takes E2E (-1) for the E2E reference
        check_block_index(args.block, cfg.model.n_blocks)
    k = args.block if args.command == "train-block" else E2E
    train_arm(cfg, data, Path(args.out), k, isolate=False, progress=not args.no_progress)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """Train all B blocks: each in its own process (a stack's in order), or a stack's all at once (--schedule concurrent).

    A process per block keeps each block's peak memory and its metrics its own.
    """
    from blocktrain.train.child import train_run

    cfg, data = run_config(args, open_train=True)
    isolate = isolate_arms(args.isolate, cfg, parallel=args.parallel)
    train_run(cfg, data, Path(args.out), isolate=isolate, progress=not args.no_progress, parallel=args.parallel)
    return 0


def isolate_arms(choice: str, cfg: RunConfig, parallel: int = 1) -> bool:
    """``--isolate``: a fresh process per arm (yes), or every arm in this process (no); auto: no for the tiny preset,
    whose arms train in well under the second a fresh interpreter takes to import torch, yes otherwise."""
    if choice == "no" and parallel > 1:
        raise BlockTrainError(f"--parallel {parallel} trains blocks side by side in fresh processes: drop --isolate no, "
                              "or train them one at a time with --parallel 1")
    return choice == "yes" or (choice == "auto" and (cfg.name != "tiny" or parallel > 1))


def cmd_eval(args: argparse.Namespace) -> int:
    from blocktrain.checkpoint.run import RunDir
    from blocktrain.config import Precision
    from blocktrain.data.dataset import resolve_run_data
    from blocktrain.device import resolve_device, resolve_precision
    from blocktrain.evaluate.assembled import load_model_from_run
    from blocktrain.evaluate.report import evaluate_model

    # before any model is loaded
    at_least(args.batch_size, 1, "--batch-size", "windows per forward pass")
    at_least(args.chains, 1, "--chains", "chains scored")
    if args.max_bytes is not None:
        at_least(args.max_bytes, 0, "--max-bytes", "bytes scored; 0: the whole split")
    max_bytes = args.max_bytes or None  # 0: the whole split, as bench quality's --max-eval-bytes 0
    device = resolve_device(args.device)
    precision = resolve_precision(Precision(args.precision), device)
    run = RunDir(Path(args.run))
    model = load_model_from_run(run, args.model, precision, device)
    trained_on = run.load_config().dataset
    data_dir = resolve_run_data(args.data, run.recorded_data(), trained_on, args.run)
    data = data_dir.open(args.split)
    scoring = data_dir.fingerprint()
    if trained_on and trained_on != scoring:
        log.warning("%s trained on dataset %s but is scored on %s (%s); its CE is not comparable with the run's own",
                    args.run, trained_on[:12], data_dir.root, scoring[:12])
    result = evaluate_model(
        model, data, chains=args.chains, max_bytes=max_bytes, blocks_alone=args.blocks_alone,
        progress=not args.no_progress, batch_size=args.batch_size,
    )
    result["dataset_fingerprint"] = scoring
    result["trained_on_dataset"] = trained_on or None
    if args.json:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    else:
        from blocktrain.evaluate.report import format_eval

        sys.stdout.write(format_eval(result) + "\n")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from blocktrain.checkpoint.run import RunDir
    from blocktrain.device import resolve_device
    from blocktrain.evaluate.assembled import load_model_from_run
    from blocktrain.evaluate.generate import generate

    at_least(args.bytes, 0, "--bytes", "bytes generated")
    if not (args.temperature >= 0 and math.isfinite(args.temperature)):  # sampling.py: 0 (or below) is greedy
        raise BlockTrainError(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
    at_least(args.top_k, 0, "--top-k", "most likely bytes sampled among; 0: all")
    if not 0 <= args.seed < 2**63:  # seeds are 63-bit (data.stream.mix_seed), as the gateway's
        raise BlockTrainError(f"--seed must be in [0, 2**63), got {args.seed}")
    if not 0 < args.top_p <= 1:
        raise BlockTrainError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.pipeline and args.top_p < 1 and args.mode not in ("ar", "spec"):
        raise BlockTrainError(f"--top-p is sampled by the local model and by --mode ar or spec, not {args.mode}")
    if args.pipeline:
        from blocktrain.serve.client.pipeline import generate_remote

        text = generate_remote(
            args.pipeline, args.mode, args.prompt.encode(), args.bytes, timeout_s=args.timeout,
            temperature=args.temperature, top_k=args.top_k, seed=args.seed, sweeps=args.sweeps,
            draft_min=args.draft_min, draft_max=args.draft_max, top_p=args.top_p)
    else:
        if not args.run:
            raise BlockTrainError("generate needs a RUN directory or --pipeline HOST:PORT")
        model = load_model_from_run(RunDir(Path(args.run)), args.model, device=resolve_device(args.device))
        text = generate(
            model, args.prompt.encode(), args.bytes, temperature=args.temperature, top_k=args.top_k,
            seed=args.seed, progress=not args.no_progress, top_p=args.top_p,
        )
    sys.stdout.write(args.prompt + text.decode("utf-8", errors="replace") + "\n")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from blocktrain.report.plot import plot_runs

    out = plot_runs([Path(r) for r in args.runs], Path(args.out))
    log.info("wrote %s", out)
    return 0


def cmd_bench_quality(args: argparse.Namespace) -> int:
    from blocktrain.bench.quality import QualityOptions, run_quality_bench
    from blocktrain.bench.quality_report import rederive, write_result

    if args.rederive:  # derived figures only: no training, no data
        src = Path(args.rederive)
        result = rederive(read_result(src))
        write_result(result, Path(args.json) if args.json else src, str(result["preset"]))
        return 0
    cfg, data = run_config(args)
    opts = QualityOptions(
        cfg=cfg, data=data, out=Path(args.out or f"runs/bench-quality-{cfg.name}"),
        objective=args.bench_objective, json_path=Path(args.json) if args.json else None, chains=args.chains,
        max_eval_bytes=args.max_eval_bytes, fresh=args.fresh, resume=args.resume, progress=not args.no_progress,
        lr_sweep=not args.no_lr_sweep, matched_flops=not args.no_matched_flops, matched_steps=not args.no_matched_steps,
        command="blocktrain " + shlex.join(sys.argv[1:]),
        isolate=isolate_arms(args.isolate, cfg),
    )
    run_quality_bench(opts)
    return 0


def read_result(src: Path) -> dict[str, Any]:
    """``--rederive JSON``: an earlier bench quality result (BlockTrainError if it cannot be read as one)."""
    try:
        result = json.loads(src.read_text())
    except OSError as exc:
        raise BlockTrainError(f"cannot read --rederive {src}: {exc.strerror or exc}; pass the JSON an earlier "
                              "bench quality wrote (its --json)") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BlockTrainError(f"--rederive {src} is not JSON ({exc}); pass the JSON an earlier bench quality wrote") from exc
    if not isinstance(result, dict) or "preset" not in result:
        raise BlockTrainError(f"--rederive {src} is not a bench quality result (no 'preset'); pass the JSON an earlier "
                              "bench quality wrote")
    return result


def cmd_bench_machine(args: argparse.Namespace) -> int:
    from blocktrain.bench.machine import machine_info, measure_peak_flops
    from blocktrain.device import resolve_device

    device = resolve_device(args.device)
    peak = measure_peak_flops(device, seconds=args.seconds)
    result = {**machine_info(device), "peak_flops": peak}
    sys.stdout.write(f"{device}: fp32 {peak['fp32'] / 1e9:,.0f} GFLOP/s, bf16 {peak['bf16'] / 1e9:,.0f} GFLOP/s\n")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def speed_options(args: argparse.Namespace, command: str) -> SpeedOptions:
    """`blocktrain bench speed` flags -> SpeedOptions (also used by benchmarks/quality/speed_reference.py)."""
    from blocktrain.data.dataset import resolve_data_dir

    return SPEED_FLAGS.build(args, data=resolve_data_dir(args.data), command=command)


def cmd_bench_speed(args: argparse.Namespace) -> int:
    from blocktrain.bench.speed import run_speed_bench

    run_speed_bench(speed_options(args, "blocktrain " + shlex.join(sys.argv[1:])))
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from blocktrain.data.prepare import prepare

    out = Path(args.out).expanduser()
    for path in (out, *out.parents):  # the nearest existing one must be a directory
        if path.exists():
            if not path.is_dir():
                raise BlockTrainError(f"--out {args.out}: {path} is not a directory; "
                                      "choose a new or empty directory for the dataset")
            break
    done = prepare(Path(args.src), out, PREPARE_FLAGS.build(args))
    m = done.manifest
    for split in ("train", "valid", "test"):
        info = m["splits"][split]
        sys.stdout.write(f"{split:5s} {info['documents']:>9,d} documents {info['bytes']:>14,d} bytes  {info['sha256'][:12]}\n")
    if m["binary_files_skipped"]:
        sys.stdout.write(f"skipped {m['binary_files_skipped']} binary files\n")
    sys.stdout.write(f"dataset {args.out} fingerprint {done.fingerprint}\n"
                     f"train on it: blocktrain train --data {args.out}\n")
    return 0


def at_least(value: int, least: int, flag: str, what: str) -> None:
    """A BlockTrainError naming ``flag`` unless ``value >= least``."""
    if value < least:
        raise BlockTrainError(f"{flag} must be >= {least} ({what}), got {value}; set {flag} N >= {least}")


class ExactParser(argparse.ArgumentParser):
    """A parser that takes only whole option names: no prefix matching, so ``--blocks`` is never ``--blocks-alone``.

    ``add_subparsers`` creates sub-parsers of the parser's own class, so every sub-command inherits this.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    p = ExactParser(prog="blocktrain", description=__doc__)  # its sub-parsers are ExactParsers too
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("prepare", help="turn a text file, a folder of files or a JSONL dump into a dataset directory")
    s.add_argument("src", help="a text file, a directory (read recursively), a .jsonl file or a WikiText directory")
    s.add_argument("--out", required=True, help="the dataset directory to write (new or empty)")
    PREPARE_FLAGS.add(s)
    s.set_defaults(fn=cmd_prepare)

    s = sub.add_parser("train-block", help="train one block alone")
    add_run_args(s)
    s.add_argument("--block", type=int, required=True, help="block index k (0 = highest noise)")
    s.set_defaults(fn=cmd_train_one)

    s = sub.add_parser("train", help="train all B blocks into one run directory")
    add_run_args(s)
    s.add_argument("--parallel", type=int, default=1,
                   help="train this many diffusion blocks at once, as processes (a progressive stack trains in order)")
    s.add_argument("--isolate", choices=["auto", "yes", "no"], default="auto", help=ISOLATE_HELP)
    s.set_defaults(fn=cmd_train)

    s = sub.add_parser("train-e2e", help="train the end-to-end reference")
    add_run_args(s)
    s.set_defaults(fn=cmd_train_one)

    s = sub.add_parser("eval", help="cross-entropy of a run over a whole split")
    s.add_argument("run", help="run directory")
    s.add_argument("--split", default="test", choices=["train", "valid", "test"])
    s.add_argument("--data", default=None, help="data directory")
    s.add_argument("--model", default="auto", choices=["auto", "blocktrain", "e2e"], help="which model of the run")
    s.add_argument("--chains", type=int, default=1, help="K: also score the mixture of K chains")
    s.add_argument("--blocks-alone", action="store_true", help="also score each block alone on pure noise")
    s.add_argument("--max-bytes", type=int, default=None, help="score only the first N bytes (default and 0: all)")
    s.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                   help="inference arithmetic (bf16: autocast, about 2x faster on CPU, CE within ~0.001)")
    s.add_argument("--device", default="auto", help=DEVICE_HELP + "; the split and its windows live there too")
    s.add_argument("--batch-size", type=int, default=32, help="windows per forward pass")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.add_argument("--no-progress", action="store_true")
    s.set_defaults(fn=cmd_eval)

    s = sub.add_parser("generate", help="generate bytes from a run (or a serving pipeline)")
    s.add_argument("run", nargs="?", help="run directory")
    s.add_argument("--prompt", default="\n = ", help="text to continue")
    s.add_argument("--bytes", type=int, default=200, help="bytes to generate")
    s.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (0 = greedy)")
    s.add_argument("--top-k", type=int, default=40, help="sample among the k most likely bytes (0 = all)")
    s.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the smallest set of most likely bytes whose mass reaches p (1 = all)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--model", default="auto", choices=["auto", "blocktrain", "e2e"])
    s.add_argument("--device", default="auto", help=DEVICE_HELP + " (a local RUN; a --pipeline's stages have their own)")
    s.add_argument("--pipeline", default=None, help="HOST:PORT of the first serving stage")
    s.add_argument("--mode", default="ar", choices=["ar", "sweep", "spec", "baseline"],
                   help="serving mode with --pipeline (spec: speculative decoding)")
    s.add_argument("--draft-min", type=int, default=1, help="--mode spec: shortest draft, bytes")
    s.add_argument("--draft-max", type=int, default=16, help="--mode spec: longest draft, bytes")
    s.add_argument("--sweeps", type=int, default=1, help="k sweeps of --mode sweep")
    s.add_argument("--timeout", type=float, default=60.0, help="with --pipeline: seconds before a request fails")
    s.add_argument("--no-progress", action="store_true")
    s.set_defaults(fn=cmd_generate)

    s = sub.add_parser("plot", help="draw loss and CE curves to PNG")
    s.add_argument("runs", nargs="+", help="run directories")
    s.add_argument("--out", default="curves.png", help="PNG path")
    s.set_defaults(fn=cmd_plot)

    s = sub.add_parser("bench", help="benchmarks")
    bsub = s.add_subparsers(dest="bench", required=True)
    q = bsub.add_parser("quality", help="E2E vs block objectives, at matched steps and matched FLOPs")
    add_run_args(q, need_out=False, skip=("objective",))
    q.add_argument("--objective", dest="bench_objective", default="both", choices=["diffusion", "stack", "both"],
                   help="which block objective(s) to train and score against the E2E reference")
    q.add_argument("--out", default=None, help="bench directory (default runs/bench-quality-PRESET)")
    q.add_argument("--json", default=None, help="write the result JSON here (and a .md table beside it)")
    q.add_argument("--chains", type=int, default=2, help="K for the diffusion K-chain mixture row")
    q.add_argument("--max-eval-bytes", type=int, default=None,
                   help="score only the first N test bytes (default: the preset's --test-bytes; 0: the whole split)")
    q.add_argument("--isolate", choices=["auto", "yes", "no"], default="auto", help=ISOLATE_HELP)
    q.add_argument("--fresh", action="store_true", help="delete the bench directory first")
    q.add_argument("--resume", action="store_true",
                   help="continue the bench directory if it exists: each arm from its last checkpoint (a bench cut by "
                        "a time limit loses nothing; its wall times then count this run only, and the JSON says so)")
    q.add_argument("--no-lr-sweep", action="store_true", help="skip the lr sweep (x0.5, x1, x2) of E2E and stack block 0")
    q.add_argument("--no-matched-flops", action="store_true", help="skip the E2E run at the stack's training FLOPs")
    q.add_argument("--rederive", metavar="JSON",
                   help="recompute the derived figures (gains, gaps) and the table of an earlier result from its "
                        "measured CEs, writing it back (or to --json); trains nothing")
    q.add_argument("--no-matched-steps", action="store_true",
                   help="train the E2E once, at matched FLOPs only (the long budget); needs --no-lr-sweep")
    q.set_defaults(fn=cmd_bench_quality)

    q = bsub.add_parser("machine", help="dense matmul peak of this device in fp32 and bf16")
    q.add_argument("--device", default="auto", help=DEVICE_HELP)
    q.add_argument("--seconds", type=float, default=1.0, help="timing budget per dtype")
    q.add_argument("--json", default=None, help="write the result JSON here")
    q.set_defaults(fn=cmd_bench_machine)

    q = bsub.add_parser("speed", help="seconds per step and MFU of the E2E and block trainers, fp32 against bf16")
    q.add_argument("--data", default=None, help="data directory")
    SPEED_FLAGS.add(q)  # --preset, --out, --steps, --device, --json
    q.set_defaults(fn=cmd_bench_speed)

    # Sub-commands of the distributed parts register themselves.
    from blocktrain.cli import distributed, serving

    distributed.register(sub)
    serving.register(sub, bsub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # SIGTERM (a service manager's stop, ``kill PID``) stops a command as Ctrl-C does: a training saves its checkpoint
    # (its default action killed it, losing up to --checkpoint-every steps). Signal handlers live in the main thread.
    signals = {signal.SIGTERM: interrupt} if threading.current_thread() is threading.main_thread() else {}
    try:
        with handling_signals(signals):
            return int(args.fn(args))
    except BlockTrainError as exc:
        sys.stderr.write(f"blocktrain: error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("blocktrain: interrupted; checkpoints were saved, rerun the same command to resume\n")
        return 130
