"""CLI of pipelined serving: stage servers and the serving benchmark (issue 4)."""

from __future__ import annotations

import argparse
import asyncio
import enum
import logging
import os
import signal
import typing
from dataclasses import MISSING, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from blocktrain.cli.fields import arg_type, field_comments, flag_name
from blocktrain.config import Objective

if TYPE_CHECKING:
    from blocktrain.bench.serve_options import ServeBenchOptions
    from blocktrain.serve.stage.options import StageOptions

log = logging.getLogger(__name__)

# StageOptions fields set by explicit flags: unit-converting (ms, MiB), parsed (--next) or secret (--token-file).
# Every other field gets a flag derived from its declaration (see _add_option_flags).
STAGE_EXPLICIT = {
    "next_stages": "--next", "link_delay_s": "--delay-ms", "max_frame_bytes": "--max-frame-mib",
    "batch_window_s": "--batch-window-ms", "conn_buffer_bytes": "--conn-buffer-mib", "buffer_bytes": "--buffer-mib",
    "token": "--token-file",
}
STAGE_ALIASES = {"request_timeout_s": ("--timeout",)}  # flag names kept from before the flags were derived
STAGE_PREFIX, BENCH_PREFIX = "stage__", "bench__"  # argparse dests of derived flags: prefix + field name


def _add_option_flags(
    p: argparse.ArgumentParser, cls: type, prefix: str, *, skip: typing.Collection[str] = (),
    aliases: typing.Mapping[str, tuple[str, ...]] | None = None, types: typing.Mapping[str, typing.Callable[[str], Any]] | None = None,
) -> None:
    """One flag per field of the option dataclass ``cls`` (but ``skip``): ``--kebab-name``, help from its unit comment.

    A field in seconds (``x_s``) is also reachable as ``--x``; ``aliases`` adds other names, ``types`` parsers
    for fields whose default's type cannot parse a flag. Unset flags stay None: the dataclass default applies.
    """
    comments = field_comments(cls)
    for f in fields(cls):
        if f.name in skip:
            continue
        names = [flag_name(f.name)]
        if f.name.endswith("_s"):
            names.append(flag_name(f.name.removesuffix("_s")))
        names += (aliases or {}).get(f.name, ())
        kw = {"type": types[f.name], "metavar": f.name.upper()} if types and f.name in types else arg_type(cls, f.name)
        help_ = comments.get(f.name, f.name)
        if f.default is not MISSING and f.default is not None:
            help_ += f" (default: {f.default.value if isinstance(f.default, enum.Enum) else f.default})"
        p.add_argument(*names, dest=prefix + f.name, default=None, help=help_.replace("%", "%%"), **kw)


def _given_options(args: argparse.Namespace, cls: type, prefix: str) -> dict[str, Any]:
    """The fields of ``cls`` whose derived flags were given, by field name."""
    return {f.name: v for f in fields(cls) if (v := getattr(args, prefix + f.name, None)) is not None}


def _int_tuple(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(k) for k in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,2,4, got {text!r}") from None


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
    from blocktrain.serve.stage.options import StageOptions
    from blocktrain.serve.wire.limits import SMALL_FRAME_BYTES

    given = _given_options(args, StageOptions, STAGE_PREFIX)
    default = StageOptions()
    max_frame = int(args.max_frame_mib * 2**20) if args.max_frame_mib is not None else default.max_frame_bytes
    conn_buffer = int(args.conn_buffer_mib * 2**20) if args.conn_buffer_mib is not None else max_frame
    small = given.get("max_connections", default.max_connections) * SMALL_FRAME_BYTES
    if args.delay_ms is not None:
        given["link_delay_s"] = args.delay_ms / 1000.0
    if args.batch_window_ms is not None:
        given["batch_window_s"] = args.batch_window_ms / 1000.0
    return StageOptions(
        **given, next_stages=next_stages, max_frame_bytes=max_frame, conn_buffer_bytes=conn_buffer,
        buffer_bytes=int(args.buffer_mib * 2**20) if args.buffer_mib is not None else 4 * conn_buffer + small,
        token=read_token(args),
    )


def next_stages(args: argparse.Namespace) -> tuple[tuple[str, int], ...]:
    """--next A,B -> the next stage and its replicas (ValueError on a bad address)."""
    from blocktrain.serve.wire.links import parse_address

    return tuple(parse_address(a) for a in args.next.split(",")) if args.next else ()


def bench_options(args: argparse.Namespace) -> ServeBenchOptions:
    """`blocktrain bench serve` flags -> ServeBenchOptions (ConfigError on a bad value); unset flags keep the defaults."""
    from blocktrain.bench.serve_options import ServeBenchOptions

    return ServeBenchOptions(**_given_options(args, ServeBenchOptions, BENCH_PREFIX))


def cmd_serve(args: argparse.Namespace) -> int:
    import torch

    from blocktrain.checkpoint.run import RunDir
    from blocktrain.config import Precision
    from blocktrain.errors import ConfigError, ServeError
    from blocktrain.serve.runtime import Span
    from blocktrain.serve.runtime.kvcache import CacheOptions
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
    precision = Precision(args.precision)
    span: Span
    if args.random:
        cfg = parse_shape(args.random, objective=Objective(args.objective))
        cache = CacheOptions(ttl_s=args.cache_ttl, max_bytes=int(args.cache_mib * 2**20))
        span = random_e2e_span(cfg, lo, hi, args.seed) if args.model == "e2e" else random_run_span(cfg, lo, hi, args.seed,
                                                                                                  cache)
        span.precision = precision
    elif args.run:
        run = RunDir(Path(args.run))
        cache = CacheOptions(ttl_s=args.cache_ttl, max_bytes=int(args.cache_mib * 2**20))
        span = load_e2e_span(run, lo, hi, precision) if args.model == "e2e" else load_run_span(run, lo, hi, precision, cache)
    else:
        raise ConfigError("serve needs --run RUN (trained weights) or --random SHAPE (random weights)")
    log.info("loaded %s %d-%d: %.1fM parameters, %s arithmetic", span.describe()["family"], lo, hi, span.n_params() / 1e6,
             precision.value)
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
    from blocktrain.serve.gateway.app import TOKEN_ENV, GatewayOptions, run_gateway
    from blocktrain.serve.wire.links import parse_address

    try:
        host, port = parse_address(args.listen)
        parse_address(args.pipeline)
    except ValueError as exc:
        raise ConfigError(f"{exc}; give --listen and --pipeline as HOST:PORT") from exc
    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV, "")
    opts = GatewayOptions(pipeline=args.pipeline, model_name=args.model_name, token=token.strip(),
                          max_tokens_cap=args.max_tokens_cap, max_body_bytes=int(args.max_body_kib * 1024),
                          request_timeout_s=args.timeout, max_connections=args.max_connections)
    run_gateway(opts, host, port)
    return 0


def register(sub: argparse._SubParsersAction, bench: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the serve sub-command (and 'bench serve') to the parser."""
    from blocktrain.bench.serve_options import ServeBenchOptions
    from blocktrain.serve.stage.options import StageOptions

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
    s.add_argument("--delay-ms", type=float, default=None,
                   help=f"inject this one-way delay on the forward link (default: {StageOptions.link_delay_s * 1000:g})")
    s.add_argument("--max-frame-mib", type=float, default=None,
                   help=f"largest frame accepted or sent (default: {StageOptions.max_frame_bytes / 2**20:g})")
    s.add_argument("--batch-window-ms", type=float, default=None,
                   help=f"wait for more frames before a batch (default: {StageOptions.batch_window_s * 1000:g})")
    s.add_argument("--conn-buffer-mib", type=float, default=None,
                   help="largest frame one connection may have buffered (default: --max-frame-mib)")
    s.add_argument("--buffer-mib", type=float, default=None,
                   help="frames buffered at once over all connections, 64 KiB per connection of it kept for small "
                        "frames (default: 4 x --conn-buffer-mib + 64 KiB x --max-connections)")
    _add_option_flags(s, StageOptions, STAGE_PREFIX, skip=STAGE_EXPLICIT, aliases=STAGE_ALIASES)
    s.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                   help="arithmetic of this stage's blocks (bf16: autocast). fp32 by default: stages compute on "
                        "the CPU, where one-row decode matmuls gain nothing from bf16, and fp32 keeps a pipeline's "
                        "output equal to the local model's")
    s.add_argument("--cache-mib", type=float, default=256.0,
                   help="stack runs: MiB of KV cache this stage holds over all requests (least recently used dropped)")
    s.add_argument("--cache-ttl", type=float, default=600.0,
                   help="stack runs: seconds after which an unused request's KV cache is dropped")
    s.add_argument("--token-file", default=None,
                   help="file holding the shared token that every connection must send first (default: "
                        "$BLOCKTRAIN_SERVE_TOKEN; none: no authentication)")
    s.set_defaults(fn=cmd_serve)

    b = bench.add_parser("serve", help="sweep vs ar vs the AR baseline over three stages (netns or loopback); "
                         "run it alone on the machine")
    _add_option_flags(b, ServeBenchOptions, BENCH_PREFIX, types={"sweeps": _int_tuple})
    b.set_defaults(fn=cmd_bench_serve)

    g = sub.add_parser("gateway", help="an OpenAI-style HTTP API (/v1/completions, /v1/models) in front of a pipeline")
    g.add_argument("--pipeline", required=True, help="HOST:PORT of the pipeline's entry stage")
    g.add_argument("--listen", default="127.0.0.1:8000", help="HOST:PORT the HTTP API listens on")
    g.add_argument("--token", default=None,
                   help="bearer token HTTP clients must send (default: $BLOCKTRAIN_GATEWAY_TOKEN; none: no authentication)")
    g.add_argument("--model-name", default=None, help="model id to report and accept (default: from the entry stage)")
    g.add_argument("--max-tokens-cap", type=int, default=4096, help="largest max_tokens (bytes) accepted")
    g.add_argument("--max-body-kib", type=float, default=1024.0, help="largest request body accepted")
    g.add_argument("--timeout", type=float, default=120.0, help="seconds a request (or a whole stream) may take")
    g.add_argument("--max-connections", type=int, default=256, help="HTTP connections served at once (more: 503)")
    g.set_defaults(fn=cmd_gateway)
