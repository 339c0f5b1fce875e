"""Every DPLB metric name, help text, label set and bucket layout (DESIGN §7). Nothing else defines metrics.

Contract: ``dplb_`` prefix, base units (seconds, bytes, ratios 0–1), ``_total`` only on counters, bounded labels
(worker id, closed reason/outcome sets; never a client-supplied model, path, prompt or request id). Each process
builds its metrics into its own :class:`prometheus_client.CollectorRegistry` through the factories below, so tests
can run several in one interpreter. Dashboards and alerts import the names from here.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

# ---- names (dashboards/alerts import these) --------------------------------------------------------------------
WORKER_QUEUE_LENGTH = "dplb_worker_queue_length"
WORKER_REQUESTS_INFLIGHT = "dplb_worker_requests_inflight"
WORKER_KV_CACHE_USAGE = "dplb_worker_kv_cache_usage_ratio"
WORKER_GPU_MEMORY_USED = "dplb_worker_gpu_memory_used_bytes"
WORKER_GPU_MEMORY_TOTAL = "dplb_worker_gpu_memory_total_bytes"
WORKER_LATENCY_AVG = "dplb_worker_latency_avg_seconds"
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

LIFECYCLE_STATES = ("unset", "starting", "warming", "ready", "draining", "stopped")
OUTCOMES = ("ok", "upstream_error", "upstream_4xx", "upstream_5xx", "client_disconnect", "timeout")

# Buckets: µs..ms for the decision, 5 ms..10 min for model requests (prefill of long prompts is slow).
DECISION_BUCKETS = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 1e-2)
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 600)
WARMUP_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200)


@dataclass
class WorkerMetrics:
    """The metrics a worker process exports on its metrics port (beside the engine's ``vllm:*`` metrics)."""

    registry: CollectorRegistry
    warmup: Gauge
    first_request: Gauge
    cuda_oom: Gauge
    nvml_errors: Gauge
    lifecycle: Gauge
    requests: Gauge
    errors: Gauge
    collector_tick: Histogram


def worker_metrics(worker_id: int, version: str) -> WorkerMetrics:
    """Build a worker's metrics in a fresh registry. Counters read from the engine are exported as gauges
    mirroring the worker's own running totals (the collector owns the numbers, Prometheus just reads them)."""
    reg = CollectorRegistry(auto_describe=True)
    w = str(worker_id)
    Info(BUILD_INFO, "DPLB build", registry=reg).info({"version": version, "component": "worker"})
    m = WorkerMetrics(
        registry=reg,
        warmup=Gauge(WORKER_WARMUP_DURATION, "Duration of the worker's warm-up request, seconds.", ["worker"],
                     registry=reg),
        first_request=Gauge(WORKER_FIRST_REQUEST_DURATION,
                            "E2E duration of the first real request after the worker became ready, seconds.",
                            ["worker"], registry=reg),
        cuda_oom=Gauge(WORKER_CUDA_OOM + "_total", "CUDA out-of-memory errors reported by the engine.", ["worker"],
                       registry=reg),
        nvml_errors=Gauge(NVML_ERRORS + "_total", "Failed NVML reads.", ["worker"], registry=reg),
        lifecycle=Gauge(WORKER_LIFECYCLE, "Worker lifecycle, one-hot.", ["worker", "state"], registry=reg),
        requests=Gauge(WORKER_REQUESTS + "_total", "Model requests the worker completed.", ["worker"], registry=reg),
        errors=Gauge(WORKER_ERRORS + "_total", "Model requests the engine failed (5xx or cut).", ["worker"],
                     registry=reg),
        collector_tick=Histogram(WORKER_COLLECTOR_TICK, "Time one collector tick takes, seconds.", ["worker"],
                                 buckets=(*DECISION_BUCKETS[3:], 0.05, 0.1), registry=reg),
    )
    for g in (m.warmup, m.first_request, m.cuda_oom, m.nvml_errors, m.requests, m.errors):
        g.labels(w).set(0)
    for s in LIFECYCLE_STATES:
        m.lifecycle.labels(w, s).set(0)
    m.collector_tick.labels(w)
    return m


__all__ = ["Counter", "Gauge", "Histogram", "WorkerMetrics", "worker_metrics"]
