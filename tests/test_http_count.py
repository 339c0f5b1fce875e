"""dplb.router.http_count: the router's count of the HTTP requests it answers, read back from the real metrics
registry (runs against the compiled module when scripts/build_native.sh built it)."""

from __future__ import annotations

import time

from dplb.obs.metrics_router import RouterMetrics
from dplb.router.http_count import HttpCount, route_label


def _requests(m: RouterMetrics, route: str, method: str, status: str) -> float | None:
    return m.registry.get_sample_value("dplb_http_requests_total", {"route": route, "method": method,
                                                                    "status": status})


def test_routes_are_counted_under_their_template_and_unknown_input_under_other() -> None:
    m = RouterMetrics("9.9")
    count = HttpCount(m)
    t0 = time.perf_counter()
    for path, method, status in [("/v1/completions", "POST", 200), ("/v1/completions", "POST", 200),
                                 ("/health", "GET", 200), ("/v1/responses/resp_1", "GET", 404),
                                 ("/v1/models/org/model-a", "GET", 200), ("/nope", "GET", 404),
                                 ("/v1/completions", "BREW", 405), ("/v1/chat/completions", "POST", 0)]:
        count.observe(path, method, status, t0)
    assert _requests(m, "/v1/completions", "POST", "200") == 2
    assert _requests(m, "/health", "GET", "200") == 1
    assert _requests(m, "/v1/responses/{id}", "GET", "404") == 1
    assert _requests(m, "/v1/models/{model}", "GET", "200") == 1
    assert _requests(m, "other", "GET", "404") == 1
    assert _requests(m, "/v1/completions", "other", "405") == 1
    assert _requests(m, "/v1/chat/completions", "POST", "0") == 1  # the client left before a status
    dur = m.registry.get_sample_value("dplb_http_request_duration_seconds_count",
                                      {"route": "/v1/completions", "method": "POST"})
    total = m.registry.get_sample_value("dplb_http_request_duration_seconds_sum",
                                        {"route": "/v1/completions", "method": "POST"})
    assert dur == 2 and total is not None and 0 <= total < 60


def test_the_label_table_stays_bounded_whatever_paths_and_methods_clients_send() -> None:
    m = RouterMetrics("9.9")
    count = HttpCount(m)
    for i in range(500):
        count.observe(f"/scan/{i}", f"M{i}", 404, time.perf_counter())
        count.observe(f"/v1/responses/r{i}", "GET", 404, time.perf_counter())
    assert _requests(m, "other", "other", "404") == 500
    assert _requests(m, "/v1/responses/{id}", "GET", "404") == 500
    series = [s for fam in m.registry.collect() if fam.name == "dplb_http_requests" for s in fam.samples
              if s.name == "dplb_http_requests_total"]
    assert len(series) == 2, series
    assert len(count._children) == 2


def test_route_label() -> None:
    assert route_label("/v1/embeddings") == "/v1/embeddings"
    assert route_label("/metrics/host") == "/metrics/host"
    assert route_label("/v1/models") == "/v1/models"
    assert route_label("/v1/models/") == "/v1/models/{model}"
    assert route_label("/v1/responses/") == "/v1/responses/{id}"
    assert route_label("/v1/completions/") == "other"
