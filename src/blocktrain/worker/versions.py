"""How a worker comes to hold version v of its block: a peer's copy (hivemind), the published step from the version
it holds, or the whole weights; each checked against what the coordinator published."""

from __future__ import annotations

import logging

import torch

from blocktrain.checkpoint.safetensors_io import tensors_sha256, unpack
from blocktrain.errors import CheckpointError, ProtocolError
from blocktrain.protocol.codes import Reason
from blocktrain.protocol.delta import Compression, decode_delta, wire_schema
from blocktrain.protocol.messages import WorkAnswer
from blocktrain.protocol.weights import apply_step
from blocktrain.worker.client import CoordinatorClient
from blocktrain.worker.engines import Engine

log = logging.getLogger(__name__)


def fetch_version(
    client: CoordinatorClient, engine: Engine, k: int, shapes: dict[str, tuple[int, ...]], work: WorkAnswer,
    base: dict[str, torch.Tensor] | None, base_version: int,
) -> tuple[dict[str, torch.Tensor], int]:
    """Block k's weights (fp32) at the version ``work`` names, and that version; ``base``: the weights of
    ``base_version`` held now (None: none yet). A step that does not reproduce the published sha256 is dropped for
    the whole weights; weights that do not fit the block's ``shapes`` are refused (422)."""
    v, sha = work.version, work.weights_sha
    pulled = engine.pull(k, work)  # a peer that has version v first (hivemind engine)
    if pulled is not None:
        return pulled, v
    if base is not None and v == base_version + 1:
        try:
            tensors, meta = unpack(client.step(k, base_version), source="step")
            encoding = Compression(meta.get("compression", Compression.BF16.value))
            schema = wire_schema(shapes, encoding)
            if {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()} == {
                n: (spec.shape, spec.dtype) for n, spec in schema.items()
            }:
                new = apply_step(base, decode_delta(tensors, encoding))
                if tensors_sha256(new) == sha:
                    return new, v
            log.warning("block %d: step to v%d does not reproduce the published weights; pulling them", k, v)
        except (ProtocolError, CheckpointError, ValueError) as exc:
            log.warning("block %d: could not apply the step to v%d (%s); pulling full weights", k, v, exc)
    try:
        tensors, meta = unpack(client.weights(k), source="weights")
        got = int(meta.get("version", v))
    except (CheckpointError, ValueError) as exc:
        raise ProtocolError(502, f"the coordinator's weights of block {k} could not be read: {exc}", Reason.SCHEMA) from exc
    if meta.get("block_index") != str(k) or {n: tuple(t.shape) for n, t in tensors.items()} != shapes:
        raise ProtocolError(422, f"the coordinator sent weights that do not fit block {k}", Reason.SCHEMA)
    new = {n: t.float() for n, t in tensors.items()}
    # version v must be the one published (a newer one is checked against the next work answer's sha); an older one
    # (a caching proxy) or other bytes would have the worker fetch them again and again
    if got < v or (got == v and tensors_sha256(new) != sha):
        raise ProtocolError(502, f"the weights served for block {k} are version {got}, not the version {v} with sha256 "
                            f"{sha[:12]} the work answer named; a proxy between worker and coordinator may cache them",
                            Reason.BASE)
    return new, got
