"""Block objectives behind one seam: :class:`~blocktrain.objectives.base.Objective`.

A run config names its objective (``RunConfig.objective``); :func:`get_objective`
maps the name to its implementation through one registry. The built-ins are
``stack`` and ``diffusion``; :func:`register_objective` adds another, and nothing
outside this package needs to change for it. Objective code never imports network code.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from blocktrain.config import OBJECTIVE_NAMES, RunConfig
from blocktrain.config import Objective as ObjectiveKind
from blocktrain.errors import ConfigError
from blocktrain.objectives.base import LocalLoss, Objective, compose_logits
from blocktrain.objectives.diffusion import DiffusionObjective
from blocktrain.objectives.stack import StackObjective

_REGISTRY: dict[str, Callable[[RunConfig], Objective]] = {
    ObjectiveKind.STACK: StackObjective,
    ObjectiveKind.DIFFUSION: DiffusionObjective,
}

# what every objective must have (the Protocol's fields and methods), checked once per factory by get_objective
_MEMBERS = frozenset(Objective.__annotations__) | {n for n, v in vars(Objective).items()
                                                    if callable(v) and not n.startswith("_")}
_CHECKED: set[Callable[[RunConfig], Objective]] = set(_REGISTRY.values())


def register_objective(name: str, factory: Callable[[RunConfig], Objective]) -> None:
    """Make ``RunConfig(objective=name)`` train, evaluate and average with ``factory(cfg)``."""
    if name in _REGISTRY and _REGISTRY[name] is not factory:
        raise ConfigError(f"an objective named {name!r} is registered already; choose another name")
    if not name.isidentifier():
        raise ConfigError(f"an objective's name must be an identifier, got {name!r}")
    _REGISTRY[name] = factory
    OBJECTIVE_NAMES.add(name)  # run configs may now name it


def unregister_objective(name: str) -> None:
    """Forget a plug-in objective registered with :func:`register_objective` (the built-in ones stay)."""
    if name in {o.value for o in ObjectiveKind}:
        raise ConfigError(f"{name!r} is a built-in objective; only plug-ins can be unregistered")
    factory = _REGISTRY.pop(name, None)
    if factory is None:
        raise ConfigError(f"no plug-in objective named {name!r} is registered")
    _CHECKED.discard(factory)
    OBJECTIVE_NAMES.discard(name)


def objective_names() -> list[str]:
    return sorted(_REGISTRY)


def get_objective(cfg: RunConfig) -> Objective:
    """The objective a run's config names."""
    try:
        factory = _REGISTRY[cfg.objective]
    except KeyError:
        raise ConfigError(f"unknown objective {cfg.objective!r}; known: {', '.join(objective_names())} "
                          "(a plug-in objective must be registered with blocktrain.objectives.register_objective)") from None
    objective = factory(cfg)
    if factory not in _CHECKED:
        missing = sorted(m for m in _MEMBERS if not hasattr(objective, m))
        if missing:
            raise ConfigError(f"the objective registered as {cfg.objective!r} lacks {', '.join(missing)}, which "
                              "blocktrain.objectives.base.Objective asks of every objective (one written for an "
                              "earlier release: add them)")
        _CHECKED.add(factory)
    return objective


def build_block(cfg: RunConfig, k: int) -> nn.Module:
    """A freshly initialised block k of the run's objective."""
    return get_objective(cfg).build_block(k)


__all__ = ["LocalLoss", "Objective", "build_block", "compose_logits", "get_objective", "objective_names",
           "register_objective", "unregister_objective"]
