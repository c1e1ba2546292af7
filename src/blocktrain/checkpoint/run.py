"""Run directories: one config, B block checkpoints and/or one E2E checkpoint.

Layout::

    RUN/run.json                       config (JSON) and format version
    RUN/blocks/block_{k}.safetensors   weights of block k (+ frozen E) and metadata
    RUN/blocks/block_{k}.state.safetensors   optimiser state for resuming
    RUN/e2e/model.safetensors          E2E reference weights
    RUN/e2e/model.state.safetensors    its optimiser state
    RUN/metrics/*.jsonl                per-run training metrics
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from blocktrain.checkpoint.safetensors_io import atomic_write_bytes, load_file, save_file
from blocktrain.config import RunConfig
from blocktrain.errors import CheckpointError, ConfigError, RunError

RUN_FORMAT_VERSION = 1
MAX_RECIPE_CHANGES = 100  # run.json keeps the last this many recipe changes
# train fields that change where and how a run computes or reports, not what it trains (no warning when they change)
RUNTIME_FIELDS = frozenset(f"train.{k}" for k in ("device", "compile", "profile_steps", "log_every", "checkpoint_every",
                                                  "eval_bytes", "eval_every", "test_bytes", "recompute"))

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checkpoint:
    tensors: dict[str, torch.Tensor]  # parameter and buffer tensors by name
    meta: dict[str, str]  # verified metadata header

    @property
    def step(self) -> int:
        return int(self.meta.get("step", "0"))


class RunDir:
    """A run directory bound to one :class:`RunConfig`."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._data: dict[str, str] | None = None  # the data directory init() was given, to record in run.json

    # --- config -----------------------------------------------------------
    @property
    def config_path(self) -> Path:
        return self.root / "run.json"

    def init(self, cfg: RunConfig, data_dir: Path | None = None) -> RunConfig:
        """Create the run, or check that an existing run has the same architecture; ``data_dir``, the directory it
        trains on, is recorded in run.json (``data``), so that eval and the other readers find it without --data."""
        if data_dir is not None:
            self._data = {"dir": str(Path(data_dir).expanduser().resolve()), "fingerprint": cfg.dataset}
        if self.config_path.exists():
            existing = self.load_config()
            if existing.dataset and cfg.dataset and existing.dataset != cfg.dataset:
                raise ConfigError(
                    f"{self.root} trains on dataset {existing.dataset[:12]}, but --data names dataset "
                    f"{cfg.dataset[:12]}; pass the run's own data, or choose a new --out directory"
                )
            if existing.architecture_key() != cfg.architecture_key():
                raise ConfigError(
                    f"{self.root} already holds a run with another model/diffusion config "
                    f"(preset {existing.name!r}); choose a new --out directory"
                )
            filled = existing.dataset != cfg.dataset and not existing.dataset  # a run from before fingerprints
            existing = existing.with_dataset(cfg.dataset) if filled else existing
            # the caller's recipe (its train section and the stack's init, step split and later lr, outside the
            # architecture key); the run's own record for the rest. A changed --step-ratio with the same train section
            # was dropped for the recorded one
            resumed = replace(existing, train=cfg.train, stack=cfg.stack)
            changed = recipe_changes(existing, resumed)
            trains = {k: v for k, v in changed.items() if k not in RUNTIME_FIELDS}
            if trains:  # recorded below, so that run.json names the recipe the run goes on with, and its changes
                log.warning("%s goes on with another recipe than it recorded: %s", self.root,
                            "; ".join(f"{k} {a} -> {b}" for k, (a, b) in trains.items()))
            if filled or changed or (data_dir is not None and self.recorded_data() != self._data):
                self._write(resumed, changed)
            return resumed
        self._write(cfg)
        return cfg

    def _write(self, cfg: RunConfig, changed: dict[str, tuple[Any, Any]] | None = None) -> None:
        doc: dict[str, Any] = {"format_version": RUN_FORMAT_VERSION, "config": cfg.to_dict()}
        data = self._data or self.recorded_data()
        if data:
            doc["data"] = data
        history = self._recipe_history()
        if changed:
            history = [*history, {"time": time.time(), "changed": {k: list(v) for k, v in changed.items()}}]
        if history:
            doc["recipe_changes"] = history[-MAX_RECIPE_CHANGES:]
        atomic_write_bytes(self.config_path, json.dumps(doc, indent=2).encode())

    def _recipe_history(self) -> list[Any]:
        """run.json's ``recipe_changes``: each resume with another recipe, when and what changed (old, new)."""
        with contextlib.suppress(OSError, ValueError, AttributeError):
            history = json.loads(self.config_path.read_text()).get("recipe_changes", [])
            return history if isinstance(history, list) else []
        return []

    def recorded_data(self) -> dict[str, str] | None:
        """``{"dir", "fingerprint"}`` of the data the run trains on, as run.json records it (None: not recorded)."""
        if not self.config_path.is_file():
            return None
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(self.config_path.read_text()).get("data")
            if isinstance(data, dict) and isinstance(data.get("dir"), str):
                return {"dir": data["dir"], "fingerprint": str(data.get("fingerprint", ""))}
        return None

    def load_config(self) -> RunConfig:
        if not self.config_path.is_file():
            raise RunError(f"{self.root} is not a BlockTrain run (no run.json); train one with 'blocktrain train'")
        try:
            doc = json.loads(self.config_path.read_text())
        except json.JSONDecodeError as exc:
            raise RunError(f"{self.config_path} is not valid JSON: {exc}") from exc
        if doc.get("format_version") != RUN_FORMAT_VERSION:
            raise RunError(f"{self.config_path}: unsupported run format {doc.get('format_version')!r}")
        return RunConfig.from_dict(doc["config"])

    # --- paths --------------------------------------------------------------
    def block_path(self, k: int) -> Path:
        return self.root / "blocks" / f"block_{k}.safetensors"

    def block_state_path(self, k: int) -> Path:
        return self.root / "blocks" / f"block_{k}.state.safetensors"

    def e2e_path(self) -> Path:
        return self.root / "e2e" / "model.safetensors"

    def e2e_state_path(self) -> Path:
        return self.root / "e2e" / "model.state.safetensors"

    def metrics_path(self, name: str) -> Path:
        return self.root / "metrics" / f"{name}.jsonl"

    def has_blocks(self, n_blocks: int) -> bool:
        return all(self.block_path(k).is_file() for k in range(n_blocks))

    def has_e2e(self) -> bool:
        return self.e2e_path().is_file()


def recipe_changes(old: RunConfig, new: RunConfig) -> dict[str, tuple[Any, Any]]:
    """The train and stack fields ``new`` changes, ``section.field`` -> (old, new), as run.json writes them."""
    a, b = old.to_dict(), new.to_dict()
    return {f"{sec}.{k}": (a[sec].get(k), v) for sec in ("train", "stack") for k, v in b[sec].items()
            if a[sec].get(k) != v}


def save_model(path: Path, module: nn.Module, cfg: RunConfig, kind: str, step: int, **extra: str) -> str:
    meta = {"kind": kind, "config": cfg.to_json(), "step": str(step), **extra}
    return save_file(path, {k: v for k, v in module.state_dict().items()}, meta)


def load_model(path: Path, module: nn.Module, cfg: RunConfig, kind: str, **expect: str) -> Checkpoint:
    """Load a checkpoint into ``module`` after checking kind, architecture and extra fields."""
    tensors, meta = load_file(path)
    if meta.get("kind") != kind:
        raise CheckpointError(f"{path} is a {meta.get('kind')!r} checkpoint, expected {kind!r}")
    try:
        other = RunConfig.from_json(meta.get("config", ""))
    except ConfigError as exc:
        raise CheckpointError(f"{path}: its embedded config is unreadable ({exc})") from exc
    if other.dataset and cfg.dataset and other.dataset != cfg.dataset:
        raise CheckpointError(
            f"{path} was trained on dataset {other.dataset[:12]}, but its run directory's run.json records dataset "
            f"{cfg.dataset[:12]}, so it belongs to another run; move it out and train it again here, or use it from "
            "the run directory it came from")
    if other.architecture_key() != cfg.architecture_key():
        # ``cfg`` is the run's own (its run.json): the file was copied in from another run.
        raise CheckpointError(
            f"{path} was trained with another model config (preset {other.name!r}) than its run directory's "
            f"run.json (preset {cfg.name!r}), so it belongs to another run; move it out and train it again here, "
            "or use it from the run directory it came from"
        )
    for key, value in expect.items():
        if meta.get(key) != value:
            raise CheckpointError(f"{path}: metadata {key}={meta.get(key)!r}, expected {value!r}")
    own = module.state_dict()
    if set(own) != set(tensors) or any(own[k].shape != tensors[k].shape for k in own):
        raise CheckpointError(f"{path}: tensor names or shapes do not match the model; the file belongs elsewhere")
    module.load_state_dict(tensors)
    return Checkpoint(tensors=tensors, meta=meta)


def optimizer_tensors(opt: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, torch.Tensor]:
    """Flatten optimiser state to named tensors: ``{param_name}::{key}``."""
    out: dict[str, torch.Tensor] = {}
    sd = opt.state_dict()
    for idx, state in sd["state"].items():
        for key, value in state.items():
            out[f"{names[idx]}::{key}"] = torch.as_tensor(value)
    return out


def load_optimizer_tensors(opt: torch.optim.Optimizer, names: dict[int, str], tensors: dict[str, torch.Tensor]) -> None:
    sd = opt.state_dict()
    by_name = {v: k for k, v in names.items()}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        pname, _, field = key.rpartition("::")
        if pname not in by_name:
            raise CheckpointError(f"optimiser state names unknown parameter {pname!r}")
        state.setdefault(by_name[pname], {})[field] = value
    sd["state"] = state
    opt.load_state_dict(sd)
