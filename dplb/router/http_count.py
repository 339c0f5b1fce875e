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
from typing import Final

from dplb.obs.fastmetrics import CounterChild, HistogramChild
from dplb.obs.metrics_router import RouterMetrics
from dplb.router.routes import PROXY_PATHS, RESPONSES_PREFIX

#: Paths counted under their own name: the local endpoints, the fan-out routes and every proxied path.
ROUTES: Final = frozenset({"/health", "/ready", "/metrics", "/metrics/host", "/v1/models", "/debug/decisions",
                    "/v1/load_lora_adapter", "/v1/unload_lora_adapter"}) | PROXY_PATHS
#: The prefix of ``GET /v1/models/{model}`` and its route label.
MODELS_PREFIX, MODEL_ROUTE = "/v1/models/", "/v1/models/{model}"
_RESPONSE_ROUTE: Final = RESPONSES_PREFIX + "{id}"
_METHODS: Final = frozenset({"GET", "POST", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH"})
# (Final: compiled, a C static instead of a module-dict and an attribute lookup per use.)
_perf_counter: Final = time.perf_counter


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
        # route label → method label → status → its two children (nested by label: no key tuple made and hashed
        # per request; bounded by the labels)
        self._children: dict[str, dict[str, dict[int, tuple[CounterChild, HistogramChild]]]] = {}

    def observe(self, path: str, method: str, status: int, t0: float) -> None:
        """Count one request for ``path`` with ``method`` answered with ``status`` (0: none was sent), and its
        duration since ``t0`` (``time.perf_counter`` seconds)."""
        route = route_label(path)
        by_method = self._children.get(route)
        if by_method is None:
            by_method = self._children[route] = {}
        if method not in _METHODS:  # bounded: labels, not input
            method = "other"
        by_status = by_method.get(method)
        if by_status is None:
            by_status = by_method[method] = {}
        children = by_status.get(status)
        if children is None:
            m = self._metrics
            children = by_status[status] = (m.http_requests.labels(route, method, str(status)),
                                             m.http_duration.labels(route, method))
        children[0].inc()
        children[1].observe(_perf_counter() - t0)


__all__ = ["MODELS_PREFIX", "MODEL_ROUTE", "ROUTES", "HttpCount", "route_label"]
