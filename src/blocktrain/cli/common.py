"""Argument helpers shared by the sub-commands.

Run flags are derived from the config dataclasses' fields (``TrainConfig`` and
``StackConfig`` whole, plus a few ``ModelConfig`` / ``DiffusionConfig`` fields
and the objective), so a new field needs one edit: its declaration. The help
text is the field's unit comment.
"""

from __future__ import annotations

import argparse
import enum
from dataclasses import fields, replace
from typing import Any

from blocktrain.cli.fields import arg_type as _arg_type
from blocktrain.cli.fields import field_comments as _field_comments
from blocktrain.config import DiffusionConfig, ModelConfig, Objective, RunConfig, StackConfig, TrainConfig
from blocktrain.presets import PRESETS, get_preset

# (section of RunConfig, dataclass, field, flag): every run flag and where its value goes.
_SECTIONS: tuple[tuple[str, type], ...] = (("train", TrainConfig), ("stack", StackConfig))
_EXTRA: tuple[tuple[str, type, str, str], ...] = (
    ("model", ModelConfig, "n_blocks", "--blocks"),
    ("diffusion", DiffusionConfig, "sigma_min", "--sigma-min"),
    ("diffusion", DiffusionConfig, "sigma_max", "--sigma-max"),
)


def _run_flags() -> list[tuple[str, type, str, str]]:
    out = [(section, cls, f.name, "--" + f.name.replace("_", "-")) for section, cls in _SECTIONS for f in fields(cls)]
    return [*out, *_EXTRA]


def _dest(section: str, name: str) -> str:
    return f"cfg__{section}__{name}"


def add_run_args(p: argparse.ArgumentParser, *, need_out: bool = True, skip: tuple[str, ...] = ()) -> None:
    """Add --preset, --data, --objective and one flag per config field (``skip``: names the caller flags itself)."""
    p.add_argument("--preset", default="cpu-small", help=f"configuration preset: {', '.join(PRESETS)}")
    if need_out:
        p.add_argument("--out", required=True, help="run directory to create or resume")
    p.add_argument("--data", default=None, help="data directory (else $BLOCKTRAIN_DATA, cache, or download)")
    if "objective" not in skip:
        p.add_argument(
        "--objective", type=Objective, choices=list(Objective), default=None, metavar="{diffusion,stack}",
        help="block objective (default: the preset's)",
        )
    for section, cls, name, flag in _run_flags():
        if name in skip:
            continue
        comment = _field_comments(cls).get(name, "")
        p.add_argument(flag, dest=_dest(section, name), default=None, help=f"override {section}.{name}: {comment}", **_arg_type(cls, name))
    p.add_argument("--no-progress", action="store_true", help="disable progress bars")


def config_from_args(args: argparse.Namespace) -> RunConfig:
    cfg = get_preset(args.preset)
    if getattr(args, "objective", None) is not None:
        cfg = replace(cfg, objective=args.objective)
    changes: dict[str, dict[str, Any]] = {}
    for section, _cls, name, _flag in _run_flags():
        value = getattr(args, _dest(section, name), None)
        if value is not None:
            changes.setdefault(section, {})[name] = value
    for section, kw in changes.items():
        cfg = replace(cfg, **{section: replace(getattr(cfg, section), **kw)})
    return cfg


def forward_run_args(args: argparse.Namespace) -> list[str]:
    """Re-emit the run arguments for a child process."""
    out = ["--preset", args.preset]
    if args.data is not None:
        out += ["--data", str(args.data)]
    if getattr(args, "objective", None) is not None:
        out += ["--objective", args.objective.value]
    for section, _cls, name, flag in _run_flags():
        value = getattr(args, _dest(section, name), None)
        if value is not None:
            out += [flag, value.value if isinstance(value, enum.Enum) else str(value)]
    if args.no_progress:
        out.append("--no-progress")
    return out
