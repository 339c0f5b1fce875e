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

from dplb.obs.fastmetrics import CounterChild, CounterFamily, HistogramChild, HistogramFamily
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
    """The usage ledger's families in ``registry`` (names in :mod:`dplb.obs.metrics`); :meth:`ledger` gives one
    (tenant, class)'s children, looked up once."""

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
        self._ledgers: dict[tuple[str, str], TenantLedger] = {}
        self.slo_objective = Gauge(TENANT_SLO_OBJECTIVE, "A priority class's SLO target from the tenants file (0-1).",
                                   ["priority", "slo"], registry=registry)



    def ledger(self, tenant: str, priority: str) -> TenantLedger:
        """The children of ``tenant`` in class ``priority`` (made on first use; a series appears only when first
        updated, as with ``labels()``)."""
        key = (tenant, priority)
        led = self._ledgers.get(key)
        if led is None:
            led = self._ledgers[key] = TenantLedger(self, tenant, priority)
        return led


class TenantLedger:
    """One (tenant, class)'s series of :class:`TenantMetrics`: the token counters (``prompt``, ``completion``,
    ``cached``: made at once, as the gate always made them) and the rest, each child made on its first update."""

    __slots__ = ("_e2e", "_m", "_name", "_priority", "_requests", "_ttft", "_wait", "cached", "completion", "prompt")

    def __init__(self, metrics: TenantMetrics, tenant: str, priority: str) -> None:
        self._m, self._name, self._priority = metrics, tenant, priority
        tok = metrics.tokens
        self.prompt = tok.labels(tenant, "prompt")
        self.completion = tok.labels(tenant, "completion")
        self.cached = tok.labels(tenant, "cached")
        self._requests: dict[str, CounterChild] = {}
        self._wait: HistogramChild | None = None
        self._ttft: HistogramChild | None = None
        self._e2e: HistogramChild | None = None

    def request(self, outcome: str) -> None:
        """One request ended with ``outcome`` (:data:`dplb.obs.metrics.TENANT_OUTCOMES`)."""
        c = self._requests.get(outcome)
        if c is None:
            c = self._requests[outcome] = self._m.requests.labels(self._name, self._priority, outcome)
        c.inc()

    def wait(self, seconds: float) -> None:
        """A request's wait in the fair queue (0 when admitted at once), seconds."""
        c = self._wait
        if c is None:
            c = self._wait = self._m.queue_wait.labels(self._name, self._priority)
        c.observe(seconds)

    def first_token(self, seconds: float) -> None:
        """A streamed request's time to its first body byte, seconds."""
        c = self._ttft
        if c is None:
            c = self._ttft = self._m.ttft.labels(self._name, self._priority)
        c.observe(seconds)

    def end_to_end(self, seconds: float) -> None:
        """A request answered OK: arrival to the end of its response, seconds."""
        c = self._e2e
        if c is None:
            c = self._e2e = self._m.e2e.labels(self._name, self._priority)
        c.observe(seconds)


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
