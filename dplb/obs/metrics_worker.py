"""The metrics a worker process exports on its own metrics port (docs/DESIGN.md §9), beside the engine's ``vllm:*``.

Contract: only the :data:`dplb.obs.metrics.WORKER_SIDE` names (what the worker's shm slot does not carry; the
router exports the rest for every worker), in a fresh registry per :func:`worker_metrics` call. The running totals
and the reconciler's figures are read at scrape time from the callables the worker passes, so the hot path pays
nothing; names come from :mod:`dplb.obs.metrics`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from dplb.obs.metrics import (
    BUILD_INFO,
    DECISION_BUCKETS,
    NVML_ERRORS,
    WORKER_COLLECTOR_TICK,
    WORKER_ENGINE_REQUESTS,
    WORKER_ERRORS,
    WORKER_INFO,
    WORKER_LEAKED_INFLIGHT,
    WORKER_ORPHAN_ABORTS,
    WORKER_ORPHANS,
    WORKER_REQUESTS,
)


@dataclass
class WorkerMetrics:
    """The metrics a worker process exports on its metrics port (beside the engine's ``vllm:*`` metrics): only
    :data:`~dplb.obs.metrics.WORKER_SIDE` names. The counters are read at scrape time from ``counters()`` (the
    collector's running totals: requests completed, requests failed, NVML read errors), typed as counters."""

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
    """Build a worker's metrics in a fresh registry (see :data:`dplb.obs.metrics.WORKER_SIDE`). ``counters()``
    returns the running totals (requests completed, requests failed, NVML errors) exported as counters at scrape
    time; ``reconcile()`` the reconciler's figures (orphans now, orphan aborts in total, leaked router in-flight now,
    engine requests; docs/DESIGN.md §8.1)."""
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
