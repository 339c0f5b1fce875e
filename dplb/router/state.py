"""The router's view of the workers: the shm segment (or the fallback), the policy, in-flight counts, decisions.

Contract
- :meth:`RouterState.decide` is the routing step of the hot path: read the segment (zero-copy mmap, seqlock),
  run ``policy.pick`` and record the decision (ring for ``/debug/decisions``, metrics). No I/O beyond the mmap.
- Without a segment (never created, deleted at runtime, unreadable) the router keeps serving on its own in-flight
  counts (reason ``fallback``), exports ``dplb_shm_segment_present 0``, logs once per transition, and re-attaches
  when the segment is back (:meth:`RouterState.monitor`, a background task).
- In-flight counts per worker are the router's own: incremented by :meth:`acquire`, decremented by
  :meth:`release` on every exit path of a proxied request. Both publish this process's correction and in-flight
  count to its router slot (:mod:`dplb.state.router_slots`), and every pick adds the other router processes' published
  correction (N processes behind one port route like one router). Likewise what the policy learns: each pick first
  hands the policy the raw entries the others published in their rings (:meth:`dplb.policy.Policy.absorb`), then
  publishes what its own pick learnt (``RouteRequest.learned``); every monitor step also runs the ``on_tick`` hooks
  (the response-id map's replay of its peers' rings, :mod:`dplb.state.response_rings`). The policy is prepared for
  the request (:meth:`dplb.policy.Policy.prepare`) before the decision is timed.
- One log line per worker registration (becomes routable) and deregistration (with the reason); these, restarts,
  stall metrics and the panic gauge are counted and logged by :class:`dplb.router.worker_watch.WorkerWatch` from
  every monitor step's snapshot.
- Worker health (ejection for failures, heartbeat hysteresis) is :class:`dplb.router.health.WorkerHealth`, fed
  every snapshot this state reads and, through :meth:`RouterState.report`, every attempt's outcome; its ejected
  and held-out workers are passed to the policy. It shares ejections and failure streaks with the other router
  processes through this process's router slot: every pick and monitor step reads what the peers published.
- Panic routing (docs/DESIGN.md §5.1; the pick itself is the policy's): every monitor step checks whether no worker
  is routable while some are on heartbeat probation only (:func:`dplb.policy.panic_set`); ``dplb_router_panic`` is 1
  while so, with one log line on entering and one on leaving (none per request). Off with ``--no-panic-routing``.
  ``routable_workers(panic=True)`` gives the same set per call to the tenant gate, which counts room on those
  workers while in panic (its queued requests are granted and then routed in panic).
- Stalls (:class:`dplb.policy.stall.StallDetector`, off with ``stall_after_s`` 0): every monitor step feeds it the
  snapshot and every router process's in-flight counts, and it also takes a worker's own verdict (``FLAG_STALLED`` in
  its slot: a stall whose requests all left before ``--stall-after``, found by the worker's probe); a stalled worker
  is passed to the policy (``stalled``), and the attempts open on it (registered by :meth:`acquire`) are cut
  (``cut_stalled()``: answered 504 ``worker_stalled`` or ended with an SSE error event). ``dplb_worker_stalled``,
  ``dplb_worker_stalls_total`` and ``dplb_stalled_requests_failed_total`` count it. A stalled worker is never in
  :meth:`RouterState.routable_workers` (``/ready``, the host report: a host whose every worker is stalled is not ready
  and reports ``down``). The detector's in-band probe (one request at a time to a stalled worker idle for
  ``--stall-after``) is taken only as a last resort — no other worker can take the request — by a worker that probes
  its own engine (its slot's ``FLAG_STALLED``: :mod:`dplb.worker.stall_probe`); one that does not (its own stall check
  off or not seeing the stall) takes it whenever it is due, since nothing else would bring it back.
- A segment that comes back after it was lost is attached at once but routed on only when one of its workers is
  routable (or after :data:`PROMOTE_GRACE_S`): a freshly recreated segment is empty until the workers re-publish,
  and routing on it meanwhile would answer 503 ``no_workers_registered`` although every worker is serving. While
  its header has no model or run dir (recreated by ``dplb segment create``), every monitor step re-reads it: the
  launcher restores them. A router whose segment at its start has no run dir in its header (made by ``dplb segment
  create`` without ``$DPLB_RUN_DIR``) writes its own ``--run-dir`` there (the stack's: ``dplb state`` finds the
  router's last good tenants copy through it); a segment recreated later is the launcher's to restore.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Final

from dplb.config import PolicyConfig, RouterConfig
from dplb.errors import ConfigError, ShmError
from dplb.obs.metrics_router import RouterMetrics
from dplb.policy import Policy, RouteRequest, make_policy, panic_set, routable
from dplb.policy.decision import OK, REASON_FALLBACK, REASON_NO_WORKERS, Decision
from dplb.policy.stall import StallDetector
from dplb.router.health import READMIT_INTERVALS, Outcome, WorkerHealth
from dplb.router.worker_watch import Cuttable, WorkerWatch
from dplb.state.router_slots import RouterSlots
from dplb.state.shm import FLAG_STALLED, STALE_INTERVALS, Lifecycle, Segment, WorkerState
from dplb.tenants import DEFAULT_TENANT

log = logging.getLogger("dplb.router")
PROMOTE_GRACE_S: Final = 5.0  # a returned segment without any routable worker is routed on after this long anyway
_READY: Final = Lifecycle.READY
_NONE: Final[frozenset[int]] = frozenset()
# (Final: compiled, a C static instead of a module-dict and an attribute lookup per use.)
_perf_counter: Final = time.perf_counter
_monotonic_ns: Final = time.monotonic_ns
_time: Final = time.time


class RouterState:
    """Shared state of one router process (single event loop; not thread-safe by design)."""

    def __init__(self, cfg: RouterConfig, metrics: RouterMetrics) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.segment: Segment | None = None
        self.slots: RouterSlots | None = None  # this process's router slot in ``segment`` (None: not writable)
        self._attach_error: str | None = None
        self._try_attach(initial=True)
        seg = self._attached_segment()
        n = cfg.num_workers or (seg.num_workers if seg is not None else None)
        if n is None:
            raise ShmError(
                f"cannot tell how many workers there are: the segment is missing ({self._attach_error}) and "
                "--num-workers was not given. Start the workers' segment with `dplb launch`, or pass --num-workers.")
        self.num_workers = n
        self.policy: Policy = make_policy(cfg.policy, n)
        self.inflight = [0] * n
        #: (unix time, request id, tenant, decision) of the last ``debug_ring`` decisions (``/debug/decisions``).
        self.decisions: collections.deque[tuple[float, str, str, Decision]] = collections.deque(maxlen=cfg.debug_ring)
        self.watch = WorkerWatch(n, metrics)  # the monitor step's transitions: logs and counts
        ejections = metrics.ejections
        self.health = WorkerHealth(n, self.pid_of, lambda k: ejections.labels(str(k)).inc())
        self._share_health()
        self._had_segment = seg is not None
        self.stall = StallDetector(n, cfg.stall_after_s, heed_flag=True) if cfg.stall_after_s > 0 else None
        self.attempts: list[set[Cuttable]] = [set() for _ in range(n)]  # open attempts per worker (stall cuts)
        self._pending: Segment | None = None  # a returned segment not routed on yet (see module docstring)
        self._pending_since = 0.0
        #: Called at every monitor step, after the heartbeat (e.g. the response-id map's replay of its peers' rings).
        self.on_tick: list[Callable[[], None]] = []
        metrics.init_workers(n)
        metrics.shm_present.set(1 if seg is not None else 0)

    # ---- segment ---------------------------------------------------------------------------------------------
    def _attached_segment(self) -> Segment | None:
        """The attached segment, or None. ``__init__`` reads it through this method, not as ``self.segment``: there
        mypy narrows ``self.segment`` to the None assigned before :meth:`_try_attach`, and mypyc compiles that
        narrowing into a cast that fails once a segment is attached."""
        return self.segment

    def _try_attach(self, initial: bool = False) -> bool:
        try:
            seg = Segment.attach(self.cfg.shm_path, writable=False)
        except ShmError as e:
            err = type(e).__name__ if type(e).__name__ in ("ShmMissingError", "ShmLayoutError") else "ShmError"
            if err != self._attach_error:  # once per kind of failure, not every check
                self.metrics.shm_errors.labels("attach", err).inc()
                (log.warning if initial or err != "ShmMissingError" else log.info)("state segment unavailable: %s", e)
            self._attach_error = err
            return False
        if self.cfg.num_workers and seg.num_workers < self.cfg.num_workers:
            if initial:  # at start-up a wrong count is the operator's to fix: refuse to start
                seg.close()
                raise ConfigError(f"--num-workers {self.cfg.num_workers}: the state segment {seg.path} has "
                                  f"{seg.num_workers} worker slots; pass --num-workers {seg.num_workers} or fewer, "
                                  f"or recreate it with `dplb segment create --num-workers {self.cfg.num_workers}`")
            if self._attach_error != "too_few_slots":  # replaced at runtime by a smaller one: ignore it
                log.error("segment %s has %d slots, fewer than --num-workers %d; ignoring it (recreate it with "
                          "`dplb segment create --num-workers %d`)", seg.path, seg.num_workers,
                          self.cfg.num_workers, self.cfg.num_workers)
                self.metrics.shm_errors.labels("attach", "ShmLayoutError").inc()
            self._attach_error = "too_few_slots"
            seg.close()
            return False
        self.segment = seg
        self._attach_error = None
        self._close_slots()
        # Registered in the header too, so `dplb doctor` never calls this segment stale.
        self.slots = RouterSlots.claim(seg.path, seg.num_workers, self.cfg.port, self.cfg.process_index,
                                       inode=seg.inode)
        if initial and self.slots is not None and not seg.header.run_dir:  # (a recreated one: the launcher's)
            self._record_run_dir(seg)
        log.info("attached state segment %s (%d workers, %d ms interval%s)", seg.path, seg.num_workers,
                 seg.state_interval_ms, f"; router slot {self.slots.index}" if self.slots else
                 "; no router slot (segment not writable, all taken or replaced meanwhile): other routers cannot "
                 "see this one's in-flight requests")
        return True

    def _record_run_dir(self, seg: Segment) -> None:
        """Write this router's run directory into ``seg``'s header, empty in a segment ``dplb segment create`` made
        without ``$DPLB_RUN_DIR`` (by hand, a unit without the env file): it is the stack's (the workers' sockets are
        there), and it is where ``dplb state`` finds the last good tenants copy that names the tenant tables. Only
        into the file attached (same inode), never over a run dir already there."""
        with contextlib.suppress(ShmError, OSError), Segment.attach(seg.path) as w:
            if w.inode == seg.inode and w.restore_header("", [], self.cfg.run_dir):
                seg.reload_header()
                log.info("recorded the run directory %s in the segment's header (it had none)", self.cfg.run_dir)

    def _share_health(self) -> None:
        """Point the worker health at this process's router slot's health table (None: no slot), after any change
        of the slot (attach, loss, close)."""
        self.health.share(self.slots.health if self.slots is not None else None)

    def _close_slots(self) -> None:
        if self.slots is not None:
            self.health.share(None)  # (never a closed table: a report may come before the next monitor step)
            self.slots.close()
            self.slots = None

    def close(self) -> None:
        """Give the router slot back and unmap the segment (shutdown)."""
        self._close_slots()
        if self.segment is not None:
            self.segment.close()

    def _interval_ms(self) -> int:
        seg = self.segment
        return seg.state_interval_ms if seg is not None else self.cfg.policy.state_interval_ms

    def snapshot(self) -> list[WorkerState] | None:
        """Every worker's state from shm, or None without a segment."""
        seg = self.segment
        if seg is None:
            return None
        snap = seg.read_all()
        return snap[: self.num_workers]

    # ---- hot path --------------------------------------------------------------------------------------------
    def decide(self, request: RouteRequest, request_id: str, tenant: str = DEFAULT_TENANT) -> Decision:
        """Pick a worker for one request of ``tenant`` (see module docstring) and record the decision
        (:meth:`choose`, then :meth:`record`). Never raises for a missing segment."""
        d, seconds = self.choose(request)
        self.record(d, seconds, request_id, tenant)
        return d

    def choose(self, request: RouteRequest) -> tuple[Decision, float]:
        """:meth:`decide` without the record: (the decision, its duration in seconds). The caller must
        :meth:`record` it (the direct relay does once the request is on its way to the worker)."""
        policy = self.policy
        policy.prepare(request)
        t0 = _perf_counter()
        seg = self.segment
        snap = None if seg is None else seg.read_all()[: self.num_workers]  # (snapshot(), inlined: per request)
        slots = self.slots
        if slots is not None and not slots.has_peers:  # (asked once: only the monitor changes it)
            slots = None  # alone on the segment: nobody to learn from or tell
        health = self.health
        if slots is not None:
            health.sync(slots.peer_slots)  # the peers' ejections and failure streaks (one load each if unchanged)
        ejected = health.ejected(snap) if health.any_ejected else _NONE
        if snap is None:
            # No state: only workers whose socket file exists are candidates (a stat per worker, fallback only).
            exclude = request.exclude | request.cannot_serve | ejected | {
                k for k in range(self.num_workers) if not os.path.exists(self.cfg.socket_path(k))}
            try:
                k = self.policy.pick_without_state(self.inflight, exclude)
                d = Decision(self.policy.name, k, REASON_FALLBACK, [], self.policy.baseline_s)
            except LookupError:
                d = Decision(self.policy.name, None, REASON_NO_WORKERS, [], self.policy.baseline_s)
        else:
            assert seg is not None
            now = _monotonic_ns()
            held = health.observe(snap, now, seg.state_interval_ms)
            if slots is not None and policy.shares:
                policy.absorb(slots.drain_prefix(), now)  # what the other router processes learnt meanwhile
            if policy.follows_engines:
                kv = seg.kv_reader()  # what the workers' engines confirmed and evicted meanwhile
                policy.absorb_engine(kv.drain(), kv.refresh_mask(now, policy.truth_block_bytes), now)
            shared = None if slots is None else self._shared(snap, now)
            first, last = _NONE, None
            if self.stall is not None and self.stall.any_stalled:
                first, last = self._stall_sets(snap, now)
            d = policy.pick(snap, now, request, held=held, ejected=ejected, inflight=self.inflight, shared=shared,
                            stalled=first)
            if last is not None and d.worker is None:  # no other worker can take it: a stalled one's probe may
                d = policy.pick(snap, now, request, held=held, ejected=ejected, inflight=self.inflight,
                                shared=shared, stalled=last)
            if request.learned and slots is not None and d.worker is not None:
                slots.publish_prefix(d.worker, request.learned)
        return d, _perf_counter() - t0

    def record(self, d: Decision, seconds: float, request_id: str, tenant: str = DEFAULT_TENANT) -> None:
        """Count decision ``d`` (made in ``seconds``) in the metrics and keep it in the debug ring
        (``/debug/decisions``) with the request's id and ``tenant`` (the tenant is kept with the decision, not looked
        up by request id: a client chooses its ``X-Request-Id``, and two tenants may send the same one)."""
        self.metrics.observe_decision(d, seconds)
        self.decisions.append((_time(), request_id, tenant, d))

    def dry_run(self, snap: list[WorkerState] | None) -> Decision | None:
        """What the policy would see right now for a request without a prompt (a metrics scrape): every
        candidate's inputs, terms and health; None without a segment. Chooses nothing."""
        if snap is None:
            return None
        now = time.monotonic_ns()
        health = self.health
        return self.policy.pick(snap, now, held=health.held_out(), ejected=health.ejected(snap), dry_run=True,
                                inflight=self.inflight, shared=self._shared(snap, now), stalled=self.stalled(now))

    def _stall_sets(self, snap: list[WorkerState], now: int) -> tuple[frozenset[int], frozenset[int] | None]:
        """(the stalled workers a pick leaves out, the smaller set a second pick leaves out when the first found
        nobody, or None when there is none): a stalled worker due for the detector's probe that probes its own
        engine (``FLAG_STALLED`` in its slot) is let in only as a last resort (module docstring)."""
        st = self.stall
        assert st is not None
        out, may = st.stalled(), st.excluded(now)
        if out == may:
            return out, None
        first = may | frozenset(k for k in out - may if snap[k].flags & FLAG_STALLED)
        return first, (may if first != may else None)

    def stalled_workers(self) -> list[int]:
        """Every stalled worker, sorted (those due for a probe too; empty with the stall check off)."""
        return sorted(self.stall.stalled()) if self.stall is not None else []

    def stalled(self, now_ns: int) -> frozenset[int]:
        """Stalled workers not to route to at ``now_ns`` (a stalled worker free of requests for ``--stall-after``
        may take one probe request; :mod:`dplb.policy.stall`)."""
        return self.stall.excluded(now_ns) if self.stall is not None else frozenset()

    def _shared(self, snap: list[WorkerState], now: int) -> list[int] | None:
        """The other router processes' correction per worker (None when there are none or none sent lately)."""
        slots = self.slots
        if slots is None or not slots.has_peers:
            return None
        g = self.policy.grace_ns
        horizon = STALE_INTERVALS * self._interval_ms() * 1_000_000 + g
        return slots.peer_correction([w.heartbeat_mono_ns - g for w in snap], now, horizon)

    def inflight_all(self) -> list[int]:
        """Open requests per worker of every live router process on the segment (this one included)."""
        if self.slots is None:
            return list(self.inflight)
        return [a + b for a, b in zip(self.inflight, self.slots.peer_inflight(), strict=False)]

    # ---- health ------------------------------------------------------------------------------------------------
    def report(self, worker: int, outcome: Outcome, e2e_s: float = 0.0, ttft_s: float | None = None) -> None:
        """How one attempt on ``worker`` ended: its outcome feeds the worker's health, and a latency sample
        (:attr:`Outcome.latency_sample`: ``e2e_s`` end to end and ``ttft_s`` to the first body byte, seconds since
        the request arrived) the policy's baseline."""
        self.health.report(worker, outcome)
        if outcome.latency_sample:
            self.policy.observe_latency(e2e_s, ttft_s)

    def held_out(self) -> frozenset[int]:
        """Workers kept out by the heartbeat hysteresis right now (stale, or fresh again but on probation)."""
        return self.health.held_out()

    def pid_of(self, worker: int) -> int:
        """The pid worker ``worker`` published (0 without a segment)."""
        seg = self.segment
        return seg.read(worker).pid if seg is not None else 0

    def acquire(self, worker: int, attempt: Cuttable | None = None) -> None:
        """A request was dispatched to ``worker`` (published to this process's router slot); ``attempt`` is cut if
        the worker stalls before :meth:`release` (kept only while the stall check is on)."""
        if attempt is not None and self.stall is not None:
            self.attempts[worker].add(attempt)
        n = self.inflight[worker] = self.inflight[worker] + 1
        slots = self.slots
        if slots is not None and worker < slots.num_workers:
            c = self.policy.correction(worker)
            slots.publish(worker, c if c < n else n, n, _monotonic_ns())

    def release(self, worker: int, attempt: Cuttable | None = None) -> None:
        """A request to ``worker`` ended (any outcome)."""
        if attempt is not None and self.stall is not None:
            self.attempts[worker].discard(attempt)
        n = self.inflight[worker] = self.inflight[worker] - 1
        slots = self.slots
        if slots is not None and worker < slots.num_workers:
            c = self.policy.correction(worker)
            slots.publish(worker, c if c < n else n, n)

    # ---- background ------------------------------------------------------------------------------------------
    async def monitor(self) -> None:
        """Watch segment presence and worker (de)registration until cancelled."""
        while True:
            try:
                self.check_once()
            except Exception:  # keep watching whatever happens
                log.exception("router monitor step failed")
            # While a worker is on probation, look at every state interval so "steadily fresh" means it.
            await asyncio.sleep(min(self.cfg.shm_check_interval_s, self._interval_ms() / 1000)
                                if self.health.watching or self._pending is not None else self.cfg.shm_check_interval_s)

    def check_once(self) -> None:
        """One monitor step (also called by tests): segment presence (``dplb_shm_segment_present`` is 1 while the
        router routes on a segment), re-attachment, heartbeat hysteresis, (de)registration logs."""
        seg = self.segment
        if seg is not None and not seg.still_present():
            log.warning("state segment %s was removed or replaced; routing on the router's in-flight counts "
                        "until it is back", seg.path)
            self.metrics.shm_errors.labels("read", "segment_removed").inc()
            self.segment = None
            self._close_slots()
            seg.close()
            self._attach_error = "segment_removed"
        if self.segment is None:
            self._reattach()
        elif not (self.segment.header.model and self.segment.header.run_dir):
            self.segment.reload_header()  # a recreated segment: `dplb launch` restores its model and run dir
        self.metrics.shm_present.set(1 if self.segment else 0)
        self._share_health()
        if self.slots is not None:
            self.slots.heartbeat()
            self.health.sync(self.slots.peer_slots)
        for hook in self.on_tick:
            hook()
        snap = self.snapshot()
        if snap is None:
            self.watch.panicking(_NONE, self.routable_workers)  # routing on the fallback: no panic
            return
        watch = self.watch
        watch.restarts(snap)
        now = time.monotonic_ns()
        held = self.health.observe(snap, now, self._interval_ms())
        if self.stall is not None:
            watch.stalls(self.stall, snap, self.inflight_all(), now, self.attempts)
        watch.panicking(self._panic_set(snap, now, held), self.routable_workers)
        # Hysteresis and stalls log their own transitions.
        probing = self.stall.stalled() if self.stall is not None else _NONE
        watch.registrations(routable(snap, now, self._policy_cfg(), held, stalled=self.stalled(now)), probing)

    def _panic_set(self, snap: list[WorkerState], now: int, held: frozenset[int]) -> frozenset[int]:
        """The workers panic routing routes among now (empty: no panic; module docstring)."""
        if not (held and self.cfg.policy.panic_routing):
            return _NONE
        health = self.health
        ejected = health.ejected(snap) if health.any_ejected else _NONE
        stalled = self.stalled(now)
        return panic_set(routable(snap, now, self._policy_cfg(), held, ejected, stalled), ejected, stalled)

    def _reattach(self) -> None:
        """Without a segment: attach one that (re)appeared. After a loss, route on it only once one of its workers
        is routable or :data:`PROMOTE_GRACE_S` passed (module docstring)."""
        if self._pending is None:
            if not self._try_attach():
                return
            if not self._had_segment:
                self._had_segment = True
                log.info("state segment is here; routing on shm state")
                return
            self._pending, self.segment = self.segment, None
            self._pending_since = time.monotonic()
        pending = self._pending
        assert pending is not None
        if not pending.still_present():
            pending.close()
            self._pending = None
            return
        now = time.monotonic_ns()
        interval = pending.state_interval_ms
        snap = pending.read_all()[: self.num_workers]
        ready = [w.worker_id for w in snap if w.registered and not w.is_stale(interval, now)
                 and w.lifecycle == _READY]
        waited = time.monotonic() - self._pending_since
        if ready or waited >= PROMOTE_GRACE_S:
            self.segment, self._pending = pending, None
            log.info("state segment is back; routing on shm state again (%s)",
                     f"workers {ready} re-published" if ready else f"no worker re-published within {waited:.1f} s")

    def routable_workers(self, panic: bool = False, snap: list[WorkerState] | None = None) -> list[int]:
        """Worker ids that are eligible and ready right now (for ``/ready``, the host report and ``/v1/models``; no
        stalled worker, not even one due for a probe). Without a segment: the
        workers whose socket file exists. With ``panic`` (the tenant gate's room), when none is eligible and panic
        routing is on: the workers panic routing routes among now (:func:`dplb.policy.panic_set`, the condition of
        ``dplb_router_panic``, here on this very snapshot), empty when there are none. Costs nothing more while
        some worker is routable. ``snap``: the caller's :meth:`snapshot` of now (read here when None)."""
        snap = snap if snap is not None else self.snapshot()
        if snap is None:
            return [k for k in range(self.num_workers) if os.path.exists(self.cfg.socket_path(k))]
        now = time.monotonic_ns()
        health = self.health
        # Every stalled worker is left out, the one due for a probe too: it is not ready (module docstring).
        held, ejected = health.held_out(), health.ejected(snap)
        stalled = self.stall.stalled() if self.stall is not None else _NONE
        cands = routable(snap, now, self._policy_cfg(), held, ejected, stalled)
        ok = [c.worker_id for c in cands if c.why is OK]
        if ok or not (panic and held and self.cfg.policy.panic_routing):
            return ok
        return sorted(panic_set(cands, ejected, stalled))

    def _policy_cfg(self) -> PolicyConfig:
        """The policy configuration with the segment's state interval (what staleness is measured against)."""
        iv = self._interval_ms()
        cfg = self.cfg.policy
        return cfg if cfg.state_interval_ms == iv else dataclasses.replace(cfg, state_interval_ms=iv)


__all__ = ["PROMOTE_GRACE_S", "READMIT_INTERVALS", "RouterState"]
