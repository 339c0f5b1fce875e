"""The router's own count of the HTTP requests it answers: ``dplb_http_requests_total`` and
``dplb_http_request_duration_seconds`` (:class:`dplb.obs.metrics_router.RouterMetrics`), by route template, method
and status.

Contract
- :meth:`HttpCount.observe` counts one finished request, on every path (proxied or local, ASGI or the direct relay):
  the route label is the path itself for a known route (:data:`ROUTES`), ``/v1/responses/{id}`` and
  ``/v1/models/{model}`` for those templates, ``other`` for any other path; the method label is the method for a
  standard one, ``other`` otherwise. Labels stay bounded whatever clients send.
- The label children of each (route, method, status) label set are looked up once and kept (a bounded table).
- Per request, so it is one of the modules scripts/build_native.sh compiles (:data:`dplb.native.HOT_MODULES`).
  Single event loop; not thread-safe.
"""

from __future__ import annotations

import time

from dplb.obs.fastmetrics import CounterChild, HistogramChild
from dplb.obs.metrics_router import RouterMetrics
from dplb.router.routes import PROXY_PATHS, RESPONSES_PREFIX

#: Paths counted under their own name: the local endpoints, the fan-out routes and every proxied path.
ROUTES = frozenset({"/health", "/ready", "/metrics", "/metrics/host", "/v1/models", "/debug/decisions",
                    "/v1/load_lora_adapter", "/v1/unload_lora_adapter"}) | PROXY_PATHS
#: The prefix of ``GET /v1/models/{model}`` and its route label.
MODELS_PREFIX, MODEL_ROUTE = "/v1/models/", "/v1/models/{model}"
_RESPONSE_ROUTE = RESPONSES_PREFIX + "{id}"
_METHODS = frozenset({"GET", "POST", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH"})


def route_label(path: str) -> str:
    """The ``route`` label of a request for ``path`` (module docstring)."""
    if path in ROUTES:
        return path
    if path.startswith(RESPONSES_PREFIX):
        return _RESPONSE_ROUTE
    return MODEL_ROUTE if path.startswith(MODELS_PREFIX) else "other"


class HttpCount:
    """Counts the router's HTTP requests in ``metrics`` (module docstring)."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self._metrics = metrics
        self._children: dict[tuple[str, str, int], tuple[CounterChild, HistogramChild]] = {}

    def observe(self, path: str, method: str, status: int, t0: float) -> None:
        """Count one request for ``path`` with ``method`` answered with ``status`` (0: none was sent), and its
        duration since ``t0`` (``time.perf_counter`` seconds)."""
        key = (route_label(path), method if method in _METHODS else "other", status)  # bounded: labels, not input
        children = self._children.get(key)
        if children is None:
            m = self._metrics
            children = self._children[key] = (m.http_requests.labels(key[0], key[1], str(status)),
                                              m.http_duration.labels(key[0], key[1]))
        children[0].inc()
        children[1].observe(time.perf_counter() - t0)


__all__ = ["MODELS_PREFIX", "MODEL_ROUTE", "ROUTES", "HttpCount", "route_label"]
