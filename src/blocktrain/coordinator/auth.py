"""Who is asking: the coordinator's bearer tokens, and the refusals of requests without a valid one.

Tokens are stored hashed (``tokens``, :class:`.tables.TokenTable`; ``blocktrain token add NAME`` creates one) and
cached in memory; a lookup compares the request's hash with every cached one in constant time. An unknown token
re-reads the table (a token added while the coordinator runs), at most once per :data:`TOKEN_RELOAD_SECONDS`, and
the coordinator's tick re-reads it every :data:`TOKEN_REFRESH_SECONDS`, so a token replaced or revoked by another
process (``blocktrain token add/revoke``) stops working within seconds. A quarantined worker's token is revoked
(:mod:`.conduct`) and answered 403. Updates refused for want of a valid
token are counted in memory only, and logged at a limited rate: unauthenticated traffic writes nothing to disk.

:meth:`Tokens.worker_for_token`, :meth:`Tokens.refuse` and :meth:`Tokens.refused` are called without the coordinator's
lock (from every request, in the HTTP layer's threads): the first two read the cache, which is replaced whole, never
changed in place (an unknown token due a re-read of the table re-reads it on the store's second connection, under
the front's reload claim, never under the coordinator's lock);
the second appends to a queue that :meth:`Tokens.unauthenticated_rejections` folds in, under the lock, as every other
method is called.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections import deque
from typing import NoReturn

from blocktrain.coordinator.conduct import Conduct
from blocktrain.coordinator.store import Store, hash_token
from blocktrain.errors import ProtocolError
from blocktrain.protocol.codes import Reason

log = logging.getLogger(__name__)

TOKEN_RELOAD_SECONDS = 1.0  # seconds between re-reads of the token table caused by unknown tokens
TOKEN_REFRESH_SECONDS = 5.0  # seconds between re-reads from the coordinator's tick: a token replaced or revoked by
# 'blocktrain token add/revoke' while it runs stops working within this (a cached one stayed valid until a restart)
UNAUTH_LOG_SECONDS = 10.0  # at most one log line per this many seconds about unauthenticated updates


class Tokens:
    """The token cache of one coordinator and its count of unauthenticated refusals."""

    def __init__(self, store: Store, conduct: Conduct) -> None:
        self.store, self.conduct = store, conduct
        # (token hash -> worker name, a quarantined worker's revoked token hash -> its name): replaced whole, as one
        # object, on a re-read, so a reader never sees the new tokens beside the old revocations
        self._cache: tuple[dict[str, str], dict[str, str]] = ({}, {})
        self._last_reload = float("-inf")  # time.monotonic() of the last re-read of the token table
        self._unauth: deque[str] = deque()  # reasons of refused unauthenticated updates, not yet counted
        self._unauth_counts: dict[str, int] = {}  # reason -> refused unauthenticated updates (never stored)
        self._unauth_logged = float("-inf")  # time.monotonic() of the last log line about them
        self._unauth_quiet = 0  # refusals not logged since that line
        self._reload()

    def _reload(self) -> None:
        with self.store.reads.snapshot():  # the second connection, both tables from one commit: no lock needed
            tokens = {h: name for name, h in self.store.token_reads.token_hashes()}
            revoked = self.store.revocation_reads.revoked_tokens()
        self._cache = (tokens, revoked)

    def _lookup(self, h: str, tokens: dict[str, str]) -> str | None:
        """The worker of token hash ``h`` in ``tokens``, revoked or not (constant time in which hash matches)."""
        found = None
        for known, name in tokens.items():
            if hmac.compare_digest(h, known):
                found = name
        return found

    def worker_for_token(self, token: str) -> str | None:
        """(Unlocked.) Constant-time comparison against every cached hash; None if unknown or revoked since cached."""
        found = self._lookup(hash_token(token), self._cache[0])
        return None if found in self.conduct.revoked else found

    def reload_due(self) -> bool:
        """(Unlocked.) Whether an unknown token would re-read the table now (at most once per TOKEN_RELOAD_SECONDS)."""
        return time.monotonic() - self._last_reload >= TOKEN_RELOAD_SECONDS

    def refuse(self, token: str | None) -> NoReturn:
        """(Unlocked.) The refusal of a token the cache does not admit: 403 if it is a quarantined worker's (revoked
        since the cache was read, or by a quarantine the table holds), 401 otherwise. From the cache alone, so a flood
        of made-up tokens neither queries the database nor waits for the coordinator's lock."""
        if not token:
            raise ProtocolError(401, "missing bearer token; send 'Authorization: Bearer <token>'", Reason.AUTH)
        h = hash_token(token)
        tokens, revoked_hashes = self._cache
        name = self._lookup(h, tokens)
        revoked = name if name in self.conduct.revoked else revoked_hashes.get(h)
        if revoked is not None:
            raise ProtocolError(403, f"worker {revoked!r} is quarantined and its token revoked: its updates were "
                                "refused too often for what they are or do; ask the run's operator", Reason.QUARANTINED)
        raise ProtocolError(401, "unknown bearer token; create one with 'blocktrain token add NAME'", Reason.AUTH)

    def authenticate(self, token: str | None) -> str:
        """(Under the front's reload claim, not the coordinator's lock.) The worker a request's token names (an
        unknown token re-reads the table on the store's second connection, at most once per TOKEN_RELOAD_SECONDS, so
        unknown tokens cannot hammer the database); 401 or 403 otherwise."""
        name = self.worker_for_token(token) if token else None
        if name is None and token and self.reload_due():
            self._last_reload = time.monotonic()  # a token may have been added by 'blocktrain token add' while we run
            self._reload()
            name = self.worker_for_token(token)
        if name is None:
            self.refuse(token)
        return name

    def refresh(self) -> None:
        """(From the tick, under the front's reload claim.) Re-read the token table if it was not read for TOKEN_REFRESH_SECONDS."""
        now = time.monotonic()
        if now - self._last_reload >= TOKEN_REFRESH_SECONDS:
            self._last_reload = now
            self._reload()

    def add_token(self, name: str, now: float) -> str:
        token = self.store.tokens.add_token(name, now)  # ConfigError for a name the answers cannot carry
        self._reload()
        return token

    def refused(self, k: int | None, exc: ProtocolError) -> None:
        """(Unlocked.) Count (in memory) and log, at a limited rate, an update refused for want of a valid token."""
        self._unauth.append(exc.reason)
        now = time.monotonic()
        if now - self._unauth_logged < UNAUTH_LOG_SECONDS:  # a race between two threads costs one log line at most
            self._unauth_quiet += 1
            return
        quiet, self._unauth_quiet, self._unauth_logged = self._unauth_quiet, 0, now
        more = f" (and {quiet} more in the last {UNAUTH_LOG_SECONDS:g} s)" if quiet else ""
        log.warning("rejected unauthenticated update for block %s: %d %s: %s%s", k, exc.status, exc.reason, exc, more)

    def unauthenticated_rejections(self) -> dict[str, int]:
        """Refused unauthenticated updates since start-up, by reason (kept in memory only)."""
        while self._unauth:
            reason = self._unauth.popleft()
            self._unauth_counts[reason] = self._unauth_counts.get(reason, 0) + 1
        return dict(self._unauth_counts)
