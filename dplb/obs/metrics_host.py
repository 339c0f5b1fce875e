"""The host load report's families (docs/DESIGN.md §9, §13): the Model Server Protocol ``vllm:*`` families the
Inference Extension's Endpoint Picker reads, exported once as the host's aggregate, and the ``dplb_host_*`` figures.

Contract: :class:`HostReportCollector` reads the latest :class:`dplb.router.host_report.HostReport` at scrape time
and computes nothing; names come from :mod:`dplb.obs.metrics` (:data:`~dplb.obs.metrics.HOST_FAMILIES`). The
waiting and KV-usage families carry the report's ``picker_waiting``/``picker_kv_usage``: the host's figures while it
is up, saturated while it drains or is down (the report's docstring says why and which values).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

from dplb.obs.metrics import (
    HOST_AGENT_WEIGHT,
    HOST_CAPACITY,
    HOST_DRAINING_WORKERS,
    HOST_LOAD,
    HOST_ROUTABLE_WORKERS,
    HOST_ROUTER_PENDING,
    HOST_RPS,
    HOST_STATE,
    HOST_STATES,
    HOST_UTILIZATION,
    MSP_CACHE_CONFIG,
    MSP_KV_USAGE,
    MSP_LORA_INFO,
    MSP_RUNNING,
    MSP_WAITING,
)


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
                                "router sent that the workers do not count yet; saturated (at the picker's default "
                                "queue threshold per worker) while the host drains or is down.",
                                value=r.picker_waiting)
        yield GaugeMetricFamily(MSP_RUNNING, "Host aggregate: requests the routable workers are running.",
                                value=r.running)
        yield GaugeMetricFamily(MSP_KV_USAGE, "Host aggregate KV-cache usage: used / total blocks over the routable "
                                "workers. 1 means 100 percent usage; 1 while the host drains or is down.",
                                value=r.picker_kv_usage)
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

