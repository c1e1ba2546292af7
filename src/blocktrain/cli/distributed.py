"""CLI of decentralised training: coordinator, worker, token management (issue 3)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from blocktrain.cli.common import add_run_args, config_from_args, handling_signals, interrupt
from blocktrain.cli.fields import Flags
from blocktrain.coordinator.settings import CoordinatorSettings
from blocktrain.errors import BlockTrainError
from blocktrain.worker.options import WorkerOptions

if TYPE_CHECKING:
    from blocktrain.config import RunConfig
    from blocktrain.data.dataset import DataDir

log = logging.getLogger("blocktrain")

SETTINGS_FLAGS = Flags(CoordinatorSettings, "settings__")
WORKER_FLAGS = Flags(WorkerOptions, "worker__", rename={"url": "--coordinator", "compression": "--compress"},
                     skip=("token", "verify_tls", "progress"))  # the worker command sets these itself


def settings_from_args(args: argparse.Namespace) -> CoordinatorSettings:
    """The coordinator settings given as flags (one per field); for the rest, those the run in ``--run-dir`` last ran
    with where it has run before, else the dataclass defaults."""
    given = SETTINGS_FLAGS.values(args)
    fresh = getattr(args, "reset_settings", False) or not getattr(args, "run_dir", None)
    stored = None if fresh else _stored_settings(Path(args.run_dir))
    if stored is None:
        return CoordinatorSettings(**given)
    settings, notes = CoordinatorSettings.continued(stored, given)
    log.info("continuing the outer step and inner start this run ran with (a flag given changes its value; "
             "--reset-settings takes the flags and defaults alone)")
    for note in notes:
        log.warning("setting %s", note)
    return settings


def _stored_settings(run_dir: Path) -> dict[str, object] | None:
    """The settings the coordinator of ``run_dir`` last ran with (None: it has not run, or ran before they were kept)."""
    from blocktrain.coordinator.settings import SETTINGS_META
    from blocktrain.coordinator.store import Store

    if not (run_dir / "coordinator" / "state.sqlite3").is_file():
        return None
    store = Store(run_dir)
    try:
        text = store.meta.get_meta(SETTINGS_META)
    finally:
        store.close()
    return None if text is None else dict(json.loads(text))


def coordinator_inputs(args: argparse.Namespace) -> tuple[RunConfig, CoordinatorSettings, DataDir | None]:
    """The run's config, the coordinator's settings and its data (the gate's, the audits' and the evaluations'),
    from the coordinator's flags."""
    from blocktrain.data.dataset import resolve_data_dir

    settings = settings_from_args(args)
    if args.no_eval:  # no evaluation of the assembled model; the gate and the audits keep their own flags
        settings = dataclasses.replace(settings, eval_every=0)
    cfg = config_from_args(args)
    needs_data = not args.no_eval or settings.gate_tolerance is not None
    data = resolve_data_dir(args.data) if needs_data or args.data or os.environ.get("BLOCKTRAIN_DATA") else None
    if data is not None:  # its fingerprint is published, workers holding other data are refused; gate and audits
        cfg = cfg.with_dataset(data.fingerprint())
        log.info("dataset %s", data.describe())
    else:
        log.warning("no --data: workers' datasets are not checked against the run's, and no update is gated or "
                    "audited (give the coordinator --data DIR, the run's dataset, to check them)")
    return cfg, settings, data


def cmd_coordinator(args: argparse.Namespace) -> int:
    from blocktrain.coordinator.app import run_server
    from blocktrain.coordinator.service import Coordinator

    if bool(args.tls_cert) != bool(args.tls_key):
        raise BlockTrainError("--tls-cert and --tls-key go together; pass both or neither")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    cfg, settings, data = coordinator_inputs(args)
    c = Coordinator(Path(args.run_dir), cfg, settings, data)
    # SIGTERM (a service manager's stop) ends the run as Ctrl-C does, through close(): its default action would
    # kill the process before it could stop the processes it started (the hivemind DHT peer).
    try:
        with handling_signals({signal.SIGTERM: interrupt}):
            run_server(c, args.host, args.port, args.tls_cert, args.tls_key)
    except KeyboardInterrupt:
        # Not a training checkpoint: every acknowledged update and published version is already stored.
        sys.stderr.write(
            f"blocktrain: coordinator stopped; every accepted update and published version is stored in "
            f"{Path(args.run_dir) / 'coordinator'}; rerun the same command to continue the run "
            "(workers retry until it is back)\n"
        )
        return 130
    finally:
        c.close()
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from blocktrain.data.dataset import resolve_data_dir
    from blocktrain.worker.loop import Worker

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is too chatty
    token = args.token or os.environ.get("BLOCKTRAIN_TOKEN")
    if not token:
        raise BlockTrainError(
            "no token: pass --token T or set BLOCKTRAIN_TOKEN (create one with 'blocktrain token add')"
        )
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    opts = WORKER_FLAGS.build(args, token=token, progress=not args.no_progress,
                                                verify_tls=args.ca_cert or not args.insecure)
    stop, abandon = threading.Event(), threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if stop.is_set():
            log.warning("second signal: abandoning the current round")
            abandon.set()
        else:
            log.warning("signal %d: finishing the current round, then leaving (signal again to abandon)", signum)
            stop.set()

    with handling_signals({signal.SIGINT: on_signal, signal.SIGTERM: on_signal}):
        summary = Worker(opts, resolve_data_dir(args.data), stop=stop, abandon=abandon).run()
    log.info("worker done: %s", summary)
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(summary.__dict__, indent=2))
    return 0


def cmd_token_add(args: argparse.Namespace) -> int:
    from blocktrain.coordinator.store import Store

    store = Store(Path(args.run_dir))
    try:
        token = store.tokens.add_token(args.name, time.time())
    finally:
        store.close()
    sys.stdout.write(token + "\n")
    log.info("token for worker %r stored (hashed) in %s; it is shown only once", args.name, args.run_dir)
    return 0


def cmd_token_revoke(args: argparse.Namespace) -> int:
    from blocktrain.coordinator.store import Store

    store = Store(Path(args.run_dir))
    try:
        with store.tx():
            had = store.tokens.revoke_token(args.name)
    finally:
        store.close()
    if not had:
        log.error("worker %r has no token in %s; nothing revoked", args.name, args.run_dir)
        return 1
    log.info("token of worker %r revoked in %s; a running coordinator stops accepting it within seconds", args.name,
             args.run_dir)
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the coordinator/worker/token sub-commands to the parser."""
    s = sub.add_parser("coordinator", help="serve decentralised training: publish blocks, average updates")
    # its own --eval-*, --device below; no local training's logging, checkpoints, test scoring, profile or compile
    # (workers train, each with its own --compile)
    add_run_args(s, need_out=False, skip=("eval_every", "eval_bytes", "device", "log_every", "checkpoint_every", "test_bytes",
                                          "profile_steps", "compile"))
    s.add_argument("--run-dir", required=True, help="run directory holding the coordinator state")
    s.add_argument("--reset-settings", action="store_true",
                   help="on a restart, take the flags and this version's defaults alone, not the outer step and inner "
                        "start the run ran with (what decides a stored push must still match)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8470, help="port to listen on")
    # One flag per CoordinatorSettings field (--round-seconds, --no-fsync, ...): a new setting needs no edit here.
    SETTINGS_FLAGS.add(s)
    s.add_argument("--no-eval", action="store_true",
                   help="no evaluation of the assembled model (--eval-every 0); without --data (or $BLOCKTRAIN_DATA), "
                        "also no loss gate and no audits, which need the run's data")
    s.add_argument("--threads", type=int, default=None, help="torch threads")
    s.add_argument("--tls-cert", default=None, help="TLS certificate (PEM)")
    s.add_argument("--tls-key", default=None, help="TLS private key (PEM)")
    s.set_defaults(fn=cmd_coordinator)

    s = sub.add_parser("worker", help="train one block for a coordinator")
    WORKER_FLAGS.add(s)  # --coordinator, --block, --local-steps, --compress, --precision, --device, --give-up-s, ...
    s.add_argument("--token", default=None, help="bearer token (or $BLOCKTRAIN_TOKEN)")
    s.add_argument("--data", default=None, help="data directory")
    s.add_argument("--threads", type=int, default=None, help="torch threads (1 when several share a machine)")
    s.add_argument("--ca-cert", default=None, help="CA bundle to verify the coordinator's TLS certificate")
    s.add_argument("--insecure", action="store_true", help="do not verify TLS certificates")
    s.add_argument("--summary-json", default=None, help="write the worker's summary here at exit")
    s.add_argument("--no-progress", action="store_true")
    s.set_defaults(fn=cmd_worker)

    s = sub.add_parser("token", help="manage worker tokens")
    tsub = s.add_subparsers(dest="token_command", required=True)
    t = tsub.add_parser("add", help="create a bearer token for worker NAME; printed once, stored hashed")
    t.add_argument("name", help="worker name")
    t.add_argument("--run-dir", required=True, help="the coordinator's run directory")
    t.set_defaults(fn=cmd_token_add)
    t = tsub.add_parser("revoke", help="delete the bearer token of worker NAME (a leaked one); 'add' makes a new one")
    t.add_argument("name", help="worker name")
    t.add_argument("--run-dir", required=True, help="the coordinator's run directory")
    t.set_defaults(fn=cmd_token_revoke)
