"""In-flight reconciliation: every state interval the worker compares what its engine runs, what is open on its
socket and what the routers believe they sent it, and aborts orphans (docs/DESIGN.md §8.1).

Contract
- Three views, all read on the worker's serving loop: the engine's requests (:meth:`Reconcilable.requests`, each
  with the open HTTP request it serves), the HTTP requests open on the worker's socket (:attr:`RequestStats.open`:
  ``X-Request-Id``, the client process by ``SO_PEERCRED``, whether the client left), and each live router
  process's in-flight count for this worker (its router slot, :meth:`dplb.state.shm.Segment.router_inflight`).
- **Orphan**: an engine request whose HTTP request is closed or whose client left (a disconnect whose abort was
  lost), or — for engines that name requests by ``X-Request-Id`` only (vLLM) — one that matches no open request
  while every open live request already has its engine request. Work without a client by design (a
  ``background: true`` response) is never an orphan. An orphan seen at :data:`PERSIST_TICKS` consecutive ticks
  (≥ 2 intervals: a request being set up or torn down is never caught) is counted (``orphans``) and aborted once
  (``orphan_aborts_total``); one the engine keeps after the abort stays counted.
- **Leaked counter**: per live router process, its in-flight count for this worker minus the live requests from
  that process open on the socket; the positive parts summed, and the minimum over the last
  :data:`PERSIST_TICKS` ticks is reported (``leaked``), so a request in transit is never counted. The worker does
  not correct a router's counter (it cannot tell which of the router's requests it is); the policy is in
  docs/DESIGN.md §8.1.
- One log line when orphans are aborted (per tick that aborts) and one per change of the leaked figure.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable

from dplb.worker.engines.base import EngineRequest, OpenRequest, Reconcilable, RequestStats

log = logging.getLogger("dplb.worker.reconcile")
#: Consecutive ticks a mismatch must be seen at before it counts: 3 samples span ≥ 2 state intervals.
PERSIST_TICKS = 3


class Reconciler:
    """The reconciler of one worker. ``engine``: None when the engine cannot list its requests (then only the
    leaked-counter check runs). ``router_inflight()`` returns ``{router pid: in-flight to this worker}`` (empty
    without a segment). Figures for the metrics: ``orphans``, ``orphan_aborts_total``, ``leaked``,
    ``engine_requests`` (what the engine held at the last tick)."""

    def __init__(self, engine: Reconcilable | None, stats: RequestStats,
                 router_inflight: Callable[[], dict[int, int]], worker_id: int, interval_s: float) -> None:
        self.engine = engine
        self.stats = stats
        self.router_inflight = router_inflight
        self.worker_id = worker_id
        self.interval_s = interval_s
        self.orphans = 0
        self.orphan_aborts_total = 0
        self.leaked = 0
        self.engine_requests = 0
        self._streak: dict[str, int] = {}  # engine id → consecutive ticks seen as an orphan
        self._aborted: set[str] = set()  # engine ids the reconciler already aborted
        self._excess: collections.deque[int] = collections.deque(maxlen=PERSIST_TICKS)

    def figures(self) -> tuple[int, int, int, int]:
        """(orphans now, orphan aborts sent in total, leaked router in-flight now, engine requests at the last
        tick), for the metrics."""
        return self.orphans, self.orphan_aborts_total, self.leaked, self.engine_requests

    async def run(self) -> None:
        """Tick every ``interval_s`` until cancelled; a failing tick is logged, never fatal."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.tick()
            except Exception:
                log.exception("worker %d: reconciliation tick failed", self.worker_id)

    async def tick(self) -> None:
        """One comparison of the three views (module docstring); aborts the orphans that persisted."""
        opened = list(self.stats.open)
        if self.engine is not None:
            held = self.engine.requests()
            self.engine_requests = len(held)
            await self._orphans(held, opened)
        self._leaks(opened)

    # ---- orphans -----------------------------------------------------------------------------------------------
    async def _orphans(self, held: list[EngineRequest], opened: list[OpenRequest]) -> None:
        candidates = find_orphans(held, opened)
        streak = {rid: self._streak.get(rid, 0) + 1 for rid in candidates}
        self._streak = streak
        self._aborted &= streak.keys()
        confirmed = [rid for rid, n in streak.items() if n >= PERSIST_TICKS]
        self.orphans = len(confirmed)
        fresh = [rid for rid in confirmed if rid not in self._aborted]
        if not fresh:
            return
        assert self.engine is not None
        for rid in fresh:
            self._aborted.add(rid)
            self.orphan_aborts_total += 1
            with contextlib.suppress(Exception):  # an engine that fails one abort must not stop the others
                await self.engine.abort(rid)
        log.warning("worker %d: aborted %d orphan request(s) the engine still ran with no client waiting (a lost "
                    "abort; %d in total)", self.worker_id, len(fresh), self.orphan_aborts_total)

    # ---- leaked router counters --------------------------------------------------------------------------------
    def _leaks(self, opened: list[OpenRequest]) -> None:
        mine: dict[int, int] = {}
        for r in opened:
            if r.live and r.peer_pid:
                mine[r.peer_pid] = mine.get(r.peer_pid, 0) + 1
        excess = sum(max(0, n - mine.get(pid, 0)) for pid, n in self.router_inflight().items())
        self._excess.append(excess)
        leaked = min(self._excess) if len(self._excess) == PERSIST_TICKS else 0
        if leaked != self.leaked:
            (log.warning if leaked else log.info)(
                "worker %d: routers count %d request(s) in flight here that are not open on its socket%s",
                self.worker_id, leaked, " (dplb state --json shows each router's count)" if leaked else "")
        self.leaked = leaked


def find_orphans(held: list[EngineRequest], opened: list[OpenRequest]) -> list[str]:
    """The engine ids in ``held`` that no client waits for (module docstring), given the HTTP requests ``opened``
    on the socket now. Pure: no I/O, no state."""
    out: list[str] = []
    by_xrid: dict[str, list[OpenRequest]] = {}
    for r in opened:
        if r.xrid:
            by_xrid.setdefault(r.xrid, []).append(r)
    unmatched: list[str] = []
    claimed: set[OpenRequest] = set()
    for e in held:
        owner = e.owner
        if owner is None:
            continue  # work without a client by design
        if isinstance(owner, OpenRequest):
            if owner.live:
                claimed.add(owner)
            else:
                out.append(e.id)
            continue
        match = _match(owner, by_xrid)
        if match is None:
            unmatched.append(e.id)
            continue
        live = [r for r in match if r.live]
        if not live:
            out.append(e.id)
            continue
        free = [r for r in live if r not in claimed]  # one claim each: requests may share an X-Request-Id
        claimed.add(free[0] if free else live[0])
    if unmatched and not any(r.live and r not in claimed for r in opened):
        out += unmatched  # every live request has its engine request: these belong to none
    return out


def _match(external_id: str, by_xrid: dict[str, list[OpenRequest]]) -> list[OpenRequest] | None:
    """The open requests whose ``X-Request-Id`` an engine's external request id was made from: vLLM names them
    ``<kind>-<X-Request-Id>`` with an optional ``-<n>`` suffix (one per prompt), or the id itself."""
    found = by_xrid.get(external_id)
    if found is not None:
        return found
    _, sep, rest = external_id.partition("-")
    if not sep:
        return None
    found = by_xrid.get(rest)
    if found is None:
        head, sep, tail = rest.rpartition("-")
        if sep and tail.isdigit():
            found = by_xrid.get(head)
    return found


__all__ = ["PERSIST_TICKS", "Reconciler", "find_orphans"]
