"""hivemind's averager as BlockTrain uses it: one block's deltas all-reduced all or nothing, within bounds.

:class:`BlockAverager` is hivemind's ``DecentralizedAverager`` (1.1.12, pinned) with three changes:

* its all-reduce is used only whole (:class:`WholeRunner`): a member that fails or stalls its slice, a sender that
  one reducer did not take in full, an auxiliary member or a weight other than 1 raise :class:`PartialGroupError`
  for every member that sees it, where hivemind would put a member's own values in a failed slice and average a
  slice over the senders left, logging only;
* every wait of its exchange is bounded (:func:`exchange_timeouts`), and its tensors' lock is taken with a deadline
  (:meth:`BlockAverager.tensors_within`);
* a peer's copy of the block's weights is pulled within a byte budget and a deadline (:meth:`BlockAverager.pull_state`).

hivemind names its RPC handlers after the averager's class; :attr:`BlockAverager.RPC_NAME` keeps the name they had
before the class was renamed, so peers of either release still meet.
:mod:`.groups` builds one per block and runs a round's exchange with it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import signal
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import aclosing, contextmanager
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import AllreduceException
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import as_aiter, azip
from hivemind.utils.streaming import combine_from_streaming
from hivemind.utils.timed_storage import get_dht_time

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 60.0  # seconds a new averager process may take to be ready (hivemind waits unbounded)
MIN_CHUNK_S = 1.0  # seconds an all-reduce waits for a peer's next chunk at least, however short the matchmaking


def exchange_timeouts(matchmaking_s: float) -> dict[str, float]:
    """The bounds of one group's all-reduce, for hivemind's averager (1.1.x leaves each unbounded unless told):
    a sender whose next chunk is ``next_chunk_timeout`` late is dropped (which fails the group, see
    :class:`WholeRunner`), a reducer whose next result is ``reducer_timeout`` late counts as failed (it waits for
    every sender's chunk first: twice the senders' bound, as hivemind requires more), and the all-reduce stops
    after ``allreduce_timeout`` whatever it waits for (later still, so that a late peer is named as such first).

    Derived from the matchmaking time, as the worker's budget for a round's exchange is (three windows: the
    matchmaking and two for the exchange): a chunk later than two windows could not finish within it, and the
    all-reduce's own bound frees the averager's tensors (which it holds throughout) for a later round when its
    caller has stopped waiting (:meth:`GroupAverager.average` gives up at its own timeout)."""
    chunk = max(MIN_CHUNK_S, 2.0 * matchmaking_s)
    return {"next_chunk_timeout": chunk, "sender_timeout": chunk, "reducer_timeout": 2.0 * chunk,
            "allreduce_timeout": 3.0 * chunk}


def start_quietly(process: Any, timeout: float = READY_TIMEOUT_S) -> None:
    """Start a hivemind background process with SIGINT ignored in it, the caller's handler kept, and wait at most
    ``timeout`` seconds until it is ready (TimeoutError past it; the process is the caller's to shut down).

    hivemind's own ``run_in_background`` sets SIGINT to ignored in the *calling* process for good (the
    worker's Ctrl-C would stop working) and fails outside the main thread; this works around both.
    """
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited by the forked child only
        try:
            process.start()
        finally:
            signal.signal(signal.SIGINT, previous)
    else:
        process.start()
    process.wait_until_ready(timeout)


class StateTooLargeError(Exception):
    """A peer's state stream ran past the bytes the block's weights take."""


class PartialGroupError(AllreduceException):  # type: ignore[misc]
    """A group's all-reduce did not average every member's whole delta at weight 1 (a failed or stalled slice, a
    dropped sender, an auxiliary member or another weight): its result is no group mean, and is not used."""


class TensorsBusyError(Exception):
    """The averager's tensors stayed locked past the caller's deadline (an all-reduce it stopped waiting for)."""


class WholeRunner(AllReduceRunner):  # type: ignore[misc]
    """hivemind's butterfly all-reduce, all or nothing: a sender is taken only at weight 1, and a sender dropped by
    this member's reducer (refused, late or cut off) ends the whole all-reduce here instead of averaging the slice
    over the senders left.

    Ending it is what tells the other members: this reducer sends no further results, so every other member sees it
    fail (hivemind's ``failed_size``) and fails the group too (:meth:`BlockAverager._run_allreduce_inplace_`);
    averaging on over fewer senders, it sent those members a mean they could not tell from a whole one."""

    failure: PartialGroupError | None = None  # why this member's reducer ended the all-reduce, if it did

    async def _ban_sender(self, peer_id: PeerID) -> None:
        async with self.banlock:
            if peer_id not in self.banned_senders:
                self.banned_senders.add(peer_id)  # not the reducer's on_sender_failed: no slice over fewer senders
                if self.failure is None:
                    self.failure = PartialGroupError(f"sender {peer_id} was dropped from the all-reduce (refused, "
                                                     "late or cut off)")
                self.finalize(exception=self.failure)

    async def _accumulate_parts_streaming(self, stream: AsyncIterator[averaging_pb2.AveragingData],
                                          sender_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        async with aclosing(super()._accumulate_parts_streaming(self._at_unit_weight(stream), sender_index)) as parts:
            async for message in parts:
                yield message

    async def _at_unit_weight(self, stream: AsyncIterator[averaging_pb2.AveragingData]
                              ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """A sender's parts, refused at the first whose weight is not exactly 1 (each member sends s_i x Delta_i at
        weight 1; a reducer divided by the senders' own weights, where -1 against 1 leaves a zero denominator)."""
        async for message in stream:
            if message.weight != 1.0:
                if self.failure is None:
                    self.failure = PartialGroupError(f"a sender's weight was {message.weight}, not 1")
                raise self.failure  # the stream's end drops the sender (_ban_sender), which ends the all-reduce
            yield message


class BlockAverager(DecentralizedAverager):  # type: ignore[misc]
    """hivemind's averager, sharing this worker's copy of the block's published weights as its state, and pulling a
    peer's copy within a byte budget and a deadline (:meth:`pull_state`)."""

    RPC_NAME = "_BlockAverager"  # what peers' RPC handlers are named by (hivemind: the class's name); kept as released

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        """hivemind's handle name, by :attr:`RPC_NAME` whatever this class (or a subclass) is called."""
        handle = f"{cls.RPC_NAME}.{method_name}"
        return handle if namespace is None else f"{namespace}::{handle}"

    def __init__(self, *args: Any, shared: Callable[[], tuple[dict[str, Any], list[torch.Tensor]]], **kwargs: Any) -> None:
        self._shared = shared
        super().__init__(*args, **kwargs)

    def get_current_state(self) -> tuple[dict[str, Any], list[torch.Tensor], None]:
        meta, tensors = self._shared()  # called in this (the host) process, for a peer that downloads it
        return meta, tensors, None

    @contextmanager
    def tensors_within(self, timeout: float) -> Iterator[Sequence[torch.Tensor]]:
        """hivemind's ``get_tensors``, its lock waited for at most ``timeout`` seconds (TensorsBusyError past it): a
        step whose caller stopped waiting goes on in the averager's process, holding the lock until its all-reduce
        ends (``allreduce_timeout``, :func:`exchange_timeouts`)."""
        if not self.lock_averaged_tensors.acquire(timeout=max(0.0, timeout)):
            raise TensorsBusyError(f"the averager's tensors stayed locked for {timeout:.1f} s")
        try:
            yield self._averaged_tensors
        finally:
            self.lock_averaged_tensors.release()

    async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info: GroupInfo,
                                      group_id: bytes | None = None, **kwargs: Any) -> None:
        """hivemind's own (1.1.12), with :class:`WholeRunner`, raising PartialGroupError where the all-reduce was
        not whole: a reducer failed (hivemind put this member's own values in its slice, logging only), this
        member's reducer dropped a sender, or a member declared itself auxiliary (no delta of its own: hivemind
        1.1.12's runner does not act on the mode, a later one would average without it). The tensors are updated
        in place as results come (a failed group leaves them partly averaged; the caller discards them)."""
        group_id = group_info.group_id if group_id is None else group_id
        runner = WholeRunner(p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=tensors,
                              group_id=group_id, ordered_peer_ids=group_info.peer_ids, **kwargs)
        assert group_id in self._running_groups, f"group {group_id!r} was not registered"  # as hivemind's own
        self._running_groups[group_id].set_result(runner)
        auxiliary = [str(peer) for peer, data in zip(group_info.peer_ids, group_info.gathered, strict=True)
                     if AveragingMode(self.serializer.loads(data)[1]) is AveragingMode.AUX]
        if auxiliary:
            error = PartialGroupError(f"member(s) {', '.join(auxiliary)} joined as auxiliary peers, with no delta of "
                                      "their own")
            runner.finalize(exception=error)  # its peers' requests are answered at once, not at their timeouts
            raise error
        try:
            async for tensor, update in azip(as_aiter(*tensors), runner):
                tensor.add_(update, alpha=self._averaging_alpha)
                self.last_updated = get_dht_time()
                self._state_updated.set()
        except Exception as exc:  # hivemind's 'terminated during iteration' where this member's reducer ended it
            if runner.failure is not None:
                raise runner.failure from exc
            raise
        failed = runner.tensor_part_container.failed_size
        if failed:
            raise PartialGroupError(f"{failed} of {runner.tensor_part_container.total_size} values came back "
                                    "unaveraged (a reducer failed or stalled)")
        if runner.banned_senders:  # dropped once this member had every result (whole: a drop ends the all-reduce),
            # but the dropped sender fails the group, and the coordinator takes a member's delta once: so do the others
            raise PartialGroupError(f"sender(s) {', '.join(map(str, runner.banned_senders))} were dropped")

    def pull_state(self, version: int, max_bytes: int, timeout: float) -> tuple[Any, list[torch.Tensor]] | None:
        """The state of a peer that offers ``version``, read for at most ``timeout`` seconds and ``max_bytes`` bytes
        in all, else None. hivemind's ``load_state_from_peers`` bounds neither: its caller stops waiting, but its
        download goes on in the averager's process, at a second per chunk, as long and as large as the peer streams
        it; and it asks first the peer that declares the highest version, which any peer can declare."""
        future = MPFuture()
        self._outer_pipe.send(("_pull_state", [], dict(version=version, max_bytes=max_bytes, timeout=timeout,
                                                        future=future)))
        return future.result(timeout=timeout + 5.0)  # type: ignore[no-any-return]  # the process answers at the deadline

    async def _pull_state(self, version: int, max_bytes: int, timeout: float, future: MPFuture) -> None:
        """In the averager's process: the peers offering ``version`` exactly, in random order, until one serves it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            found = await self.dht.get(f"{self.prefix}.all_averagers", latest=True, return_future=True)
            entries = found.value if found is not None and isinstance(found.value, dict) else {}
            peers = [PeerID(p) for p, e in entries.items()
                     if isinstance(p, bytes) and getattr(e, "value", None) == version and PeerID(p) != self.peer_id]
            random.shuffle(peers)
            for peer in peers:
                if loop.time() >= deadline:
                    break
                try:
                    got = await asyncio.wait_for(self._read_state(peer, max_bytes), deadline - loop.time())
                except Exception as exc:  # timed out, too large, cut or malformed: the next peer, then the coordinator
                    log.info("peer %s did not serve v%d: %s: %s", peer, version, type(exc).__name__, exc)
                    continue
                if got is not None:
                    future.set_result(got)
                    return
        finally:
            if not future.done():
                future.set_result(None)

    async def _read_state(self, peer: PeerID, max_bytes: int) -> tuple[Any, list[torch.Tensor]] | None:
        """One peer's state stream (hivemind's ``rpc_download_state``: metadata on the first message, each tensor's
        parts after the part that names its dtype), refused past ``max_bytes``."""
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        meta: Any = None
        tensors: list[torch.Tensor] = []
        parts: list[Any] = []
        received = 0
        async for message in stream:
            received += message.ByteSize()  # every field (a stream of empty-buffered parts was free before)
            if received > max_bytes:
                raise StateTooLargeError(f"its state runs past {max_bytes} bytes")
            if message.metadata and meta is None:
                meta = self.serializer.loads(message.metadata)
            if message.tensor_part.dtype and parts:  # a new tensor begins
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                parts = []
            parts.append(message.tensor_part)
        if parts:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        return None if meta is None else (meta, tensors)
