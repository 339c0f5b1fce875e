"""The router's scrape-time collectors (docs/DESIGN.md §9): per-worker scoring inputs, the policy's settings and
plugin figures (:class:`WorkerStateCollector`) and the workers' KV-ring figures (:class:`KvTruthCollector`).

Contract: nothing is stored or updated on the hot path; each scrape reads the current shm snapshot, policy and KV
rings through the ``source`` callable and yields fresh families, so the figures are exactly what the scorer sees.
Terms, plugin notes and stats are read by name, so a new scorer needs no edit here. Names come from
:mod:`dplb.obs.metrics`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

from dplb.obs.metrics import (
    LATENCY_BASELINE,
    LIFECYCLE_STATES,
    POLICY_INFO,
    POLICY_WEIGHT,
    PREFIX_COMPARED,
    PREFIX_ENGINE_CACHED,
    PREFIX_ENGINE_EVENTS,
    PREFIX_EVENTS_LOST,
    PREFIX_INDEX_BLOCKS,
    PREFIX_INDEX_BYTES,
    PREFIX_INDEX_CAPACITY,
    PREFIX_PREDICTED,
    PREFIX_PREDICTION_ERROR,
    PREFIX_RING_LOST,
    WORKER_CUDA_OOM,
    WORKER_E2E_AVG,
    WORKER_FIRST_REQUEST_DURATION,
    WORKER_GPU_MEMORY_TOTAL,
    WORKER_GPU_MEMORY_USED,
    WORKER_INFLIGHT_CORRECTION,
    WORKER_KV_CACHE_USAGE,
    WORKER_LATENCY_AVG,
    WORKER_LIFECYCLE,
    WORKER_MAX_QUEUE,
    WORKER_MODEL_LOAD_DURATION,
    WORKER_QUEUE_LENGTH,
    WORKER_REQUESTS_INFLIGHT,
    WORKER_REQUESTS_RUNNING,
    WORKER_REQUESTS_WAITING,
    WORKER_SCORE,
    WORKER_SCORE_TERM,
    WORKER_STATE_LAST_UPDATE,
    WORKER_TTFT_AVG,
    WORKER_UP,
    WORKER_WARMUP_DURATION,
    WORKERS_REGISTERED,
)


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
        "baseline_window": str(cfg.baseline_window), "panic_routing": str(cfg.panic_routing).lower()}
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

