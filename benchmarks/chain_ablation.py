"""Composition ablation on cpu-mini: does the chain beat its best block used alone?

Each run trains the E2E reference or the B=4 blocks of one recipe (same seeds,
same data streams), scores the first 128 KiB of the validation split with the
full chain (K=1, fixed seed) and every block alone, and appends one JSON line.

    python benchmarks/chain_ablation.py e2e
    python benchmarks/chain_ablation.py naive --sigma-min 1 --sigma-max 10
    python benchmarks/chain_ablation.py chain --sigma-min 0.05 --sigma-max 10
    python benchmarks/chain_ablation.py boost --sigma-min 0.05 --sigma-max 10
    python benchmarks/chain_ablation.py ensemble
    python benchmarks/chain_ablation.py table      # renders benchmarks/results/ablation.md

Recipes (block k, slice step sigmas s_0 = sigma_max > s_1 > ... > s_B = sigma_min):
- naive: the library's block loss: z = E[y] + sigma*eps, sigma from block k's slice.
- chain: chain-aware. Block k trains at sigma = s_k on the z that frozen copies
  of blocks 0..k-1 produce by Euler steps from z = sigma_max*eps (forward only,
  no gradient, no optimiser state): exactly the inference input, no target leak.
- boost: chain-aware, and block k's logits are a residual added to the running
  logit sum of the blocks before it (D and the readout use the running sum).
- ensemble: no chain. Every block is a plain LM fed pure noise at sigma_max;
  the readout is the mean of the B blocks' probabilities (compute: B forwards,
  the same as one traversal). It bounds what passing predictions can add.

Train compute is counted as 6 x params x bytes for trained blocks plus
2 x params x bytes for the frozen forward passes; inference compute is forward
FLOPs per scored byte. Run one at a time: every run uses both CPU cores.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from blocktrain.config import DiffusionConfig, Readout, Slicing, Solver
from blocktrain.data.dataset import resolve_data_dir
from blocktrain.data.stream import TrainStream
from blocktrain.diffusion.loss import block_loss
from blocktrain.diffusion.partition import NoisePartition
from blocktrain.diffusion.sampler import block_alone_logits, chain_logits, evaluations_per_traversal, initial_noise
from blocktrain.evaluate.scoring import score_split
from blocktrain.model.block import BlockDenoiser
from blocktrain.model.e2e import E2ETransformer
from blocktrain.presets import cpu_mini
from blocktrain.train.loop import lr_at, make_optimizer

RESULTS = Path(__file__).parent / "results"
JSONL = RESULTS / "ablation-cpu-mini.jsonl"
EVAL_BYTES = 131072
B = 4
D_MODEL = cpu_mini().model.d_model


def chain_state(
    mode: str, blocks: list[BlockDenoiser], part: NoisePartition, x: torch.Tensor, g: torch.Generator, upto: int, sigma_max: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Euler chain through blocks[0:upto] from z = sigma_max*eps: (z at s_upto, running logits)."""
    z = initial_noise(tuple(x.shape), D_MODEL, sigma_max, g)  # type: ignore[arg-type]
    total: torch.Tensor | None = None
    for k in range(upto):
        s, s_next = part.block_steps(k, 1)
        logits = blocks[k](x, z, torch.tensor(s))
        total = logits if (total is None or mode != "boost") else total + logits
        d = torch.softmax(total, -1) @ blocks[k].E  # D = softmax(logits) @ E
        z = z + (s_next - s) * (z - d) / s  # Euler step, Karras et al. (2022) Eq. (4)
    return z, total


def run_e2e(cfg, train, valid) -> dict:  # type: ignore[no-untyped-def]
    torch.manual_seed(1)
    m = E2ETransformer(cfg.model)
    opt, _ = make_optimizer(m, cfg.train)
    ts = TrainStream(train, cfg.model.context, cfg.train.batch_size, 0, stream=99)
    for step in range(cfg.train.steps):
        for gr in opt.param_groups:
            gr["lr"] = lr_at(step, cfg.train)
        x, y = ts.batch(step)
        loss = F.cross_entropy(m(x).reshape(-1, 256), y.reshape(-1).long())  # (b, t, 256) -> (b*t, 256)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    m.eval()
    with torch.no_grad():
        ce = score_split(lambda x: torch.log_softmax(m(x), -1).unsqueeze(0), valid, cfg.model.context, max_bytes=EVAL_BYTES)
    params = sum(p.numel() for p in m.parameters())
    tokens = cfg.train.steps * cfg.train.batch_size * cfg.model.context
    return {"ce": ce.ce_nats_per_byte, "train_flops": 6.0 * params * tokens, "infer_flops_per_byte": 2.0 * params}


def run_blocks(mode: str, cfg, train, valid) -> dict:  # type: ignore[no-untyped-def]
    part = NoisePartition(cfg.diffusion, B)
    smax = cfg.diffusion.sigma_max
    steps, T = cfg.train.steps, cfg.model.context
    blocks: list[BlockDenoiser] = []
    frozen_forwards = 0
    for k in range(B):
        torch.manual_seed(1009 + k)
        blk = BlockDenoiser(cfg.model, cfg.diffusion.sigma_data)
        opt, _ = make_optimizer(blk, cfg.train)
        ts = TrainStream(train, T, cfg.train.batch_size, 0, stream=1000 * k)
        for p in blocks:
            p.eval()
        for step in range(steps):
            for gr in opt.param_groups:
                gr["lr"] = lr_at(step, cfg.train)
            x, y = ts.batch(step)
            g = ts.generator(step, 1)
            if mode == "ensemble":
                z = initial_noise(tuple(x.shape), cfg.model.d_model, smax, g)  # type: ignore[arg-type]
                loss = F.cross_entropy(blk(x, z, torch.tensor(smax)).reshape(-1, 256), y.reshape(-1).long())
            elif mode == "naive":
                loss = block_loss(blk, k, x, y, part, cfg.diffusion, g).loss
            else:
                with torch.no_grad():
                    z, prev = chain_state(mode, blocks, part, x, g, k, smax)
                frozen_forwards += k
                logits = blk(x, z, torch.tensor(part.block_steps(k, 1)[0]))
                if mode == "boost" and prev is not None:
                    logits = logits + prev
                loss = F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1).long())  # (b, t, 256) -> (b*t, 256)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(blk.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        blk.eval()
        blocks.append(blk)
        sys.stderr.write(f"block {k}: final training loss {float(loss):.3f}\n")

    @torch.no_grad()
    def chain_lp(x: torch.Tensor) -> torch.Tensor:
        g = torch.Generator().manual_seed(7)
        if mode == "ensemble":
            shape = tuple(x.shape)
            lps = [torch.log_softmax(b(x, initial_noise(shape, D_MODEL, smax, g), torch.tensor(smax)), -1) for b in blocks]  # type: ignore[arg-type]
            return (torch.logsumexp(torch.stack(lps), 0) - math.log(B)).unsqueeze(0)
        _, total = chain_state(mode, blocks, part, x, g, B, smax)
        assert total is not None
        return torch.log_softmax(total, -1).unsqueeze(0)

    ce = score_split(chain_lp, valid, T, max_bytes=EVAL_BYTES).ce_nats_per_byte
    alone = []
    for k in range(B):

        @torch.no_grad()
        def lp(x: torch.Tensor, k: int = k) -> torch.Tensor:
            g = torch.Generator().manual_seed(11 + k)
            if mode == "ensemble":
                z = initial_noise(tuple(x.shape), cfg.model.d_model, smax, g)  # type: ignore[arg-type]
                return torch.log_softmax(blocks[k](x, z, torch.tensor(smax)), -1).unsqueeze(0)
            return torch.log_softmax(block_alone_logits(blocks[k], k, x, part, g), -1).unsqueeze(0)

        alone.append(score_split(lp, valid, T, max_bytes=EVAL_BYTES).ce_nats_per_byte)
    infer = {}
    if mode == "naive":  # the same blocks under other inference schedules (the library's sampler)
        variants = {
            "euler_2_steps": replace(cfg.diffusion, steps_per_block=2),
            "euler_4_steps": replace(cfg.diffusion, steps_per_block=4),
            "heun_1_step": replace(cfg.diffusion, solver=Solver.HEUN),
            "readout_sigma_min": replace(cfg.diffusion, readout=Readout.SIGMA_MIN),
        }
        for name, dcfg in variants.items():

            @torch.no_grad()
            def vlp(x: torch.Tensor, dcfg: DiffusionConfig = dcfg) -> torch.Tensor:
                g = torch.Generator().manual_seed(7)
                return torch.log_softmax(chain_logits(blocks, x, NoisePartition(dcfg, B), dcfg, g), -1).unsqueeze(0)

            ce_v = score_split(vlp, valid, T, max_bytes=EVAL_BYTES).ce_nats_per_byte
            infer[name] = {"ce": ce_v, "evaluations": evaluations_per_traversal(dcfg, B)}
    params = sum(p.numel() for p in blocks[0].parameters())
    tokens = steps * cfg.train.batch_size * T
    return {
        "ce": ce,
        "blocks_alone_ce": alone,
        "compositional_gain": min(alone) - ce,
        "train_flops": 6.0 * params * tokens * B + 2.0 * params * (frozen_forwards * cfg.train.batch_size * T),
        "infer_flops_per_byte": 2.0 * params * B,
        "inference_variants": infer,
    }


def _label(r: dict) -> str:  # type: ignore[type-arg]
    parts = [r["recipe"]]
    if r.get("slicing", "equal_prob") != "equal_prob":
        parts.append(r["slicing"])
    if r.get("overlap", 0.1) != 0.1:
        parts.append(f"overlap {r['overlap']:g}")
    return ", ".join(parts)


def render_table() -> str:
    rows = [json.loads(line) for line in JSONL.read_text().splitlines() if line.strip()]
    e2e_by_steps = {r["steps"]: r["ce"] for r in rows if r["recipe"] == "e2e"}
    out = [
        "# Composition ablation (cpu-mini)",
        "",
        "cpu-mini: d=128, 4 heads, L=8, B=4, T=128, batch 16; each block trains as many steps as the E2E run (matched compute).",
        f"CE in nats/byte on the first {EVAL_BYTES} bytes of the validation split, K=1 chain with a fixed seed.",
        "Gap = composed minus E2E at the same steps. Gain = best block alone minus composed (positive: the chain composes).",
        "Train compute: 6 x params x bytes (+2 x params x bytes for the frozen forward passes of chain-aware recipes);",
        "params include each block's embedding tables and head, so the 4 blocks count 1.4x the E2E FLOPs at equal steps.",
        "Inference compute: forward FLOPs per scored byte of one traversal. Generated by `benchmarks/chain_ablation.py`.",
        "",
        "| recipe | sigma range | steps | E2E CE | composed CE | gap | blocks alone | gain | train GFLOPs | infer MFLOPs/byte | command |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        e2e_ce = e2e_by_steps.get(r["steps"], float("nan"))
        alone = ", ".join(f"{a:.3f}" for a in r.get("blocks_alone_ce", [])) or "-"
        gain = f"{r['compositional_gain']:+.3f}" if "compositional_gain" in r else "-"
        rng = f"[{r['sigma_min']:g}, {r['sigma_max']:g}]" if r["recipe"] not in ("e2e", "ensemble") else "-"
        gap = "-" if r["recipe"] == "e2e" else f"{r['ce'] - e2e_ce:+.3f}"
        out.append(
            f"| {_label(r)} | {rng} | {r['steps']} | {e2e_ce:.3f} | {r['ce']:.3f} | {gap} | {alone} | {gain} | "
            f"{r['train_flops'] / 1e9:,.0f} | {r['infer_flops_per_byte'] / 1e6:.2f} | `{r['command']}` |"
        )
    variants = [r for r in rows if r.get("inference_variants")]
    if variants:
        out += [
            "",
            "## Inference schedule on the same trained blocks",
            "",
            "Composed CE of each naive row's blocks under other schedules (evaluations per traversal in brackets).",
            "",
            "| recipe | sigma range | Euler 1 step [4] | Euler 2 steps [8] | Euler 4 steps [16] | Heun 1 step [7] "
            "| readout at sigma_min [5] |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in variants:
            v = r["inference_variants"]
            cells = " | ".join(f"{v[k]['ce']:.3f}" for k in ("euler_2_steps", "euler_4_steps", "heun_1_step", "readout_sigma_min"))
            out.append(f"| {_label(r)} | [{r['sigma_min']:g}, {r['sigma_max']:g}] | {r['ce']:.3f} | {cells} |")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", choices=["e2e", "naive", "chain", "boost", "ensemble", "table"])
    ap.add_argument("--sigma-min", type=float, default=1.0)
    ap.add_argument("--sigma-max", type=float, default=10.0)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--slicing", choices=[s.value for s in Slicing], default=Slicing.EQUAL_PROB.value)
    ap.add_argument("--overlap", type=float, default=0.1)
    ap.add_argument("--data", default=None)
    args = ap.parse_args()
    if args.recipe == "table":
        (RESULTS / "ablation.md").write_text(render_table())
        sys.stdout.write(render_table())
        return 0
    torch.set_num_threads(2)
    cfg = cpu_mini()
    cfg = replace(
        cfg,
        diffusion=replace(
            cfg.diffusion, sigma_min=args.sigma_min, sigma_max=args.sigma_max, slicing=Slicing(args.slicing), overlap=args.overlap
        ),
        train=replace(cfg.train, steps=args.steps),
    )
    data = resolve_data_dir(args.data)
    train, valid = data.open("train").data, data.open("valid").data
    t0 = time.time()
    res = run_e2e(cfg, train, valid) if args.recipe == "e2e" else run_blocks(args.recipe, cfg, train, valid)
    row = {"recipe": args.recipe, "sigma_min": args.sigma_min, "sigma_max": args.sigma_max, "steps": args.steps,
           "slicing": args.slicing, "overlap": args.overlap, **res,
           "wall_s": round(time.time() - t0, 1), "command": "python benchmarks/chain_ablation.py " + " ".join(sys.argv[1:])}
    RESULTS.mkdir(exist_ok=True)
    with JSONL.open("a") as f:
        f.write(json.dumps(row) + "\n")
    sys.stdout.write(json.dumps(row, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
