"""Worker health as the router sees it (outlier detection; Envoy's ``outlier_detection`` is the model): how each
attempt ended, which workers are ejected for failing, which are held out by heartbeat hysteresis.

Contract
- :class:`Outcome` is the vocabulary: every upstream attempt ends in exactly one member, and the member alone says
  whether the worker connection may be reused, what it tells this module about the worker (:class:`Verdict`) and
  which ``outcome`` label its duration is recorded under in ``dplb_upstream_request_duration_seconds`` (none for an
  attempt that never reached a worker's answer phase). :meth:`Outcome.of_status` classifies a complete response;
  a complete stream that the worker ended with its own 5xx error event (vLLM's engine died under its API server:
  the event, then ``[DONE]``, then a clean end) is :attr:`Outcome.FAILED_STREAM`, a failure like a broken one.
- Ejection (passive health check, like nginx's ``max_fails``): :data:`MAX_FAILS` failures in a row (a 5xx other
  than 503, a timeout, a broken or unanswered connection) or one refused connection eject a worker for
  :data:`UNREACHABLE_S` seconds, or until it publishes a different pid (it restarted); failures reported while it
  is ejected (the requests it held when it died, breaking one after the other) count for nothing: one ejection,
  one log line, one count in ``dplb_worker_ejections_total``. A worker that fails fast
  looks idle to the score (no latency sample, empty queue) and would otherwise attract traffic. 503 (the worker's
  queue is full) and 4xx are not failures.
- Shared by a router group (:meth:`WorkerHealth.share`, :meth:`WorkerHealth.sync`; the table in the segment is
  :mod:`dplb.state.health_board`): each process publishes its ejections (until when, the worker's pid then) and its
  failure streaks; a process adopts a live peer's ejection with the same expiry and the same restart rule (logged
  at debug, counted only by the process that ejected), and counts its peers' streaks into its own: the failures in
  a row across the group, those since the group's last reset (a published success, an ejection for failures), reach
  :data:`MAX_FAILS` once. So N
  processes eject a failing worker after :data:`MAX_FAILS` failures in all, not N × :data:`MAX_FAILS`. A process
  reads its peers' tables at every pick and before counting a failure (one 8-byte load per peer when nothing
  changed); it publishes a success only while some streak on that worker is open.
- Hysteresis on heartbeats: a worker seen routable whose heartbeat then went stale (older than
  ``STALE_INTERVALS`` × state interval; the policy then skips it) stays out after its heartbeat is fresh again
  until it has been fresh at every observation for :data:`READMIT_INTERVALS` state intervals (a worker restarted
  under a new pid is exempt: its lifecycle gates it). A single late heartbeat (shorter than the stale limit) changes
  nothing; a worker flapping stale/fresh stays out instead of flapping in and out. One log line each way. While no
  worker can take a request, the policy routes among those on probation rather than refusing it (panic routing,
  docs/DESIGN.md §5.1).
- Pure state: no I/O but logs and the loads and stores of the shared table (mapped memory); time comes from the
  caller (``now_ns``) or the injected ``clock``, so the state machine is testable without processes
  (``tests/test_health.py``, ``tests/test_health_group.py``). Single event loop; not thread-safe.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Sequence

from dplb.state.health_board import FIELDS, HealthBoard
from dplb.state.shm import STALE_INTERVALS, Lifecycle, WorkerState

log = logging.getLogger("dplb.router")
UNREACHABLE_S = 2.0  # a worker that refused a connection is skipped this long (or until it restarts)
MAX_FAILS = 3  # consecutive failed responses that eject a worker for UNREACHABLE_S
READMIT_INTERVALS = 5  # state intervals a once-stale worker must stay fresh before it is routed to again
_READY = Lifecycle.READY
_NONE: frozenset[int] = frozenset()


class Verdict(enum.Enum):
    """What one attempt says about its worker's health."""

    NONE = "none"  # nothing: the worker refused while draining, or the client left before the answer began
    SUCCESS = "success"  # an answer that is not a failure: the failure streak starts over
    FAILURE = "failure"  # one more failure in a row (MAX_FAILS eject)
    UNREACHABLE = "unreachable"  # the connection was refused: ejected at once


@enum.unique
class Outcome(enum.Enum):
    """How one upstream attempt ended. Value: (duration label or None, connection reusable, verdict)."""

    OK = ("ok", True, Verdict.SUCCESS)  # complete response, status < 400
    UPSTREAM_4XX = ("upstream_4xx", True, Verdict.SUCCESS)
    FULL = ("upstream_5xx", True, Verdict.SUCCESS)  # 503 without the draining marker: queue full, not broken
    UPSTREAM_5XX = ("upstream_5xx", True, Verdict.FAILURE)
    TIMEOUT = ("timeout", False, Verdict.FAILURE)  # first byte or idle between chunks
    NO_ANSWER = (None, False, Verdict.FAILURE)  # closed (or the attempt failed) before the response head
    BROKEN = ("upstream_error", False, Verdict.FAILURE)  # closed or failed mid-response
    # A complete stream the worker itself failed with a 5xx error event (dplb.errors.stream_failure): the bytes are
    # the worker's and were relayed unchanged, the connection is sound, the request failed.
    FAILED_STREAM = ("upstream_error", True, Verdict.FAILURE)
    DRAINING = (None, False, Verdict.NONE)  # ``503 worker_draining`` refusal: nothing was generated
    CLIENT_LEFT_EARLY = ("client_disconnect", False, Verdict.NONE)  # before the worker's answer began
    CLIENT_LEFT = ("client_disconnect", False, Verdict.SUCCESS)  # mid-response
    UNREACHABLE = (None, False, Verdict.UNREACHABLE)  # connect failed: no request byte was sent
    STALLED = ("stalled", False, Verdict.NONE)  # failed fast: the worker's engine stalled (dplb.policy.stall)

    # Each member's value as plain attributes (set below, after the class: a compiled ``__init__`` cannot run
    # while the enum class is being made), not properties over ``value``: read on every attempt (an enum property
    # costs a descriptor call each time).
    #: The ``outcome`` label of ``dplb_upstream_request_duration_seconds`` (None: the duration is not recorded).
    recorded: str | None
    #: True when the response was read completely: the connection may go back to the pool (if keep-alive).
    reusable: bool
    #: What this outcome tells :class:`WorkerHealth` about the worker.
    verdict: Verdict
    #: True when the attempt's end-to-end time is a sample of the policy's latency baseline (:attr:`OK` only).
    latency_sample: bool
    #: True when the client got a failure from this attempt, whatever status its head said (a stream cut, failed
    #: by the worker's error event, timed out or stalled; a 5xx): what a tenant's availability SLO counts as bad.
    failed: bool

    @staticmethod
    def of_status(status: int) -> Outcome:
        """The outcome of a complete response with HTTP status ``status``."""
        if status < 400:
            return Outcome.OK
        if status < 500:
            return Outcome.UPSTREAM_4XX
        return Outcome.FULL if status == 503 else Outcome.UPSTREAM_5XX


def _member_attributes() -> None:
    """Set each :class:`Outcome` member's attributes from its value (once, at import)."""
    for o in Outcome:
        o.recorded, o.reusable, o.verdict = o.value
        o.latency_sample = o is Outcome.OK
        o.failed = o.verdict is Verdict.FAILURE or o is Outcome.STALLED


_member_attributes()


class WorkerHealth:
    """Ejection and heartbeat hysteresis of ``num_workers`` workers (see module docstring).

    ``pid_of(k)``: the pid worker k publishes now (0 when unknown), read when a worker is ejected so that a restart
    lifts the ejection early. ``on_eject(k)``: called once per ejection for failures (the metric; not for an
    ejection adopted from a peer). ``clock``: CLOCK_MONOTONIC seconds (ejection deadlines; the peers' tables hold
    the same clock in ns)."""

    def __init__(self, num_workers: int, pid_of: Callable[[int], int],
                 on_eject: Callable[[int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        n = num_workers
        self._pid_of = pid_of
        self._on_eject = on_eject
        self._clock = clock
        # Ejected workers: skipped until this clock time (0 = not ejected) or until a pid other than this appears.
        self._until = [0.0] * n
        self._until_pid = [0] * n
        self._fails = [0] * n
        self._n = n
        # Sharing with the router group (module docstring): this process's table, its own streaks' starts and last
        # resets (clock s), its own ejection as published (ns, pid), the live peers and their tables.
        self.board: HealthBoard | None = None
        self._since = [0.0] * n
        self._reset = [0.0] * n
        self._pub_until = [0] * n
        self._pub_pid = [0] * n
        self._peers: Sequence[int] = ()
        self._views: dict[int, tuple[int, ...]] = {}
        self._peer_streak = [False] * n  # some peer has a streak open on the worker
        self._adopted = [0] * n  # the peer ejection (until, ns) adopted last
        # Heartbeat hysteresis: workers out for a stale heartbeat, the pid they had, and since when (monotonic ns)
        # they have been fresh at every observation (0 = not fresh yet).
        self._out = [False] * n
        self._fresh_pid = [0] * n  # pid last seen fresh and ready
        self._stale_pid = [0] * n
        self._fresh_since = [0] * n
        self._any_out = False
        # The last observation that changed nothing while nobody was out: its snapshot and interval, and until when
        # (monotonic ns) every worker fresh in it stays fresh. The same snapshot before then changes nothing again.
        self._quiet: tuple[list[WorkerState], int, int] | None = None

    # ---- ejection ----------------------------------------------------------------------------------------------
    def report(self, worker: int, outcome: Outcome) -> None:
        """Feed one attempt's outcome (see :class:`Outcome` and the module docstring)."""
        verdict = outcome.verdict
        if verdict is Verdict.SUCCESS:
            if self.board is not None and not self._fails[worker]:
                self.sync(self._peers)  # a peer's streak may have begun since this request's pick (one load each)
            if self._fails[worker] or self._peer_streak[worker]:
                self._succeeded(worker)
        elif verdict is Verdict.FAILURE:
            self._failed(worker)
        elif verdict is Verdict.UNREACHABLE:
            self._eject(worker)

    def _succeeded(self, worker: int) -> None:
        self._fails[worker] = 0
        self._since[worker] = 0.0
        self._reset[worker] = self._clock()
        self._publish(worker)

    def _failed(self, worker: int) -> None:
        if self.board is not None:
            self.sync(self._peers)  # a peer may have ejected it, or failed on it, meanwhile
        if self._until[worker] and self._clock() < self._until[worker] \
                and self._pid_of(worker) == self._until_pid[worker]:
            return  # ejected already: the requests it held when it failed say nothing new (one ejection)
        if self._fails[worker] and self._views and self._peer_reset(worker) >= self._since[worker]:
            self._fails[worker] = 0  # a peer's success (or ejection) came since this streak began: it starts over
        fails = self._fails[worker] = self._fails[worker] + 1
        if fails == 1:
            self._since[worker] = self._clock()
        streak = self._group_streak(worker) if self._views else fails
        if streak < MAX_FAILS:
            self._publish(worker)
            return
        self._fails[worker] = 0
        self._since[worker] = 0.0
        self._reset[worker] = self._clock()  # every process's streak starts over after this ejection
        if streak == fails:
            log.warning("worker %d failed %d requests in a row; ejecting it for %.0f s", worker, fails, UNREACHABLE_S)
        else:
            log.warning("worker %d failed %d requests in a row (%d through this router process); ejecting it for "
                        "%.0f s", worker, streak, fails, UNREACHABLE_S)
        if self._on_eject is not None:
            self._on_eject(worker)
        self._eject(worker)

    def _group_streak(self, worker: int) -> int:
        """The failures in a row on ``worker`` across the group: each process's open streak that began after the
        group's last reset (a published success or an ejection for failures, by any of them); this process's own
        always (:meth:`_failed` starts it over after a peer's reset)."""
        i = FIELDS * worker
        last_reset = max(self._peer_reset(worker), self._reset[worker])
        total = self._fails[worker]
        for v in self._views.values():
            if v[i + 2] and v[i + 3] / 1e9 > last_reset:
                total += v[i + 2]
        return total

    def _peer_reset(self, worker: int) -> float:
        """The latest reset (clock s) the live peers published for ``worker``: a success or an ejection for
        failures; 0.0 when none."""
        i = FIELDS * worker + 4
        return max((v[i] for v in self._views.values()), default=0) / 1e9

    def _eject(self, worker: int) -> None:
        self._until[worker] = until = self._clock() + UNREACHABLE_S
        self._until_pid[worker] = self._pid_of(worker)
        self._pub_until[worker] = int(until * 1e9)
        self._pub_pid[worker] = self._until_pid[worker]
        self._publish(worker)

    def _publish(self, worker: int) -> None:
        board = self.board
        if board is not None:
            board.write(worker, self._pub_until[worker], self._pub_pid[worker], self._fails[worker],
                        int(self._since[worker] * 1e9), int(self._reset[worker] * 1e9))

    def share(self, board: HealthBoard | None) -> None:
        """Publish into ``board`` (this process's router slot's table) and read its peers' from now on; None: alone
        (no router slot). A new board starts from nothing known of the peers."""
        if board is self.board:
            return
        self.board = board
        self._peers, self._views = (), {}
        self._peer_streak = [False] * self._n
        if board is not None:
            for k in range(self._n):
                if self._fails[k] or self._pub_until[k]:
                    self._publish(k)

    def sync(self, peers: Sequence[int]) -> None:
        """Read the tables of the live ``peers`` (router slot indices) that changed since the last call, adopting
        their new ejections (module docstring). One load per peer when none changed; nothing without a board."""
        board = self.board
        if board is None:
            return
        if peers is not self._peers:
            self._peers = peers
            if any(r not in peers for r in self._views):
                self._views = {r: v for r, v in self._views.items() if r in peers}
                self._recount()
        got = board.changed(peers)
        if got is None:
            return
        now_ns = int(self._clock() * 1e9)
        for r, v in got:
            self._views[r] = v
            for k in range(min(self._n, len(v) // FIELDS)):
                until = v[FIELDS * k]
                if until > now_ns and until != self._adopted[k] and until / 1e9 > self._until[k]:
                    self._adopt(k, until, v[FIELDS * k + 1], r)
        self._recount()

    def _adopt(self, worker: int, until_ns: int, pid: int, slot: int) -> None:
        self._adopted[worker] = until_ns
        self._until[worker] = until_ns / 1e9
        self._until_pid[worker] = pid
        log.debug("worker %d ejected by the router process in router slot %d for %.1f s more", worker, slot,
                  until_ns / 1e9 - self._clock())
        if self._fails[worker]:
            self._fails[worker] = 0
            self._since[worker] = 0.0
            self._publish(worker)

    def _recount(self) -> None:
        views = self._views.values()
        self._peer_streak = [any(v[FIELDS * k + 2] for v in views) for k in range(self._n)]

    @property
    def any_ejected(self) -> bool:
        """True when some worker may be ejected (a cheap test before :meth:`ejected`)."""
        return any(self._until)

    def ejected(self, snap: Sequence[WorkerState] | None) -> frozenset[int]:
        """Workers ejected right now; expired ejections and those of workers that published another pid in
        ``snap`` (restarted) are lifted."""
        now = self._clock()
        out: set[int] = set()
        for k, until in enumerate(self._until):
            if not until:
                continue
            restarted = snap is not None and snap[k].pid not in (0, self._until_pid[k])
            if now >= until or restarted:
                self._until[k] = 0.0
            else:
                out.add(k)
        return frozenset(out)

    # ---- heartbeat hysteresis ----------------------------------------------------------------------------------
    @property
    def watching(self) -> bool:
        """True while some worker may be held out (its observer should look at every state interval)."""
        return self._any_out

    def observe(self, snap: Sequence[WorkerState], now_ns: int, interval_ms: int) -> frozenset[int]:
        """Update the stale/probation state from one snapshot taken at ``now_ns`` (monotonic ns) with the
        segment's state interval; return the workers fresh again but still on probation (the policy itself skips
        the stale ones). An observation of the same states (equal values) while nobody is out and before any
        worker fresh in them can go stale changes nothing and costs one comparison (every pick observes)."""
        quiet = self._quiet
        if quiet is not None and now_ns <= quiet[2] and interval_ms == quiet[1] and snap == quiet[0]:
            return _NONE
        interval_ns = interval_ms * 1_000_000
        stale_ns = STALE_INTERVALS * interval_ns
        readmit_ns = READMIT_INTERVALS * interval_ns
        out, fresh_pid = self._out, self._fresh_pid
        oldest = now_ns  # the oldest heartbeat of a fresh worker
        for w in snap:
            k = w.worker_id
            if w.pid == 0 or w.torn:
                continue
            hb = w.heartbeat_mono_ns
            if out[k]:
                self._while_out(w, now_ns, stale_ns, readmit_ns)
            elif now_ns - hb <= stale_ns:
                if hb < oldest:
                    oldest = hb
                if w.lifecycle == _READY:
                    fresh_pid[k] = w.pid  # seen routable: going stale from here is a flap
            elif w.lifecycle == _READY and fresh_pid[k] == w.pid:
                self._went_stale(w, now_ns, stale_ns, readmit_ns)
        if not self._any_out:
            self._quiet = (list(snap), interval_ms, oldest + stale_ns)
            return _NONE
        self._quiet = None
        held = self.held_out()
        self._any_out = bool(held)
        return held

    def _went_stale(self, w: WorkerState, now_ns: int, stale_ns: int, readmit_ns: int) -> None:
        k = w.worker_id
        self._out[k] = self._any_out = True
        self._stale_pid[k] = w.pid
        self._fresh_since[k] = 0
        log.warning("worker %d heartbeat is stale (%.2f s old, limit %.2f s); not routing to it until it has been "
                    "fresh for %.2f s", k, (now_ns - w.heartbeat_mono_ns) / 1e9, stale_ns / 1e9, readmit_ns / 1e9)

    def _while_out(self, w: WorkerState, now_ns: int, stale_ns: int, readmit_ns: int) -> None:
        k = w.worker_id
        if w.pid != self._stale_pid[k]:
            self._out[k] = False  # restarted: a new process, gated by its own lifecycle
            log.info("worker %d restarted (pid %d → %d); its stale-heartbeat hold is lifted", k, self._stale_pid[k],
                     w.pid)
        elif now_ns - w.heartbeat_mono_ns > stale_ns:
            self._fresh_since[k] = 0
        elif not self._fresh_since[k]:
            self._fresh_since[k] = now_ns
        elif now_ns - self._fresh_since[k] >= readmit_ns:
            self._out[k] = False
            log.info("worker %d heartbeat has been fresh for %.2f s; routing to it again", k,
                     (now_ns - self._fresh_since[k]) / 1e9)

    def held_out(self) -> frozenset[int]:
        """Workers kept out by the heartbeat hysteresis right now (stale, or fresh again but on probation)."""
        return frozenset(k for k, o in enumerate(self._out) if o)


__all__ = ["MAX_FAILS", "READMIT_INTERVALS", "UNREACHABLE_S", "Outcome", "Verdict", "WorkerHealth"]
