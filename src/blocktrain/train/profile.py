"""Where a training step's time goes: torch.profiler over a run's last steps, as a table of operators.

``TrainConfig.profile_steps`` = n profiles the run's last n steps (after warm-up, compilation and the timed
steps that ``bench speed`` reads). The operators are ranked by their own time on the device (CUDA kernels on a
GPU, the operator itself on a CPU) and written beside the run's metrics:

    metrics/NAME.profile.json   {"device", "steps", "step_seconds", "ops": [{"name", "calls", "self_device_s",
                                 "self_cpu_s", "share"}, ...]}   (the top TOP_OPS operators)
    metrics/NAME.profile.md     the same as a table
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from blocktrain.device import synchronize
from blocktrain.train.loop import Hook, StepRecord

log = logging.getLogger(__name__)

TOP_OPS = 25  # operators kept in the report


def _self_device_us(event: Any) -> float:
    """An averaged event's own device time in microseconds (torch >= 2.4 names it self_device_time_total)."""
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, attr):
            return float(getattr(event, attr))
    return 0.0


class ProfileHook(Hook):
    """Profiles steps [first, first + steps) of a run and writes the report when the last of them is done."""

    def __init__(self, first: int, steps: int, device: torch.device, out: Path) -> None:
        if steps < 1:
            raise ValueError(f"profile steps must be >= 1, got {steps}")
        self.first = first
        self.steps = steps
        self.device = device
        self.out = out  # metrics/NAME: the report is written to NAME.profile.json and NAME.profile.md
        self.cuda = device.type == "cuda"
        self._prof: profile | None = None
        self._t0 = 0.0

    def before(self, step: int) -> bool:
        if step == self.first and self._prof is None:
            synchronize(self.device)  # the profile starts with an idle device
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self._prof = profile(activities=acts)
            self._prof.__enter__()
            self._t0 = time.perf_counter()
        return True

    def after(self, rec: StepRecord) -> None:
        if self._prof is not None and rec.done == self.first + self.steps:
            synchronize(self.device)
            seconds = (time.perf_counter() - self._t0) / self.steps
            self._prof.__exit__(None, None, None)
            self.write(self._prof, seconds)
            self._prof = None

    def interrupted(self, done: int) -> None:
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self._prof = None

    def write(self, prof: profile, step_seconds: float) -> dict[str, Any]:
        """The report of a finished profile (also returned)."""
        events = prof.key_averages()
        device_us = {id(e): (_self_device_us(e) if self.cuda else float(e.self_cpu_time_total)) for e in events}
        total = sum(device_us.values()) or 1.0
        ranked = sorted(events, key=lambda e: device_us[id(e)], reverse=True)[:TOP_OPS]
        ops = [{"name": e.key, "calls": int(e.count), "self_device_s": device_us[id(e)] / 1e6 / self.steps,
                "self_cpu_s": float(e.self_cpu_time_total) / 1e6 / self.steps, "share": device_us[id(e)] / total}
               for e in ranked]
        report = {"device": str(self.device), "steps": self.steps, "step_seconds": step_seconds, "ops": ops}
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.with_suffix(".profile.json").write_text(json.dumps(report, indent=2) + "\n")
        self.out.with_suffix(".profile.md").write_text(format_profile(report) + "\n")
        log.info("profile of %d steps written to %s", self.steps, self.out.with_suffix(".profile.md"))
        return report


def format_profile(report: dict[str, Any]) -> str:
    """A report as a markdown table: per step, each operator's own device time and its share of the total."""
    lines = [f"Profile on {report['device']}: {report['steps']} steps, {report['step_seconds'] * 1e3:.2f} ms a step "
             "(wall, profiler on)", "", "| operator | calls/step | self device ms/step | share | self CPU ms/step |",
             "|---|---|---|---|---|"]
    for op in report["ops"]:
        lines.append(f"| `{op['name']}` | {op['calls'] / report['steps']:.0f} | {op['self_device_s'] * 1e3:.3f} | "
                     f"{op['share']:.1%} | {op['self_cpu_s'] * 1e3:.3f} |")
    return "\n".join(lines)
