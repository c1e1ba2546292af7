"""Frozen inputs of a ``stack`` worker: the finished blocks 0..k-1 that block k reads.

The coordinator publishes each finished block's version and weights sha256 in
``GET /v1/work`` (``frozen``) and serves its weights at
``GET /v1/blocks/{j}/frozen``. A worker downloads each (block, version) once,
keeps it on disk under a content-addressed name in its cache directory, and
checks every copy -- downloaded or cached -- against the published sha256
before building the forward-only copy (:meth:`Objective.freeze`). A download
that does not match is refused with a :class:`~blocktrain.errors.CheckpointError`;
a damaged cache file is downloaded again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from blocktrain.checkpoint.safetensors_io import atomic_write_bytes, tensors_sha256, unpack
from blocktrain.config import CompileMode
from blocktrain.device import compile_module
from blocktrain.errors import CheckpointError
from blocktrain.objectives import Objective
from blocktrain.objectives.base import whole_blocks
from blocktrain.protocol.messages import FrozenRef
from blocktrain.protocol.weights import block_schema
from blocktrain.worker.client import CoordinatorClient

log = logging.getLogger(__name__)

FrozenKey = tuple[tuple[int, int, str], ...]  # (block, version, weights sha256) of each frozen input


class FrozenInputs:
    """Fetches, caches, verifies and freezes the earlier blocks a worker's block reads."""

    def __init__(self, client: CoordinatorClient, objective: Objective, cache_dir: Path, device: torch.device,
                 dtype: torch.dtype, compile_mode: CompileMode = CompileMode.OFF) -> None:
        self.client = client
        self.objective = objective
        self.cache_dir = cache_dir.expanduser()
        self.device = device
        self.dtype = dtype  # bf16 copies when the worker computes in bf16
        self.compile_mode = compile_mode  # torch.compile of each frozen copy (once per copy loaded)
        self.key: FrozenKey = ()
        self.modules: list[nn.Module] = []
        self.whole: list[nn.Module] = []  # the earlier blocks whole (fp32, CPU), kept only for Objective.inherit
        self.downloads = 0  # frozen blocks downloaded from the coordinator (cache hits excluded)

    def ensure(self, refs: Sequence[FrozenRef]) -> list[nn.Module]:
        """The frozen copies the coordinator's ``refs`` name; loaded again only when a version changes."""
        key: FrozenKey = tuple((r.block, r.version, r.weights_sha) for r in refs)
        if key == self.key and len(self.modules) == len(key):
            return self.modules
        states = []
        for j, v, sha in key:
            with torch.device("meta"):
                shapes = block_schema(self.objective.build_block(j))
            states.append(self._weights(j, v, sha, shapes))
            log.info("frozen input: block %d version %d (sha %s...)", j, v, sha[:12])
        whole = whole_blocks(self.objective, states)  # with what each inherits from the ones before it
        modules = [compile_module(self.objective.freeze(block, self.dtype).to(self.device), self.compile_mode)
                   for block in whole]
        # a stack variant's block reads frozen heads of the earlier blocks (Objective.inherit): keep them whole
        self.whole = whole if self.objective.inherits() else []
        self.key, self.modules = key, modules
        return modules

    def path(self, j: int, v: int, sha: str) -> Path:
        return self.cache_dir / f"block{j}-v{v}-{sha}.safetensors"

    def _weights(self, j: int, v: int, sha: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        path = self.path(j, v, sha)
        if path.is_file():
            try:
                return _checked(path.read_bytes(), j, v, sha, shapes, source=str(path))
            except CheckpointError as exc:
                log.warning("cached frozen block %d is damaged (%s); downloading it again", j, exc)
                path.unlink(missing_ok=True)
        payload = self.client.frozen(j)
        self.downloads += 1
        weights = _checked(payload, j, v, sha, shapes, source=f"the frozen block {j} sent by {self.client.url}")
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, payload)  # only a verified copy is cached
        return weights


def _checked(payload: bytes, j: int, v: int, sha: str, shapes: dict[str, tuple[int, ...]],
             source: str) -> dict[str, torch.Tensor]:
    """Unpack a frozen block and refuse it unless it is block j, version v, with the published sha256."""
    tensors, meta = unpack(payload, source=source)  # raises on a header/content mismatch (corruption)
    got = tensors_sha256(tensors)
    if got != sha or meta.get("block_index") != str(j) or meta.get("version") != str(v):
        raise CheckpointError(
            f"{source} is block {meta.get('block_index')} version {meta.get('version')} with sha256 {got[:16]}..., "
            f"but the coordinator published block {j} version {v} with sha256 {sha[:16]}...; the download was "
            "altered on the way: check the network path (proxies, TLS) and restart the worker"
        )
    if {n: tuple(t.shape) for n, t in tensors.items()} != shapes:
        raise CheckpointError(f"{source} does not have the parameters of block {j} of this run's objective; "
                              "check that the worker and the coordinator run the same BlockTrain version")
    return {n: t.float() for n, t in tensors.items()}
