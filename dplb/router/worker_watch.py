"""What the router's monitor step makes of each snapshot, worker by worker: the transitions it counts and logs
(:class:`WorkerWatch`). The routing state itself is :mod:`dplb.router.state`'s; this module decides nothing about
routing.

Contract
- Registration: one log line when a worker becomes routable, one when it stops being so (with the reason); a worker
  held out by the heartbeat hysteresis or stalled logs nothing here (those log their own transitions), nor does a
  stalled worker let in for one probe request.
- Restarts: a worker slot's new pid counts one restart in ``dplb_worker_restarts_total`` (:meth:`WorkerWatch.restarts`).
- Stalls: the detector's verdicts become ``dplb_worker_stalls_total``, ``dplb_worker_stalled`` and the cut of the
  stalled workers' open attempts (``dplb_stalled_requests_failed_total``).
- Panic: ``dplb_router_panic`` and one log line on entering and one on leaving panic routing (none per request).
- Single event loop; not thread-safe.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from dplb.obs.metrics_router import RouterMetrics
from dplb.policy.decision import OK, WHY_HELD_OUT, WHY_STALE, WHY_STALLED, Candidate
from dplb.policy.stall import StallDetector
from dplb.state.shm import FLAG_PREV_STOPPED, Lifecycle, WorkerState

log = logging.getLogger("dplb.router")


class Cuttable(Protocol):
    """An open attempt the state can fail when its worker stalls (:class:`dplb.router.attempt.Attempt`)."""

    def cut_stalled(self) -> bool:
        """Fail the attempt now; True the first time."""
        ...


class WorkerWatch:
    """The monitor step's per-worker bookkeeping for ``num_workers`` workers, counted in ``metrics`` (module
    docstring)."""

    def __init__(self, num_workers: int, metrics: RouterMetrics) -> None:
        n = num_workers
        self.metrics = metrics
        self._routable = [False] * n
        self._seen_pid = [0] * n  # the pid last seen in each worker slot, and whether it published stopped since
        self._seen_stopped = [False] * n
        self._stalled_shown: frozenset[int] = frozenset()
        #: The workers panic routing routes among now (empty: no panic).
        self.panic: frozenset[int] = frozenset()

    def registrations(self, cands: Iterable[Candidate], probing: frozenset[int]) -> None:
        """Log the workers that became routable or stopped being so among ``cands`` (:func:`dplb.policy.routable`
        without the ejected ones: ejection is not a (de)registration); ``probing``: the stalled workers, not
        registered again when let in for a probe request."""
        for c in cands:
            k, w = c.worker_id, c.state
            ok = c.why is OK
            if ok and not self._routable[k] and k not in probing:
                log.info("worker %d registered (pid %d, %s)", k, w.pid, w.lifecycle.name.lower())
            elif not ok and self._routable[k] and c.why not in (WHY_HELD_OUT, WHY_STALLED):
                log.warning("worker %d deregistered (%s)", k, "stale heartbeat" if c.why == WHY_STALE else c.why)
            self._routable[k] = ok

    def restarts(self, snap: Sequence[WorkerState]) -> None:
        """Count a worker slot's new pid as a restart of that worker (``dplb_worker_restarts_total``): ``exited``
        when the old process published ``stopped`` before it left (seen by a monitor step, or told by the new
        one's ``FLAG_PREV_STOPPED``: the old state may stand for less than a step), else ``killed``. A slot not
        written (pid 0: a worker not started yet, a recreated segment) changes nothing; the first pid seen is no
        restart."""
        seen, stopped = self._seen_pid, self._seen_stopped
        for w in snap:
            k, pid = w.worker_id, w.pid
            if not pid or w.torn:
                continue
            if pid != seen[k]:
                if seen[k]:
                    reason = "exited" if stopped[k] or w.flags & FLAG_PREV_STOPPED else "killed"
                    self.metrics.restarts.labels(str(k), reason).inc()
                    log.info("worker %d replaced (pid %d → %d; the old one %s)", k, seen[k], pid,
                             "stopped by itself" if stopped[k] else "left without stopping: killed or crashed")
                seen[k], stopped[k] = pid, False
            if w.lifecycle == Lifecycle.STOPPED:
                stopped[k] = True

    def stalls(self, st: StallDetector, snap: Sequence[WorkerState], inflight_all: Sequence[int], now: int,
               attempts: Sequence[set[Cuttable]]) -> None:
        """Feed the stall detector ``st`` (``inflight_all``: every router process's open requests per worker; ``now``:
        CLOCK_MONOTONIC ns); cut the open ``attempts`` of the workers it says to; keep the metrics in step."""
        st.observe(snap, inflight_all, now)
        m = self.metrics
        for k in st.newly_stalled:
            m.stalls.labels(str(k)).inc()
        for k in st.cut:
            for a in list(attempts[k]):
                if a.cut_stalled():
                    m.stalled_failed.labels(str(k)).inc()
        shown = st.stalled()
        if shown != self._stalled_shown:
            for k in shown ^ self._stalled_shown:
                m.stalled.labels(str(k)).set(1 if k in shown else 0)
            self._stalled_shown = shown

    def panicking(self, panic: frozenset[int], routable_now: Callable[[], list[int]]) -> None:
        """Keep ``dplb_router_panic`` and the panic log lines in step with ``panic`` (the workers panic routing
        routes among now: :func:`dplb.policy.panic_set`); ``routable_now`` names the routable workers for the line
        that ends a panic."""
        was = self.panic
        self.panic = panic
        if bool(panic) == bool(was):
            return
        self.metrics.panic.set(1 if panic else 0)
        if panic:
            log.warning("no worker is routable; routing among workers %s, fresh again and ready but on heartbeat "
                        "probation (panic routing) until one is readmitted", sorted(panic))
        else:
            ok = routable_now()
            log.info("panic routing over: %s", f"workers {ok} routable" if ok else "no worker on probation is fresh "
                     "and ready any more")


__all__ = ["Cuttable", "WorkerWatch"]
