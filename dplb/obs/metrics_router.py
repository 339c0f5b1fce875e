"""The router's per-request families (docs/DESIGN.md §9): decisions, rejections, upstream outcomes and latencies,
retries and resumed streams, stalls, ejections and panic routing, shm errors, HTTP routes and the prefix-routing
counters.

Contract: :class:`RouterMetrics` builds them, with the process collector and the build info, in the router process's
own registry; every known label value is pre-created at zero by ``init_workers``; the hot path only looks up cached
label children. Names and label-value sets come from :mod:`dplb.obs.metrics`; the scrape-time figures are in
:mod:`dplb.obs.metrics_scrape`.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector

from dplb import native
from dplb.errors import RESEND_REASONS
from dplb.obs.fastmetrics import CounterFamily, HistogramChild, HistogramFamily
from dplb.obs.metrics import (
    BUILD_INFO,
    DECISION_BUCKETS,
    DIRECT_PATHS,
    DIRECT_RELAY,
    HTTP_REQUEST_DURATION,
    HTTP_REQUESTS,
    OUTCOMES,
    PANIC,
    PANIC_ROUTED,
    PREFIX_HIT_BLOCKS,
    PREFIX_QUERY_BLOCKS,
    PREFIX_ROUTED,
    REQUEST_BUCKETS,
    REQUESTS_REJECTED,
    RESTART_REASONS,
    RESUME_REFUSALS,
    ROUTING_DECISION_DURATION,
    ROUTING_DECISIONS,
    SHM_ERROR_LABELS,
    SHM_ERRORS,
    SHM_SEGMENT_PRESENT,
    STALLED_REQUESTS_FAILED,
    STATE_READ_AGE,
    STREAM_RESUME_DURATION,
    STREAM_RESUME_REFUSED,
    STREAMS_RESUMED,
    UPSTREAM_REQUEST_DURATION,
    UPSTREAM_RESENDS,
    UPSTREAM_RETRIES,
    UPSTREAM_TTFB,
    WORKER_EJECTIONS,
    WORKER_RESTARTS,
    WORKER_STALLED,
    WORKER_STALLS,
)
from dplb.policy.decision import Decision


class RouterMetrics:
    """The router's metrics in its own registry.

    Per-worker scoring inputs are not stored here: :class:`WorkerStateCollector` reads them from shm and from the
    policy at scrape time (``bind``), so they are exactly what the scorer sees, at no cost on the hot path.
    """

    def __init__(self, version: str) -> None:
        reg = self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=reg)  # process_* (RSS, open fds, CPU seconds, start time) of the router
        # compiled: whether the hot path runs as mypyc extension modules (true/false/partial/stale; dplb.native).
        self._version = version
        self.build_info = Info(BUILD_INFO, "DPLB build", registry=reg)
        self.set_build_label(native.build_label())
        # Per-request families (decisions, their duration and state age, HTTP routes, upstream TTFB and duration, the
        # prefix outcome and blocks of a routed request):
        # the lock-free fastmetrics drop-ins, same exposition (dplb.obs.fastmetrics); the rest prometheus_client's.
        self.decisions = CounterFamily(ROUTING_DECISIONS, "Routing decisions by chosen worker and reason.",
                                       ["worker", "reason"], registry=reg)
        self.decision_duration = HistogramFamily(ROUTING_DECISION_DURATION, "shm read + pick() time, seconds.",
                                                 buckets=DECISION_BUCKETS, registry=reg)
        self.rejected = Counter(REQUESTS_REJECTED, "Requests the router answered itself with an error, by reason.",
                                ["reason"], registry=reg)
        self.ejections = Counter(WORKER_EJECTIONS, "Times a worker was ejected for a few seconds after consecutive "
                                 "failed responses (passive health check).", ["worker"], registry=reg)
        self.restarts = Counter(WORKER_RESTARTS, "Times the worker's process was replaced in its slot (a new pid "
                                "published), by how the old one left: exited (it published stopped first: its engine "
                                "died, a stall restart, a stop) or killed (it did not: killed, crashed, frozen).",
                                ["worker", "reason"], registry=reg)
        self.panic_routed = Counter(PANIC_ROUTED, "Requests routed in panic: no worker could take them, so they went "
                                    "to a worker held out only by the heartbeat hysteresis (fresh again, on "
                                    "probation).", registry=reg)
        self.panic = Gauge(PANIC, "1 while no worker is routable and the router routes among the workers on "
                           "heartbeat probation (panic routing; 0 with --no-panic-routing).", registry=reg)
        self.stalled = Gauge(WORKER_STALLED, "1 while the worker is stalled: requests in flight and no engine "
                             "progress (token, prefill step) for --stall-after seconds.", ["worker"], registry=reg)
        self.stalls = Counter(WORKER_STALLS, "Times the worker was found stalled (no engine progress with requests "
                              "in flight).", ["worker"], registry=reg)
        self.stalled_failed = Counter(STALLED_REQUESTS_FAILED, "In-flight requests the router failed fast (504 "
                                      "worker_stalled, or an SSE error event) because their worker stalled.",
                                      ["worker"], registry=reg)
        self.direct_relay = CounterFamily(
            DIRECT_RELAY, "Proxied requests offered to the direct relay, by how they went: answered from the protocol "
            "callbacks (direct), taken then continued on the ASGI path (continued: no pooled connection, no worker, a "
            "failure before the head), or left to the ASGI path (declined).", ["path"], registry=reg)
        for p in DIRECT_PATHS:
            self.direct_relay.labels(p)
        self.retries = Counter(UPSTREAM_RETRIES, "Requests re-sent to another worker after a failure before any "
                               "byte reached the first one.", registry=reg)
        self.resends = CounterFamily(UPSTREAM_RESENDS, "Requests sent again on a new connection to the same worker "
                                     "because the pooled connection they were written on ended with them undelivered "
                                     "(unread: reset; closed before the write: epipe), reaching no engine.", ["reason"],
                                     registry=reg)
        for r in RESEND_REASONS:
            self.resends.labels(r)
        self.resumed = Counter(STREAMS_RESUMED, "Broken SSE streams re-issued to another worker with what the "
                               "client already received as the continuation (--resume-streams).", registry=reg)
        self.resume_refused = Counter(STREAM_RESUME_REFUSED, "Broken SSE streams not resumed, by reason (the "
                                      "client got an error event).", ["reason"], registry=reg)
        self.resume_duration = Histogram(STREAM_RESUME_DURATION, "Time from a stream's break to the first token "
                                         "relayed from the worker resuming it, seconds.", buckets=REQUEST_BUCKETS,
                                         registry=reg)
        self.upstream_duration = HistogramFamily(UPSTREAM_REQUEST_DURATION, "Proxied request duration by worker "
                                                 "and outcome, seconds.", ["worker", "outcome"],
                                                 buckets=REQUEST_BUCKETS, registry=reg)
        self.upstream_ttfb = HistogramFamily(UPSTREAM_TTFB, "Time from dispatch to the worker's first response "
                                             "byte, seconds.", ["worker"], buckets=REQUEST_BUCKETS, registry=reg)
        self.shm_present = Gauge(SHM_SEGMENT_PRESENT, "1 when the router reads worker state from the shm segment.",
                                 registry=reg)
        self.shm_errors = Counter(SHM_ERRORS, "Shared-memory errors by operation and error.", ["operation", "error"],
                                  registry=reg)
        self.http_requests = CounterFamily(HTTP_REQUESTS, "Router HTTP requests by route template, method and "
                                           "status (\"0\": the client left before any status was sent).",
                                           ["route", "method", "status"], registry=reg)
        self.http_duration = HistogramFamily(HTTP_REQUEST_DURATION, "Router HTTP request duration by route "
                                             "template, seconds.", ["route", "method"], buckets=REQUEST_BUCKETS,
                                             registry=reg)
        self.state_age = HistogramFamily(STATE_READ_AGE, "Age of the chosen worker's published state when the "
                                         "router decided, seconds.",
                                         buckets=(0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.6, 1, 2, 5), registry=reg)
        self._decision_hist: HistogramChild = self.decision_duration.labels()
        self._age_hist: HistogramChild = self.state_age.labels()
        self.prefix_routed = CounterFamily(
            PREFIX_ROUTED, "Routed requests with a prefix key by outcome: hit (the worker with the longest cached "
            "prefix got it), spill (load sent it elsewhere), miss (no worker had any block).", ["outcome"],
            registry=reg)
        self.prefix_query_blocks = CounterFamily(
            PREFIX_QUERY_BLOCKS, "Prompt blocks of routed requests, by chosen worker (the router's analogue of "
            "vllm:prefix_cache_queries).", ["worker"], registry=reg)
        self.prefix_hit_blocks = CounterFamily(
            PREFIX_HIT_BLOCKS, "Prompt blocks the prefix index predicted the chosen worker has cached (predicted hit "
            f"rate = this / {PREFIX_QUERY_BLOCKS}_total).", ["worker"], registry=reg)
        self._decision_counters: dict[str, dict[int | None, Any]] = {}  # reason → worker → what counts it
        self._decision_children: dict[tuple[int | None, str], Any] = {}  # (the notes' children)
        from dplb.policy.decision import NOTE_PREFIX_BLOCKS, NOTE_PREFIX_HIT_BLOCKS, NOTE_PREFIX_OUTCOME

        # What the policy's plugins note about a routed request (Decision.notes), read by name: outcome notes
        # (the value is the label) and worker notes (the amount added for the chosen worker). A plugin noting
        # something not listed here is simply not exported.
        self._outcome_notes = {NOTE_PREFIX_OUTCOME: self.prefix_routed}
        self._worker_notes = {NOTE_PREFIX_BLOCKS: self.prefix_query_blocks,
                              NOTE_PREFIX_HIT_BLOCKS: self.prefix_hit_blocks}


    def set_build_label(self, compiled: str) -> None:
        """``dplb_build_info``'s ``compiled`` label (:attr:`dplb.native.Build.label`): at start-up, and ``"stale"``
        when the build went stale under the running router (:class:`dplb.native.StaleWatch`)."""
        self.build_info.info({"version": self._version, "component": "router", "compiled": compiled})
    def init_workers(self, n: int) -> None:
        """Pre-create every known label value at zero."""
        from dplb.errors import RouterErrorKind
        from dplb.policy.decision import ROUTED_REASONS, UNROUTED_REASONS

        for k in range(n):
            for r in ROUTED_REASONS:
                self.decisions.labels(str(k), r)
            self.upstream_ttfb.labels(str(k))
            self.ejections.labels(str(k))
            for reason in RESTART_REASONS:
                self.restarts.labels(str(k), reason)
            self.stalled.labels(str(k)).set(0)
            self.stalls.labels(str(k))
            self.stalled_failed.labels(str(k))
            for o in OUTCOMES:
                self.upstream_duration.labels(str(k), o)
        for r in UNROUTED_REASONS:
            self.decisions.labels("none", r)
        for kind in RouterErrorKind:
            self.rejected.labels(kind.code)
        for reason in RESUME_REFUSALS:
            self.resume_refused.labels(reason)
        for op, err in SHM_ERROR_LABELS:
            self.shm_errors.labels(op, err)
        from dplb.policy.decision import PREFIX_OUTCOMES

        for o in PREFIX_OUTCOMES:
            self.prefix_routed.labels(o)
        for k in range(n):
            self.prefix_query_blocks.labels(str(k))
            self.prefix_hit_blocks.labels(str(k))

    def observe_decision(self, d: Decision, seconds: float) -> None:
        """Count one decision and its duration."""
        worker = d.worker
        reason = d.reason
        by_worker = self._decision_counters.get(reason)  # (by reason, then worker: no key tuple per decision)
        if by_worker is None:
            by_worker = self._decision_counters[reason] = {}
        child = by_worker.get(worker)
        if child is None:
            child = by_worker[worker] = self._decision_child((worker, reason))
        child.inc()
        self._decision_hist.observe(seconds)
        age = d.chosen_age_s()
        if age is not None:
            self._age_hist.observe(age)
        notes = d.notes
        if notes and worker is not None:  # (notes come only with a chosen worker)
            self._count_notes(notes, worker)

    def _decision_child(self, key: tuple[int | None, str]) -> Any:
        """What counts a decision of (worker, reason) ``key``: its ``dplb_routing_decisions_total`` child, and for a
        panic decision ``dplb_router_panic_routed_total`` too (made once per key, so the hot path tests nothing)."""
        from dplb.policy.decision import REASON_PANIC

        child = self.decisions.labels("none" if key[0] is None else str(key[0]), key[1])
        return _Both(child, self.panic_routed) if key[1] == REASON_PANIC else child

    def _count_notes(self, notes: dict[str, Any], worker: int) -> None:
        """Count what the policy's plugins noted about one routed request, by note name (see ``__init__``). Label
        children are cached in the decisions' dict, under keys no decision has (reasons starting with NUL)."""
        cache = self._decision_children
        for note, counter in self._outcome_notes.items():
            value = notes.get(note)
            if value is not None:
                child = cache.get((None, "\0" + value))
                if child is None:
                    child = cache[(None, "\0" + value)] = counter.labels(value)
                child.inc()
        for note, counter in self._worker_notes.items():
            amount = notes.get(note)
            if amount is not None:
                child = cache.get((worker, "\0" + note))
                if child is None:
                    child = cache[(worker, "\0" + note)] = counter.labels(str(worker))
                child.inc(amount)



class _Both:
    """Two counters counted as one (a panic decision: its decision child and the panic counter)."""

    __slots__ = ("first", "second")

    def __init__(self, first: Any, second: Any) -> None:
        self.first = first
        self.second = second

    def inc(self) -> None:
        """Count one in both."""
        self.first.inc()
        self.second.inc()
