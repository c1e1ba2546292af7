"""The inner optimiser of a round, and what it starts each round from (issue 43: volunteers that share their state).

A worker trains H inner AdamW steps per round from the published weights W_v. What its two moments hold at the
round's start decides how far those H steps go (``benchmarks/results/averaging-scaling.md``): from m = v = 0 the
first steps are sign-like (step 1 moves every coordinate by lr whatever its gradient), so at H <= 6 six workers
move the block about three times as far as one machine at six times the batch, and the outer step amplifies it.
:class:`InnerStart` names what a round starts from:

* ``fresh``:   m = 0, v = 0, both bias corrections restarted (DiLoCo with a reset inner state);
* ``carried``: the worker's own m and v from its previous round (DiLoCo's inner optimiser kept);
* ``shared_v``: v = the coordinator's published mean v_bar of the workers' second moments (a full estimate: no bias
  correction), m = 0 with its own bias correction restarted, so step 1 is g / sqrt(v_bar), not sign(g);
* ``shared_mv``: m and v the published means m_bar and v_bar (both full estimates);
* ``local_m``: v = v_bar, m the worker's own, carried with its bias correction.

:class:`RoundAdamW` is AdamW (Loshchilov & Hutter 2019, Alg. 2; torch's ``AdamW`` numerics) whose two moments keep
separate bias corrections c1 = 1 - beta1^t1 and c2 = 1 - beta2^t2, stored as such (a loaded full estimate has c = 1):

    m <- beta1 m + (1 - beta1) g ;  c1 <- 1 - beta1 (1 - c1)
    v <- beta2 v + (1 - beta2) g^2 ;  c2 <- 1 - beta2 (1 - c2)
    W <- W (1 - lr wd) - lr (m / c1) / (sqrt(v / c2) + eps)

With c1 = c2 = 1 - beta^t it is torch's AdamW step for step (``tests/test_inner.py``). The moments a worker pushes
are the bias-corrected estimates m / c1 and v / c2 (:func:`moment_estimates`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from blocktrain.config import TrainConfig
from blocktrain.protocol.inner_state import ROUND_SCALARS, STEP_SCALARS, inner_state
from blocktrain.protocol.moments import M_PREFIX, V_PREFIX, InnerStart
from blocktrain.train.step import ADAMW_BETAS, decay_groups, make_optimizer

__all__ = ["InnerRounds", "InnerStart", "OptimizerFactory", "RoundAdamW", "Snapshot", "inner_scalars", "make_inner_optimizer",
           "make_round_optimizer", "moment_estimates", "start_round"]

OptimizerFactory = Callable[[], tuple[torch.optim.Optimizer, dict[int, str]]]  # -> (optimiser, index -> name)
Snapshot = dict[str, dict[str, object]]  # parameter name -> its state: (host tensor, its device) pairs, host floats


class RoundAdamW(torch.optim.Optimizer):
    """AdamW with a bias correction per moment (module docstring); state per parameter: ``exp_avg``,
    ``exp_avg_sq`` (the parameter's shape and device) and the host floats ``c1``, ``c2``."""

    def __init__(self, params: Iterable[dict], lr: float, betas: tuple[float, float] = ADAMW_BETAS,
                 eps: float = 1e-8, foreach: bool | None = None) -> None:
        if lr < 0 or eps < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"invalid RoundAdamW settings: lr {lr}, betas {betas}, eps {eps}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0})
        self.foreach = foreach  # every tensor of a bucket in one launch per op (None: on CUDA only)

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        """One step of every parameter with a gradient, as multi-tensor (``torch._foreach_*``) kernels: on CUDA (or
        with ``foreach=True``) the parameters of a group that share their (c1, c2), in practice all of them, step
        together, so a step costs a handful of kernel launches, not five per parameter (what bounds a small block's
        step on a GPU). Otherwise they step one tensor at a time through the same ops: on the CPU the multi-tensor
        ops loop over the tensors anyway, and a bucket-wide temporary (117 MB for the paper block) only costs
        memory and time (``benchmarks/results/optimizer-speed-cpu.json``)."""
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            buckets: dict[tuple[float, float], tuple[list[torch.Tensor], ...]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st.update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p), c1=0.0, c2=0.0)
                st["c1"] = c1 = 1.0 - beta1 * (1.0 - st["c1"])
                st["c2"] = c2 = 1.0 - beta2 * (1.0 - st["c2"])
                ps, gs, ms, vs = buckets.setdefault((c1, c2), ([], [], [], []))
                ps.append(p)
                gs.append(p.grad)
                ms.append(st["exp_avg"])
                vs.append(st["exp_avg_sq"])
            for (c1, c2), (ps, gs, ms, vs) in buckets.items():
                together = ps[0].is_cuda if self.foreach is None else self.foreach
                n = len(ps) if together else 1  # tensors per launch
                for i in range(0, len(ps), n):
                    _adamw_update(ps[i:i + n], gs[i:i + n], ms[i:i + n], vs[i:i + n], lr=lr, wd=wd, eps=eps,
                                  beta1=beta1, beta2=beta2, c1=c1, c2=c2)


def _adamw_update(ps: list[torch.Tensor], gs: list[torch.Tensor], ms: list[torch.Tensor], vs: list[torch.Tensor], *,
                  lr: float, wd: float, eps: float, beta1: float, beta2: float, c1: float, c2: float) -> None:
    """The update of the module docstring for tensors sharing (c1, c2), in place."""
    if wd:
        torch._foreach_mul_(ps, 1.0 - lr * wd)
    torch._foreach_lerp_(ms, gs, 1.0 - beta1)  # m <- beta1 m + (1 - beta1) g
    torch._foreach_mul_(vs, beta2)  # v <- beta2 v + (1 - beta2) g^2
    torch._foreach_addcmul_(vs, gs, gs, value=1.0 - beta2)
    denom = torch._foreach_div(vs, c2)  # sqrt(v / c2) + eps
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(ps, ms, denom, value=-lr / c1)  # W <- W - lr (m / c1) / denom


def make_round_optimizer(module: nn.Module, cfg: TrainConfig) -> tuple[RoundAdamW, dict[int, str]]:
    """:class:`RoundAdamW` over ``module``'s trainable parameters, with :func:`make_optimizer`'s groups, betas and
    index -> name map."""
    groups, names = decay_groups(module, cfg)
    return RoundAdamW(groups, lr=cfg.lr), names


def make_inner_optimizer(module: nn.Module, cfg: TrainConfig, start: InnerStart) -> tuple[torch.optim.Optimizer, dict[int, str]]:
    """The inner optimiser a round starting under ``start`` uses, with its index -> name map: :class:`RoundAdamW`
    where moments are shared (its bias corrections are per moment), torch's (fused) AdamW otherwise. The worker, the
    in-process rounds and the audit's replay all build it here."""
    return make_round_optimizer(module, cfg) if start.shares else make_optimizer(module, cfg)


def inner_scalars(start: InnerStart) -> tuple[str, ...]:
    """The per-parameter scalars the inner optimiser :func:`make_inner_optimizer` builds for ``start`` holds beside
    its two moments (what an audit upload of its state must name)."""
    return ROUND_SCALARS if start.shares else STEP_SCALARS


def _holders(opt: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimisers that hold ``opt``'s per-parameter state: its parts (train.step.MuonAdamW), else itself."""
    parts = getattr(opt, "parts", None)
    return list(parts) if parts else [opt]


def _params(opt: torch.optim.Optimizer, names: Mapping[int, str]) -> dict[str, torch.Tensor]:
    ps = [p for g in opt.param_groups for p in g["params"]]
    return {names[i]: p for i, p in enumerate(ps)}


def moment_estimates(opt: RoundAdamW, names: Mapping[int, str], prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The bias-corrected moments ``m / c1`` (``m/NAME``) and ``v / c2`` (``v/NAME``) of every parameter that has
    stepped, as float32 on its device, for the prefixes asked."""
    out: dict[str, torch.Tensor] = {}
    for n, p in _params(opt, names).items():
        st = opt.state.get(p)
        if not st:
            continue
        if M_PREFIX in prefixes:
            out[M_PREFIX + n] = (st["exp_avg"] / max(st["c1"], 1e-12)).float()
        if V_PREFIX in prefixes:
            out[V_PREFIX + n] = (st["exp_avg_sq"] / max(st["c2"], 1e-12)).float()
    return out


def start_round(opt: RoundAdamW, names: Mapping[int, str], start: InnerStart,
                published: Mapping[str, torch.Tensor] | None) -> None:
    """Set ``opt``'s state for a round under ``start``.

    ``published``: the moment estimates (``m/NAME``, ``v/NAME``) published with the round's version, loaded as full
    estimates (c = 1) where ``start`` shares them; None when nothing new was published since the worker's last round
    (the block's first round, or between the syncs of moments shared every k rounds, DES-LOC), where the worker goes
    on from its own state. Whatever the start, ``fresh`` zeroes both moments (c = 0) and ``shared_v`` zeroes m."""
    for n, p in _params(opt, names).items():
        st = opt.state[p]
        if not st or start is InnerStart.FRESH:
            st.clear()
            st.update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p), c1=0.0, c2=0.0)
        if start is InnerStart.SHARED_V:
            st["exp_avg"].zero_()
            st["c1"] = 0.0
        for prefix, moment, corr in ((M_PREFIX, "exp_avg", "c1"), (V_PREFIX, "exp_avg_sq", "c2")):
            if published is not None and prefix in start.shares and prefix + n in published:
                st[moment] = published[prefix + n].to(device=p.device, dtype=torch.float32, copy=True)
                st[corr] = 1.0


class InnerRounds:
    """One replica's inner optimiser over its rounds of one block, as the worker and the in-process rounds hold it.

    :meth:`begin` starts each round as ``start`` says; :meth:`committed` is the state a push commits to (what an
    audit replays from) and :meth:`moments` what a sharing round's push carries. ``factory`` builds the optimiser
    (default: :func:`make_inner_optimizer` over ``module``); ``fresh`` rounds build a new one each round."""

    def __init__(self, module: nn.Module, cfg: TrainConfig, start: InnerStart,
                 factory: OptimizerFactory | None = None) -> None:
        self.start = start
        self._factory = factory or (lambda: make_inner_optimizer(module, cfg, start))
        self.opt, self.names = self._factory()

    @property
    def shares(self) -> bool:
        """Whether a round starts from published moments (then :meth:`begin` takes them)."""
        return isinstance(self.opt, RoundAdamW) and bool(self.start.shares)

    def begin(self, published: Mapping[str, torch.Tensor] | None = None) -> None:
        """Start a round: ``fresh`` builds a new optimiser (m = v = 0); a shared start loads ``published`` (the
        moments published with the round's version; None: its own state goes on, :func:`start_round`); ``carried``
        keeps the state as it is."""
        if self.start is InnerStart.FRESH:
            self.opt, self.names = self._factory()
        elif isinstance(self.opt, RoundAdamW):
            start_round(self.opt, self.names, self.start, published)

    def snapshot(self) -> Snapshot:
        """A copy of the optimiser's state as it is (before a round begins), for :meth:`restore`: its tensors
        copied to the host (a device keeps no second optimiser state through the round), its host floats as they
        are (bit for bit, unlike :meth:`committed`'s float32)."""
        if self.start is InnerStart.FRESH:
            return {}
        holders = _holders(self.opt)
        return {n: {key: (v.to("cpu", copy=True), v.device) if isinstance(v, torch.Tensor) else v
                    for key, v in h.state[p].items()}
                for n, p in _params(self.opt, self.names).items() for h in holders if p in h.state}

    def restore(self, snapshot: Snapshot) -> None:
        """Undo a round whose push did not count: the optimiser's state back to ``snapshot``, taken before it began
        (a ``fresh`` round has nothing to undo: the next starts afresh anyway)."""
        if self.start is InnerStart.FRESH:
            return
        params = _params(self.opt, self.names)
        holders = _holders(self.opt)
        owner = {id(p): h for h in holders for g in h.param_groups for p in g["params"]}  # the part that steps p
        for h in holders:
            h.state.clear()
        for n, st in snapshot.items():  # each tensor back on the device it was taken from, in its part's state
            p = params[n]
            owner[id(p)].state[p] = {key: v[0].to(v[1], copy=True) if isinstance(v, tuple) else v
                                     for key, v in st.items()}

    def committed(self, residual: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The state this round starts from with the push's error-feedback ``residual``
        (:func:`blocktrain.protocol.inner_state.inner_state`): what the push commits to by its sha."""
        return inner_state(self.opt, self.names, residual)

    def moments(self, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor] | None:
        """The moment estimates a push carries for ``prefixes`` (None: none asked, or an optimiser without them)."""
        if not prefixes or not isinstance(self.opt, RoundAdamW):
            return None
        return moment_estimates(self.opt, self.names, prefixes)
