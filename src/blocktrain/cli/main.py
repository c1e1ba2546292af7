"""``blocktrain`` command line. Each sub-command parses, then calls the library."""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from pathlib import Path

from blocktrain.cli.common import add_run_args, config_from_args, forward_run_args
from blocktrain.errors import BlockTrainError

log = logging.getLogger("blocktrain")


def cmd_train_block(args: argparse.Namespace) -> int:
    from blocktrain.data.dataset import resolve_data_dir
    from blocktrain.train.block import train_block

    cfg = config_from_args(args)
    s = train_block(cfg, resolve_data_dir(args.data), Path(args.out), args.block, progress=not args.no_progress)
    log.info("block %d: %d steps in %.1fs, train memory %.1f MiB", args.block, s.steps, s.wall_s, s.train_mem_bytes / 2**20)
    return 0


def cmd_train_e2e(args: argparse.Namespace) -> int:
    from blocktrain.data.dataset import resolve_data_dir
    from blocktrain.train.e2e import train_e2e

    cfg = config_from_args(args)
    s = train_e2e(cfg, resolve_data_dir(args.data), Path(args.out), progress=not args.no_progress)
    log.info("e2e: %d steps in %.1fs, train memory %.1f MiB", s.steps, s.wall_s, s.train_mem_bytes / 2**20)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """Train all B blocks, each in its own process (at most --parallel at a time).

    A process per block keeps each block's peak memory and its metrics its own.
    """
    from blocktrain.data.dataset import resolve_data_dir

    cfg = config_from_args(args)
    data = resolve_data_dir(args.data)
    data.open("train")
    base = [sys.executable, "-m", "blocktrain", "train-block", "--out", args.out, *forward_run_args(args)]
    if args.data is None:
        base += ["--data", str(data.root)]
    pending = list(range(cfg.model.n_blocks))
    running: list[tuple[int, subprocess.Popen[bytes]]] = []
    failed = []
    while pending or running:
        while pending and len(running) < max(1, args.parallel):
            k = pending.pop(0)
            running.append((k, subprocess.Popen([*base, "--block", str(k)])))
        k, proc = running.pop(0)
        if proc.wait() != 0:
            failed.append(k)
    if failed:
        raise BlockTrainError(f"training failed for blocks {failed}; rerun the same command to resume them")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from blocktrain.checkpoint.run import RunDir
    from blocktrain.data.dataset import resolve_data_dir
    from blocktrain.evaluate.assembled import load_model_from_run
    from blocktrain.evaluate.report import evaluate_model

    model = load_model_from_run(RunDir(Path(args.run)), args.model)
    data = resolve_data_dir(args.data).open(args.split)
    result = evaluate_model(
        model, data, chains=args.chains, max_bytes=args.max_bytes, blocks_alone=args.blocks_alone,
        progress=not args.no_progress, batch_size=args.batch_size,
    )
    if args.json:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    else:
        from blocktrain.evaluate.report import format_eval

        sys.stdout.write(format_eval(result) + "\n")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from blocktrain.checkpoint.run import RunDir
    from blocktrain.evaluate.assembled import load_model_from_run
    from blocktrain.evaluate.generate import generate

    if args.pipeline:
        from blocktrain.serve.client import generate_remote

        text = generate_remote(args, args.prompt.encode())
    else:
        if not args.run:
            raise BlockTrainError("generate needs a RUN directory or --pipeline HOST:PORT")
        model = load_model_from_run(RunDir(Path(args.run)), args.model)
        text = generate(
            model, args.prompt.encode(), args.bytes, temperature=args.temperature, top_k=args.top_k,
            seed=args.seed, progress=not args.no_progress,
        )
    sys.stdout.write(args.prompt + text.decode("utf-8", errors="replace") + "\n")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from blocktrain.report.plot import plot_runs

    out = plot_runs([Path(r) for r in args.runs], Path(args.out))
    log.info("wrote %s", out)
    return 0


def cmd_bench_quality(args: argparse.Namespace) -> int:
    from blocktrain.bench.quality import run_quality_bench

    run_quality_bench(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="blocktrain", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("train-block", help="train one block alone")
    add_run_args(s)
    s.add_argument("--block", type=int, required=True, help="block index k (0 = highest noise)")
    s.set_defaults(fn=cmd_train_block)

    s = sub.add_parser("train", help="train all B blocks into one run directory")
    add_run_args(s)
    s.add_argument("--parallel", type=int, default=1, help="train this many blocks at once, as processes")
    s.set_defaults(fn=cmd_train)

    s = sub.add_parser("train-e2e", help="train the end-to-end reference")
    add_run_args(s)
    s.set_defaults(fn=cmd_train_e2e)

    s = sub.add_parser("eval", help="cross-entropy of a run over a whole split")
    s.add_argument("run", help="run directory")
    s.add_argument("--split", default="test", choices=["train", "valid", "test"])
    s.add_argument("--data", default=None, help="data directory")
    s.add_argument("--model", default="auto", choices=["auto", "blocktrain", "e2e"], help="which model of the run")
    s.add_argument("--chains", type=int, default=1, help="K: also score the mixture of K chains")
    s.add_argument("--blocks-alone", action="store_true", help="also score each block alone on pure noise")
    s.add_argument("--max-bytes", type=int, default=None, help="score only the first N bytes (default: all)")
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
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--model", default="auto", choices=["auto", "blocktrain", "e2e"])
    s.add_argument("--pipeline", default=None, help="HOST:PORT of the first serving stage")
    s.add_argument("--mode", default="ar", choices=["ar", "sweep", "baseline"], help="serving mode with --pipeline")
    s.add_argument("--sweeps", type=int, default=1, help="k sweeps of --mode sweep")
    s.add_argument("--no-progress", action="store_true")
    s.set_defaults(fn=cmd_generate)

    s = sub.add_parser("plot", help="draw loss and CE curves to PNG")
    s.add_argument("runs", nargs="+", help="run directories")
    s.add_argument("--out", default="curves.png", help="PNG path")
    s.set_defaults(fn=cmd_plot)

    s = sub.add_parser("bench", help="benchmarks")
    bsub = s.add_subparsers(dest="bench", required=True)
    q = bsub.add_parser("quality", help="E2E vs BlockTrain at matched training compute")
    add_run_args(q, need_out=False)
    q.add_argument("--out", default=None, help="run directory (default runs/bench-quality-PRESET)")
    q.add_argument("--json", default=None, help="write the result JSON here")
    q.add_argument("--chains", type=int, default=4, help="K for the K-chain mixture row")
    q.add_argument("--max-eval-bytes", type=int, default=None, help="score only the first N test bytes")
    q.add_argument("--fresh", action="store_true", help="delete the run directory first")
    q.set_defaults(fn=cmd_bench_quality)

    # Sub-commands of the distributed parts register themselves.
    from blocktrain.cli import distributed, serving

    distributed.register(sub, bsub)
    serving.register(sub, bsub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return int(args.fn(args))
    except BlockTrainError as exc:
        sys.stderr.write(f"blocktrain: error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("blocktrain: interrupted; checkpoints were saved, rerun the same command to resume\n")
        return 130
