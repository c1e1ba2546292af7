"""A worker's inner state at the start of a round, as tensors: what an audit needs to replay the round exactly.

A worker's round depends on more than the published weights: its inner AdamW moments persist across rounds
(DiLoCo's inner optimiser), and its push carries the quantisation residual of its earlier pushes (error feedback).
The worker commits to the sha256 of that state with every push (``UpdateMeta.state_sha``), and uploads it when the
coordinator audits the push (:mod:`blocktrain.coordinator.audit`). Names:

* ``adam/<param>/exp_avg``, ``adam/<param>/exp_avg_sq`` (the parameter's shape, float32) and ``adam/<param>/step``
  (a float32 scalar), for every trainable parameter that has taken a step; for the round optimiser of shared moments
  (:class:`blocktrain.train.inner.RoundAdamW`) ``adam/<param>/c1`` and ``adam/<param>/c2`` (its two bias
  corrections, float32 scalars) in place of ``step``;
* ``residual/<param>``: the error-feedback residual e (the parameter's shape, float32), once a lossy push was sent.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from blocktrain.checkpoint.safetensors_io import legacy_tensors_sha256, pack, tensors_sha256, unpack
from blocktrain.errors import CheckpointError, ProtocolError
from blocktrain.protocol.codes import Reason

ADAM = "adam/"
RESIDUAL = "residual/"
MOMENTS = ("exp_avg", "exp_avg_sq")
STEP_SCALARS = ("step",)  # torch AdamW's per-parameter scalar: its step counter
ROUND_SCALARS = ("c1", "c2")  # RoundAdamW's: its two bias corrections
SCALARS = (*STEP_SCALARS, *ROUND_SCALARS)
STATE_FORMAT = "1"  # bumped when the names or their meaning change


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimiser's parameters in :func:`blocktrain.train.step.make_optimizer`'s index order."""
    return [p for group in opt.param_groups for p in group["params"]]


def inner_state(opt: torch.optim.Optimizer, names: Mapping[int, str],
                residual: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Host copies of ``opt``'s AdamW state and the error-feedback ``residual`` (on whatever device they live), named
    as the module docstring says."""

    def host(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(device="cpu", dtype=torch.float32, copy=True)

    out: dict[str, torch.Tensor] = {}
    for i, p in enumerate(_params(opt)):
        st = opt.state.get(p)
        if not st:
            continue
        for m in MOMENTS:
            out[f"{ADAM}{names[i]}/{m}"] = host(st[m])
        for leaf in SCALARS:
            if leaf in st:
                out[f"{ADAM}{names[i]}/{leaf}"] = host(torch.as_tensor(st[leaf])).reshape(())
    for n, e in residual.items():
        out[f"{RESIDUAL}{n}"] = host(e)
    return out


def state_sha(tensors: Mapping[str, torch.Tensor]) -> str:
    """The digest a worker commits to: sha256 over the state's names, dtypes, shapes and bytes."""
    return tensors_sha256(dict(tensors))


def commits_to(tensors: Mapping[str, torch.Tensor], sha: str) -> bool:
    """Whether ``sha``, a push's commitment, is the digest of ``tensors`` (a state already checked against the
    block's names and shapes): :func:`state_sha`, or the format version 1 digest a worker of the release before
    committed with (its audit can outlast a coordinator's upgrade; under a fixed schema that digest is one-to-one)."""
    state = dict(tensors)
    return tensors_sha256(state) == sha or legacy_tensors_sha256(state) == sha


def pack_state(tensors: Mapping[str, torch.Tensor], *, block: int, version: int) -> bytes:
    """The audit upload: the state as safetensors, with the block and version of the audited round."""
    return pack(dict(tensors), {"kind": "inner_state", "state_format": STATE_FORMAT, "block_index": str(block),
                                "base_version": str(version)})


def unpack_state(body: bytes, shapes: Mapping[str, tuple[int, ...]], *, block: int, version: int,
                 scalars: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """An audit upload as state tensors, every name, dtype and shape checked against block ``block``'s
    ``shapes``, each parameter's AdamW state holding both moments and exactly ``scalars`` (the leaves of the optimiser
    the replay builds: :data:`STEP_SCALARS` or :data:`ROUND_SCALARS`); a :class:`ProtocolError` (422) that names what
    is wrong."""
    try:
        tensors, meta = unpack(body, source="inner state")
    except CheckpointError as exc:  # not safetensors, corrupt, too many tensors: what it uploaded is no state
        raise ProtocolError(422, str(exc), Reason.AUDIT_FORMAT) from exc
    if meta.get("kind") != "inner_state" or meta.get("state_format") != STATE_FORMAT:
        raise ProtocolError(422, f"an audit upload is an inner_state of format {STATE_FORMAT}; got "
                            f"{meta.get('kind')!r} format {meta.get('state_format')!r}", Reason.AUDIT_FORMAT)
    if meta.get("block_index") != str(block) or meta.get("base_version") != str(version):
        raise ProtocolError(422, f"the state is for block {meta.get('block_index')} version {meta.get('base_version')}, "
                            f"the audit asks for block {block} version {version}", Reason.AUDIT_FORMAT)
    for name, t in tensors.items():
        if t.dtype != torch.float32 or not bool(torch.isfinite(t).all()):
            raise ProtocolError(422, f"state tensor {name!r} must be finite float32", Reason.AUDIT_FORMAT)
        if name.startswith(RESIDUAL) and name[len(RESIDUAL):] in shapes:
            want: tuple[int, ...] = shapes[name[len(RESIDUAL):]]
        elif name.startswith(ADAM) and name.count("/") >= 2:
            param, _, leaf = name[len(ADAM):].rpartition("/")
            if param not in shapes or leaf not in (*MOMENTS, *SCALARS):
                raise ProtocolError(422, f"unknown state tensor {name!r}", Reason.AUDIT_FORMAT)
            want = () if leaf in SCALARS else shapes[param]
        else:
            raise ProtocolError(422, f"unknown state tensor {name!r}", Reason.AUDIT_FORMAT)
        if tuple(t.shape) != want:
            raise ProtocolError(422, f"state tensor {name!r} has shape {tuple(t.shape)}, expected {want}", Reason.AUDIT_FORMAT)
    _check_whole(tensors, scalars)
    return tensors


def _check_whole(tensors: Mapping[str, torch.Tensor], scalars: tuple[str, ...]) -> None:
    """Every parameter's AdamW state whole and in range (its names and shapes checked already): both moments and
    exactly ``scalars``, ``step`` >= 0, bias corrections in [0, 1], v >= 0. A state the worker committed to may still
    be one the replay's optimiser does not hold (``step`` where it reads c1 and c2, or the other way round), and a
    replay from it would break, which blames no one (the coordinator's own fault): so it fails the audit here."""
    if scalars not in (STEP_SCALARS, ROUND_SCALARS):
        raise ValueError(f"scalars must be {STEP_SCALARS} or {ROUND_SCALARS}, got {scalars}")
    want = {*MOMENTS, *scalars}
    leaves: dict[str, set[str]] = {}
    for name in tensors:
        if name.startswith(ADAM):
            param, _, leaf = name[len(ADAM):].rpartition("/")
            leaves.setdefault(param, set()).add(leaf)
    for param, have in leaves.items():
        if have != want:
            raise ProtocolError(422, f"the state of {param!r} holds {', '.join(sorted(have))}; this run's inner "
                                f"optimiser holds {', '.join(sorted(want))} for each parameter", Reason.AUDIT_FORMAT)
        key = f"{ADAM}{param}/"
        if bool((tensors[key + "exp_avg_sq"] < 0).any()):
            raise ProtocolError(422, f"{key}exp_avg_sq holds a negative value", Reason.AUDIT_FORMAT)
        if "step" in have and not float(tensors[key + "step"]) >= 0:
            raise ProtocolError(422, f"{key}step must be >= 0", Reason.AUDIT_FORMAT)
        for leaf in ("c1", "c2"):
            if leaf in have and not 0.0 <= float(tensors[key + leaf]) <= 1.0:
                raise ProtocolError(422, f"{key}{leaf} (a bias correction) must be in [0, 1]", Reason.AUDIT_FORMAT)


def load_inner_state(opt: torch.optim.Optimizer, names: Mapping[int, str],
                     tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Put the AdamW state of ``tensors`` into ``opt`` (fresh: no state yet), on its parameters' device; returns the
    residual it holds (on the host, where pushes are encoded).

    The step counter goes where torch's own ``load_state_dict`` puts it: on the parameter's device for a fused or
    capturable group (their kernels read it there), on the host otherwise; a round optimiser's bias corrections are
    host floats."""
    index = {id(q): j for j, q in enumerate(_params(opt))}
    for group in opt.param_groups:
        on_device = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            key = f"{ADAM}{names[index[id(p)]]}/"
            if key + MOMENTS[0] not in tensors:
                continue
            st = opt.state[p]
            for m in MOMENTS:
                st[m] = tensors[key + m].to(p.device, copy=True)
            if key + "step" in tensors:
                st["step"] = tensors[key + "step"].to(p.device if on_device else "cpu", dtype=torch.float32, copy=True)
            for leaf in ("c1", "c2"):
                if key + leaf in tensors:
                    st[leaf] = float(tensors[key + leaf])
    return {n: t.clone() for n, t in residual_of(tensors).items()}


def residual_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The error-feedback residual a state holds, by parameter name (the tensors themselves)."""
    return {n[len(RESIDUAL):]: t for n, t in tensors.items() if n.startswith(RESIDUAL)}
