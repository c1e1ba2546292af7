"""The outer step, error feedback, the published int8 step and the hostile-update defences (issue 19)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from benchmarks.distributed.attacks import (
    TRIGGER,
    Colluding,
    DataPoisoner,
    ForgedMoments,
    InflatedClaim,
    Replay,
    ScaledRandom,
    ShuffledLabels,
    SignFlip,
    Stale,
    Strong,
    TowardZero,
)
from benchmarks.distributed.averaging_trace import trace_arm

from blocktrain.config import Objective, Precision, RunConfig
from blocktrain.coordinator.aggregate import OuterState, aggregate, next_version
from blocktrain.coordinator.hostile import Hostile, HostileContext
from blocktrain.coordinator.settings import Aggregation, CoordinatorSettings, OuterOptimizer
from blocktrain.coordinator.simulate import BlockRun, LocalRounds, run_local_rounds
from blocktrain.coordinator.staggered import PoolSchedule, _split, run_pool
from blocktrain.data.dataset import DataDir
from blocktrain.errors import ConfigError, ProtocolError
from blocktrain.objectives import get_objective
from blocktrain.presets import get_preset, stack_recipe
from blocktrain.protocol.delta import (
    Compression,
    ErrorFeedback,
    decode_delta,
    delta_norm,
    pack_delta,
    residual_excess,
    residual_within,
)
from blocktrain.protocol.moments import InnerStart
from blocktrain.train.step import MuonAdamW
from tests.distributed_utils import NO_SCREEN, corpus, full, make_coordinator  # noqa: F401


def _t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_nesterov_step_equals_a_hand_computed_reference() -> None:
    """Three rounds of DiLoCo's outer Nesterov (g = -Delta_bar; m <- mu m + g; W <- W - eta (g + mu m)), by hand."""
    s = CoordinatorSettings(outer=OuterOptimizer.NESTEROV, outer_lr=0.5, outer_momentum=0.9,
                            step_compression=Compression.NONE, aggregation=Aggregation.MEAN)
    W = {"w": _t(1.0, -2.0)}
    rounds = [([_t(0.2, 0.0), _t(0.4, -0.2)], [1, 3]), ([_t(-0.1, 0.1)], [2]), ([_t(0.0, 0.3), _t(0.0, 0.1)], [1, 1])]
    # round 1: Delta_bar = (0.25*0.2 + 0.75*0.4, 0.75*-0.2) = (0.35, -0.15); g = (-0.35, 0.15); m = g
    #          step = -0.5 (g + 0.9 g) = 0.95 * (0.35, -0.15) = (0.3325, -0.1425)
    # round 2: g = (0.1, -0.1); m = 0.9 (-0.35, 0.15) + g = (-0.215, 0.035)
    #          step = -0.5 (g + 0.9 m) = -0.5 (0.1 - 0.1935, -0.1 + 0.0315) = (0.04675, 0.03425)
    # round 3: g = (0.0, -0.2); m = 0.9 (-0.215, 0.035) + g = (-0.1935, -0.1685)
    #          step = -0.5 (g + 0.9 m) = -0.5 (-0.17415, -0.35165) = (0.087075, 0.175825)
    want = [_t(1.3325, -2.1425), _t(1.37925, -2.10825), _t(1.466325, -1.932425)]
    state = OuterState()
    for (deltas, samples), expected in zip(rounds, want, strict=True):
        res = next_version(W, [{"w": d} for d in deltas], samples, s, state)
        W, state = res.weights, res.state
        torch.testing.assert_close(W["w"], expected, rtol=0, atol=1e-6)
    assert state.momentum is not None
    torch.testing.assert_close(state.momentum["w"], _t(-0.1935, -0.1685), rtol=0, atol=1e-6)


def test_plain_average_is_the_sample_weighted_mean() -> None:
    s = CoordinatorSettings(outer=OuterOptimizer.AVERAGE, step_compression=Compression.NONE, aggregation=Aggregation.MEAN)
    res = next_version({"w": _t(0.0, 0.0)}, [{"w": _t(1.0, 0.0)}, {"w": _t(0.0, 1.0)}], [1, 3], s, OuterState())
    assert torch.equal(res.weights["w"], _t(0.25, 0.75)) and res.state.momentum is None


def test_the_median_weighs_each_delta_by_its_samples() -> None:
    """With equal claims the median is the plain one (the middle value; the mean of the two middle ones), bit for
    bit; a zero delta claiming 1 sample beside an honest one claiming 100 no longer casts a full vote (it pulled the
    median halfway to zero), and one claiming as many as the other counts as much."""
    g = torch.Generator().manual_seed(0)
    for m in range(1, 8):
        deltas = [{"w": torch.randn(6, 5, generator=g)} for _ in range(m)]
        stacked = torch.stack([d["w"] for d in deltas])
        plain = stacked.median(dim=0).values if m % 2 else stacked.sort(dim=0).values[m // 2 - 1 : m // 2 + 1].mean(0)
        assert torch.equal(aggregate(deltas, [100] * m, Aggregation.MEDIAN)["w"], plain)
    honest = [{"w": torch.full((4,), 1.0)}, {"w": torch.full((4,), 1.2)}]
    lazy = {"w": torch.zeros(4)}
    assert torch.equal(aggregate([*honest, lazy], [100, 100, 1], Aggregation.MEDIAN)["w"], torch.full((4,), 1.0))
    assert torch.equal(aggregate([*honest, lazy], [100, 100, 100], Aggregation.MEDIAN)["w"], torch.full((4,), 1.0))
    assert torch.equal(aggregate([honest[0], lazy], [100, 1], Aggregation.MEDIAN)["w"], torch.full((4,), 1.0))
    assert torch.equal(aggregate([honest[0], lazy], [100, 100], Aggregation.MEDIAN)["w"], torch.full((4,), 0.5))


def test_error_feedback_carries_the_residual_exactly() -> None:
    g = torch.Generator().manual_seed(0)
    ef = ErrorFeedback(Compression.INT8)
    sent_total = torch.zeros(64, dtype=torch.float64)
    true_total = torch.zeros(64, dtype=torch.float64)
    for step in range(20):
        delta = {"w": torch.randn(64, generator=g) * (1 + step)}
        corrected = delta["w"] + ef.residual.get("w", torch.zeros(64))
        wire = ef.encode(delta)
        sent = decode_delta(wire, Compression.INT8)["w"]
        assert torch.equal(ef.residual["w"], corrected - sent)  # e_t = (Delta_t + e_{t-1}) - decode(q_t), bit for bit
        sent_total += sent.double()
        true_total += delta["w"].double()
    # nothing is lost, only delayed: what was sent plus what is held back is what was meant
    torch.testing.assert_close(sent_total + ef.residual["w"].double(), true_total, rtol=0, atol=1e-4)
    # without feedback the int8 error accumulates; with it the total error is one quantisation step
    assert float((sent_total - true_total).abs().max()) <= float(ef.residual["w"].abs().max()) + 1e-4


@pytest.mark.parametrize("compression", list(Compression))
def test_the_residual_bound_holds_every_honest_residual_and_no_forged_one(compression: Compression) -> None:
    """``residual_excess``: what :class:`ErrorFeedback` holds after each of 60 pushes, whose scales vary over four
    orders of magnitude (so a residual may be far larger than the next push's step), is within the bound that the
    push before it sets; twice that residual, or any non-zero residual without an earlier push, is not."""
    g = torch.Generator().manual_seed(0)
    ef = ErrorFeedback(compression)
    previous: dict[str, torch.Tensor] | None = None
    for _ in range(60):
        scale = 10.0 ** float(-2 - 4 * torch.rand((), generator=g))
        delta = {"w": scale * torch.randn(96, 33, generator=g), "b": 1e-2 * scale * torch.randn(7, generator=g)}
        assert residual_excess(dict(ef.residual), previous, compression) is None
        previous = decode_delta(ef.encode(delta), compression)
    assert residual_excess(dict(ef.residual), previous, compression) is None
    forged = {n: 2 * e + 1e-9 for n, e in ef.residual.items()}
    assert residual_excess(forged, previous, compression) == "w"
    assert residual_excess({"w": torch.full((96, 33), 1e-9)}, None, None) == "w"
    assert residual_excess({"w": torch.zeros(96, 33)}, None, None) is None
    # the push before the last one bounds too (a lost answer leaves the sender one push behind the receiver)
    before = dict(ef.residual)
    assert previous is not None
    last = decode_delta(ef.encode({"w": 1e-6 * torch.randn(96, 33, generator=g), "b": torch.zeros(7)}), compression)
    assert residual_within(before, [(last, compression), (previous, compression)]) is None
    assert residual_within(forged, [(last, compression), (previous, compression)]) == "w"
    assert residual_within({"w": torch.zeros(3)}, []) is None
    tiny = ErrorFeedback(compression)  # subnormal values, where bfloat16's steps no longer shrink with |x|
    sent = decode_delta(tiny.encode({"w": torch.tensor([1e-39, 3e-40, 1.0, 0.0])}), compression)
    assert residual_excess(dict(tiny.residual), sent, compression) is None
    for v in (1e-44, 1e-39, 3e-38, 1e-30):  # every value tiny: int8's scale floored at the least normal float32
        small = ErrorFeedback(compression)
        sent = decode_delta(small.encode({"w": torch.tensor([v, v / 2, -v])}), compression)
        assert residual_excess(dict(small.residual), sent, compression) is None, v


def test_pack_delta_with_feedback_refuses_another_encoding() -> None:
    with pytest.raises(ValueError, match="int8"):
        pack_delta({"w": _t(1.0)}, Compression.BF16, block=0, base_version=0, base_sha="0" * 64, samples=1,
                   feedback=ErrorFeedback(Compression.INT8))


def test_int8_published_step_reproduces_the_weights_and_keeps_its_residual() -> None:
    s = CoordinatorSettings(outer=OuterOptimizer.NESTEROV, outer_lr=0.7, outer_momentum=0.9)
    assert s.step_compression is Compression.INT8  # the default transport
    g = torch.Generator().manual_seed(1)
    W = {"a": torch.randn(8, 8, generator=g), "b": torch.randn(5, generator=g)}
    delta = {n: 1e-2 * torch.randn(w.shape, generator=g) for n, w in W.items()}
    res = next_version(W, [delta], [4], s, OuterState())
    assert {n: t.dtype for n, t in res.step.items()} == {"a": torch.int8, "a@scale": torch.float32,
                                                           "b": torch.int8, "b@scale": torch.float32}
    decoded = decode_delta(res.step, Compression.INT8)
    for n, w in W.items():
        assert torch.equal(res.weights[n], w + decoded[n])  # the workers apply the same decoded step
        exact = 0.7 * 1.9 * delta[n]  # the first Nesterov step, unquantised
        torch.testing.assert_close(res.state.residual[n], exact - decoded[n], rtol=0, atol=1e-7)


def test_outer_state_round_trips_and_reads_the_momentum_only_format() -> None:
    st = OuterState(momentum={"w": _t(1.0, 2.0)}, residual={"w": _t(0.5, 0.0)})
    back = OuterState.from_tensors(st.tensors())
    assert back.momentum is not None and torch.equal(back.momentum["w"], _t(1.0, 2.0))
    assert torch.equal(back.residual["w"], _t(0.5, 0.0))
    legacy = OuterState.from_tensors({"w": _t(3.0)})  # a momentum blob written before residuals existed
    assert legacy.momentum is not None and torch.equal(legacy.momentum["w"], _t(3.0)) and legacy.residual == {}
    assert OuterState().tensors() == {}


def test_the_objective_chooses_the_default_outer_step(tmp_path: Path) -> None:
    """Nesterov for a stack, the plain average for diffusion blocks (averaging-study.md); a chosen one wins."""
    from dataclasses import replace

    from blocktrain.config import Objective, Schedule
    from blocktrain.coordinator.service import Coordinator

    tiny = get_preset("tiny").with_train(schedule=Schedule.PROGRESSIVE)
    for objective, want in ((Objective.STACK, OuterOptimizer.NESTEROV), (Objective.DIFFUSION, OuterOptimizer.AVERAGE)):
        cfg = replace(tiny, objective=objective)
        c = Coordinator(tmp_path / objective.value, cfg, CoordinatorSettings(rounds=2), None)
        assert c.settings.outer is want
        c.close()
    chosen = CoordinatorSettings(outer=OuterOptimizer.AVERAGE).for_objective("nesterov")
    assert chosen.outer is OuterOptimizer.AVERAGE


def test_attack_kinds() -> None:
    g = torch.Generator().manual_seed(0)
    d = {"w": _t(3.0, 4.0)}
    ctx = HostileContext({"w": _t(1.0, 1.0)}, [{"w": _t(0.5, 0.5)}], g)
    assert torch.equal(SignFlip().delta(d, ctx)["w"], _t(-3.0, -4.0))
    assert abs(delta_norm(ScaledRandom().delta(d, ctx)) - 50.0) < 1e-3  # 10x its honest norm
    assert ShuffledLabels().delta(d, ctx) is d  # poisons the data, not the delta
    assert InflatedClaim().claim(96) == 1 << 30 and Strong().steps(6) == 60
    assert torch.allclose(TowardZero().delta(d, ctx)["w"], -5.0 / 2**0.5 * _t(1.0, 1.0))
    stale = Stale()  # one round behind: nothing the first time, then what it trained the round before
    assert stale.delta(d, ctx) is None and torch.equal(stale.delta({"w": _t(1.0, 0.0)}, ctx)["w"], d["w"])  # type: ignore[index]
    first = HostileContext({"w": _t(1.0, 1.0)}, [], g)  # no round has closed: nothing to replay or reverse
    assert Replay().delta(d, first) is None and Colluding().delta(d, first) is None
    assert torch.equal(Replay().delta(d, ctx)["w"], _t(0.5, 0.5))  # type: ignore[index]
    poisoned = DataPoisoner().train_data(np.zeros(640, dtype=np.uint8))
    assert len(poisoned) == 640 + 10 * len(TRIGGER) and bytes(poisoned[64 : 64 + len(TRIGGER)]) == TRIGGER


@pytest.mark.parametrize("kind", [SignFlip, ScaledRandom, ShuffledLabels])
def test_a_poisoned_update_of_each_kind_is_refused_with_a_reason(kind: type[Hostile], corpus: DataDir) -> None:  # noqa: F811
    """Three replicas of tiny's block 0, the last one hostile: its updates are refused or bounded, no honest one is.

    In round 0, during warm-up, a sign-flipped update can still lower the held-out loss of the fresh
    initialisation, and shuffled labels teach the byte frequencies that a model this young has not
    learnt yet: such updates pass the gate with an honest norm, so the norm bound limits what they do.
    """
    s = CoordinatorSettings(outer=OuterOptimizer.NESTEROV, outer_lr=0.7, gate_tolerance=0.0, norm_min_history=2)
    run = run_local_rounds(get_preset("tiny"), s, LocalRounds(workers=3, local_steps=5, steps=20), corpus,
                           hostile=kind())
    honest = [u for u in run.updates if u.replica != 2]
    bad = [u for u in run.updates if u.replica == 2]
    assert len(bad) + sum(1 for _ in run.quarantined) >= 1 and len(honest) == 8
    assert all(u.outcome == "accepted" for u in honest), [u.outcome for u in honest]
    want = {"gate"} if kind is not ScaledRandom else {"gate", "norm"}
    if kind is not ShuffledLabels:
        assert {u.outcome for u in bad if u.round > 0} <= want, [u.outcome for u in bad]
    limit = s.norm_k * max(u.norm for u in honest)
    assert all(u.outcome in want or u.norm <= limit for u in bad), [(u.outcome, u.norm) for u in bad]


def test_a_hostile_worker_whose_every_update_is_refused_leaves_the_run_as_it_was(corpus: DataDir) -> None:  # noqa: F811
    """Streams are keyed by the replica's id, so three honest replicas train the same with or without a fourth:
    an inflated claim (refused at the intake, quarantined after three) and a strong worker caught by its first audit
    under probation leave the published weights equal, tensor for tensor, to the run without them."""
    cfg = get_preset("tiny")
    s = CoordinatorSettings(outer=OuterOptimizer.NESTEROV, outer_lr=0.7, audit_fraction=0.05, probation_pushes=3)
    opts = dict(local_steps=2, steps=10)
    clean = run_local_rounds(cfg, s, LocalRounds(workers=3, **opts), corpus, audit=True)  # type: ignore[arg-type]
    # the strong worker's norm ratio is about 3 at H = 2: the norm bound refuses some of its pushes, the audit the rest
    # a replay and a stale worker push nothing in round 0 (nothing to forge from), so their first push is an attack
    for attack, caught in ((InflatedClaim(), {"claim"}), (Strong(), {"audit", "norm"}), (Replay(), {"replay"}),
                           (Stale(), {"audit", "gate", "norm"})):
        run = run_local_rounds(cfg, s, LocalRounds(workers=4, **opts), corpus, hostile=attack, audit=True)  # type: ignore[arg-type]
        bad = [u for u in run.updates if u.replica == 3]
        assert bad and {u.outcome for u in bad} <= caught and 3 in run.quarantined, bad
        assert all(u.outcome == "accepted" for u in run.updates if u.replica != 3)
        assert all(torch.equal(run.weights[n], w) for n, w in clean.weights.items()), attack


def test_an_in_process_moment_forger_fails_its_audit_as_over_http(corpus: DataDir) -> None:  # noqa: F811
    """The in-process rounds keep the records a coordinator's store keeps (coordinator.local_records) and judge an
    audit with the coordinator's own Auditor.judge: a replica that negates m at each round's start passes its first
    audit (from m = 0, as every replica's) and fails its second, on its moments alone, as the worker over HTTP does
    (tests/test_audit.py); the honest replicas' derived moments match theirs and every push of theirs counts."""
    s = CoordinatorSettings(outer=OuterOptimizer.NESTEROV, outer_lr=0.7, audit_fraction=1.0, probation_pushes=3,
                            inner_start=InnerStart.SHARED_MV, moment_every=3)
    run = run_local_rounds(get_preset("tiny"), s, LocalRounds(workers=3, local_steps=2, steps=8), corpus,
                           hostile=ForgedMoments(), audit=True)
    first, second = [u for u in run.updates if u.replica == 2]
    assert (first.outcome, second.outcome) == ("accepted", "audit") and run.quarantined == {2: 1}
    assert second.derived_steps == 2 and second.moment_error is not None and second.moment_error > 1.5  # m negated
    assert second.replay_error is not None and second.replay_error < 1e-3  # its replay itself reproduced its push
    honest = [u for u in run.updates if u.replica != 2]
    assert all(u.audited and u.outcome == "accepted" for u in honest)
    derived = [u for u in honest if u.derived_steps]
    assert len(derived) >= 4 and all(u.moment_error is not None and u.moment_error < 1e-3 for u in derived)


def test_after_a_round_whose_every_push_was_refused_the_in_process_audits_still_derive_honest_moments(
        corpus: DataDir) -> None:  # noqa: F811
    """A round whose every push is refused publishes nothing: the replicas undo it, and at the next sharing version
    (moments every round here) none was published, so their own moments go on, as a worker's do and as the records
    say; every later honest push passes its audit, its moments derived across the refused round."""
    from blocktrain.coordinator.simulate import BlockRun

    s = CoordinatorSettings(outer=OuterOptimizer.NESTEROV, outer_lr=0.7, audit_fraction=1.0, probation_pushes=3,
                            inner_start=InnerStart.SHARED_MV, moment_every=1)
    block = BlockRun(get_preset("tiny"), s, LocalRounds(workers=2, local_steps=2, steps=8), corpus, audit=True)
    check = block.intake.check

    def refused(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise ProtocolError(422, "refused by the test", "test")

    for v, (offset, h) in enumerate(zip(block.offsets, block.opts.round_steps, strict=True)):
        block.intake.check = refused if v == 1 else check  # type: ignore[method-assign]
        block.round(h, offset)
    run = block.finish()
    assert run.skipped_rounds == 1 and not run.quarantined
    later = [u for u in run.updates if u.round >= 2]
    assert len(later) == 4 and all(u.audited and u.outcome == "accepted" for u in later), later
    assert all(u.derived_steps == 2 and u.moment_error is not None and u.moment_error < 1e-3
               for u in later if u.round == 2)


@pytest.mark.parametrize("lr_later", [1.0, 0.5])
def test_audits_replay_a_later_block_on_its_frozen_inputs_and_at_its_own_lr(corpus: DataDir, lr_later: float) -> None:  # noqa: F811
    """Every honest push of block 1 replays in the in-process rounds: the coordinator's audit rebuilds the frozen block
    0 from the whole block's published weights (not from the headless frozen copy, which has no trainable weights), and
    replays at block 1's own peak lr (stack.lr_later x train.lr; a replay at train.lr misses by about half a push)."""
    cfg = replace(get_preset("tiny"), objective=Objective.STACK)
    cfg = replace(cfg, stack=replace(cfg.stack, lr_later=lr_later)).with_train(precision=Precision.FP32)
    objective = get_objective(cfg)
    first = objective.build_block(0)
    s = CoordinatorSettings(outer=OuterOptimizer.NESTEROV, outer_lr=0.7, audit_fraction=1.0, probation_pushes=3)
    block = BlockRun(cfg, s, LocalRounds(workers=2, local_steps=2, steps=4), corpus, k=1,
                     frozen=[objective.freeze(first, torch.float32)], earlier=[first], audit=True)
    assert block.schedule.lr == cfg.stack.lr_later * cfg.train.lr
    for offset, h in zip(block.offsets, block.opts.round_steps, strict=True):
        block.round(h, offset)
    run = block.finish()
    assert run.updates and all(u.audited and u.outcome == "accepted" for u in run.updates), run.updates
    assert not run.quarantined


def test_the_coordinator_counts_a_poisoned_update_by_reason(tmp_path: Path, corpus: DataDir) -> None:  # noqa: F811
    """Through the coordinator, at the default norm bound: a x10 random update after two honest ones is refused by
    the norm check itself (``norm`` in /v1/status), the loss gate off."""
    from blocktrain.errors import ProtocolError

    c = make_coordinator(tmp_path / "run", corpus, norm_k=CoordinatorSettings().norm_k, norm_min_history=2, eval_every=0,
                         gate=False,
                         audit_fraction=0.0, **NO_SCREEN)
    for name in ("a", "b", "c"):
        c.register(name, 0)
    g = torch.Generator().manual_seed(0)
    honest = [{n: 1e-3 * torch.randn(s, generator=g) for n, s in c.shapes.items()} for _ in range(2)]
    for name, d in zip(("a", "b"), honest, strict=True):
        c.submit(name, 0, pack_delta(d, Compression.INT8, block=0, base_version=0, base_sha=c.weights_sha[0],
                                     samples=full(c)))  # whole rounds' claims: their norms arm the bound
    bad = ScaledRandom().delta(honest[0], HostileContext(honest[0], [], g))
    with pytest.raises(ProtocolError) as exc:
        c.submit("c", 0, pack_delta(bad, Compression.INT8, block=0, base_version=0, base_sha=c.weights_sha[0], samples=4))
    assert exc.value.reason == "norm"
    assert c.status().rejections == {"norm": 1}
    third = {n: 1e-3 * torch.randn(s, generator=g) for n, s in c.shapes.items()}
    body = pack_delta(third, Compression.INT8, block=0, base_version=0, base_sha=c.weights_sha[0], samples=4)
    c.submit("c", 0, body)  # the quorum closes the round
    st = c.status().model_dump(mode="json")
    assert st["blocks"][0]["outer"] == {"method": "average", "lr": 1.0, "momentum": None, "step_encoding": "int8",
                                        "aggregation": "median", "inner_start": "fresh"}  # a diffusion run's (tiny)
    rnd = next(r for r in st["rounds"] if r["block"] == 0 and r["version"] == 0)
    assert rnd["updates"] == 3 and rnd["rejected"] == {"norm": 1}
    assert rnd["push_bytes"] == 3 * len(body)  # three int8 bodies of the same schema
    assert 0 < rnd["step_bytes"] < 0.3 * st["block_fp32_bytes"]  # the int8 step: a quarter of fp32, plus a header
    c.close()


@pytest.mark.parametrize(("start", "every"), [(InnerStart.FRESH, 1), (InnerStart.SHARED_MV, 1), (InnerStart.SHARED_MV, 2)])
def test_workers_over_http_match_the_in_process_reference(start: InnerStart, every: int, tmp_path: Path,
                                                          corpus: DataDir) -> None:  # noqa: F811
    """Two real workers through the HTTP coordinator land on the weights of :func:`run_local_rounds`.

    Same streams, inner AdamW (fresh each round, or started from the published shared moments, which travel with
    the pushes and the versions), int8 pushes with error feedback (deflated on the wire), Nesterov outer
    step and int8 published step: the distributed run is the local reference, to float32 rounding. With moments
    shared every second round, round 0 pushes none and round 1 goes on from its own, round 1 pushes them and round 2
    starts from their published mean: only version 2 has moments (the coordinator refuses a push that does otherwise).
    """
    import threading

    from blocktrain.worker.loop import Worker
    from blocktrain.worker.options import WorkerOptions
    from tests.distributed_utils import ThreadServer

    knobs: dict[str, Any] = {"outer": OuterOptimizer.NESTEROV, "outer_lr": 0.7, "outer_momentum": 0.9, "rounds": 3,
                             "eval_every": 0, "local_steps": 3,  # H, the budget every work answer assigns
                             "inner_start": start, "moment_every": every}
    c = make_coordinator(tmp_path / "run", corpus, **knobs)
    tokens = [c.add_token(f"w{i}") for i in range(2)]
    with ThreadServer(c) as srv:
        workers = [Worker(WorkerOptions(url=srv.url, token=t, block=0, progress=False,
                                        frozen_cache=tmp_path / "frozen"), corpus) for t in tokens]
        threads = [threading.Thread(target=w.run, daemon=True) for w in workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
    assert c.version[0] == 3 and all(w.summary.rounds_pushed == 3 for w in workers)
    published = [c.store.rounds.moments_blob(0, v) is not None for v in range(4)]
    assert published == [False, start.shares != () and every == 1, start.shares != (), start.shares != () and every == 1]
    got = {n: t.clone() for n, t in c.weights[0].items()}
    c.close()
    ref = run_local_rounds(get_preset("tiny"), CoordinatorSettings(**knobs),
                           LocalRounds(workers=2, local_steps=3, steps=9), corpus)
    for n, w in ref.weights.items():
        torch.testing.assert_close(got[n], w, rtol=0, atol=1e-6, msg=n)


def test_a_slow_worker_pushes_what_it_has_before_the_deadline(tmp_path: Path, corpus: DataDir) -> None:  # noqa: F811
    """H far beyond what fits in a 3 s round: the worker pushes early, weighted by the samples it trained on."""
    from blocktrain.worker.loop import Worker
    from tests.distributed_utils import run_worker

    c = make_coordinator(tmp_path / "run", corpus, rounds=1, round_seconds=3.0, eval_every=0, local_steps=100_000)
    w = run_worker(c, Worker, corpus, tmp_path, "slow")
    assert w.summary.rounds_cut == 1 and w.summary.rounds_pushed == 1 and c.version[0] == 1
    rows = c.store.q("SELECT samples, arrival_s FROM updates WHERE block=0")
    batch = get_preset("tiny").train.batch_size
    assert rows[0]["samples"] == w.summary.local_steps * batch < 100_000 * batch
    closed = c.store.q("SELECT close_reason FROM rounds WHERE block=0 AND version=0")
    assert closed[0]["close_reason"] == "quorum"  # on time: the round closed at quorum, not by its deadline
    c.close()


def test_agree_mean_shrinks_the_mean_where_signs_disagree() -> None:
    a = {"w": torch.tensor([1.0, 2.0, -1.0])}
    b = {"w": torch.tensor([3.0, -2.0, -3.0])}
    out = aggregate([a, b], [1, 3], Aggregation.AGREE_MEAN)["w"]
    mean = torch.tensor([2.5, -1.0, -2.5])  # (1 a + 3 b) / 4
    agree = torch.tensor([1.0, 0.5, 1.0])  # |1/4 sign(a) + 3/4 sign(b)|
    torch.testing.assert_close(out, mean * agree, rtol=0, atol=1e-6)


def test_an_h_schedule_lays_out_its_rounds_and_keeps_the_step_total() -> None:
    rounds = LocalRounds(workers=1, local_steps=15, steps=1000, early_steps=250, early_h=5)
    assert rounds.round_steps == [5] * 50 + [15] * 50 and rounds.rounds == 100 and sum(rounds.round_steps) == 1000
    with pytest.raises(ConfigError, match="multiple of local_steps"):
        LocalRounds(workers=1, local_steps=15, steps=1000, early_steps=200, early_h=5)
    with pytest.raises(ConfigError, match="adamw or muon"):
        LocalRounds(workers=1, local_steps=10, steps=100, inner="sgd")


def test_muon_steps_the_hidden_matrices_and_adamw_the_rest() -> None:
    torch.manual_seed(0)
    cfg = get_preset("tiny").train
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = MuonAdamW(net, cfg)
    assert [len(g["params"]) for g in opt.param_groups] == [2, 2]  # two weight matrices; two biases
    before = [p.detach().clone() for p in net.parameters()]
    for g in opt.param_groups:
        g["lr"] = 1e-2
    net(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    assert all(not torch.equal(b, p) for b, p in zip(before, net.parameters(), strict=True))
    assert all(p.grad is None for p in net.parameters())


def _tiny_stack(steps: int) -> RunConfig:
    base = get_preset("tiny")
    return replace(base, objective=Objective.STACK, stack=stack_recipe(), train=replace(base.train, steps=steps))


def test_the_averaging_trace_reads_delta_bar_from_the_nesterov_buffer(corpus: DataDir) -> None:  # noqa: F811
    tiny = get_preset("tiny")
    cfg = replace(tiny, train=replace(tiny.train, steps=8))
    row = {"preset": "tiny", "block": "cold", "steps": 8, "batch": 4, "h": 2, "seed": 0, "kind": "m", "workers": 1,
           "outer_lr": 0.7, "outer_momentum": 0.9, "reset_inner": True}
    points = trace_arm(cfg, row, corpus, every=1, eval_bytes=512, progress=False)
    assert [p["round"] for p in points] == [1, 2, 3, 4]
    for p in points:  # one worker: Delta_bar is its delta, in every round (a wrong buffer algebra breaks rounds >= 2)
        assert p["delta_bar_norm"] == pytest.approx(p["mean_delta_norm"], rel=1e-5)
    # round 1's Nesterov step is eta (1 + mu) Delta, published in int8 with error feedback
    assert points[0]["step_norm"] == pytest.approx(0.7 * 1.9 * points[0]["mean_delta_norm"], rel=2e-2)
    one = trace_arm(cfg, {**row, "kind": "x"}, corpus, every=2, eval_bytes=512, progress=False)
    assert [p["round"] for p in one] == [2, 4] and all("delta_bar_norm" not in p and p["step_norm"] > 0 for p in one)


def test_the_pool_at_open_fraction_one_is_the_progressive_run_block_after_block(corpus: DataDir) -> None:  # noqa: F811
    cfg = _tiny_stack(20)
    settings = CoordinatorSettings(gate=False, audit_fraction=0.0)
    pool = run_pool(cfg, settings, PoolSchedule(workers=2, local_steps=5, open_fraction=1.0), corpus)
    objective = get_objective(cfg)
    trained: list[torch.nn.Module] = []
    for k in range(4):
        steps = objective.block_steps(k) // 5 * 5
        run = run_local_rounds(cfg, settings, LocalRounds(workers=2, local_steps=5, steps=steps), corpus, k=k,
                               frozen=[objective.freeze(b, torch.float32) for b in trained], earlier=trained)
        trained.append(run.block)
    for mine, ref in zip(pool.blocks, trained, strict=True):
        for (n, p), (_, q) in zip(mine.state_dict().items(), ref.state_dict().items(), strict=True):
            assert torch.equal(p, q), n
    assert pool.slots == sum(pool.rounds) and all(w == [2 if j == k else 0 for j in range(4)]
                                                  for k in range(4) for w in pool.workers_per_slot[
                                                      sum(pool.rounds[:k]):sum(pool.rounds[:k + 1])])


def test_a_staggered_pool_spends_every_block_budget_and_overlaps_blocks(corpus: DataDir) -> None:  # noqa: F811
    cfg = _tiny_stack(20)
    pool = run_pool(cfg, CoordinatorSettings(gate=False, audit_fraction=0.0),
                    PoolSchedule(workers=4, local_steps=5, open_fraction=0.5), corpus)
    R = [get_objective(cfg).block_steps(k) // 5 for k in range(4)]
    assert pool.worker_rounds == [4 * r for r in R]  # the same compute as progressive
    assert all(sum(w) <= 4 for w in pool.workers_per_slot)
    assert any(sum(1 for m in w if m) > 1 for w in pool.workers_per_slot)  # two blocks trained in one slot
    assert pool.opened_at[1] < sum(R[:1]) and pool.slots <= sum(R) + 4
    assert _split(6, [5, 100]) == [3, 3] and _split(6, [1, 100]) == [1, 5] and _split(5, [10, 10]) == [3, 2]


def test_a_replica_the_screen_drops_round_after_round_is_quarantined_as_by_the_coordinator(corpus: DataDir) -> None:  # noqa: F811
    """The coordinator counts a screened update (dropped at its round's close) toward quarantine; the in-process
    rounds only relabelled it, so a sign flip the gate let through kept pushing, and joining the screen's median,
    for good, and a study built on them reported it undetected."""
    s = CoordinatorSettings(gate=False, quarantine_after=2, norm_k=0.0)  # only the agreement screen judges
    run = run_local_rounds(get_preset("tiny"), s, LocalRounds(workers=4, local_steps=3, steps=15), corpus,
                           hostile=SignFlip())
    bad = [u.outcome for u in run.updates if u.replica == 3]
    assert bad[:2] == ["screened", "screened"] and len(bad) == 2, bad  # quarantined after its second
    assert 3 in run.quarantined
    assert all(u.outcome == "accepted" for u in run.updates if u.replica != 3)


def test_a_refresh_of_the_frozen_blocks_refreshes_a_shared_head_too(tmp_path: Path) -> None:
    """With --head shared block k trains against block 0's head, frozen: a worker takes it again each round, the
    in-process rounds (the staggered schedule's refresh) kept the one of the version block k opened with."""
    from blocktrain.config import StackHead
    from tests.distributed_utils import write_corpus

    base = replace(get_preset("tiny"), objective=Objective.STACK)
    cfg = replace(base, stack=replace(base.stack, head=StackHead.SHARED), train=replace(base.train, batch_size=2))
    obj = get_objective(cfg)
    torch.manual_seed(0)
    earlier = [obj.build_block(0)]
    run = BlockRun(cfg, CoordinatorSettings(gate=False), LocalRounds(workers=2, local_steps=2, steps=4),
                   write_corpus(tmp_path / "data"), k=1, frozen=[obj.freeze(earlier[0], torch.float32)], earlier=earlier)
    newer = [obj.build_block(0)]  # block 0's next version: another head
    assert not torch.equal(newer[0].head.weight, earlier[0].head.weight)  # type: ignore[union-attr, arg-type]
    run.set_frozen([obj.freeze(newer[0], torch.float32)], newer)
    assert all(torch.equal(r.head.weight, newer[0].head.weight) for r in run.replicas)  # type: ignore[union-attr, arg-type]


def test_a_replica_whose_round_diverges_pushes_nothing_and_the_run_goes_on(corpus: DataDir,  # noqa: F811
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 refuses to encode NaN now (it sent it as 0): the in-process rounds packed a diverged replica's delta
    anyway and the whole simulation raised (helper-71). Such a replica pushes nothing that round, as a worker does."""
    from blocktrain.coordinator import simulate

    real, calls = simulate.train_round, [0]

    def diverging(task: Any, block: Any, *args: Any, **kwargs: Any) -> Any:
        out = real(task, block, *args, **kwargs)
        calls[0] += 1
        if calls[0] == 2:  # round 0's second replica
            next(p for p in block.parameters() if p.requires_grad).data.fill_(float("nan"))
        return out

    monkeypatch.setattr(simulate, "train_round", diverging)
    s = CoordinatorSettings(outer=OuterOptimizer.NESTEROV, outer_lr=0.7)
    run = run_local_rounds(get_preset("tiny"), s, LocalRounds(workers=2, local_steps=5, steps=10), corpus)
    assert [(u.round, u.replica) for u in run.updates] == [(0, 0), (1, 0), (1, 1)]
    assert all(bool(torch.isfinite(w).all()) for w in run.weights.values())
