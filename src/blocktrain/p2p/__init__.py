"""Peer-to-peer averaging of a block's workers on hivemind (issue 23): the optional ``hivemind`` engine.

Workers of block k at version v find each other on a hivemind DHT under a key naming the run, the block and
the version, all-reduce their deltas weighted by samples, and one member uploads the group's mean to the
coordinator, which validates it as it validates one worker's update (:mod:`blocktrain.coordinator.groups`).

* :mod:`.trust`: the coordinator as the authority that admits peers (signed access tokens, member cards).
* :mod:`.groups`: one round's group all-reduce, and the DHT a worker joins.

hivemind is an optional extra (``pip install 'blocktrain[hivemind]'``); nothing outside this package imports
it, and this package is imported only where the engine is chosen.
"""

from __future__ import annotations

import importlib.util

from blocktrain.errors import ConfigError

__all__ = ["hivemind_available", "require_hivemind"]


def hivemind_available() -> bool:
    return importlib.util.find_spec("hivemind") is not None


def require_hivemind() -> None:
    """ConfigError saying how to install the extra, where hivemind is missing."""
    if not hivemind_available():
        raise ConfigError("the hivemind averaging engine needs hivemind: pip install 'blocktrain[hivemind]' "
                          "(or use --averaging coordinator, the default)")
