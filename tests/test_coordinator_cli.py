"""The coordinator's flags are derived from CoordinatorSettings: one flag per field, values reach the settings."""

from __future__ import annotations

import argparse
import enum
import json
import os
import signal
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest

from blocktrain.cli.common import handling_signals
from blocktrain.cli.distributed import settings_from_args
from blocktrain.cli.fields import field_comments, flag_name
from blocktrain.cli.main import build_parser
from blocktrain.coordinator.settings import NESTEROV_LR, Aggregation, CoordinatorSettings, OuterOptimizer
from blocktrain.errors import BlockTrainError


def _coordinator_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["coordinator"]  # type: ignore[no-any-return]


def _parse(tmp_path: Path, *flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["coordinator", "--run-dir", str(tmp_path / "run"), *flags])


def _other_value(name: str, default: Any) -> tuple[list[str], Any]:
    """Flags that set field ``name`` to a valid value different from its default, and that value."""
    if isinstance(default, bool):
        return [flag_name(name) if not default else "--no-" + name.replace("_", "-")], not default
    if isinstance(default, enum.Enum):
        other = next(e for e in type(default) if e is not default)
        return [flag_name(name), other.value], other
    if default is None and name == "outer":  # None: the objective's outer step
        return [flag_name(name), "average"], OuterOptimizer.AVERAGE
    if default is None:  # gate_tolerance: off by default
        return [flag_name(name), "0.25"], 0.25
    if isinstance(default, int):
        return [flag_name(name), str(default + 1)], default + 1
    if name == "device":
        return [flag_name(name), "cpu"], "cpu"
    if isinstance(default, str):  # an address
        return [flag_name(name), "127.0.0.1"], "127.0.0.1"
    value = default / 2 if default else 0.25
    return [flag_name(name), repr(value)], value


def test_every_setting_has_a_flag_with_its_unit_comment() -> None:
    parser = _coordinator_parser()
    by_flag = {opt: a for a in parser._actions for opt in a.option_strings}
    comments = field_comments(CoordinatorSettings)
    for f in fields(CoordinatorSettings):
        action = by_flag.get(flag_name(f.name))
        assert action is not None, f"CoordinatorSettings.{f.name} has no {flag_name(f.name)} flag"
        assert comments.get(f.name), f"CoordinatorSettings.{f.name} has no unit comment"
        assert action.help is not None and action.help.startswith(comments[f.name].replace("%", "%%"))
        assert action.default is None  # "not given": the dataclass default applies, never a copy of it


def test_defaults_are_the_dataclass_defaults(tmp_path: Path) -> None:
    assert settings_from_args(_parse(tmp_path)) == CoordinatorSettings()


def test_each_flag_value_reaches_the_settings(tmp_path: Path) -> None:
    for f in fields(CoordinatorSettings):
        flags, value = _other_value(f.name, f.default)
        assert value != f.default
        settings = settings_from_args(_parse(tmp_path, *flags))
        assert getattr(settings, f.name) == value, f.name
        # every other field keeps its default
        for g in fields(CoordinatorSettings):
            if g.name != f.name:
                assert getattr(settings, g.name) == g.default, (f.name, g.name)


def test_all_flags_at_once_and_old_flag_names(tmp_path: Path) -> None:
    """The flag names of the hand-written parser this replaced all still parse to the same settings."""
    args = _parse(
        tmp_path, "--round-seconds", "5", "--adaptive-deadline", "--lease-seconds", "7", "--rounds", "3",
        "--min-updates", "2", "--max-body-bytes", "100", "--norm-k", "0", "--aggregation", "trimmed_mean",
        "--trim-fraction", "0.1", "--outer", "average", "--outer-momentum", "0.5", "--gate-tolerance", "0.1",
        "--eval-every", "0", "--eval-bytes", "10", "--no-fsync",
    )
    assert settings_from_args(args) == CoordinatorSettings(
        round_seconds=5.0, adaptive_deadline=True, lease_seconds=7.0, rounds=3, min_updates=2, max_body_bytes=100,
        norm_k=0.0, aggregation=Aggregation.TRIMMED_MEAN, trim_fraction=0.1, outer=OuterOptimizer.AVERAGE,
        outer_lr=None, outer_momentum=0.5, gate_tolerance=0.1, eval_every=0, eval_bytes=10, fsync=False,
    )
    # by default the objective chooses the outer step (the averaging study's: Nesterov for a stack), NESTEROV_LR for
    # Nesterov and 1 for a plain average, mu 0.5
    default = settings_from_args(_parse(tmp_path))
    assert (default.outer, default.outer_lr, default.outer_momentum) == (None, None, 0.5)
    assert (default.for_objective("nesterov").outer, default.for_objective("nesterov").outer_lr) == (
        OuterOptimizer.NESTEROV, NESTEROV_LR)
    assert default.for_objective("average").outer_lr == 1.0
    assert settings_from_args(_parse(tmp_path, "--outer", "average")).for_objective("nesterov").outer is OuterOptimizer.AVERAGE
    # an explicit --outer-lr wins; the run's own eval flags stay apart
    args = _parse(tmp_path, "--outer", "nesterov", "--outer-lr", "0.3", "--eval-bytes", "12")
    settings = settings_from_args(args)
    assert (settings.outer, settings.outer_lr, settings.eval_bytes) == (OuterOptimizer.NESTEROV, 0.3, 12)


def test_bad_values_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        _parse(tmp_path, "--aggregation", "mode")
    with pytest.raises(SystemExit):
        _parse(tmp_path, "--rounds", "1.5")


def test_the_worker_keeps_its_frozen_cache_in_its_own_directory(tmp_path: Path) -> None:
    """No default writes outside the working directory: the frozen cache is WORK_DIR/frozen unless named."""
    from blocktrain.cli.distributed import WORKER_FLAGS
    from blocktrain.worker.options import WorkerOptions

    def opts(*flags: str) -> WorkerOptions:
        args = build_parser().parse_args(["worker", "--coordinator", "http://127.0.0.1:1", *flags])
        return WORKER_FLAGS.build(args, token="t", progress=False, verify_tls=True)

    assert opts().frozen_dir == Path("runs/worker/frozen")
    assert opts("--work-dir", str(tmp_path / "w")).frozen_dir == tmp_path / "w" / "frozen"
    assert opts("--work-dir", str(tmp_path / "w"), "--frozen-cache", str(tmp_path / "c")).frozen_dir == tmp_path / "c"


def test_signal_handlers_are_the_commands_own_and_a_forked_child_dies_on_sigterm() -> None:
    """The worker's SIGTERM handler finishes its round; a process it forks (hivemind's DHT peer) inherits the handler,
    and must still die when its owner terminates it, or the worker's exit waits on it forever. After the command its
    caller's handler is back."""
    before = signal.getsignal(signal.SIGTERM)
    seen: list[int] = []
    with handling_signals({signal.SIGTERM: lambda signum, frame: seen.append(signum)}):
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: sleeps, unless SIGTERM ends it (os._exit: never back into pytest)
            os.write(ready_w, b"1")  # a signal that came before Python's after-fork reset would be forgotten
            time.sleep(20)
            os._exit(0)
        os.read(ready_r, 1)
        os.close(ready_r)
        os.close(ready_w)
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)  # bounded: the child's sleep
        os.kill(os.getpid(), signal.SIGTERM)  # here the command's own handler runs
        time.sleep(0.1)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
    assert seen == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is before


def test_no_eval_with_data_keeps_the_gate_and_the_audits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--no-eval stops the assembled model's evaluations only. With --data given it also dropped the data from the
    coordinator, and with it the loss gate and the audits, though the help said "no evaluation" and the dataset
    was still published. Without --data the two are off, and the log says why."""
    from blocktrain.cli.distributed import coordinator_inputs
    from blocktrain.coordinator.service import Coordinator
    from tests.distributed_utils import write_corpus

    monkeypatch.delenv("BLOCKTRAIN_DATA", raising=False)
    data = write_corpus(tmp_path / "data")
    cfg, settings, got = coordinator_inputs(_parse(tmp_path, "--preset", "tiny", "--no-eval", "--data", str(data.root)))
    assert got is not None and settings.eval_every == 0 and cfg.dataset
    c = Coordinator(tmp_path / "run", cfg, settings, got)
    try:
        assert c.auditor.enabled and c.evaluator.valid is not None and c.settings.gate
    finally:
        c.close()
    cfg, settings, got = coordinator_inputs(_parse(tmp_path, "--preset", "tiny", "--no-eval"))
    assert got is None and settings.eval_every == 0


@pytest.mark.parametrize("flag", ["--log-every", "--checkpoint-every", "--test-bytes", "--profile-steps"])
def test_the_coordinator_takes_no_flag_of_local_training_it_would_ignore(tmp_path: Path, flag: str,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Workers train; the coordinator parsed these flags of a local run and ignored them."""
    with pytest.raises(SystemExit):
        _parse(tmp_path, flag, "5")
    assert "unrecognized arguments" in capsys.readouterr().err


def test_settings_record_as_json_with_enums_as_their_values() -> None:
    """What a result records of the coordinator settings it ran with: every field, JSON as it stands."""
    s = CoordinatorSettings(gate=False, aggregation=Aggregation.MEAN)
    d = json.loads(json.dumps(s.to_dict()))
    assert set(d) == {f.name for f in fields(CoordinatorSettings)}
    assert d["aggregation"] == "mean" and d["gate"] is False and d["step_compression"] == s.step_compression.value


def test_a_restart_goes_on_with_the_settings_the_run_ran_with(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Rerunning the coordinator's command continues its run, as its stop message says; the settings were rebuilt from
    the flags and this version's defaults, so an upgrade that moved a default (NESTEROV_LR: 0.5 -> 0.7) changed a
    run's outer step halfway. A restart now keeps its training's arithmetic (RUN_FIELDS), logs each value kept that
    the defaults would change, and a flag given changes its value; the rest (--no-eval, the defences, the device) is
    this start's, and --reset-settings takes the flags and defaults alone."""
    from blocktrain.coordinator.service import Coordinator
    from blocktrain.coordinator.settings import SETTINGS_META
    from blocktrain.coordinator.store import Store
    from blocktrain.presets import tiny

    def restart(*flags: str) -> tuple[CoordinatorSettings, list[str]]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="blocktrain"):
            settings = settings_from_args(_parse(tmp_path, *flags))
        return settings, [r.getMessage() for r in caplog.records]

    assert settings_from_args(_parse(tmp_path)) == CoordinatorSettings()  # a new run: the defaults
    first = CoordinatorSettings(outer_lr=0.5, rounds=3, aggregation=Aggregation.MEAN, gate=False, eval_every=0,
                                outer_cap=2.0)
    coordinator = Coordinator(tmp_path / "run", replace(tiny(), objective="stack"), first)
    ran = coordinator.settings  # the stack's outer step, Nesterov, at the run's lr
    coordinator.close()
    again, notes = restart()  # the defaults' outer lr is NESTEROV_LR, not the run's
    assert (again.outer, again.outer_lr, again.rounds, again.aggregation, again.outer_cap) == (
        OuterOptimizer.NESTEROV, 0.5, 3, Aggregation.MEAN, 2.0) and NESTEROV_LR != 0.5
    assert (again.gate, again.eval_every) == (True, 1)  # this start's: --no-gate and --no-eval were not sticky
    assert sorted(notes) == ["setting aggregation: mean kept (this version's default: median)",
                             "setting outer_cap: 2.0 kept (this version's default: None)",
                             f"setting outer_lr: 0.5 kept (this version's default: {NESTEROV_LR})",
                             "setting rounds: 3 kept (this version's default: 0)"], notes
    changed, notes = restart("--outer-lr", "0.6", "--rounds", "3")
    assert (changed.outer_lr, changed.rounds, changed.aggregation) == (0.6, 3, Aggregation.MEAN)
    assert "setting outer_lr: 0.5 -> 0.6, as given" in notes and not any("rounds" in n for n in notes)
    other, _ = restart("--outer", "average")  # a new outer step takes its own lr
    assert other.outer is OuterOptimizer.AVERAGE and other.for_objective("nesterov").outer_lr == 1.0
    reset, notes = restart("--reset-settings")
    assert reset == CoordinatorSettings() and notes == []
    store = Store(tmp_path / "run")  # what this version cannot read is dropped, logged; a flag given is not even read
    try:
        store.meta.set_meta(SETTINGS_META, json.dumps({**ran.to_dict(), "retired_knob": 2, "aggregation": "krum",
                                                       "moment_every": "three"}))
    finally:
        store.close()
    odd, notes = restart("--moment-every", "3")
    assert odd.aggregation is Aggregation.MEDIAN and odd.moment_every == 3 and odd.outer_lr == 0.5
    assert "setting retired_knob: 2 is not a setting of this version, dropped" in notes
    assert any(n.startswith("setting aggregation: the stored 'krum' cannot be read") for n in notes), notes
    assert "setting moment_every: 'three' -> 3, as given" in notes  # given: the stored value is not converted


def test_what_decides_a_stored_push_is_checked_only_once_pushes_exist_and_kept_after_a_failed_start(
        tmp_path: Path) -> None:
    """A start that failed wrote its settings before it failed, so a typo stuck (the push settings refused to change
    even with no push stored); they are written once a start has held, and compared only with pushes stored."""
    from blocktrain.coordinator.service import Coordinator
    from blocktrain.coordinator.settings import SETTINGS_META
    from blocktrain.coordinator.store import Store
    from blocktrain.presets import tiny

    cfg = replace(tiny(), objective="stack")
    base: dict[str, Any] = {"gate": False, "eval_every": 0, "fsync": False, "rounds": 2}
    Coordinator(tmp_path / "run", cfg, CoordinatorSettings(moment_every=5, **base)).close()
    with pytest.raises(BlockTrainError):  # fails after the store is open: device cuda on a CUDA-less machine
        Coordinator(tmp_path / "run", cfg, CoordinatorSettings(moment_every=7, device="cuda:7", **base))
    store = Store(tmp_path / "run")  # the last start that held is what a restart goes on with
    try:
        assert json.loads(store.meta.get_meta(SETTINGS_META) or "{}")["moment_every"] == 5
    finally:
        store.close()
    c = Coordinator(tmp_path / "run", cfg, CoordinatorSettings(moment_every=3, **base))  # no push stored: allowed
    try:
        assert json.loads(c.store.meta.get_meta(SETTINGS_META) or "{}")["moment_every"] == 3
    finally:
        c.close()
