"""The fast families (dplb.obs.fastmetrics) expose exactly what prometheus_client does for the same observations.

Each table row is a family and a list of operations; the operations go, in order and at the same clock reading,
into a prometheus_client metric in one registry and into the fast family in another, and the text and OpenMetrics
expositions of the two registries must be byte-identical (``_created`` and exemplar timestamps included: the clock
is stepped per operation).
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import prometheus_client.metrics as pm
import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as om_generate_latest
from prometheus_client.registry import DuplicateTimeseries

from dplb.obs.fastmetrics import CounterFamily, HistogramFamily
from dplb.obs.metrics import DECISION_BUCKETS, REQUEST_BUCKETS

T0 = 1_764_000_000.125
EX = {"trace_id": "0af7651916cd43dd8448eb211c80319c"}
EX2 = {"trace_id": "b7ad6b7169203331b7ad6b7169203331"}

# (kind, labelnames, buckets, ops); an op is (labelvalues, method, args): method None only makes the child.
CASES: list[tuple[str, tuple[str, ...], tuple[float, ...], list[tuple[tuple[str, ...], str | None, tuple[Any, ...]]]]] = [
    ("histogram", (), DECISION_BUCKETS, []),  # never observed: zero buckets, _sum 0
    ("histogram", (), DECISION_BUCKETS, [((), "observe", (v,)) for v in (
        0.0, 1e-6, 1.5e-6, 2.5e-6, 1e-2, 0.5, 1e-9, -1.0, math.inf, 3e-5, 3e-5)]),  # bounds exactly, above the last
    # The last value's bucket first (dplb), then a search: the same bucket again, just below and above its bounds,
    # down to the first bucket and up to +Inf and back.
    ("histogram", (), DECISION_BUCKETS, [((), "observe", (v,)) for v in (
        3e-5, 3e-5, 2.9e-5, 2.5e-5, 2.5000001e-5, 5e-5, 5.0000001e-5, 1e-9, 1e-9, 0.0, -5.0, 1e-6, 1.0000001e-6,
        math.inf, math.inf, 1e3, 0.5, 0.4999, 0.5, 3e-5)]),
    ("histogram", ("worker", "outcome"), REQUEST_BUCKETS, [
        (("0", "ok"), None, ()), (("0", "timeout"), None, ()), (("1", "ok"), None, ()),  # pre-created at zero
        (("1", "ok"), "observe", (0.2, EX)), (("1", "ok"), "observe", (0.2,)), (("1", "ok"), "observe", (700.0, EX2)),
        (("0", "ok"), "observe", (0.005, None)), (("2", "stalled"), "observe", (12.0, EX)),
        (("1", "ok"), "observe", (0.21, EX2)),  # a later exemplar replaces the bucket's
    ]),
    ("histogram", ("route",), (0.1, 1, 10), [(("/v1/chat",), "observe", (float("nan"),)),
                                              (("/v1/chat",), "observe", (2,))]),  # NaN: _sum only
    ("histogram", (), (-1.0, 0.0, 1.0), [((), "observe", (-2.0,)), ((), "observe", (0.5,))]),  # no _sum
    ("counter", (), (), [((), "inc", ()), ((), "inc", (2.5,)), ((), "inc", (0,))]),
    ("counter", ("worker", "reason"), (), [
        (("0", "least_loaded"), None, ()), (("1", "least_loaded"), None, ()), (("none", "no_worker"), None, ()),
        (("1", "least_loaded"), "inc", ()), (("1", "least_loaded"), "inc", (3,)), (("0", "affinity"), "inc", ()),
        (("0", "affinity"), "inc", (1, EX)), (("0", "affinity"), "inc", (0.25, EX2)),
    ]),
    ("counter", ("route", "method", "status"), (), [(("/v1/completions", "POST", 200), "inc", ())]),  # str() labels
]


def _pair(kind: str, labelnames: tuple[str, ...], buckets: tuple[float, ...]) -> tuple[Any, Any, Any, Any]:
    """(reference registry, reference metric, fast registry, fast family) named and described alike."""
    ref_reg, fast_reg = CollectorRegistry(auto_describe=True), CollectorRegistry(auto_describe=True)
    if kind == "histogram":
        ref: Any = Histogram("dplb_t_seconds", "A test histogram.", labelnames, buckets=buckets, registry=ref_reg)
        fast: Any = HistogramFamily("dplb_t_seconds", "A test histogram.", labelnames, buckets=buckets,
                                    registry=fast_reg)
    else:
        ref = Counter("dplb_t", "A test counter.", labelnames, registry=ref_reg)
        fast = CounterFamily("dplb_t", "A test counter.", labelnames, registry=fast_reg)
    return ref_reg, ref, fast_reg, fast


def _feed(metric: Any, labelvalues: tuple[str, ...], method: str | None, args: tuple[Any, ...]) -> None:
    target = metric.labels(*labelvalues) if labelvalues else metric
    if method is not None:
        getattr(target, method)(*args)


@pytest.mark.parametrize("created", [True, False], ids=["created", "no_created"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_exposition_matches_prometheus_client(case: int, created: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    kind, labelnames, buckets, ops = CASES[case]
    clock = [T0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    monkeypatch.setattr(pm, "_use_created", created)
    ref_reg, ref, fast_reg, fast = _pair(kind, labelnames, buckets)
    for labelvalues, method, args in ops:
        clock[0] += 0.5
        _feed(ref, labelvalues, method, args)
        _feed(fast, labelvalues, method, args)
    text = generate_latest(ref_reg)
    assert generate_latest(fast_reg).decode() == text.decode()
    assert (b"_created" in text) == created
    om = om_generate_latest(ref_reg)
    assert om_generate_latest(fast_reg).decode() == om.decode()
    if any(len(a) > 1 and a[1] for _, _, a in ops):
        assert b"# {trace_id=" in om  # the exemplars are in the OpenMetrics text


def test_router_families_expose_the_same_names_and_help() -> None:
    """RouterMetrics builds the hot-path families as fast ones; every other family stays prometheus_client's."""
    from dplb.obs.metrics_router import RouterMetrics

    m = RouterMetrics("test")
    m.init_workers(2)
    fast = (m.decisions, m.decision_duration, m.state_age, m.http_requests, m.http_duration, m.upstream_ttfb,
            m.upstream_duration)
    assert all(isinstance(f, (HistogramFamily, CounterFamily)) for f in fast)
    text = generate_latest(m.registry).decode()
    for line in ('# HELP dplb_routing_decisions_total Routing decisions by chosen worker and reason.',
                 '# TYPE dplb_upstream_request_duration_seconds histogram',
                 'dplb_upstream_request_duration_seconds_bucket{le="+Inf",outcome="stalled",worker="1"} 0.0',
                 'dplb_upstream_time_to_first_byte_seconds_count{worker="0"} 0.0',
                 'dplb_routing_decision_duration_seconds_bucket{le="1e-06"} 0.0',
                 'dplb_state_read_age_seconds_sum 0.0'):
        assert line in text


def test_errors_match_prometheus_client() -> None:
    reg = CollectorRegistry(auto_describe=True)
    h = HistogramFamily("dplb_e_seconds", "h", ("worker",), buckets=(1, 2), registry=reg)
    c = CounterFamily("dplb_e_total", "c", registry=reg)
    with pytest.raises(DuplicateTimeseries):
        HistogramFamily("dplb_e_seconds", "again", buckets=(1,), registry=reg)
    with pytest.raises(DuplicateTimeseries):
        Counter("dplb_e", "again", registry=reg)
    with pytest.raises(ValueError):
        h.labels()  # one label name, no value
    with pytest.raises(ValueError):
        h.labels("0", "1")
    with pytest.raises(ValueError):
        h.observe(1.0)  # the family has label names
    assert h.labels(worker=0) is h.labels("0")  # cached, str() of each value
    with pytest.raises(ValueError):
        c.inc(-1)
    with pytest.raises(ValueError):
        h.labels("0").observe(1.0, {"trace_id": "x" * 200})  # exemplar over 128 characters
    with pytest.raises(ValueError):
        HistogramFamily("dplb_u_seconds", "h", buckets=(2, 1))
    with pytest.raises(ValueError):
        HistogramFamily("dplb_u_seconds", "h", ("le",), buckets=(1,))


def test_collect_from_another_thread_reads_consistent_histograms() -> None:
    """While the owning thread observes, a scraping thread always sees _count == the +Inf bucket and buckets that
    never decrease."""
    h = HistogramFamily("dplb_c_seconds", "h", buckets=REQUEST_BUCKETS)
    child, stop, bad = h.labels(), threading.Event(), []

    def scrape() -> None:
        while not stop.is_set():
            samples = h.collect()[0].samples
            buckets = [s.value for s in samples if s.name.endswith("_bucket")]
            count = next(s.value for s in samples if s.name.endswith("_count"))
            if buckets != sorted(buckets) or buckets[-1] != count:
                bad.append(samples)

    t = threading.Thread(target=scrape)
    t.start()
    try:
        for i in range(200_000):
            child.observe((i % 1000) / 10.0)
    finally:
        stop.set()
        t.join()
    assert not bad
    assert h.collect()[0].samples[-3].value == 200_000  # _count
