"""Argument helpers shared by the sub-commands.

Run flags are derived from the config dataclasses' fields (``TrainConfig`` and
``StackConfig`` whole, plus a few ``ModelConfig`` / ``DiffusionConfig`` fields
and the objective) by :class:`blocktrain.cli.fields.Flags`, so a new field needs
one edit: its declaration. The help text is the field's unit comment.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
from collections.abc import Iterator
from dataclasses import replace
from types import FrameType
from typing import Any

from blocktrain.cli.fields import Flags
from blocktrain.config import DiffusionConfig, ModelConfig, Objective, RunConfig, StackConfig, TrainConfig
from blocktrain.presets import PRESETS, get_preset


def _section(section: str, cls: type, only: tuple[str, ...] | None = None, rename: dict[str, str] | None = None
             ) -> tuple[str, Flags[Any]]:
    return section, Flags(cls, f"cfg__{section}__", rename=rename or {}, only=only, show_default=False,
                          help_format=f"override {section}.{{name}}: {{comment}}")  # the preset gives the defaults


# (section of RunConfig, its flags): every run flag and where its value goes.
_RUN_FLAGS: tuple[tuple[str, Flags[Any]], ...] = (
    _section("train", TrainConfig),
    _section("stack", StackConfig),
    _section("model", ModelConfig, only=("n_blocks",), rename={"n_blocks": "--blocks"}),
    _section("diffusion", DiffusionConfig, only=("sigma_min", "sigma_max")),
)


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
    for _section_name, flags in _RUN_FLAGS:
        replace(flags, skip=skip).add(p)
    p.add_argument("--no-progress", action="store_true", help="disable progress bars")


def config_from_args(args: argparse.Namespace) -> RunConfig:
    cfg = get_preset(args.preset)
    if getattr(args, "objective", None) is not None:
        cfg = replace(cfg, objective=args.objective)
    for section, flags in _RUN_FLAGS:
        if kw := flags.values(args):
            cfg = replace(cfg, **{section: replace(getattr(cfg, section), **kw)})
    return cfg


def interrupt(signum: int, frame: object) -> None:
    """A signal handler that stops the command as Ctrl-C does (its checkpoint or state saved on the way out)."""
    raise KeyboardInterrupt


@contextlib.contextmanager
def handling_signals(handlers: dict[signal.Signals, Any]) -> Iterator[None]:
    """These signal handlers for the block, the earlier ones back after it: a command run in-process (a test, a
    notebook) leaves its caller's handlers as it found them. A process forked meanwhile inherits them (hivemind's DHT
    peer is one): there each takes the signal's default action, so that its owner's ``terminate()`` still ends it."""
    owner = os.getpid()

    def here_only(fn: Any) -> Any:
        def handle(signum: int, frame: FrameType | None) -> None:
            if os.getpid() != owner:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
                return
            fn(signum, frame)
        return handle

    earlier = {sig: signal.signal(sig, here_only(fn)) for sig, fn in handlers.items()}
    try:
        yield
    finally:
        for sig, fn in earlier.items():
            signal.signal(sig, fn)
