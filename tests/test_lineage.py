"""coordinator.lineage.trace on a store's records: which of a worker's earlier rounds an audit replays to derive the
moments an audited round started from, and where the records cannot say (the uploaded moments then stand).

The rule it mirrors is the worker's (``Worker._published_moments``, ``InnerRounds.begin``); the HTTP tests in
``tests/test_audit.py`` check that honest workers pass audits derived this way and a moment forger does not."""

from __future__ import annotations

from pathlib import Path

import pytest

from blocktrain.coordinator.lineage import MAX_ROUNDS, StoreRecords, trace
from blocktrain.coordinator.store import Store
from blocktrain.protocol.moments import InnerStart

pytestmark = pytest.mark.timeout(60)


def store_with(tmp_path: Path, kept: list[int], published: list[int], versions: int = 12) -> Store:
    """A store where worker ``w`` registered on block 0 and kept rounds against ``kept``, and moments were published
    with the versions ``published``."""
    s = Store(tmp_path, fsync=False)
    with s.tx():
        s.workers.register_worker("w", 0, True, 0.0, 1e9)
        for v in range(versions):
            s.rounds.add_version(0, v, f"weights{v}", f"sha{v}", 0.0,
                                 moments_blob=f"moments{v}" if v in published else None)
        for v in kept:
            keep(s, v)
    return s


def keep(s: Store, v: int) -> None:
    s.updates.record_update(0, v, "w", samples=12, norm=1.0, compression="int8", blob=f"update{v}", arrived=0.0,
                            arrival_s=0.0)


def links(s: Store, v: int, start: InnerStart = InnerStart.SHARED_MV) -> list[tuple[int, str | None]] | None:
    lineage = trace(StoreRecords(s), 0, "w", v, start, every=3)
    return None if lineage is None else [(link.version, link.loads) for link in lineage.links]


def test_rounds_back_to_the_last_load_or_the_first_round(tmp_path: Path) -> None:
    s = store_with(tmp_path, kept=[0, 1, 2, 3], published=[3])
    assert links(s, 2) == [(0, None), (1, None), (2, None)]  # from zero moments at the worker's first round
    assert links(s, 3) == [(3, "moments3")]  # a sync version: its start replaces both moments
    assert links(s, 4) == [(3, "moments3"), (4, None)]  # its own went on from version 3's round
    lineage = trace(StoreRecords(s), 0, "w", 4, InnerStart.SHARED_MV, every=3)
    assert lineage is not None and [(x.kept.version if x.kept else None, x.weights) for x in lineage.links] == [
        (3, "weights3"), (None, None)]  # what the earlier round trained from; the audited one is the case's own
    assert links(s, 4, InnerStart.FRESH) == [(4, None)]  # every round from zero moments


def test_a_worker_that_missed_a_sync_loads_it_and_a_missing_publication_goes_on(tmp_path: Path) -> None:
    assert links(store_with(tmp_path / "a", kept=[0, 1, 2], published=[3]), 4) == [(4, "moments3")]
    # nothing published with version 3: its own moments went on across it
    assert links(store_with(tmp_path / "b", kept=[1, 2, 3], published=[]), 4) == [(1, None), (2, None), (3, None),
                                                                                   (4, None)]
    # shared_v replaces v and zeroes m at a load: a full start; local_m keeps its m, so the walk goes on past it
    s = store_with(tmp_path / "c", kept=[2, 3], published=[3])
    assert links(s, 4, InnerStart.SHARED_V) == [(3, "moments3"), (4, None)]
    assert links(s, 4, InnerStart.LOCAL_M) == [(2, None), (3, "moments3"), (4, None)]


def test_a_new_registration_starts_afresh(tmp_path: Path) -> None:
    s = store_with(tmp_path, kept=[0, 1], published=[])
    with s.tx():
        s.workers.register_worker("w", 0, True, 1.0, 1e9)  # a new process under the same name
    assert links(s, 2) == [(2, None)]
    with s.tx():
        keep(s, 2)
    assert links(s, 3) == [(2, None), (3, None)]


def test_where_the_records_cannot_derive_the_moments(tmp_path: Path) -> None:
    far = list(range(MAX_ROUNDS + 2))
    assert links(store_with(tmp_path / "a", kept=far, published=[]), MAX_ROUNDS + 2, InnerStart.CARRIED) is None
    assert links(store_with(tmp_path / "b", kept=far[:3], published=[]), 3, InnerStart.CARRIED) is not None
    s = store_with(tmp_path / "c", kept=[0, 2], published=[])
    with s.tx():
        s.updates.record_group(0, 1, "x", ["w", "x"])  # its round against 1 went into a group's mean
    assert links(s, 3) is None and links(s, 1) is not None
    s = store_with(tmp_path / "d", kept=[0], published=[])
    with s.tx():
        s.workers.register_worker("w", 0, True, 1.0, 1e9, hivemind=True)  # a mean may stand for any of its rounds
    assert links(s, 2) is None
    assert trace(StoreRecords(s), 0, "nobody", 2, InnerStart.SHARED_MV, every=3) is None


def test_a_group_of_an_earlier_session_does_not_stop_the_trace(tmp_path: Path) -> None:
    """A worker that averaged in hivemind groups, then registered again without them, started its inner state afresh:
    the earlier session's group rounds no longer stand between it and its records."""
    s = store_with(tmp_path, kept=[], published=[])
    with s.tx():
        s.workers.register_worker("w", 0, True, 0.0, 1e9, hivemind=True)
        s.updates.record_group(0, 1, "x", ["w", "x"])
        s.workers.register_worker("w", 0, True, 1.0, 1e9)  # a new process, no groups
        keep(s, 2)
    assert links(s, 3) == [(2, None), (3, None)]
    with s.tx():
        s.updates.record_group(0, 3, "x", ["w", "x"])  # in this session a mean stood for its round against 3
    assert links(s, 4) is None


def test_a_registration_from_before_the_store_had_sessions_is_not_traced(tmp_path: Path) -> None:
    """A worker still running across the coordinator's upgrade never registered in a session: its rows of every
    earlier registration look alike (NULL), so its moments cannot be derived and stay its claim."""
    s = store_with(tmp_path, kept=[0, 1], published=[])
    with s.tx():
        s.db.execute("UPDATE workers SET session=NULL, hivemind=NULL")
        s.db.execute("UPDATE updates SET session=NULL")
    assert links(s, 2) is None
    with s.tx():
        s.workers.register_worker("w", 0, True, 1.0, 1e9)  # its next registration starts the first session
    assert links(s, 2) == [(2, None)]


@pytest.mark.parametrize("every", [3, 12])
@pytest.mark.parametrize("start", [InnerStart.SHARED_MV, InnerStart.SHARED_V, InnerStart.LOCAL_M, InnerStart.CARRIED,
                                   InnerStart.FRESH])
def test_the_in_process_records_trace_as_the_store_does_over_a_long_run(tmp_path: Path, start: InnerStart,
                                                                        every: int) -> None:
    """The in-process rounds' records (coordinator.local_records, pruned to what a trace reaches) give the lineage the
    store gives, at every version of a 40-version run with rounds sat out and a sharing version whose moments were
    never published, moments shared every 3 or 12 versions (a round may load moments published 11 versions back)."""
    import torch

    from blocktrain.coordinator.local_records import LocalRecords

    skipped, missing = {5, 11, 12, 13, 20, 27}, {9, 24}
    s = Store(tmp_path, fsync=False)
    local = LocalRecords(0, {"w": 1}, every)
    with s.tx():
        s.workers.register_worker("w", 0, True, 0.0, 1e9)

    def shape(records: StoreRecords | LocalRecords, v: int) -> list[tuple[int, bool, int | None]] | None:
        lineage = trace(records, 0, "w", v, start, every)
        return None if lineage is None else [(x.version, x.loads is not None, x.kept.version if x.kept else None)
                                             for x in lineage.links]

    traced = 0
    for v in range(40):
        moments = v > 0 and v % every == 0 and v not in missing
        with s.tx():
            s.rounds.add_version(0, v, f"weights{v}", f"sha{v}", 0.0, moments_blob=f"moments{v}" if moments else None)
        local.publish(v, {"w": torch.full((2,), float(v))})
        if moments:
            local.publish_moments(v, f"moments{v}".encode())
        want = shape(StoreRecords(s), v)
        assert shape(local, v) == want, v
        traced += want is not None
        if v not in skipped:
            with s.tx():
                keep(s, v)
            local.keep("w", v, f"update{v}".encode(), 12)
    resets = start is InnerStart.FRESH or (start.shares and not start.keeps_own and every == 3)  # a full start often
    assert traced == 40 if resets else traced >= 8
    assert len(local.weights) <= 2 * MAX_ROUNDS + 2 * every  # pruned as it goes
