"""ORCA load reports on proxied responses (and on the router's own errors and its local routes' 503s:
:mod:`dplb.router.app`): the ``endpoint-load-metrics`` header Envoy's ``client_side_weighted_round_robin`` load
balancer weights hosts by.

Contract
- :func:`orca_header` renders a :class:`dplb.router.host_report.HostReport` as ``endpoint-load-metrics`` in the
  ``TEXT`` or ``JSON`` format Envoy parses (envoyproxy/envoy ``source/common/orca/orca_parser.h``: a ``TEXT ``,
  ``JSON `` or ``BIN `` prefix; fields ``application_utilization``, ``rps_fractional``, ``named_metrics.<name>``).
  It carries what CSWRR needs — ``application_utilization`` (the host report's ``pressure``: its utilization, not
  capped at 1, so a host with a queue reports more than a host that is merely full) and ``rps_fractional``
  (its completed requests per second; Envoy's weight is qps ÷ utilization) — plus the named metrics vLLM's own
  header sends (``kv_cache_usage_perc``, ``num_requests_waiting``) and ``num_requests_running``.
- :class:`OrcaResponder` decides per request (mode :data:`MODES`): ``off``: never; ``asked`` (the default): when
  the request carries ``endpoint-load-metrics-format`` (as vLLM does); ``always``: on every proxied response.
  The requested format is ``TEXT`` or ``JSON`` (case-insensitive); anything else (``BIN``, empty, garbage) gets
  ``TEXT`` — a documented default, never an error: the client asked for load reports, and TEXT is the format every
  ORCA parser reads.
- A zero request rate is sent as a tiny positive ``rps_fractional`` (:data:`MIN_RPS`), and a zero utilization as
  a tiny positive ``application_utilization`` (:data:`MIN_UTILIZATION`, the smallest value the header's four
  decimals carry): Envoy's client-side weighted round robin refuses a report whose qps or utilization is not
  positive (``calculateWeightFromOrcaReport``: "QPS must be positive", "Utilization must be positive";
  weight = qps ÷ utilization), which would leave an idle host at its old weight until
  ``weight_expiration_period``. With both floors an idle host's weight is 0.01 ÷ 0.0001 = 100 (a busy host at
  utilization 0.5 serving 10 rps: 20).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Final

# (Final: compiled, a C static instead of a module-dict lookup per use; read per response.)
REQUEST_HEADER: Final = b"endpoint-load-metrics-format"
RESPONSE_HEADER: Final = b"endpoint-load-metrics"
MODES: Final = ("off", "asked", "always")
MIN_RPS = 0.01  # requests per second sent instead of 0 (see module docstring)
MIN_UTILIZATION = 0.0001  # application_utilization sent instead of 0: the smallest 4-decimal value above 0


def orca_fields(report: Any) -> dict[str, float]:
    """The report's ORCA fields: ``application_utilization``, ``rps_fractional`` and ``named_metrics.*``."""
    return {"application_utilization": max(MIN_UTILIZATION, round(float(report.pressure), 4)),
            "rps_fractional": round(max(MIN_RPS, float(report.rps)), 4),
            "named_metrics.kv_cache_usage_perc": round(float(report.kv_usage), 4),
            "named_metrics.num_requests_waiting": float(report.waiting),
            "named_metrics.num_requests_running": float(report.running)}


def orca_header(report: Any, fmt: str = "TEXT") -> bytes:
    """The ``endpoint-load-metrics`` value for ``report`` in ``fmt`` (``TEXT`` or ``JSON``; anything else: TEXT)."""
    fields = orca_fields(report)
    if fmt == "JSON":
        named = {k.removeprefix("named_metrics."): v for k, v in fields.items() if k.startswith("named_metrics.")}
        top = {k: v for k, v in fields.items() if not k.startswith("named_metrics.")}
        return ("JSON " + json.dumps({**top, "named_metrics": named}, separators=(",", ":"))).encode()
    return ("TEXT " + ", ".join(f"{k}={v:g}" for k, v in fields.items())).encode()


def requested_format(headers: list[tuple[bytes, bytes]]) -> str | None:
    """``TEXT``/``JSON`` when the request asks for a load report (any other value: ``TEXT``), None when not."""
    for n, v in headers:
        if n == REQUEST_HEADER:
            return "JSON" if v.strip().upper() == b"JSON" else "TEXT"
    return None


class OrcaResponder:
    """Adds the header to a proxied response head per ``mode`` (module docstring); ``report()`` returns the
    latest host report."""

    def __init__(self, mode: str, report: Callable[[], Any]) -> None:
        if mode not in MODES:
            raise ValueError(f"ORCA mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self.off = mode == "off"
        self.always = mode == "always"
        self.report = report

    def __call__(self, scope: dict[str, Any], out: list[tuple[bytes, bytes]]) -> None:
        """Append ``endpoint-load-metrics`` to the response headers ``out`` when this request gets one."""
        if self.off:
            return
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        fmt = requested_format(headers)
        if fmt is None:
            if not self.always:
                return
            fmt = "TEXT"
        out.append((RESPONSE_HEADER, orca_header(self.report(), fmt)))


__all__ = ["MIN_RPS", "MIN_UTILIZATION", "MODES", "REQUEST_HEADER", "RESPONSE_HEADER", "OrcaResponder", "orca_fields",
           "orca_header", "requested_format"]
