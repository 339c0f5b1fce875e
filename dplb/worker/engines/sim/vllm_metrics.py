"""The sim engine's ``vllm:*`` Prometheus metrics: the names, help texts, labels and buckets vLLM's own
``/metrics`` exposes (``vllm/v1/metrics/loggers.py``), so dashboards and tests read the sim like a real engine.

Contract: :class:`SimMetrics` builds them in a private :class:`CollectorRegistry` per engine (several engines may
share a process); the scheduler updates the counters and histograms as requests progress, and the gauges
(running, waiting, KV-cache usage) are read from the scheduler at scrape time through :class:`SchedulerGauges`.
These are vLLM's names, not DPLB's (those are all in :mod:`dplb.obs.metrics`). Times in seconds, tokens counted.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class SchedulerGauges(Protocol):
    """What the gauges read of :class:`dplb.worker.engines.sim.scheduler.SimScheduler` at scrape time."""

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def kv_cache_usage(self) -> float: ...


_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)


class _GaugeCollector(Collector):
    """Scheduler gauges, read at scrape time."""

    def __init__(self, sched: SchedulerGauges, model: str) -> None:
        self.sched = sched
        self.model = model

    def collect(self) -> Iterator[Metric]:
        s = self.sched
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", s.num_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage),
        ):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self.model], float(value))
            yield g


class SimMetrics:
    """The engine's ``vllm:*`` metrics in a private :class:`CollectorRegistry` (several engines may share a process)."""

    def __init__(self, sched: SchedulerGauges, model: str) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        lbl = ["model_name"]

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, lbl, registry=r)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, lbl, buckets=buckets, registry=r)

        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of tokens.").labels(
            model)
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of tokens.").labels(model)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.").labels(model)
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.").labels(
            model)
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          ["model_name", "finished_reason"], registry=r)
        self.success_length = success.labels(model, "length")
        self.success_abort = success.labels(model, "abort")
        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         _TTFT_BUCKETS).labels(model)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        _LATENCY_BUCKETS).labels(model)
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        _ITL_BUCKETS).labels(model)
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.").labels(
            model)
        self.queue_time = hist("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", _LATENCY_BUCKETS).labels(model)
        r.register(_GaugeCollector(sched, model))
