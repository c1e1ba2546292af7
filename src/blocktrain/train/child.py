"""Training a run's arms: one call for a whole run (:func:`train_run`), each arm in this process or in a fresh one.

An arm is the E2E reference or one block. In a fresh process (``isolate``), the arm's peak memory, its metrics and
its failure are its own: the library's function runs in a ``spawn`` child that receives the run config as its JSON
and the data directory as a path (no argv, no pickled tensors), and reports its :class:`TrainSummary` back through
the run directory's metrics, as every trainer writes it.

    summaries = train_run(cfg, data, out)    # every block of cfg, in the objective's order; returns their summaries
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blocktrain.checkpoint.run import RunDir
from blocktrain.config import RunConfig, Schedule
from blocktrain.data.dataset import DataDir, open_data_dir
from blocktrain.errors import BlockTrainError
from blocktrain.objectives import get_objective

log = logging.getLogger(__name__)

E2E = -1  # the arm index of the E2E reference (blocks are 0..B-1)
START_METHOD = "spawn"  # a fresh interpreter per arm (the test suite forks instead, to skip the start-up)


@dataclass(frozen=True)
class ArmResult:
    """What an arm's trainer wrote as its last metrics record (``train_steps``, memory, wall time, last eval)."""

    name: str  # "e2e" or "block_k"
    summary: dict[str, object]  # the trainer's summary record in RUN/metrics/NAME.jsonl


def train_arm(cfg: RunConfig, data: DataDir, out: Path, k: int, *, isolate: bool, progress: bool = True) -> ArmResult:
    """Train block ``k`` (or the E2E reference, ``k == E2E``) of ``cfg`` into ``out``."""
    data.open("train")  # a missing or empty split fails here, before the run directory is made
    RunDir(out).init(cfg, data.root)  # records the data directory for eval and the other readers
    if isolate:
        proc = _start(cfg, data, out, k, progress)
        _join([proc])
        if proc.exitcode != 0:
            raise ArmFailedError(k, proc.exitcode)
    else:
        _train(cfg, data, out, k, progress)
    return ArmResult(arm_name(k), run_summary(RunDir(out), arm_name(k)))


def train_run(cfg: RunConfig, data: DataDir, out: Path, *, isolate: bool = True, progress: bool = True,
              parallel: int = 1) -> list[ArmResult]:
    """Train every block of ``cfg`` into ``out`` (a stack's in order, each on the finished blocks before it);
    ``parallel`` blocks at once where the objective lets blocks train independently (in fresh processes)."""
    from blocktrain.train.schedule import schedule_of, train_concurrent

    RunDir(out).init(cfg, data.root)  # a run of another config is refused once, here, not once per block
    if schedule_of(cfg) is Schedule.CONCURRENT:
        train_concurrent(cfg, data, out, progress=progress)
        return [ArmResult(arm_name(k), {}) for k in range(cfg.model.n_blocks)]
    ordered = get_objective(cfg).trains_in_order
    if ordered and parallel > 1:
        log.warning("the progressive schedule trains block k after block k-1 has finished; ignoring --parallel %d", parallel)
    if ordered or parallel <= 1:
        done: list[ArmResult] = []
        for k in range(cfg.model.n_blocks):
            try:
                done.append(train_arm(cfg, data, out, k, isolate=isolate, progress=progress))
            except BlockTrainError as exc:  # a fresh process's (printed above), or this process's own
                later = list(range(k + 1, cfg.model.n_blocks))
                why = f"; blocks {later} did not start, since they train on block {k}" if ordered and later else ""
                raise BlockTrainError(_failed([k], why) if isinstance(exc, ArmFailedError) else
                                      f"training failed for block {k}{why}: {exc}. Fix its cause, then run the same "
                                      "command again (every block resumes from its last checkpoint)") from exc
        return done
    return _parallel(cfg, data, out, parallel, progress)


def _parallel(cfg: RunConfig, data: DataDir, out: Path, width: int, progress: bool) -> list[ArmResult]:
    """Blocks that never read each other, ``width`` fresh processes at a time."""
    pending, failed = list(range(cfg.model.n_blocks)), []
    running: list[tuple[int, multiprocessing.process.BaseProcess]] = []
    while pending or running:
        while pending and len(running) < width:
            k = pending.pop(0)
            running.append((k, _start(cfg, data, out, k, progress)))
        k, proc = running[0]
        _join([p for _, p in running])  # the oldest; every one stopped with it on an interrupt
        running.pop(0)
        if proc.exitcode != 0:
            failed.append(k)
    if failed:
        raise BlockTrainError(_failed(failed, ""))
    return [ArmResult(arm_name(k), run_summary(RunDir(out), arm_name(k))) for k in range(cfg.model.n_blocks)]


class ArmFailedError(BlockTrainError):
    def __init__(self, k: int, exitcode: int | None) -> None:
        super().__init__(f"training {arm_name(k)} failed (exit {exitcode}); its error is printed above: fix its cause, then "
                         "run the same command again (it resumes from its last checkpoint)")


def _failed(blocks: list[int], later: str) -> str:
    return (f"training failed for blocks {blocks}{later}; each one's error is printed above: fix its cause, then run "
            "the same command again (every block resumes from its last checkpoint)")


def _join(procs: list[multiprocessing.process.BaseProcess]) -> None:
    """Wait for the first of ``procs``. Interrupted (Ctrl-C, or SIGTERM to this process alone, as ``kill PID`` sends
    it), each one still running is told to stop as Ctrl-C would (SIGTERM: it saves its checkpoint) and waited for,
    so no arm goes on training, or dies unsaved, after its run said it stopped."""
    try:
        procs[0].join()
    except KeyboardInterrupt:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join()
        raise


def _interrupt_once(signum: int, frame: object) -> None:
    """Stop the arm as Ctrl-C does, once: later SIGINTs and SIGTERMs are ignored, so the checkpoint being saved is not
    cut short (Ctrl-C reaches the whole process group, and the parent then tells the arm to stop as well)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def _start(cfg: RunConfig, data: DataDir, out: Path, k: int, progress: bool) -> multiprocessing.process.BaseProcess:
    """Arm ``k`` started in a fresh process (spawn, or fork under the test suite), with this process's log level."""
    ctx: Any = multiprocessing.get_context(START_METHOD)
    proc: multiprocessing.process.BaseProcess = ctx.Process(
        target=_child, args=(cfg.to_json(), str(data.root), str(out), k, progress, logging.getLogger().getEffectiveLevel()),
        name=arm_name(k))
    proc.start()
    return proc


def arm_name(k: int) -> str:
    return "e2e" if k == E2E else f"block_{k}"


def _train(cfg: RunConfig, data: DataDir, out: Path, k: int, progress: bool) -> None:
    from blocktrain.train.block import train_block
    from blocktrain.train.e2e import train_e2e

    s = train_e2e(cfg, data, out, progress=progress) if k == E2E else train_block(cfg, data, out, k, progress=progress)
    log.info("%s: %d steps in %.1fs, train memory %.1f MiB", arm_name(k).replace("_", " "), s.steps, s.wall_s,
             s.train_mem_bytes / 2**20)


def _child(cfg_json: str, data_root: str, out: str, k: int, progress: bool, level: int) -> None:
    """The body of a fresh training process: the same logging and errors as the command line's; SIGTERM (a service
    manager's stop, or its parent's) saves the checkpoint as Ctrl-C does, and the first of them is the only one."""
    signal.signal(signal.SIGINT, _interrupt_once)
    signal.signal(signal.SIGTERM, _interrupt_once)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        _train(RunConfig.from_json(cfg_json), open_data_dir(Path(data_root)), Path(out), k, progress)
    except BlockTrainError as exc:
        sys.stderr.write(f"blocktrain: error: {exc}\n")
        sys.exit(2)
    except KeyboardInterrupt:
        sys.stderr.write("blocktrain: interrupted; checkpoints were saved, rerun the same command to resume\n")
        sys.exit(130)


def run_summary(run: RunDir, name: str) -> dict[str, object]:
    """The last summary record ``name``'s trainer wrote in ``run``."""
    from blocktrain.train.metrics import read_jsonl

    recs = [r for r in read_jsonl(run.metrics_path(name)) if r.get("event") == "summary"]
    if not recs:
        raise BlockTrainError(f"{name} wrote no summary to {run.metrics_path(name)}")
    return recs[-1]
