"""CLI of pipelined serving: stage servers and the serving benchmark (issue 4)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from pathlib import Path

log = logging.getLogger(__name__)


def cmd_serve(args: argparse.Namespace) -> int:
    import torch

    from blocktrain.checkpoint.run import RunDir
    from blocktrain.errors import ConfigError, ServeError
    from blocktrain.serve.compute import BlockSpan, E2ESpan
    from blocktrain.serve.links import parse_address
    from blocktrain.serve.loading import (
        load_block_span,
        load_e2e_span,
        parse_shape,
        parse_span,
        random_block_span,
        random_e2e_span,
        span_params,
    )
    from blocktrain.serve.stage import StageOptions, StageServer, serve_until_stopped

    torch.set_num_threads(args.threads)
    span_text = args.layers if args.model == "e2e" else args.blocks
    if span_text is None:
        raise ConfigError("give the span this stage holds: --blocks LO-HI (blocktrain) or --layers LO-HI (--model e2e)")
    lo, hi = parse_span(span_text)
    try:
        host, port = parse_address(args.listen)
        nxt = tuple(parse_address(a) for a in args.next.split(",")) if args.next else ()
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    span: BlockSpan | E2ESpan
    if args.random:
        cfg = parse_shape(args.random)
        make = random_e2e_span if args.model == "e2e" else random_block_span
        span = make(cfg, lo, hi, args.seed)
    elif args.run:
        run = RunDir(Path(args.run))
        span = load_e2e_span(run, lo, hi) if args.model == "e2e" else load_block_span(run, lo, hi)
    else:
        raise ConfigError("serve needs --run RUN (trained weights) or --random SHAPE (random weights)")
    log.info("loaded %s %d-%d: %.1fM parameters", args.model, lo, hi, span_params(span) / 1e6)
    opts = StageOptions(
        next_stages=nxt, link_delay_s=args.delay_ms / 1000.0, max_frame_bytes=int(args.max_frame_mib * 2**20),
        max_batch=args.max_batch, batch_window_s=args.batch_window_ms / 1000.0, request_timeout_s=args.timeout,
        retries=args.retries,
    )

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve_until_stopped(StageServer(span, host, port, opts), stop)

    try:
        asyncio.run(main())
    except OSError as exc:
        raise ServeError(f"cannot listen on {args.listen}: {exc}; choose another --listen address or port") from exc
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from blocktrain.serve.bench import run_serve_bench

    run_serve_bench(args)
    return 0


def register(sub: argparse._SubParsersAction, bench: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the serve sub-command (and 'bench serve') to the parser."""
    s = sub.add_parser("serve", help="serve a span of blocks (or E2E layers) as one pipeline stage")
    s.add_argument("--run", default=None, help="run directory with the trained weights")
    s.add_argument("--model", default="blocktrain", choices=["blocktrain", "e2e"], help="blocks, or the E2E baseline")
    s.add_argument("--blocks", default=None, help="blocks this stage holds, LO-HI (e.g. 0-1)")
    s.add_argument("--layers", default=None, help="E2E layers this stage holds, LO-HI (with --model e2e)")
    s.add_argument("--listen", default="127.0.0.1:7000", help="HOST:PORT to listen on")
    s.add_argument("--next", default=None,
                   help="HOST:PORT of the next stage, or replicas A,B tried in order; the last stage points back "
                        "at the first (it answers its sender when omitted)")
    s.add_argument("--random", default=None, metavar="SHAPE",
                   help="random weights of a logical shape, e.g. d_model=2048,n_heads=16,n_layers=16,n_blocks=4")
    s.add_argument("--seed", type=int, default=0, help="seed of --random weights")
    s.add_argument("--threads", type=int, default=1, help="torch threads of this process")
    s.add_argument("--delay-ms", type=float, default=0.0, help="inject this one-way delay on the forward link")
    s.add_argument("--max-frame-mib", type=float, default=64.0, help="largest frame accepted or sent")
    s.add_argument("--max-batch", type=int, default=16, help="frames run together at most")
    s.add_argument("--batch-window-ms", type=float, default=0.0, help="wait for more frames before a batch")
    s.add_argument("--timeout", type=float, default=60.0, help="entry stage: seconds before a request fails")
    s.add_argument("--retries", type=int, default=1, help="entry stage: re-runs after a downstream failure")
    s.set_defaults(fn=cmd_serve)

    b = bench.add_parser("serve", help="sweep vs ar vs the AR baseline over three stages (netns or loopback)")
    b.add_argument("--run", default="runs/bench-quality-cpu-small", help="run with trained blocks and E2E model")
    b.add_argument("--data", default=None, help="data directory (prompts and teacher-forced CE from its test split)")
    b.add_argument("--json", default=None, help="write the result JSON here")
    b.add_argument("--hop-delay-ms", type=float, default=25.0, help="one-way delay per hop")
    b.add_argument("--output-bytes", type=int, default=128, help="bytes per output")
    b.add_argument("--prompt-bytes", type=int, default=128, help="bytes of each prompt")
    b.add_argument("--prompts", type=int, default=4, help="prompts for the generative CE")
    b.add_argument("--sweeps", default="1,2,4", help="k values of sweep to measure")
    b.add_argument("--temperature", type=float, default=0.8)
    b.add_argument("--top-k", type=int, default=40)
    b.add_argument("--tf-bytes", type=int, default=16384, help="test bytes for the teacher-forced CE")
    b.add_argument("--network", default="auto", choices=["auto", "netns", "loopback"])
    b.add_argument("--scale", default="auto", help="scale run shape (auto, off, or NAME=INT,...)")
    b.add_argument("--scale-budget-gib", type=float, default=None, help="memory for the scale run's weights")
    b.add_argument("--scale-output-bytes", type=int, default=None, help="bytes per output at scale (default: same)")
    b.add_argument("--base-port", type=int, default=47100)
    b.set_defaults(fn=cmd_bench_serve)
