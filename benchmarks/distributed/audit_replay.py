"""Audit replay differences: how far an honest worker's push is from the coordinator's replay of the same round.

The coordinator's audit (``blocktrain.coordinator.audit``) replays a round from the worker's committed inner state and
passes it at ||replayed - pushed|| / ||pushed|| <= ``audit_tolerance``. Honest differences come from arithmetic the two
machines do differently: thread counts (reduction order), and bf16 autocast. This script trains one worker's second
round (AdamW moments and the int8 error-feedback residual carried from its first, as the worker carries them) with
``--worker-threads``, replays it from the snapshot with each replay thread count, through the product's
:func:`blocktrain.train.round.train_round`, and prints the relative error of the decoded int8 pushes. It also shows
what the attacks the audit exists for look like on the same scale (labels shuffled, the delta scaled by 1.1), and each push's
``scale``, the least-squares factor of the push on its replay, which the audit also bounds. ``--cross`` replays
each push in the other arithmetic too (bf16 <-> fp32): with no GPU at hand, the stand-in for a GPU worker's rounding
against a CPU coordinator's; ``--worker-device cuda`` trains the worker's rounds on a GPU (the device suite's
``audit`` job: a GPU worker against a CPU coordinator, issue 42). ``--derive-rounds N,...`` adds the replays an
audit makes where the coordinator derives the moments (``blocktrain.coordinator.lineage``): the worker trains N
rounds before the audited one (each from the weights its previous push made), the replay trains those N too, in its
own arithmetic, and the audited round from the moments they end with and the worker's residual (case ``honest,
derived from N rounds``; with the other thread count and in the other arithmetic), and the derived moments'
distance from the worker's (``moment_error``). Audits replayed from the derived moments until 82383e7; they now
replay from the uploaded state and bound its moments by the derived ones, at that distance. Each honest row also
gives ``pushed_moment_error``: how far the moments the worker's round ends with (those a push carries on a round that
shares them, through ``--moment-codec`` as the audit reads both) are from the replay's, the statistic the audit bounds
by ``audit_pushed_moment_tolerance``
(:func:`blocktrain.coordinator.audit.pushed_moment_error`; inf where one's scale on the other leaves [1/2, 2]).

    flock /tmp/blocktrain-cpu.lock python benchmarks/distributed/audit_replay.py --preset cpu-mini \
        --json benchmarks/results/audit-replay.json
    flock /tmp/blocktrain-cpu.lock python benchmarks/distributed/audit_replay.py --preset cpu-mini --cross \
        --derive-rounds 1,2,8 --json benchmarks/results/audit-replay-derived.json
    flock /tmp/blocktrain-cpu.lock python benchmarks/distributed/audit_replay.py --preset cpu-mini --h 100 --blocks 0 \
        --cross --derive-rounds 2 --json benchmarks/results/audit-replay-derived-h100.json
    flock /tmp/blocktrain-cpu.lock python benchmarks/distributed/audit_replay.py --preset cpu-mini --blocks 0,1,2,3 \
        --cross --json benchmarks/results/audit-replay-pushed-moments.json
    flock /tmp/blocktrain-cpu.lock python benchmarks/distributed/audit_replay.py --preset cpu-mini --h 100 --blocks 0,2 \
        --cross --json benchmarks/results/audit-replay-pushed-moments-h100.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from blocktrain.config import Precision, RunConfig
from blocktrain.coordinator.audit import moment_error, pushed_moment_error, replay_scale
from blocktrain.coordinator.settings import CoordinatorSettings
from blocktrain.data.dataset import resolve_data_dir
from blocktrain.data.stream import TrainStream
from blocktrain.device import CPU, resolve_device
from blocktrain.objectives import get_objective
from blocktrain.presets import get_preset, stack_recipe
from blocktrain.protocol.delta import Compression, ErrorFeedback, decode_delta, delta_norm
from blocktrain.protocol.inner_state import ADAM, RESIDUAL, inner_state, load_inner_state
from blocktrain.protocol.moments import MomentCodec, decode_moments, encode_moments
from blocktrain.protocol.weights import load_trainable, trainable_state
from blocktrain.seeds import worker_stream
from blocktrain.train.round import BlockTask, Targets, train_round
from blocktrain.train.step import make_optimizer


def shuffled(y: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    return y.flatten()[torch.randperm(y.numel(), generator=g)].view_as(y)  # (b, t), shuffled


def one_round(cfg: RunConfig, k: int, base: dict[str, torch.Tensor], state: dict[str, torch.Tensor], data: Any,
              v: int, h: int, precision: Precision, threads: int, targets: Targets | None = None,
              device: torch.device = CPU) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(decoded int8 push, inner state after) of round v of worker 1 on block k, from ``state``, trained on
    ``device`` (the push and the state come back to the host, as the worker encodes and commits them)."""
    torch.set_num_threads(threads)
    obj = get_objective(cfg)
    torch.manual_seed(0)
    earlier = [obj.build_block(j) for j in range(obj.frozen_inputs(k))]
    block = obj.build_block(k)
    load_trainable(block, base)
    if obj.inherits():
        obj.inherit(block, k, earlier, at_init=False)
    block = block.to(device)
    frozen = [obj.freeze(b, torch.float32).to(device) for b in earlier]
    opt, names = make_optimizer(block, cfg.train)
    residual = load_inner_state(opt, names, state)
    stream = TrainStream(data, cfg.model.context, cfg.train.batch_size, cfg.train.seed, stream=worker_stream(1, k, v),
                         device=device)
    schedule = replace(cfg.train, steps=10 * h)
    train_round(BlockTask(obj, k, frozen, device), block, opt, stream, steps=h, offset=v * h, schedule=schedule,
                precision=precision, targets=targets)
    local = trainable_state(block)
    fb = ErrorFeedback(Compression.INT8, residual)
    push = decode_delta(fb.encode({n: local[n] - base[n] for n in base}), Compression.INT8)
    return push, inner_state(opt, names, fb.residual)


def derived_state(replayed: dict[str, torch.Tensor], worker: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state a derived replay starts from: the moments of the replayed earlier round, the worker's residual."""
    return {**{n: t for n, t in replayed.items() if not n.startswith(RESIDUAL)},
            **{n: t for n, t in worker.items() if n.startswith(RESIDUAL)}}


def rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b||, as the audit judges a replay."""
    return delta_norm({n: a[n] - b[n] for n in b}) / delta_norm(b)


Replay = tuple[Precision, int, torch.device]  # (arithmetic, threads, device) of a run of a round


def estimates(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An inner state's moments named as a push carries them (m/NAME, v/NAME); with the same step count on both
    sides, the bias corrections cancel in :func:`pushed_moment_error`."""
    out = {}
    for name, t in state.items():
        if name.startswith(ADAM) and name.endswith(("/exp_avg", "/exp_avg_sq")):
            param, _, leaf = name[len(ADAM):].rpartition("/")
            out[("m/" if leaf == "exp_avg" else "v/") + param] = t
    return out


def coded(moments: dict[str, torch.Tensor], codec: MomentCodec, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """``moments`` as the coordinator reads them from a push: encoded with ``codec`` and decoded (the audit passes its
    replay's through the same codec before comparing)."""
    host = {n: t.to(CPU) for n, t in moments.items()}
    return decode_moments(encode_moments(host, codec), codec, shapes)


def row(k: int, worker: Replay, replay: Replay, case: str, replayed: dict[str, torch.Tensor],
        pushed: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One table row: the audit's two statistics of ``pushed`` against its replay (``replay_scale``)."""
    return {"block": k, "precision": worker[0].value, "worker_threads": worker[1], "worker_device": str(worker[2]),
            "replay_precision": replay[0].value, "replay_threads": replay[1], "replay_device": str(replay[2]),
            "case": case, "relative_error": rel(replayed, pushed), "scale": replay_scale(pushed, replayed)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="cpu-mini")
    ap.add_argument("--h", type=int, default=25, help="inner steps per round")
    ap.add_argument("--worker-threads", type=int, default=2)
    ap.add_argument("--replay-threads", default="2,1")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--blocks", default="0,1")
    ap.add_argument("--data", default=None)
    ap.add_argument("--cross", action="store_true",
                    help="also replay each push in the other arithmetic (bf16 <-> fp32), a stand-in for another device")
    ap.add_argument("--derive-rounds", default="",
                    help="comma-separated N: also replay N earlier rounds and the audited one from the moments they end with")
    ap.add_argument("--worker-device", default="cpu", help="where the worker trains its rounds (cuda: a GPU worker)")
    ap.add_argument("--replay-device", default="cpu",
                    help="where the coordinator replays them, beside a replay on the worker's device")
    ap.add_argument("--moment-codec", default=CoordinatorSettings().moment_codec.value,
                    choices=[c.value for c in MomentCodec], help="the codec pushed moments travel in (pushed_moment_error)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    cfg = replace(get_preset(args.preset), stack=stack_recipe())
    data = resolve_data_dir(args.data).open("train").data
    obj = get_objective(cfg)
    wdev, rdev = resolve_device(args.worker_device), resolve_device(args.replay_device)
    chains = [int(x) for x in args.derive_rounds.split(",") if x]
    codec = MomentCodec(args.moment_codec)
    rows = []
    for k in (int(x) for x in args.blocks.split(",")):
        torch.manual_seed(k)
        base = trainable_state(obj.build_block(k))
        for prec in (Precision(p) for p in args.precisions.split(",")):
            worker: Replay = (prec, args.worker_threads, wdev)
            # the same run again, the other thread counts (and the replay's device), the other arithmetic
            replays = [worker, *[(prec, t, rdev) for t in (int(x) for x in args.replay_threads.split(","))
                                 if (t, rdev) != (args.worker_threads, wdev)]]
            if args.cross:  # the other arithmetic: a stand-in for another device's rounding where none is at hand
                replays.append((Precision.FP32 if prec is Precision.BF16 else Precision.BF16, args.worker_threads, rdev))
            # round 0 from a fresh state gives the carried state of round 1, the audited one
            push0, state = one_round(cfg, k, base, {}, data, 0, args.h, worker[0], worker[1], device=wdev)
            base1 = {n: base[n] + push0[n] for n in base}
            pushed, ends = one_round(cfg, k, base1, state, data, 1, args.h, worker[0], worker[1], device=wdev)
            shapes = {n: tuple(t.shape) for n, t in base.items()}
            for rp in replays:
                replayed, ends_r = one_round(cfg, k, base1, state, data, 1, args.h, rp[0], rp[1], device=rp[2])
                carried = [coded(estimates(e), codec, shapes) for e in (ends, ends_r)]  # as a push carries them
                rows.append({**row(k, worker, rp, "honest", replayed, pushed),
                             "pushed_moment_error": pushed_moment_error(*carried), "moment_codec": codec.value})
            if chains:  # the worker's rounds 0..N; the coordinator's own replay of 0..N-1, then N from its moments
                bases: list[dict[str, torch.Tensor]] = [base]
                states: list[dict[str, torch.Tensor]] = [{}]
                pushes: list[dict[str, torch.Tensor]] = []
                for v in range(max(chains) + 1):
                    push, after = one_round(cfg, k, bases[v], states[v], data, v, args.h, worker[0], worker[1], device=wdev)
                    pushes.append(push)
                    bases.append({n: bases[v][n] + push[n] for n in base})
                    states.append(after)
                for n in chains:
                    for rp in replays:
                        state_r: dict[str, torch.Tensor] = {}
                        for v in range(n):
                            _, state_r = one_round(cfg, k, bases[v], state_r, data, v, args.h, rp[0], rp[1], device=rp[2])
                        replayed, _ = one_round(cfg, k, bases[n], derived_state(state_r, states[n]), data, n, args.h,
                                                rp[0], rp[1], device=rp[2])
                        rows.append({**row(k, worker, rp, f"honest, derived from {n} rounds", replayed, pushes[n]),
                                     "moment_error": moment_error(states[n], state_r)})
            replayed, _ = one_round(cfg, k, base1, state, data, 1, args.h, worker[0], worker[1], device=wdev)
            bad, _ = one_round(cfg, k, base1, state, data, 1, args.h, worker[0], worker[1], targets=shuffled, device=wdev)
            rows.append(row(k, worker, worker, "labels shuffled", replayed, bad))
            rows.append(row(k, worker, worker, "delta x 1.1", replayed, {n: 1.1 * d for n, d in pushed.items()}))
            print(f"block {k} {prec.value} done", file=sys.stderr, flush=True)
    print("| block | precision | worker threads | worker device | replay in | replay threads | replay device | case "
          "| relative error | scale | moment error | pushed moment error |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['block']} | {r['precision']} | {r['worker_threads']} | {r['worker_device']} | {r['replay_precision']} "
              f"| {r['replay_threads']} | {r['replay_device']} | {r['case']} | {r['relative_error']:.3g} "
              f"| {r['scale']:.4f} | {r.get('moment_error', float('nan')):.3g} "
              f"| {r.get('pushed_moment_error', float('nan')):.3g} |")
    if args.json:
        command = "python benchmarks/distributed/audit_replay.py " + " ".join(sys.argv[1:])
        args.json.write_text(json.dumps({"preset": cfg.name, "h": args.h, "rows": rows, "command": command,
                                         "torch": torch.__version__}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
