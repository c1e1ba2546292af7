"""CLI of pipelined serving: stage servers and the serving benchmark (issue 4)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from pathlib import Path

from blocktrain.bench.serve_options import ServeBenchOptions
from blocktrain.cli.fields import Flags
from blocktrain.config import Objective
from blocktrain.serve.gateway.options import GatewayOptions
from blocktrain.serve.runtime.kvcache import CacheOptions
from blocktrain.serve.stage.options import StageOptions

log = logging.getLogger(__name__)

# StageOptions fields whose flags are not derived as --kebab-name: in other units (ms, MiB: converted by the
# flag builder), parsed (--next) or secret (--token-file); every other field's flag is derived from its declaration.
STAGE_RENAMED = {"link_delay_s": "--delay-ms", "max_frame_bytes": "--max-frame-mib", "batch_window_s": "--batch-window-ms",
                 "conn_buffer_bytes": "--conn-buffer-mib", "buffer_bytes": "--buffer-mib"}
STAGE_EXPLICIT = {**STAGE_RENAMED, "next_stages": "--next", "token": "--token-file"}
STAGE_PREFIX, BENCH_PREFIX = "stage__", "bench__"  # argparse dests of derived flags: prefix + field name
STAGE_FLAGS = Flags(StageOptions, STAGE_PREFIX, rename=STAGE_RENAMED, skip=("next_stages", "token"),
                    aliases={"request_timeout_s": ("--timeout",)},  # its flag name from before the flags were derived
                    default_text={"conn_buffer_bytes": "--max-frame-mib",
                                  "buffer_bytes": "4 x --conn-buffer-mib + 64 KiB x --max-connections"})
CACHE_FLAGS = Flags(CacheOptions, "cache__", rename={"max_bytes": "--cache-mib", "ttl_s": "--cache-ttl",
                                                     "max_requests": "--cache-requests"})
BENCH_FLAGS = Flags(ServeBenchOptions, BENCH_PREFIX)
GATEWAY_FLAGS = Flags(GatewayOptions, "gateway__", rename={"max_body_bytes": "--max-body-kib"},
                      aliases={"request_timeout_s": ("--timeout",)}, skip=("token", "pipeline_token"))


def cache_options(args: argparse.Namespace) -> CacheOptions:
    """`blocktrain serve` --cache-* flags -> the KV cache limits of the stage (a BlockTrain or an E2E span)."""
    return CACHE_FLAGS.build(args)


def read_token(args: argparse.Namespace) -> str:
    """The shared serving token: --token-file, else $BLOCKTRAIN_SERVE_TOKEN, else "" (no authentication)."""
    from blocktrain.errors import ConfigError
    from blocktrain.serve.client.pipeline import TOKEN_ENV

    if args.token_file:
        try:
            token = Path(args.token_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read --token-file {args.token_file}: {exc}") from exc
        if not token:
            raise ConfigError(f"--token-file {args.token_file} is empty; write the shared token into it")
        return token
    return os.environ.get(TOKEN_ENV, "").strip()


def stage_options(args: argparse.Namespace, next_stages: tuple[tuple[str, int], ...] = ()) -> StageOptions:
    """`blocktrain serve` flags -> StageOptions (ConfigError on a bad value); unset flags keep the field defaults."""
    from blocktrain.serve.wire.limits import SMALL_FRAME_BYTES

    given = STAGE_FLAGS.values(args)
    default = StageOptions()  # the buffers' defaults follow the frame cap and connections given
    conn_buffer = given.setdefault("conn_buffer_bytes", given.get("max_frame_bytes", default.max_frame_bytes))
    small = given.get("max_connections", default.max_connections) * SMALL_FRAME_BYTES
    given.setdefault("buffer_bytes", 4 * conn_buffer + small)
    return StageOptions(**given, next_stages=next_stages, token=read_token(args))


def next_stages(args: argparse.Namespace) -> tuple[tuple[str, int], ...]:
    """--next A,B -> the next stage and its replicas (ValueError on a bad address)."""
    from blocktrain.serve.wire.links import parse_address

    return tuple(parse_address(a) for a in args.next.split(",")) if args.next else ()


def bench_options(args: argparse.Namespace) -> ServeBenchOptions:
    """`blocktrain bench serve` flags -> ServeBenchOptions (ConfigError on a bad value); unset flags keep the defaults."""
    return BENCH_FLAGS.build(args)


def cmd_serve(args: argparse.Namespace) -> int:
    import torch

    from blocktrain.checkpoint.run import RunDir
    from blocktrain.config import Precision
    from blocktrain.device import resolve_device, resolve_precision
    from blocktrain.errors import ConfigError, ServeError
    from blocktrain.serve.runtime import Span
    from blocktrain.serve.runtime.loading import (
        load_e2e_span,
        load_run_span,
        parse_shape,
        parse_span,
        random_e2e_span,
        random_run_span,
    )
    from blocktrain.serve.stage.server import StageServer, serve_until_stopped
    from blocktrain.serve.wire.links import parse_address

    torch.set_num_threads(args.threads)
    span_text = args.layers if args.model == "e2e" else args.blocks
    if span_text is None:
        raise ConfigError("give the span this stage holds: --blocks LO-HI (blocktrain) or --layers LO-HI (--model e2e)")
    lo, hi = parse_span(span_text)
    try:
        host, port = parse_address(args.listen)
        nxt = next_stages(args)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    device = resolve_device(args.device)
    precision = resolve_precision(Precision(args.precision), device)
    span: Span
    if args.random:
        cfg = parse_shape(args.random, objective=Objective(args.objective))
        span = (random_e2e_span(cfg, lo, hi, args.seed, cache_options(args), device) if args.model == "e2e"
                else random_run_span(cfg, lo, hi, args.seed, cache_options(args), device))
        span.precision = precision
    elif args.run:
        run = RunDir(Path(args.run))
        span = (load_e2e_span(run, lo, hi, precision, cache_options(args), device) if args.model == "e2e"
                else load_run_span(run, lo, hi, precision, cache_options(args), device))
    else:
        raise ConfigError("serve needs --run RUN (trained weights) or --random SHAPE (random weights)")
    log.info("loaded %s %d-%d: %.1fM parameters, %s arithmetic on %s", span.describe()["family"], lo, hi,
             span.n_params() / 1e6, precision.value, device)
    opts = stage_options(args, nxt)
    if not opts.token:
        log.warning("stage %s accepts unauthenticated connections; set BLOCKTRAIN_SERVE_TOKEN or --token-file "
                    "on every stage and client unless the network is private", span_text)

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
    from blocktrain.bench.serve import run_serve_bench

    run_serve_bench(bench_options(args))
    return 0


def cmd_gateway(args: argparse.Namespace) -> int:
    """``blocktrain gateway`` flags -> a running gateway."""
    from blocktrain.errors import ConfigError
    from blocktrain.serve.gateway.app import TOKEN_ENV, run_gateway
    from blocktrain.serve.wire.links import parse_address

    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV, "")
    opts = GATEWAY_FLAGS.build(args, token=token.strip())
    try:
        host, port = parse_address(args.listen)
        parse_address(opts.pipeline)
    except ValueError as exc:
        raise ConfigError(f"{exc}; give --listen and --pipeline as HOST:PORT") from exc
    run_gateway(opts, host, port)
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
    s.add_argument("--objective", default="diffusion", choices=[o.value for o in Objective],
                   help="the blocks --random builds (a run directory names its own)")
    s.add_argument("--threads", type=int, default=1, help="torch threads of this process")
    s.add_argument("--device", default="auto",
                   help="where this stage's blocks, KV caches and arithmetic live: auto (cuda if available, else "
                        "cpu), cpu, cuda or cuda:N; frames cross the wire from the host either way")
    STAGE_FLAGS.add(s)  # --delay-ms, --max-frame-mib, --batch-window-ms, --buffer-mib, --idle-timeout, ...
    s.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                   help="arithmetic of this stage's blocks (bf16: autocast, fp32 where the device lacks it). fp32 "
                        "by default: on a CPU one-row decode matmuls gain nothing from bf16, and fp32 keeps a "
                        "pipeline's output equal to the local model's")
    CACHE_FLAGS.add(s)  # stack runs' KV cache: --cache-mib, --cache-ttl, --cache-requests
    s.add_argument("--token-file", default=None,
                   help="file holding the shared token that every connection must send first (default: "
                        "$BLOCKTRAIN_SERVE_TOKEN; none: no authentication)")
    s.set_defaults(fn=cmd_serve)

    b = bench.add_parser("serve", help="sweep vs ar vs the AR baseline over three stages on loopback; "
                         "run it alone on the machine")
    BENCH_FLAGS.add(b)
    b.set_defaults(fn=cmd_bench_serve)

    g = sub.add_parser("gateway", help="an OpenAI-style HTTP API (/v1/completions, /v1/models) in front of a pipeline")
    g.add_argument("--listen", default="127.0.0.1:8000", help="HOST:PORT the HTTP API listens on")
    g.add_argument("--token", default=None,
                   help="bearer token HTTP clients must send (default: $BLOCKTRAIN_GATEWAY_TOKEN; none: no authentication)")
    GATEWAY_FLAGS.add(g)  # --pipeline, --model-name, --max-tokens-cap, --max-body-kib, --timeout, --max-connections
    g.set_defaults(fn=cmd_gateway)
