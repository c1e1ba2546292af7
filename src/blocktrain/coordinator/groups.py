"""The coordinator's side of hivemind averaging (issue 23): the DHT it bootstraps, the tokens it signs, and the
checks a group's upload must pass beyond those of one worker's update.

With ``--hivemind`` the coordinator is the run's authority (:class:`blocktrain.p2p.trust.Authority`, an RSA key
kept in the run directory) and a DHT peer that workers join first; both are published in ``/v1/status`` and in
every registration answer, so a worker needs no flag beyond ``--averaging hivemind``. A group upload is accepted
only if every member's proof verifies (signed, over its peer id and the round, by the key this coordinator
admitted that worker with, kept in the store), every member is registered on the block, is not quarantined
and has not already sent an update for the version, and the uploader is a member. A group mean refused by the
loss gate is refused whole; its members are recorded, and a member of two refused groups is quarantined
(:mod:`.conduct`): it may no longer push or join an accepted group.
"""

from __future__ import annotations

import logging
import secrets
from pathlib import Path
from typing import Any

from blocktrain.coordinator.conduct import Conduct
from blocktrain.coordinator.store import Store
from blocktrain.errors import ProtocolError
from blocktrain.protocol.codes import Reason
from blocktrain.protocol.group import GroupMember, round_scope

log = logging.getLogger(__name__)

class PeerHub:
    """The authority and the bootstrap DHT peer of one run (hivemind is imported only here)."""

    def __init__(self, run_root: Path, store: Store, host: str) -> None:
        from blocktrain.p2p import require_hivemind

        require_hivemind()
        import hivemind

        from blocktrain.p2p.trust import Authority, PeerAuthorizer, load_key

        run = store.meta.get_meta("p2p_run")
        if run is None:
            run = secrets.token_hex(8)
            with store.tx():
                store.meta.set_meta("p2p_run", run)
        self.run = run  # names this run's DHT keys and scopes every card
        self.store = store  # used under the coordinator's lock, as everywhere
        key = load_key(run_root / "coordinator" / "authority.der")
        self.authority = Authority(key)
        own = self.authority.issue("coordinator", key.get_public_key().to_bytes())
        # the same peer id and port after a restart, so the workers already in the run find it where they left it
        # (with new ones they would have formed a second DHT with the workers registered since)
        identity = str(run_root / "coordinator" / "dht.identity")
        port = store.meta.get_meta("p2p_port") or "0"

        def start(port: str) -> hivemind.DHT:
            authorizer = PeerAuthorizer(key, own, self.authority.public_key, issuer=self.authority)
            return hivemind.DHT(start=True, host_maddrs=[f"/ip4/{host}/tcp/{port}"], identity_path=identity,
                                authorizer=authorizer)

        try:
            self.dht = start(port)
        except Exception as exc:
            if port == "0":
                raise
            log.warning("the run's DHT port %s is taken (%s); it starts on another one: running workers join it again "
                        "when they next register", port, exc)
            self.dht = start("0")
        self.initial_peers = [str(a) for a in self.dht.get_visible_maddrs()]
        bound = next((a.split("/tcp/")[1].split("/")[0] for a in self.initial_peers if "/tcp/" in a), "0")
        if bound != port:
            with store.tx():
                store.meta.set_meta("p2p_port", bound)
        log.info("hivemind DHT up; workers join it at %s", ", ".join(self.initial_peers))

    def admit(self, worker: str, public_key: str) -> dict[str, Any]:
        """What a registering worker needs to join the run's DHT and groups (its token, signed now)."""
        try:
            answer = self.reissue(worker, public_key)  # refuses what is not a key before anything is stored
        except ValueError:
            raise ProtocolError(422, "p2p_key is not an RSA public key in OpenSSH form", Reason.P2P_KEY) from None
        with self.store.tx():
            self.store.meta.set_meta(f"p2p_key:{worker}", public_key)  # checks its proofs in group uploads
        return answer

    def reissue(self, worker: str, public_key: str) -> dict[str, Any]:
        """A new token for ``public_key`` (the key ``worker`` registered with: :meth:`admit` stored it), and the DHT to
        join; ValueError when it is not a key."""
        import base64

        return {"token": base64.b64encode(self.authority.issue(worker, public_key.encode())).decode(), **self.status()}

    def revoke(self, workers: list[str]) -> None:
        """The run's DHT peer refuses the requests of these quarantined workers (their tokens stay valid until they
        expire); handed to its process without waiting (called under the coordinator's lock), logged if it fails."""
        from blocktrain.p2p.groups import revoke_in

        try:
            revoke_in(self.dht, frozenset(workers), timeout_s=None)
        except Exception as exc:
            log.warning("could not hand the quarantined workers to the DHT process: %s", exc)

    def status(self) -> dict[str, Any]:
        return {"run": self.run, "initial_peers": self.initial_peers, "authority": self.authority.public_key.decode()}

    def members(self, group: tuple[GroupMember, ...], k: int, v: int) -> list[str]:
        """The workers the group names, in its order; 403 if a member's proof does not verify with the key this
        coordinator admitted it with (call under the coordinator's lock: it reads the store)."""
        from blocktrain.p2p.trust import proof_verifies

        scope = round_scope(self.run, k, v)
        for m in group:
            key = self.store.meta.get_meta(f"p2p_key:{m.worker}")
            if key is None or not proof_verifies(key.encode(), m.peer, scope, m.proof):
                raise ProtocolError(403, f"group member {m.peer} ({m.worker!r}) has no proof this coordinator admitted "
                                    f"for block {k} v{v}; the group's mean is refused whole", Reason.GROUP_MEMBER)
        names = [m.worker for m in group]
        if len(set(names)) != len(names):
            raise ProtocolError(422, "a worker appears twice in the group", Reason.GROUP)
        return names

    def close(self) -> None:
        self.dht.shutdown()


def check_members(store: Store, conduct: Conduct, uploader: str, names: list[str], k: int, v: int) -> None:
    """Every member registered on block k to average in groups, not quarantined, not already counted for v; the
    uploader among them (called under the coordinator's lock, before the mean's checks, so that a mean naming workers
    it may not name is refused before it is recorded against them, and again as it is accepted)."""
    if uploader not in names:
        raise ProtocolError(403, f"worker {uploader!r} uploads a group it is not a member of", Reason.GROUP)
    for name in names:
        row = store.workers.worker(name)
        if row is None or row.block != k:
            raise ProtocolError(409, f"group member {name!r} is not registered on block {k}", Reason.GROUP_MEMBER)
        if not store.workers.averages_in_groups(name):  # it pushes its own deltas now (its trace would end here)
            raise ProtocolError(409, f"group member {name!r} is not registered to average in groups",
                                Reason.GROUP_MEMBER)
        if conduct.quarantined(name):
            raise ProtocolError(403, f"group member {name!r} is quarantined; the group's mean is refused", Reason.QUARANTINED)
        if store.updates.submitted(k, v, name):
            raise ProtocolError(409, f"group member {name!r} already counts for block {k} version {v}", Reason.DUPLICATE)

