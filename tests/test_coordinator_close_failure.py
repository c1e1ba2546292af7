"""A round close that fails is its own block's failure, and a restart cannot change what a stored push is.

Found by a review (helper-62): ``Uploads.accept`` closes rounds after the push is committed, inside the push's
``except ProtocolError``, so a close failing on any block answered the pusher 422 and counted a refusal against it;
``leave`` was refused after it was committed; and one block's failing close stopped every tick before the other
blocks' deadlines. The trigger it used, a restart with another ``--moment-every`` under a round holding pushes made
under the old one, is refused at start-up now."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from blocktrain.coordinator.service import Coordinator
from blocktrain.coordinator.settings import CloseReason
from blocktrain.errors import ConfigError, ProtocolError
from blocktrain.protocol.delta import Compression, pack_delta
from blocktrain.protocol.moments import InnerStart
from tests.distributed_utils import NO_SCREEN, FakeClock, make_coordinator

QUIET: dict[str, Any] = {**NO_SCREEN, "fsync": False, "gate": False, "norm_k": 0.0, "lazy_fraction": 0.0,
                         "audit_fraction": 0.0, "probation_pushes": 0, "min_updates": 1}


def _push(c: Coordinator, name: str, k: int, seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    delta = {n: 1e-3 * torch.randn(s, generator=g) for n, s in c.block_shapes[k].items()}
    return pack_delta(delta, Compression.BF16, block=k, base_version=c.version[k], base_sha=c.weights_sha[k], samples=4)


def test_a_failing_close_is_neither_the_pushers_nor_the_other_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    c = make_coordinator(tmp_path / "run", None, clock, **QUIET)
    try:
        for name, k in (("a", 0), ("b", 1)):
            c.add_token(name)
            c.register(name, k)
        real = c.rounds.close_round

        def close_round(k: int, reason: CloseReason, now: float) -> None:
            if k == 1:
                raise ProtocolError(422, "moments", "a stored push no longer parses")
            real(k, reason, now)

        monkeypatch.setattr(c.rounds, "close_round", close_round)
        with caplog.at_level("ERROR"):
            answer = c.submit("b", 1, _push(c, "b", 1, seed=1))  # its quorum close fails: the push still counts
            assert answer.accepted and not answer.round_closed
            c.tick()
        assert c.store.q("SELECT worker FROM rejections") == [] and "b" not in c.store.rounds.refused(1, 0)
        assert [r.getMessage()[:40] for r in caplog.records] == ["block 1: closing round v0 failed, it sta"]
        assert c.submit("a", 0, _push(c, "a", 0, seed=0)).round_closed  # block 0 is untouched by block 1's failure
        c.leave("b")  # answered, not refused after it was committed
        monkeypatch.setattr(c.rounds, "close_round", real)
        clock.advance(c.settings.round_seconds + 1)
        c.tick()  # block 1's cause gone, its deadline closes it
        assert (c.version[0], c.version[1]) == (1, 1)
    finally:
        c.close()


def test_a_restart_that_changes_what_a_stored_push_is_is_refused(tmp_path: Path) -> None:
    shared = {**QUIET, "inner_start": InnerStart.SHARED_MV, "min_updates": 2}
    c = make_coordinator(tmp_path / "run", None, FakeClock(), moment_every=3, **shared)
    try:
        for name in ("a", "b"):
            c.add_token(name)
            c.register(name, 0)
        assert c.submit("a", 0, _push(c, "a", 0, seed=0)).accepted  # v0 shares no moments at every 3; b awaited
    finally:
        c.close()
    with pytest.raises(ConfigError, match=r"--moment-every 3 \(now 1\).*restart it with the run's own value"):
        make_coordinator(tmp_path / "run", None, FakeClock(), moment_every=1, **shared)
    make_coordinator(tmp_path / "run", None, FakeClock(), moment_every=3, **shared).close()  # its own: fine


def test_a_close_that_fails_after_its_commit_is_reported_closed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """What follows a stored close (a warm start, screened workers' refusals) failing is not a round that stayed
    open: the version has moved on, and the push that closed it is told so."""
    c = make_coordinator(tmp_path / "run", None, FakeClock(), **QUIET)
    try:
        c.add_token("a")
        c.register("a", 0)

        def broken(*args: object) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(c.rounds, "_advance", broken)
        with caplog.at_level("ERROR"):
            assert c.submit("a", 0, _push(c, "a", 0, seed=0)).round_closed
        assert c.version[0] == 1
        assert [r.getMessage()[:60] for r in caplog.records] == [
            "block 0: round v0 closed, but what follows its close failed: "[:60]]
    finally:
        c.close()


def test_the_auditors_replay_times_are_bounded() -> None:
    """Every replay's wall time was kept for the whole run and sorted on every status, under the lock."""
    from blocktrain.coordinator.audit import REPLAY_TIMES, Auditor
    from blocktrain.coordinator.settings import CoordinatorSettings
    from blocktrain.presets import tiny
    from blocktrain.protocol.messages import AuditAnswer

    auditor = Auditor(tiny(), CoordinatorSettings(device="cpu"), None, key=bytes(32))
    for i in range(REPLAY_TIMES + 500):
        auditor.record(AuditAnswer(passed=True, relative_error=0.0, tolerance=0.05, seconds=float(i)))
    assert len(auditor.replay_seconds) == REPLAY_TIMES and auditor.passed == REPLAY_TIMES + 500
    assert auditor.summary()["median_replay_s"] == 500 + REPLAY_TIMES // 2  # the latest replays'


def test_a_failed_warm_start_is_tried_again_and_the_block_waits_for_it(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A stack block opens when the one before it finishes, then is warm-started from it. A warm start that failed (a
    full disk) raised out of the close, left the block at its first weights for good, and a restart warm-started it
    under the pushes made from those weights since. It is now tried again each tick, and until it is done the block
    hands out no round and takes no push: one made from its first weights would have made the warm start moot."""
    from dataclasses import replace

    from blocktrain.config import StackInit
    from blocktrain.coordinator.settings import CoordinatorSettings
    from blocktrain.protocol.codes import BlockState, Reason, RoundState
    from tests.distributed_utils import HANDMADE
    from tests.test_coordinator_stack import STACK, delta_for, finish_block

    cfg = replace(STACK, stack=replace(STACK.stack, init=StackInit.COPY))
    settings = CoordinatorSettings(fsync=False, rounds=2, **HANDMADE)

    def coordinator(run: Path, failures: int) -> Coordinator:
        c = Coordinator(run, cfg, settings, None, clock=FakeClock())
        real = c.checkpoints.warm_start

        def warm_start(k: int) -> None:
            if len(calls := failed.setdefault(str(run), [])) < failures:
                calls.append(k)
                raise OSError(28, "No space left on device")
            real(k)

        monkeypatch.setattr(c.checkpoints, "warm_start", warm_start)
        return c

    failed: dict[str, list[int]] = {}
    c = coordinator(tmp_path / "a", failures=1)
    try:
        finish_block(c, 0, "seed")  # its last close opens block 1; the warm start fails
        cold = c.weights_sha[1]
        assert c.state[1] is BlockState.OPEN and failed[str(tmp_path / "a")] == [1]
        c.tick()
        assert c.weights_sha[1] != cold  # warm-started at the next tick
    finally:
        c.close()
    c = coordinator(tmp_path / "b", failures=10**6)
    try:
        finish_block(c, 0, "seed")
        cold = c.weights_sha[1]
        c.add_token("w")
        c.register("w", 1)
        work = c.work("w")
        assert work.round_state is RoundState.WAITING and "its warm start from block 0 failed" in work.message
        assert c.status().blocks[1].round_state is RoundState.WAITING
        with pytest.raises(ProtocolError) as refused:  # one pushed anyway, from the first weights
            c.submit("w", 1, pack_delta(delta_for(c, 1), Compression.BF16, block=1, base_version=0, base_sha=cold,
                                        samples=4))
        assert refused.value.status == 409 and refused.value.reason == Reason.WAITING
        assert c.store.updates.accepted_updates(1, 0) == [] and not c.conduct.quarantined("w")
    finally:
        c.close()
    again = Coordinator(tmp_path / "b", cfg, settings, None, clock=FakeClock())  # the disk has room again
    try:
        assert again.version[1] == 0 and again.weights_sha[1] != cold  # warm-started at the restart
        assert again.work("w").round_state is RoundState.OPEN
    finally:
        again.close()
