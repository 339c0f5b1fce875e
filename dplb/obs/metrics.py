"""Every DPLB metric name, help text, label set and bucket layout (docs/DESIGN.md §9). Nothing else defines metrics.

Contract: ``dplb_`` prefix, base units (seconds, bytes, ratios 0–1), ``_total`` only on counters, bounded labels
(worker id, closed reason/outcome sets; never a client-supplied model, path, prompt or request id). Each process
builds its metrics into its own :class:`prometheus_client.CollectorRegistry` through the factories below, so tests
can run several in one interpreter. Dashboards and alerts import the names from here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

# ---- names (dashboards/alerts import these) --------------------------------------------------------------------
WORKER_QUEUE_LENGTH = "dplb_worker_queue_length"
WORKER_REQUESTS_INFLIGHT = "dplb_worker_requests_inflight"
WORKER_KV_CACHE_USAGE = "dplb_worker_kv_cache_usage_ratio"
WORKER_GPU_MEMORY_USED = "dplb_worker_gpu_memory_used_bytes"
WORKER_GPU_MEMORY_TOTAL = "dplb_worker_gpu_memory_total_bytes"
WORKER_LATENCY_AVG = "dplb_worker_latency_avg_seconds"  # what the latency scorer uses (E2E or TTFT)
WORKER_E2E_AVG = "dplb_worker_e2e_avg_seconds"
WORKER_TTFT_AVG = "dplb_worker_ttft_avg_seconds"
WORKER_REQUESTS_RUNNING = "dplb_worker_requests_running"
WORKER_REQUESTS_WAITING = "dplb_worker_requests_waiting"
WORKER_INFLIGHT_CORRECTION = "dplb_worker_inflight_correction"
WORKER_MAX_QUEUE = "dplb_worker_max_queue"
POLICY_INFO = "dplb_policy"  # exposed as dplb_policy_info
POLICY_WEIGHT = "dplb_policy_weight"
PREFIX_INDEX_BLOCKS = "dplb_prefix_index_blocks"
PREFIX_INDEX_CAPACITY = "dplb_prefix_index_capacity_blocks"
PREFIX_INDEX_BYTES = "dplb_prefix_index_bytes"
PREFIX_ROUTED = "dplb_prefix_routed"  # _total, by outcome (hit / spill / miss)
PREFIX_QUERY_BLOCKS = "dplb_prefix_query_blocks"  # _total, per chosen worker
PREFIX_HIT_BLOCKS = "dplb_prefix_hit_blocks"  # _total, per chosen worker: blocks the index says it has cached
# What each worker's engine really held, against the router's prediction (the workers' KV rings, dplb.state.kv_rings)
PREFIX_COMPARED = "dplb_prefix_compared_requests"  # _total, per worker: requests compared
PREFIX_ENGINE_CACHED = "dplb_prefix_engine_cached_tokens"  # _total, per worker: engine-cached prompt tokens
PREFIX_PREDICTED = "dplb_prefix_predicted_tokens"  # _total, per worker: router-predicted cached tokens
PREFIX_PREDICTION_ERROR = "dplb_prefix_prediction_error_tokens"  # _total, per worker: Σ|predicted − cached|
PREFIX_ENGINE_EVENTS = "dplb_prefix_engine_events"  # gauge, per worker: 1 = the index follows its engine's events
PREFIX_EVENTS_LOST = "dplb_prefix_engine_events_lost"  # _total, per worker: event batches its subscription lost
PREFIX_RING_LOST = "dplb_prefix_kv_ring_lost"  # _total: KV-ring entries this router process could not read
LATENCY_BASELINE = "dplb_latency_baseline_seconds"
WORKER_SCORE = "dplb_worker_score"
WORKER_SCORE_TERM = "dplb_worker_score_term"
WORKER_UP = "dplb_worker_up"
WORKER_LIFECYCLE = "dplb_worker_lifecycle"
WORKER_STATE_LAST_UPDATE = "dplb_worker_state_last_update_timestamp_seconds"
WORKERS_REGISTERED = "dplb_workers_registered"
ROUTING_DECISIONS = "dplb_routing_decisions"  # exposed as dplb_routing_decisions_total
ROUTING_DECISION_DURATION = "dplb_routing_decision_duration_seconds"
STATE_READ_AGE = "dplb_state_read_age_seconds"
REQUESTS_REJECTED = "dplb_requests_rejected"  # _total
UPSTREAM_RETRIES = "dplb_upstream_retries"  # _total
STREAMS_RESUMED = "dplb_streams_resumed"  # _total
STREAM_RESUME_REFUSED = "dplb_stream_resume_refused"  # _total
STREAM_RESUME_DURATION = "dplb_stream_resume_duration_seconds"
#: Why a broken stream was not resumed (``--resume-streams``; the ``reason`` label of
#: ``dplb_stream_resume_refused_total``): what the request asked for (``n``, ``logprobs``, ``structured_output``,
#: ``tools``, ``echo``, ``prompt_not_text``, ``continued_message``), what was delivered (``tool_calls``,
#: ``reasoning``), limits (``max_tokens``, ``body_too_large``, ``too_many_resumes``, ``finished``: the answer ended
#: and only its usage was lost) and the resumed try (``no_worker``, ``worker_refused``).
RESUME_REFUSALS = ("n", "logprobs", "structured_output", "tools", "echo", "prompt_not_text", "continued_message",
                   "tool_calls", "reasoning", "max_tokens", "body_too_large", "too_many_resumes", "finished",
                   "no_worker", "worker_refused")
WORKER_EJECTIONS = "dplb_worker_ejections"  # _total
WORKER_STALLED = "dplb_worker_stalled"  # 1 while stalled (requests outstanding, no engine progress)
WORKER_STALLS = "dplb_worker_stalls"  # _total: times found stalled
STALLED_REQUESTS_FAILED = "dplb_stalled_requests_failed"  # _total: in-flight requests failed fast on a stalled worker
UPSTREAM_REQUEST_DURATION = "dplb_upstream_request_duration_seconds"
UPSTREAM_TTFB = "dplb_upstream_time_to_first_byte_seconds"
HTTP_REQUESTS = "dplb_http_requests"  # _total
HTTP_REQUEST_DURATION = "dplb_http_request_duration_seconds"
WORKER_WARMUP_DURATION = "dplb_worker_warmup_duration_seconds"
WORKER_FIRST_REQUEST_DURATION = "dplb_worker_first_request_duration_seconds"
WORKER_CUDA_OOM = "dplb_worker_cuda_oom"  # _total
SHM_SEGMENT_PRESENT = "dplb_shm_segment_present"
SHM_ERRORS = "dplb_shm_errors"  # _total
NVML_ERRORS = "dplb_nvml_errors"  # _total
BUILD_INFO = "dplb_build"  # exposed as dplb_build_info
WORKER_REQUESTS = "dplb_worker_requests"  # _total (worker side)
WORKER_ERRORS = "dplb_worker_errors"  # _total (worker side)
WORKER_COLLECTOR_TICK = "dplb_worker_collector_tick_seconds"
WORKER_INFO = "dplb_worker"  # exposed as dplb_worker_info{worker, engine} (worker side; joins engine series)
WORKER_MODEL_LOAD_DURATION = "dplb_worker_model_load_duration_seconds"
WORKER_ORPHANS = "dplb_worker_orphan_requests"  # worker side: engine requests no client waits for (persisting)
WORKER_ORPHAN_ABORTS = "dplb_worker_orphan_aborts"  # _total (worker side): aborts the reconciler sent
WORKER_LEAKED_INFLIGHT = "dplb_worker_leaked_inflight"  # worker side: router in-flight the worker does not have
WORKER_ENGINE_REQUESTS = "dplb_worker_engine_requests"  # worker side: requests the engine holds (reconciler's view)
ROUTER_PROCESSES = "dplb_router_processes"  # {state="configured"|"answered"}: a router group's processes
# The usage ledger (docs/DESIGN.md §15): labels tenant (the configured ones + "default") and priority class.
TENANT_REQUESTS = "dplb_tenant_requests"  # _total, by tenant, priority, outcome (TENANT_OUTCOMES)
TENANT_TOKENS = "dplb_tenant_tokens"  # _total, by tenant, kind (prompt, completion, cached)
TENANT_QUEUE_WAIT = "dplb_tenant_queue_wait_seconds"
TENANT_TTFT = "dplb_tenant_ttft_seconds"
TENANT_E2E = "dplb_tenant_e2e_seconds"
TENANT_QUEUED = "dplb_tenant_queued_requests"
TENANT_SLO_EVENTS = "dplb_tenant_slo_events"  # _total, by tenant, priority, slo (availability, ttft), result
TENANT_SLO_OBJECTIVE = "dplb_tenant_slo_objective"  # by priority, slo: the tenants file's target (0-1)

#: One owner per name: the router exports every per-worker figure that travels through the shm slot
#: (lifecycle, warm-up, first request, model load, CUDA OOMs, scoring inputs) for all workers, even those whose
#: metrics port is off; a worker's own port exports only what the slot does not carry. No name is in both jobs
#: except dplb_build_info (told apart by its ``component`` label), so an unfiltered ``sum`` never double-counts.
WORKER_SIDE = frozenset({BUILD_INFO, WORKER_INFO, WORKER_REQUESTS, WORKER_ERRORS, NVML_ERRORS, WORKER_COLLECTOR_TICK,
                         WORKER_ORPHANS, WORKER_ORPHAN_ABORTS, WORKER_LEAKED_INFLIGHT, WORKER_ENGINE_REQUESTS})

#: How a router group's /metrics merges its processes (:mod:`dplb.router.siblings`). GROUP_SHARED: figures every
#: process derives from the same shm segment and router slots (the per-worker scoring inputs, health, lifecycle)
#: and the settings: the answering process's own view, once. Everything else is a process's own (its counters and
#: histograms, process_* resources, its latency baseline and prefix-index copy): one series per process with a
#: ``process`` label, so nothing is summed twice and a restarted process resets only its own series (rate() stays
#: right). Aggregate with ``sum by (...)`` as the dashboards and alerts do.
GROUP_SHARED = frozenset({
    WORKER_QUEUE_LENGTH, WORKER_REQUESTS_RUNNING, WORKER_REQUESTS_WAITING, WORKER_INFLIGHT_CORRECTION,
    WORKER_MAX_QUEUE, WORKER_REQUESTS_INFLIGHT, WORKER_KV_CACHE_USAGE, WORKER_GPU_MEMORY_USED, WORKER_GPU_MEMORY_TOTAL,
    WORKER_LATENCY_AVG, WORKER_E2E_AVG, WORKER_TTFT_AVG, WORKER_SCORE, WORKER_SCORE_TERM, WORKER_UP, WORKER_LIFECYCLE,
    WORKER_STATE_LAST_UPDATE, WORKER_WARMUP_DURATION, WORKER_FIRST_REQUEST_DURATION, WORKER_MODEL_LOAD_DURATION,
    WORKER_CUDA_OOM, WORKERS_REGISTERED, POLICY_INFO, POLICY_WEIGHT, BUILD_INFO, ROUTER_PROCESSES,
})
#: Scrape-time figures of one process (not derived from shm): labelled per process like the counters.
GROUP_PER_PROCESS_SCRAPE = frozenset({LATENCY_BASELINE, PREFIX_INDEX_BLOCKS, PREFIX_INDEX_CAPACITY, PREFIX_INDEX_BYTES})

# (operation, error) label pairs of dplb_shm_errors_total: a closed set.
SHM_ERROR_LABELS = (("attach", "ShmMissingError"), ("attach", "ShmLayoutError"), ("attach", "ShmError"),
                    ("read", "segment_removed"))
LIFECYCLE_STATES = ("unset", "starting", "warming", "ready", "draining", "stopped")
#: ok (2xx), client_error (4xx of the worker), rejected (the router's 401/403/429), server_error (5xx, the router's
#: 503s included: what an availability SLO counts as bad), cancelled (the client left first).
TENANT_OUTCOMES = ("ok", "client_error", "rejected", "server_error", "cancelled")
OUTCOMES = ("ok", "upstream_error", "upstream_4xx", "upstream_5xx", "client_disconnect", "timeout", "stalled")

# Buckets: µs..ms for the decision, 5 ms..10 min for model requests (prefill of long prompts is slow).
DECISION_BUCKETS = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 1e-2)
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 600)
WARMUP_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200)


@dataclass
class WorkerMetrics:
    """The metrics a worker process exports on its metrics port (beside the engine's ``vllm:*`` metrics): only
    :data:`WORKER_SIDE` names. The counters are read at scrape time from ``counters()`` (the collector's running
    totals: requests completed, requests failed, NVML read errors), typed as counters."""

    registry: CollectorRegistry
    collector_tick: Histogram


class _WorkerCounters:
    """Scrape-time figures of one worker: ``source()`` returns (requests_total, errors_total, nvml_errors_total);
    ``reconcile()`` the reconciler's (orphans now, orphan aborts sent in total, leaked router in-flight now, engine
    requests at its last tick)."""

    def __init__(self, worker: str, source: Callable[[], tuple[int, int, int]],
                 reconcile: Callable[[], tuple[int, int, int, int]]) -> None:
        self.worker, self.source, self.reconcile = worker, source, reconcile

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        req, err, nvml = self.source()
        for name, doc, v in ((WORKER_REQUESTS, "Model requests the worker completed.", req),
                             (WORKER_ERRORS, "Model requests the engine failed (5xx or cut).", err),
                             (NVML_ERRORS, "Failed NVML reads of the worker's GPU memory.", nvml)):
            fam = CounterMetricFamily(name, doc, labels=["worker"])
            fam.add_metric([self.worker], v)
            yield fam
        orphans, aborts, leaked, held = self.reconcile()
        g = GaugeMetricFamily(WORKER_ORPHANS, "Engine requests whose client is gone (no open request on the worker's "
                              "socket), seen for at least two state intervals.", labels=["worker"])
        g.add_metric([self.worker], orphans)
        yield g
        c = CounterMetricFamily(WORKER_ORPHAN_ABORTS, "Aborts the worker's reconciler sent to its engine for orphan "
                                "requests (an abort that the client's disconnect should have caused).",
                                labels=["worker"])
        c.add_metric([self.worker], aborts)
        yield c
        g = GaugeMetricFamily(WORKER_LEAKED_INFLIGHT, "Requests the routers count in flight to this worker that are "
                              "not open on its socket, for at least two state intervals (summed over routers).",
                              labels=["worker"])
        g.add_metric([self.worker], leaked)
        yield g
        g = GaugeMetricFamily(WORKER_ENGINE_REQUESTS, "Requests the engine holds (waiting or running) as the "
                              "reconciler saw them at its last tick (vLLM: one per prompt).", labels=["worker"])
        g.add_metric([self.worker], held)
        yield g


def worker_metrics(worker_id: int, version: str, engine: str = "sim",
                   counters: Callable[[], tuple[int, int, int]] = lambda: (0, 0, 0),
                   reconcile: Callable[[], tuple[int, int, int, int]] = lambda: (0, 0, 0, 0)) -> WorkerMetrics:
    """Build a worker's metrics in a fresh registry (see :data:`WORKER_SIDE`). ``counters()`` returns the running
    totals (requests completed, requests failed, NVML errors) exported as counters at scrape time; ``reconcile()``
    the reconciler's figures (orphans now, orphan aborts in total, leaked router in-flight now, engine requests;
    docs/DESIGN.md §8.1)."""
    reg = CollectorRegistry(auto_describe=True)
    w = str(worker_id)
    Info(BUILD_INFO, "DPLB build", registry=reg).info({"version": version, "component": "worker"})
    Info(WORKER_INFO, "This worker's id and engine (joins the engine's vllm:* series to a worker id by instance).",
         registry=reg).info({"worker": w, "engine": engine})
    reg.register(_WorkerCounters(w, counters, reconcile))
    m = WorkerMetrics(
        registry=reg,
        collector_tick=Histogram(WORKER_COLLECTOR_TICK, "Time one collector tick takes, seconds.", ["worker"],
                                 buckets=(*DECISION_BUCKETS[3:], 0.05, 0.1), registry=reg),
    )
    m.collector_tick.labels(w)
    return m


class RouterMetrics:
    """The router's metrics in its own registry.

    Per-worker scoring inputs are not stored here: :class:`WorkerStateCollector` reads them from shm and from the
    policy at scrape time (``bind``), so they are exactly what the scorer sees, at no cost on the hot path.
    """

    def __init__(self, version: str) -> None:
        reg = self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=reg)  # process_* (RSS, open fds, CPU seconds, start time) of the router
        Info(BUILD_INFO, "DPLB build", registry=reg).info({"version": version, "component": "router"})
        self.decisions = Counter(ROUTING_DECISIONS, "Routing decisions by chosen worker and reason.",
                                 ["worker", "reason"], registry=reg)
        self.decision_duration = Histogram(ROUTING_DECISION_DURATION, "shm read + pick() time, seconds.",
                                           buckets=DECISION_BUCKETS, registry=reg)
        self.rejected = Counter(REQUESTS_REJECTED, "Requests the router answered itself with an error, by reason.",
                                ["reason"], registry=reg)
        self.ejections = Counter(WORKER_EJECTIONS, "Times a worker was ejected for a few seconds after consecutive "
                                 "failed responses (passive health check).", ["worker"], registry=reg)
        self.stalled = Gauge(WORKER_STALLED, "1 while the worker is stalled: requests in flight and no engine "
                             "progress (token, prefill step) for --stall-after seconds.", ["worker"], registry=reg)
        self.stalls = Counter(WORKER_STALLS, "Times the worker was found stalled (no engine progress with requests "
                              "in flight).", ["worker"], registry=reg)
        self.stalled_failed = Counter(STALLED_REQUESTS_FAILED, "In-flight requests the router failed fast (503 "
                                      "worker_stalled, or an SSE error event) because their worker stalled.",
                                      ["worker"], registry=reg)
        self.retries = Counter(UPSTREAM_RETRIES, "Requests re-sent to another worker after a failure before any "
                               "byte reached the first one.", registry=reg)
        self.resumed = Counter(STREAMS_RESUMED, "Broken SSE streams re-issued to another worker with what the "
                               "client already received as the continuation (--resume-streams).", registry=reg)
        self.resume_refused = Counter(STREAM_RESUME_REFUSED, "Broken SSE streams not resumed, by reason (the "
                                      "client got an error event).", ["reason"], registry=reg)
        self.resume_duration = Histogram(STREAM_RESUME_DURATION, "Time from a stream's break to the first token "
                                         "relayed from the worker resuming it, seconds.", buckets=REQUEST_BUCKETS,
                                         registry=reg)
        self.upstream_duration = Histogram(UPSTREAM_REQUEST_DURATION, "Proxied request duration by worker and "
                                           "outcome, seconds.", ["worker", "outcome"], buckets=REQUEST_BUCKETS,
                                           registry=reg)
        self.upstream_ttfb = Histogram(UPSTREAM_TTFB, "Time from dispatch to the worker's first response byte, "
                                       "seconds.", ["worker"], buckets=REQUEST_BUCKETS, registry=reg)
        self.shm_present = Gauge(SHM_SEGMENT_PRESENT, "1 when the router reads worker state from the shm segment.",
                                 registry=reg)
        self.shm_errors = Counter(SHM_ERRORS, "Shared-memory errors by operation and error.", ["operation", "error"],
                                  registry=reg)
        self.http_requests = Counter(HTTP_REQUESTS, "Router HTTP requests by route template, method and status.",
                                     ["route", "method", "status"], registry=reg)
        self.http_duration = Histogram(HTTP_REQUEST_DURATION, "Router HTTP request duration by route template, "
                                       "seconds.", ["route", "method"], buckets=REQUEST_BUCKETS, registry=reg)
        self.state_age = Histogram(STATE_READ_AGE, "Age of the chosen worker's published state when the router "
                                   "decided, seconds.", buckets=(0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.6, 1, 2, 5),
                                   registry=reg)
        self.prefix_routed = Counter(PREFIX_ROUTED, "Routed requests with a prefix key by outcome: hit (the worker "
                                     "with the longest cached prefix got it), spill (load sent it elsewhere), miss "
                                     "(no worker had any block).", ["outcome"], registry=reg)
        self.prefix_query_blocks = Counter(PREFIX_QUERY_BLOCKS, "Prompt blocks of routed requests, by chosen worker "
                                           "(the router's analogue of vllm:prefix_cache_queries).", ["worker"],
                                           registry=reg)
        self.prefix_hit_blocks = Counter(PREFIX_HIT_BLOCKS, "Prompt blocks the prefix index predicted the chosen "
                                         "worker has cached (predicted hit rate = this / "
                                         f"{PREFIX_QUERY_BLOCKS}_total).", ["worker"], registry=reg)
        self._decision_children: dict[tuple[int | None, str], object] = {}
        from dplb.policy.decision import NOTE_PREFIX_BLOCKS, NOTE_PREFIX_HIT_BLOCKS, NOTE_PREFIX_OUTCOME

        # What the policy's plugins note about a routed request (Decision.notes), read by name: outcome notes
        # (the value is the label) and worker notes (the amount added for the chosen worker). A plugin noting
        # something not listed here is simply not exported.
        self._outcome_notes = {NOTE_PREFIX_OUTCOME: self.prefix_routed}
        self._worker_notes = {NOTE_PREFIX_BLOCKS: self.prefix_query_blocks,
                              NOTE_PREFIX_HIT_BLOCKS: self.prefix_hit_blocks}

    def init_workers(self, n: int) -> None:
        """Pre-create every known label value at zero."""
        from dplb.errors import RouterErrorKind
        from dplb.policy.decision import DECISION_REASONS

        for k in range(n):
            for r in DECISION_REASONS[:4]:
                self.decisions.labels(str(k), r)
            self.upstream_ttfb.labels(str(k))
            self.ejections.labels(str(k))
            self.stalled.labels(str(k)).set(0)
            self.stalls.labels(str(k))
            self.stalled_failed.labels(str(k))
            for o in OUTCOMES:
                self.upstream_duration.labels(str(k), o)
        for r in DECISION_REASONS[4:]:
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

    def observe_decision(self, d: object, seconds: float) -> None:
        """Count one decision (``d`` a :class:`dplb.policy.Decision`) and its duration."""
        key = (d.worker, d.reason)  # type: ignore[attr-defined]
        child = self._decision_children.get(key)
        if child is None:
            child = self._decision_children[key] = self.decisions.labels(
                "none" if key[0] is None else str(key[0]), key[1])
        child.inc()  # type: ignore[attr-defined]
        self.decision_duration.observe(seconds)
        age = d.chosen_age_s()  # type: ignore[attr-defined]
        if age is not None:
            self.state_age.observe(age)
        notes = d.notes  # type: ignore[attr-defined]
        if notes:
            self._count_notes(notes, d.worker)  # type: ignore[attr-defined]

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
                child.inc()  # type: ignore[attr-defined]
        for note, counter in self._worker_notes.items():
            amount = notes.get(note)
            if amount is not None:
                child = cache.get((worker, "\0" + note))
                if child is None:
                    child = cache[(worker, "\0" + note)] = counter.labels(str(worker))
                child.inc(amount)  # type: ignore[attr-defined]


class TenantMetrics:
    """The usage ledger's families in ``registry`` (names above); children looked up per (tenant, class)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        lt, lp = ["tenant", "priority"], ["tenant", "priority", "outcome"]
        self.requests = Counter(TENANT_REQUESTS, "Proxied requests by tenant, priority class and outcome.", lp,
                                registry=registry)
        self.tokens = Counter(TENANT_TOKENS, "Tokens by tenant and kind (prompt, completion, cached: the engine's "
                              "usage counts).", ["tenant", "kind"], registry=registry)
        self.queue_wait = Histogram(TENANT_QUEUE_WAIT, "Time requests waited in the router's fair queue, seconds.",
                                    lt, buckets=REQUEST_BUCKETS, registry=registry)
        self.ttft = Histogram(TENANT_TTFT, "Time from arrival to the first response body byte, seconds.", lt,
                              buckets=REQUEST_BUCKETS, registry=registry)
        self.e2e = Histogram(TENANT_E2E, "Time from arrival to the end of the response, seconds.", lt,
                             buckets=REQUEST_BUCKETS, registry=registry)
        self.queued = Gauge(TENANT_QUEUED, "Requests waiting in the router's fair queue, by tenant.", ["tenant"],
                            registry=registry)
        self.slo_events = Counter(TENANT_SLO_EVENTS, "Requests counted by a class's SLO: availability (bad = a 5xx), "
                                  "ttft (bad = TTFT over the class's ttft_s), by result good/bad.",
                                  ["tenant", "priority", "slo", "result"], registry=registry)
        self.slo_objective = Gauge(TENANT_SLO_OBJECTIVE, "A priority class's SLO target from the tenants file (0-1).",
                                   ["priority", "slo"], registry=registry)


class WorkerStateCollector:
    """Scrape-time collector of the per-worker scoring inputs, as the scorer sees them right now.

    ``source()`` returns ``(decision, inflight, registered, baseline_s, policy)``: a dry-run
    :class:`~dplb.policy.decision.Decision` over the current snapshot (None without a segment), the router's in-flight
    count per worker, the number of registered workers, the latency baseline (None until frozen) and the
    :class:`dplb.policy.Policy` (its settings and the prefix index). Terms are exported generically by scorer name
    (``dplb_worker_score_term{term=…}``), so a new scorer needs no edit here.
    """

    def __init__(self, source: Callable[[], tuple[Any, list[int], int, float | None, Any]]) -> None:
        self.source = source

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        d, inflight, registered, baseline, policy = self.source()

        def g(name: str, doc: str, labels: tuple[str, ...] = ("worker",)) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=list(labels))

        fam = {
            WORKER_QUEUE_LENGTH: g(WORKER_QUEUE_LENGTH, "Queue the scorer sees: running + waiting + router "
                                   "correction, requests."),
            WORKER_REQUESTS_RUNNING: g(WORKER_REQUESTS_RUNNING, "Requests the engine is running (its batch), from "
                                       "shm."),
            WORKER_REQUESTS_WAITING: g(WORKER_REQUESTS_WAITING, "Requests waiting in the engine's queue, from shm."),
            WORKER_INFLIGHT_CORRECTION: g(WORKER_INFLIGHT_CORRECTION, "Requests the router sent that the worker's "
                                          "last snapshot may not count yet (the optimistic correction)."),
            WORKER_MAX_QUEUE: g(WORKER_MAX_QUEUE, "Soft queue cap of the queue term for this worker, requests."),
            WORKER_REQUESTS_INFLIGHT: g(WORKER_REQUESTS_INFLIGHT, "Requests the router has in flight to the worker "
                                        "(every router process on the segment, from their router slots)."),
            WORKER_KV_CACHE_USAGE: g(WORKER_KV_CACHE_USAGE, "KV-cache usage, ratio 0-1."),
            WORKER_GPU_MEMORY_USED: g(WORKER_GPU_MEMORY_USED, "NVML GPU memory used, bytes."),
            WORKER_GPU_MEMORY_TOTAL: g(WORKER_GPU_MEMORY_TOTAL, "NVML GPU memory total, bytes."),
            WORKER_LATENCY_AVG: g(WORKER_LATENCY_AVG, "Latency the score uses (mean E2E or mean TTFT of the "
                                  "worker's last 10 requests, per --latency-signal), seconds."),
            WORKER_E2E_AVG: g(WORKER_E2E_AVG, "Mean E2E latency of the worker's last 10 requests, seconds."),
            WORKER_TTFT_AVG: g(WORKER_TTFT_AVG, "Mean time to first token of the worker's last 10 requests, "
                               "seconds."),
            WORKER_SCORE: g(WORKER_SCORE, "Routing score (higher is better), 0-1."),
            WORKER_SCORE_TERM: g(WORKER_SCORE_TERM, "Each score term before weighting, 0-1, by scorer name (the "
                                 "prefix term is 0 here: a scrape has no prompt).", ("worker", "term")),
            WORKER_UP: g(WORKER_UP, "1 when the worker is routable (no health filter rejects it)."),
            WORKER_LIFECYCLE: g(WORKER_LIFECYCLE, "Worker lifecycle, one-hot.", ("worker", "state")),
            WORKER_STATE_LAST_UPDATE: g(WORKER_STATE_LAST_UPDATE, "Wall time of the worker's last heartbeat, unix "
                                        "seconds."),
            WORKER_WARMUP_DURATION: g(WORKER_WARMUP_DURATION, "Duration of the worker's warm-up request, seconds "
                                      "(0 until warmed)."),
            WORKER_FIRST_REQUEST_DURATION: g(WORKER_FIRST_REQUEST_DURATION, "E2E of the first real request after "
                                             "ready, seconds (0 until served)."),
            WORKER_MODEL_LOAD_DURATION: g(WORKER_MODEL_LOAD_DURATION, "Engine load time of the worker's current "
                                          "process (model load up to the warm-up), seconds (0 until loaded)."),
        }
        oom = CounterMetricFamily(WORKER_CUDA_OOM, "CUDA out-of-memory errors the worker reported.",
                                  labels=["worker"])
        for k, n in enumerate(inflight):
            fam[WORKER_REQUESTS_INFLIGHT].add_metric([str(k)], n)
        if d is not None:
            for c in d.candidates:
                w, s = str(c.worker_id), c.state
                view = d.candidate_dict(c)
                for name, v in ((WORKER_QUEUE_LENGTH, c.queue), (WORKER_REQUESTS_RUNNING, s.num_running),
                                (WORKER_REQUESTS_WAITING, s.num_waiting), (WORKER_INFLIGHT_CORRECTION, c.correction),
                                (WORKER_KV_CACHE_USAGE, s.kv_cache_usage),
                                (WORKER_GPU_MEMORY_USED, s.gpu_memory_used_bytes),
                                (WORKER_GPU_MEMORY_TOTAL, s.gpu_memory_total_bytes),
                                (WORKER_LATENCY_AVG, view.get("latency_s", s.avg_latency_s)),
                                (WORKER_E2E_AVG, s.avg_latency_s), (WORKER_TTFT_AVG, s.avg_ttft_s),
                                (WORKER_SCORE, c.score), (WORKER_UP, 1 if c.routable else 0),
                                (WORKER_STATE_LAST_UPDATE, s.heartbeat_unix_ns / 1e9),
                                (WORKER_WARMUP_DURATION, s.warmup_seconds),
                                (WORKER_FIRST_REQUEST_DURATION, s.first_request_seconds),
                                (WORKER_MODEL_LOAD_DURATION, s.model_load_seconds)):
                    fam[name].add_metric([w], v)
                if "max_queue" in view:
                    fam[WORKER_MAX_QUEUE].add_metric([w], view["max_queue"])
                for term, v in view["terms"].items():
                    fam[WORKER_SCORE_TERM].add_metric([w, term], v)
                life = LIFECYCLE_STATES[int(s.lifecycle)] if int(s.lifecycle) < len(LIFECYCLE_STATES) else "unset"
                for st in LIFECYCLE_STATES:
                    fam[WORKER_LIFECYCLE].add_metric([w, st], 1 if st == life else 0)
                oom.add_metric([w], s.cuda_oom_total)
        yield from fam.values()
        yield oom
        yield GaugeMetricFamily(WORKERS_REGISTERED, "Worker slots written at least once since the segment was created "
                                "(same notion as the router's no_workers_registered; see dplb_worker_up for routable).",
                                value=registered)
        yield GaugeMetricFamily(LATENCY_BASELINE, "Latency baseline of the score (P95 of the first 50 requests), "
                                "seconds; NaN until frozen.", value=float("nan") if baseline is None else baseline)
        yield from _policy_families(policy)


class KvTruthCollector:
    """Scrape-time collector of the workers' KV-ring figures: per worker, the requests whose router prediction was
    compared with the engine's cached tokens, the cached and predicted tokens and the absolute error summed over
    them (mean error per request = error ÷ compared), whether the index follows the worker's engine events, and
    the event batches its subscription lost; plus the ring entries this router process lost. ``source()`` returns
    the segment's :class:`dplb.state.kv_rings.KvRingReader` (or None without a segment) and the worker count."""

    def __init__(self, source: Callable[[], tuple[Any, int]]) -> None:
        self.source = source

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        reader, n = self.source()
        docs = {PREFIX_COMPARED: "Requests whose predicted cached tokens the worker compared with its engine's.",
                PREFIX_ENGINE_CACHED: "Prompt tokens the engine served from its prefix cache (compared requests).",
                PREFIX_PREDICTED: "Prompt tokens the router's prefix index predicted cached (compared requests).",
                PREFIX_PREDICTION_ERROR: "Sum over compared requests of |predicted - engine cached| prompt tokens.",
                PREFIX_EVENTS_LOST: "KV event batches the worker's subscription to its engine lost."}
        keys = {PREFIX_COMPARED: "compared_total", PREFIX_ENGINE_CACHED: "cached_tokens_total",
                PREFIX_PREDICTED: "predicted_tokens_total", PREFIX_PREDICTION_ERROR: "error_tokens_total",
                PREFIX_EVENTS_LOST: "lost_batches"}
        fams = {name: CounterMetricFamily(name, doc, labels=["worker"]) for name, doc in docs.items()}
        ev = GaugeMetricFamily(PREFIX_ENGINE_EVENTS, "1 when the router's prefix index follows the worker's engine "
                               "(its KV events), 0 when it falls back to what it sent.", labels=["worker"])
        lost = CounterMetricFamily(PREFIX_RING_LOST, "KV-ring entries this router process could not read (each gap "
                                   "dropped that worker's confirmations).", value=reader.lost if reader else 0)
        if reader is not None:
            for k in range(n):
                c = reader.counters(k)
                for name, fam in fams.items():
                    fam.add_metric([str(k)], c[keys[name]])
                ev.add_metric([str(k)], c["events"])
        yield from fams.values()
        yield ev
        yield lost


def _policy_families(policy: Any) -> Iterator[Metric]:
    """The policy's settings (an info metric: the configuration, then every configured plugin's parameters in force
    as ``<plugin>_<parameter>``), one weight per scorer, and the gauges of what the plugins report (``stats()``)."""
    cfg = policy.cfg
    settings = {
        "policy": cfg.name, "memory_signal": cfg.memory_signal, "latency_signal": cfg.latency_signal,
        "max_queue": str(cfg.max_queue), "max_queue_from_worker": str(cfg.max_queue_from_worker).lower(),
        "hard_queue_cap": str(cfg.hard_queue_cap), "waiting_weight": f"{cfg.waiting_weight:g}",
        "latency_deadband": f"{cfg.latency_deadband:g}", "prefix_block_bytes": str(cfg.prefix_block_bytes),
        "baseline_window": str(cfg.baseline_window)}
    # A setting that is an older flag's PolicyConfig field (``waiting_weight``) shows the value in force: that of
    # the first configured plugin whose parameter it is the default of (scorers come before the picker), so
    # ``--scorer-param queue.waiting_weight=4`` reads 4 under both names.
    claimed: set[str] = set()
    for plugin in policy.plugins:
        fields = {p.name: p.field for p in plugin.parameters}
        for k, v in plugin.params.items():
            text = str(v).lower() if isinstance(v, bool) else f"{v:g}" if isinstance(v, float) else str(v)
            settings[f"{plugin.name}_{k}"] = text
            field = fields.get(k)
            if field in settings and field not in claimed:
                settings[field] = text
                claimed.add(field)
    yield InfoMetricFamily(POLICY_INFO, "Routing policy settings.", value=settings)
    wf = GaugeMetricFamily(POLICY_WEIGHT, "Weight of each scorer in the score.", labels=["term"])
    for name, w in zip(policy.term_names, policy.weights, strict=False):
        wf.add_metric([name], w)
    yield wf
    from dplb.policy.decision import STAT_INDEX_BLOCKS, STAT_INDEX_BYTES, STAT_INDEX_CAPACITY

    # What the plugins report about their own state (Plugin.stats()), read by (plugin, stat) name.
    gauges = {
        ("prefix", STAT_INDEX_BLOCKS): (PREFIX_INDEX_BLOCKS, "Blocks in the prefix index."),
        ("prefix", STAT_INDEX_CAPACITY): (PREFIX_INDEX_CAPACITY, "Capacity of the prefix index (LRU), blocks."),
        ("prefix", STAT_INDEX_BYTES): (PREFIX_INDEX_BYTES, "Estimated memory of the prefix index, bytes."),
    }
    stats = policy.plugin_stats()
    for (plugin, stat), (name, doc) in gauges.items():
        value = stats.get(plugin, {}).get(stat)
        if value is not None:
            yield GaugeMetricFamily(name, doc, value=value)


__all__ = [
    "Counter", "Gauge", "Histogram", "RouterMetrics", "WorkerMetrics", "WorkerStateCollector", "worker_metrics",
]


# ---- host load report (dplb.router.host_report): the fleet-facing figures --------------------------------------
#: The Model Server Protocol families the Inference Extension's Endpoint Picker reads from a model-server pod
#: (gateway-api-inference-extension ``docs/proposals/003-model-server-protocol``). The router exports each exactly
#: once, the host's aggregate: the EPP takes one series per family and ignores the rest.
MSP_WAITING = "vllm:num_requests_waiting"
MSP_RUNNING = "vllm:num_requests_running"
MSP_KV_USAGE = "vllm:kv_cache_usage_perc"
MSP_LORA_INFO = "vllm:lora_requests_info"
MSP_CACHE_CONFIG = "vllm:cache_config_info"
MSP_FAMILIES = frozenset({MSP_WAITING, MSP_RUNNING, MSP_KV_USAGE, MSP_LORA_INFO, MSP_CACHE_CONFIG})
HOST_UTILIZATION = "dplb_host_utilization_ratio"
HOST_LOAD = "dplb_host_load_ratio"
HOST_AGENT_WEIGHT = "dplb_host_agent_weight_percent"
HOST_RPS = "dplb_host_requests_per_second"
HOST_STATE = "dplb_host_state"  # one-hot {state="up"|"drain"|"down"}
HOST_ROUTABLE_WORKERS = "dplb_host_routable_workers"
HOST_DRAINING_WORKERS = "dplb_host_draining_workers"
HOST_CAPACITY = "dplb_host_capacity_requests"
HOST_ROUTER_PENDING = "dplb_host_router_pending_requests"
HOST_STATES = ("up", "drain", "down")
HOST_FAMILIES = MSP_FAMILIES | {HOST_UTILIZATION, HOST_LOAD, HOST_AGENT_WEIGHT, HOST_RPS, HOST_STATE,
                                HOST_ROUTABLE_WORKERS, HOST_DRAINING_WORKERS, HOST_CAPACITY, HOST_ROUTER_PENDING}
# Every router process computes the host report from the same segment and router slots: shared in a group's merge.
GROUP_SHARED = GROUP_SHARED | HOST_FAMILIES


class HostReportCollector:
    """Scrape-time collector of the host load report. ``source()`` returns the latest
    :class:`dplb.router.host_report.HostReport` (read by attribute); nothing is computed at scrape time."""

    def __init__(self, source: Callable[[], Any]) -> None:
        self.source = source

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        r = self.source()
        yield GaugeMetricFamily(MSP_WAITING, "Host aggregate: requests waiting in the workers' queues plus those the "
                                "router sent that the workers do not count yet.", value=r.waiting)
        yield GaugeMetricFamily(MSP_RUNNING, "Host aggregate: requests the routable workers are running.",
                                value=r.running)
        yield GaugeMetricFamily(MSP_KV_USAGE, "Host aggregate KV-cache usage: used / total blocks over the routable "
                                "workers. 1 means 100 percent usage.", value=r.kv_usage)
        cache = GaugeMetricFamily(MSP_CACHE_CONFIG, "Host aggregate cache config: block size (tokens) and the "
                                  "routable workers' KV blocks summed.", labels=["block_size", "num_gpu_blocks"])
        cache.add_metric([str(r.kv_block_size), str(r.kv_total_blocks)], 1)
        yield cache
        if r.adapters:
            lora = GaugeMetricFamily(MSP_LORA_INFO, "Host aggregate LoRA adapters (value: last update, unix "
                                     "seconds); max_lora: the routable workers' --max-loras summed, empty when none "
                                     "says.", labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
            lora.add_metric([",".join(r.adapters), "", str(r.max_loras) if r.max_loras > 0 else ""], r.time_unix)
            yield lora
        for name, doc, v in (
                (HOST_UTILIZATION, "Host utilization 0-1 (1: every batch slot or the KV cache is full, or the host "
                 "drains or has no routable worker).", r.utilization),
                (HOST_LOAD, "(running + waiting) / batch capacity of the routable workers.", r.load),
                (HOST_AGENT_WEIGHT, "Weight the HAProxy agent reports while up, percent (100 / (1 + load)).",
                 r.agent_weight),
                (HOST_RPS, "Requests the workers completed per second (last 5 s).", r.rps),
                (HOST_ROUTABLE_WORKERS, "Workers routable now.", len(r.routable)),
                (HOST_DRAINING_WORKERS, "Workers whose lifecycle is draining.", len(r.draining)),
                (HOST_CAPACITY, "Batch slots (max_num_seqs) of the routable workers, requests.", r.capacity),
                (HOST_ROUTER_PENDING, "Requests sent to a worker that its last snapshot does not count yet.",
                 r.router_pending)):
            yield GaugeMetricFamily(name, doc, value=v)
        st = GaugeMetricFamily(HOST_STATE, "What the host reports to the front balancer, one-hot.", labels=["state"])
        for s in HOST_STATES:
            st.add_metric([s], 1 if r.state == s else 0)
        yield st


__all__ += ["HostReportCollector", "KvTruthCollector"]
