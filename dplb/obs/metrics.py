"""Every DPLB metric name, label-value set and bucket layout (docs/DESIGN.md §9). Nothing else names a metric.

Contract: ``dplb_`` prefix, base units (seconds, bytes, ratios 0–1), ``_total`` only on counters, bounded labels
(worker id, closed reason/outcome sets; never a client-supplied model, path, prompt or request id). Dashboards,
alerts and scripts import the names from here. The families (help texts, label names, how each figure is read)
live with the job that exports them, each taking its names from here, and each process builds them into its own
:class:`prometheus_client.CollectorRegistry`, so tests can run several in one interpreter:
:mod:`dplb.obs.metrics_router` (the router's per-request families), :mod:`dplb.obs.metrics_scrape` (the router's
scrape-time collectors: per-worker scoring inputs, policy settings, KV-ring figures), :mod:`dplb.obs.metrics_host`
(the host load report and the Model Server Protocol families), :mod:`dplb.obs.metrics_tenant` (the usage ledger)
and :mod:`dplb.obs.metrics_worker` (a worker's own metrics port).
"""

from __future__ import annotations

# ---- names (dashboards/alerts import these) --------------------------------------------------------------------
NAME_PREFIX = "dplb_"  # every name below starts with it (a /metrics page without one is not DPLB's)
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
#: _total, by ``reason`` (dplb.errors.RESEND_REASONS): requests sent again on a new connection because the pooled one
#: they were written on ended with them undelivered (they reached no engine).
UPSTREAM_RESENDS = "dplb_upstream_resends"
DIRECT_RELAY = "dplb_direct_relay_requests"  # _total
#: How a request offered to the direct relay went (the ``path`` label of :data:`DIRECT_RELAY`).
DIRECT_PATHS = ("direct", "continued", "declined")
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
# Worker processes replaced in their slot, seen by the router (the dying worker's own counters leave with it):
# ``exited`` when it published ``stopped`` first (it left by itself: its engine died, it stalled past
# --stall-restart-after, it was stopped), ``killed`` when it did not (killed, crashed, or frozen and killed).
WORKER_RESTARTS = "dplb_worker_restarts"  # _total
RESTART_REASONS = ("exited", "killed")
# Panic routing (docs/DESIGN.md §5.1): requests routed to a worker on heartbeat probation because no other could take
# them, and 1 while no worker is routable and the router routes among those on probation (per router process).
PANIC_ROUTED = "dplb_router_panic_routed"  # _total
PANIC = "dplb_router_panic"
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
# With --tenants only: 1 = the file on disk is what runs; 0 = it did not load (at a start or a SIGHUP) and the
# router runs the previous / last good version.
TENANTS_FILE_VALID = "dplb_tenants_file_valid"
TENANTS_FILE_FAILURES = "dplb_tenants_file_load_failures"  # _total: loads of the file that failed (start, SIGHUP)

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
#: 503s included, and a 200 stream that failed: cut, or ended by the worker's own error event — what an availability
#: SLO counts as bad), cancelled (the client left first).
TENANT_OUTCOMES = ("ok", "client_error", "rejected", "server_error", "cancelled")
OUTCOMES = ("ok", "upstream_error", "upstream_4xx", "upstream_5xx", "client_disconnect", "timeout", "stalled")

# Buckets: µs..ms for the decision, 5 ms..10 min for model requests (prefill of long prompts is slow).
DECISION_BUCKETS = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 1e-2)
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 600)
WARMUP_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200)


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
