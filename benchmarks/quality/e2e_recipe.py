"""Why does the E2E reference learn less per byte than one plain 2-layer block? One row per recipe change (issue 11).

Trains the E2E reference of a preset (cpu-mini by default) with one change at a
time, in-process, through the library's data stream, model, loss and optimiser
step, and scores it on the first ``--eval-bytes`` of validation. The ``aux``
rows add deep supervision to the E2E model: a LayerNorm + Linear head after
layers 2, 4 and 6 (of 8), trained end to end on the mean of all heads' CE; the
score is always the last head's. The ``stack0`` row is the stack objective's
block 0 alone (2 layers + its head) at the same steps, for reference.

    python benchmarks/quality/e2e_recipe.py --json benchmarks/results/e2e-recipe-cpu-mini.json

Prints one line per row and writes JSON; CE figures do not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from blocktrain.config import VOCAB_SIZE, Objective, Precision, RunConfig
from blocktrain.data.dataset import resolve_data_dir
from blocktrain.data.stream import TrainStream
from blocktrain.device import autocast
from blocktrain.evaluate.scoring import score_split
from blocktrain.model.e2e import E2ETransformer
from blocktrain.model.loss import lm_loss
from blocktrain.objectives.stack import StackObjective
from blocktrain.presets import get_preset
from blocktrain.seeds import E2E_INIT, E2E_STREAM, init_seed
from blocktrain.train.loop import train_steps
from blocktrain.train.step import lr_at, make_optimizer

CPU = torch.device("cpu")


class AuxE2E(nn.Module):
    """The E2E reference plus auxiliary next-byte heads after some layers (deeply-supervised nets, Lee et al. 2015)."""

    def __init__(self, cfg: RunConfig, after: tuple[int, ...]) -> None:
        super().__init__()
        self.e2e = E2ETransformer(cfg.model)
        self.after = after
        d = cfg.model.d_model
        self.aux = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, VOCAB_SIZE)) for _ in after)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x (b, t) -> logits of every head, the auxiliary ones first and the model's own head last."""
        m = self.e2e
        h = m.embed(x)
        outs = []
        for i, layer in enumerate(m.layers):
            h = layer(h)
            if i + 1 in self.after:
                outs.append(self.aux[self.after.index(i + 1)](h))
        return [*outs, m.readout(h)]


def train_and_score(cfg: RunConfig, variant: str, data: Any, valid: Any, eval_bytes: int) -> dict[str, Any]:
    tc = cfg.train
    stream = TrainStream(data.data, cfg.model.context, tc.batch_size, tc.seed, stream=E2E_STREAM)
    torch.manual_seed(init_seed(tc.seed, E2E_INIT))
    if variant == "stack0":
        stack_cfg = replace(cfg, objective=Objective.STACK)
        block = StackObjective(stack_cfg).build_block(0)
        model: nn.Module = block

        def logits_of(x: torch.Tensor) -> list[torch.Tensor]:
            return [block.logits(block(x))]
    elif variant.startswith("aux"):
        model = AuxE2E(cfg, (2, 4, 6))
        logits_of = model  # type: ignore[assignment]
    else:
        e2e = E2ETransformer(cfg.model)
        model = e2e

        def logits_of(x: torch.Tensor) -> list[torch.Tensor]:
            return [e2e(x)]

    def loss_at(step: int) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
        x, y = stream.batch(step)
        heads = logits_of(x)
        return sum((lm_loss(lg, y) for lg in heads), torch.zeros((), device=y.device)) / len(heads), {}

    t0 = time.perf_counter()
    train_steps(model, make_optimizer(model, tc)[0], loss_at, range(tc.steps), lr=lambda s: lr_at(s, tc),
                grad_clip=tc.grad_clip, precision=tc.precision)
    model.eval()

    def lp(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), autocast(tc.precision, CPU):
            return torch.log_softmax(logits_of(x)[-1].float(), dim=-1).unsqueeze(0)

    ce = score_split(lp, valid.data, cfg.model.context, max_bytes=eval_bytes).ce_nats_per_byte
    return {"variant": variant, "val_ce": ce, "train_s": time.perf_counter() - t0, "steps": tc.steps,
            "lr": tc.lr, "warmup_steps": tc.warmup_steps, "weight_decay": tc.weight_decay, "batch_size": tc.batch_size}


VARIANTS: dict[str, dict[str, Any]] = {
    "baseline": {},
    "stack0": {},
    "warmup x0.25": {"warmup_scale": 0.25},
    "warmup x4": {"warmup_scale": 4.0},
    "weight decay 0": {"weight_decay": 0.0},
    "batch x2, steps /2": {"batch_scale": 2},
    "aux heads after layers 2, 4, 6": {},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="cpu-mini")
    ap.add_argument("--steps", type=int, default=None, help="override the preset's steps")
    ap.add_argument("--eval-bytes", type=int, default=131072, help="validation bytes scored per row")
    ap.add_argument("--data", default=None)
    ap.add_argument("--only", nargs="*", default=None, help="run only these variants")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = get_preset(args.preset).with_train(precision=Precision.BF16)
    if args.steps:
        cfg = cfg.with_train(steps=args.steps)
    dd = resolve_data_dir(args.data)
    train, valid = dd.open("train"), dd.open("valid")
    rows = []
    for name, change in VARIANTS.items():
        if args.only and name not in args.only:
            continue
        tc = cfg.train
        c = cfg.with_train(
            warmup_steps=max(1, round(tc.warmup_steps * change.get("warmup_scale", 1.0))),
            weight_decay=change.get("weight_decay", tc.weight_decay),
            batch_size=tc.batch_size * change.get("batch_scale", 1),
            steps=tc.steps // change.get("batch_scale", 1),
        )
        variant = "stack0" if name == "stack0" else ("aux" if name.startswith("aux") else "e2e")
        row = {"row": name, **train_and_score(c, variant, train, valid, args.eval_bytes)}
        rows.append(row)
        print(f"{name:32s} val CE {row['val_ce']:.4f}  ({row['train_s']:.0f} s)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"preset": args.preset, "rows": rows,
                                               "command": "python benchmarks/quality/e2e_recipe.py " + " ".join(sys.argv[1:])},
                                              indent=2) + "\n")


if __name__ == "__main__":
    main()
