"""The usage ledger's families (docs/DESIGN.md §15): requests, tokens, fair-queue wait, TTFT and E2E, queued
requests and SLO events, by tenant and priority class.

Contract: :class:`TenantMetrics` registers them in the registry it is given (the router's); labels are bounded (the
configured tenants + ``default``, the priority classes, the closed :data:`dplb.obs.metrics.TENANT_OUTCOMES`).
Names come from :mod:`dplb.obs.metrics`. The families a request updates (requests, tokens, the three histograms, SLO
events) are :mod:`dplb.obs.fastmetrics`'s (the same exposition, no lock, a bisect per observation): every request of
a router with ``--api-key`` or ``--access-log`` updates them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from dplb.obs.fastmetrics import CounterFamily, HistogramFamily
from dplb.obs.metrics import (
    REQUEST_BUCKETS,
    TENANT_E2E,
    TENANT_QUEUE_WAIT,
    TENANT_QUEUED,
    TENANT_REQUESTS,
    TENANT_SLO_EVENTS,
    TENANT_SLO_OBJECTIVE,
    TENANT_TOKENS,
    TENANT_TTFT,
    TENANTS_FILE_FAILURES,
    TENANTS_FILE_VALID,
)


class TenantMetrics:
    """The usage ledger's families in ``registry`` (names in :mod:`dplb.obs.metrics`); children looked up per
    (tenant, class)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        lt, lp = ["tenant", "priority"], ["tenant", "priority", "outcome"]
        self.requests = CounterFamily(TENANT_REQUESTS, "Proxied requests by tenant, priority class and outcome.",
                                      lp, registry=registry)
        self.tokens = CounterFamily(TENANT_TOKENS, "Tokens by tenant and kind (prompt, completion, cached: the "
                                    "engine's usage counts).", ["tenant", "kind"], registry=registry)
        self.queue_wait = HistogramFamily(TENANT_QUEUE_WAIT, "Time requests waited in the router's fair queue, "
                                          "seconds.", lt, buckets=REQUEST_BUCKETS, registry=registry)
        self.ttft = HistogramFamily(TENANT_TTFT, "Time from arrival to the first response body byte of a streamed "
                                    "response (the first token; a response that is not a stream is not observed), "
                                    "seconds.", lt, buckets=REQUEST_BUCKETS, registry=registry)
        self.e2e = HistogramFamily(TENANT_E2E, "Time from arrival to the end of the response of a request answered "
                                   "OK (outcome ok), seconds.", lt, buckets=REQUEST_BUCKETS, registry=registry)
        self.queued = Gauge(TENANT_QUEUED, "Requests waiting in the router's fair queue, by tenant.", ["tenant"],
                            registry=registry)
        self.slo_events = CounterFamily(TENANT_SLO_EVENTS, "Requests counted by a class's SLO: availability (bad = a "
                                        "5xx, or a 200 stream that failed: cut, or ended by the worker's error event), "
                                        "ttft (streamed requests only; bad = TTFT over the class's ttft_s), by result "
                                        "good/bad.", ["tenant", "priority", "slo", "result"], registry=registry)
        self.slo_objective = Gauge(TENANT_SLO_OBJECTIVE, "A priority class's SLO target from the tenants file (0-1).",
                                   ["priority", "slo"], registry=registry)



class TenantsFileMetrics:
    """Whether the tenants file on disk is what the router runs (registered with ``--tenants`` only): a gauge, 0
    while the router runs an older / last good version because the file did not load, and a failure counter."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.valid = Gauge(TENANTS_FILE_VALID, "1 when the --tenants file on disk loaded at the last start or SIGHUP; "
                           "0 when it did not and the router runs the previous (last good) version.",
                           registry=registry)
        self.failures = Counter(TENANTS_FILE_FAILURES, "Loads of the --tenants file that failed (at a start, "
                                "falling back on the last good copy, or at a SIGHUP, keeping the previous one).",
                                registry=registry)

    def loaded(self, ok: bool) -> None:
        """Record one load of the file."""
        self.valid.set(1 if ok else 0)
        if not ok:
            self.failures.inc()
