"""OpenTelemetry tracing of routed requests (docs/DESIGN.md §9). Off unless the standard ``OTEL_*`` variables ask
for it.

Contract
- :func:`make_tracer` returns None unless ``OTEL_EXPORTER_OTLP_ENDPOINT``/``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is
  set or ``OTEL_TRACES_EXPORTER=otlp``; ``OTEL_SDK_DISABLED=true`` wins. With None, the proxy never touches
  OpenTelemetry: tracing off costs one ``is None`` test per request.
- Spans per request: a SERVER span named by route template (``POST /v1/chat/completions``), continuing the
  client's ``traceparent`` if sane; a ``dplb.route`` span with ``dplb.worker.id`` (= ``X-SG-Worker-ID``), the
  policy, the reason and the state age, and one ``dplb.candidate`` event per worker with its inputs, terms, score
  and eligibility; a CLIENT span per upstream attempt following the GenAI semantic conventions
  (``gen_ai.operation.name``, ``gen_ai.request.model``) whose context is injected as ``traceparent`` into the worker
  request, so vLLM's own ``llm_request`` span (``--otlp-traces-endpoint``) becomes its child.
- Export is batched on a background thread (BatchSpanProcessor); a failing or absent collector never fails or
  slows a request.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from dplb import __version__

log = logging.getLogger("dplb.tracing")

def tracing_requested(env: dict[str, str] | None = None) -> bool:
    """True when the standard OpenTelemetry variables ask for trace export."""
    e = os.environ if env is None else env
    if e.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    if e.get("OTEL_TRACES_EXPORTER", "").lower() == "none":
        return False
    return bool(e.get("OTEL_EXPORTER_OTLP_ENDPOINT") or e.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or e.get("OTEL_TRACES_EXPORTER", "").lower() == "otlp")


def make_tracer(service_name: str = "dplb-router") -> Any:
    """A tracer exporting over OTLP (protocol from ``OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL``, default
    http/protobuf), or None when tracing is not requested."""
    if not tracing_requested():
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    proto = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
             or "http/protobuf")
    if proto == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore[assignment]
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name),
                                "service.version": __version__})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    log.info("tracing on: OTLP %s export to %s", proto, os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
             or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "the default endpoint"))
    tracer = provider.get_tracer("dplb", __version__)
    tracer._dplb_provider = provider  # type: ignore[attr-defined]  # kept for shutdown()
    return tracer


def shutdown(tracer: Any) -> None:
    """Flush and stop the exporter (bounded by the SDK's own timeouts)."""
    provider = getattr(tracer, "_dplb_provider", None)
    if provider is not None:
        provider.shutdown()


def candidate_event_attributes(d: Any, c: Any) -> dict[str, Any]:
    """Attributes of one ``dplb.candidate`` event: candidate ``c`` of decision ``d`` (a
    :class:`dplb.policy.decision.Decision`) — health, every input the scorers read, each term by scorer name
    (``dplb.term.<name>``) and the score. Values that are None (e.g. no baseline yet) are left out (OTel attributes
    cannot be null)."""
    out: dict[str, Any] = {}
    for k, v in d.candidate_dict(c).items():
        if k == "terms":
            for name, t in v.items():
                out[f"dplb.term.{name}"] = t
        elif k == "worker":
            out["dplb.worker.id"] = v
        elif v is not None:
            out[f"dplb.{k}"] = v
    return out
