"""Micro-benchmark: the per-call cost of the router's hot-path metric updates, prometheus_client against
dplb.obs.fastmetrics.

Times, with timeit (statements, so no wrapper call is counted; ``--repeat`` runs of ``--number`` calls each, the
median per call in ns): a cached histogram child's ``observe`` (request buckets, a mid-range value), the same with
an exemplar dict, a counter child's ``inc``, and one proxied request's worth of updates (5 observes, 2 incs, one
with an exemplar, as :class:`dplb.obs.metrics_router.RouterMetrics` and the router record them). Usage:
``python benchmarks/bench_fastmetrics.py [--repeat 31] [--number 100000]``.
"""

from __future__ import annotations

import argparse
import statistics
import timeit
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from dplb.obs.fastmetrics import CounterFamily, HistogramFamily
from dplb.obs.metrics import DECISION_BUCKETS, REQUEST_BUCKETS

EX = {"trace_id": "0af7651916cd43dd8448eb211c80319c"}


def _families(fast: bool) -> dict[str, Any]:
    reg = CollectorRegistry()
    h: Any = HistogramFamily if fast else Histogram
    c: Any = CounterFamily if fast else Counter
    return {"dur": h("b_dur_seconds", "d", ["worker", "outcome"], buckets=REQUEST_BUCKETS, registry=reg),
            "dec": h("b_dec_seconds", "d", buckets=DECISION_BUCKETS, registry=reg),
            "cnt": c("b_total", "c", ["worker", "reason"], registry=reg)}


def _cases(fast: bool) -> dict[str, Any]:
    f = _families(fast)
    dur, cnt = f["dur"].labels("0", "ok"), f["cnt"].labels("0", "least_loaded")
    dec = f["dec"].labels() if fast else f["dec"]
    ttfb, http = f["dur"].labels("1", "ok"), f["dur"].labels("2", "ok")

    def request() -> None:  # what one proxied request records
        cnt.inc()
        dec.observe(2e-5)
        dec.observe(0.15)  # state age
        ttfb.observe(0.08)
        dur.observe(1.3, EX)
        cnt.inc()
        http.observe(1.31)

    g = {"dur": dur, "cnt": cnt, "EX": EX, "request": request}
    return {"observe": ("dur.observe(0.7)", g), "observe+exemplar": ("dur.observe(0.7, EX)", g),
            "inc": ("cnt.inc()", g), "request (5 observe, 2 inc)": ("request()", g)}


def main() -> None:
    """Print the median ns per call of each case, before (prometheus_client) and after (fastmetrics)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=31)
    ap.add_argument("--number", type=int, default=100_000)
    a = ap.parse_args()
    before, after = _cases(False), _cases(True)
    print(f"{'case':28} {'prometheus_client':>18} {'fastmetrics':>12} {'speed-up':>9}   (median ns/call)")
    for name in before:
        med = [statistics.median(timeit.repeat(stmt, repeat=a.repeat, number=a.number, globals=g)) / a.number * 1e9
               for stmt, g in (before[name], after[name])]
        print(f"{name:28} {med[0]:18.0f} {med[1]:12.0f} {med[0] / med[1]:8.1f}x")


if __name__ == "__main__":
    main()
