"""OpenTelemetry tracing of routed requests (docs/DESIGN.md §9). Off unless the standard ``OTEL_*`` variables ask
for it.

Contract
- :func:`make_tracer` returns None unless ``OTEL_EXPORTER_OTLP_ENDPOINT``/``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is
  set or ``OTEL_TRACES_EXPORTER=otlp``; ``OTEL_SDK_DISABLED=true`` wins. With None, the proxy never touches
  OpenTelemetry: each request carries :data:`NO_TRACE`, whose hooks do nothing.
- Tracing is hooks on the proxy's one request path, not a second path: :meth:`Tracing.begin` gives a request its
  :class:`RequestTrace`, which the proxy calls at the same points it calls :data:`NO_TRACE` at (``dispatched``,
  ``deciding``/``routed``, ``attempt``/``attempt_done``, ``exemplar``, ``end``).
- Spans per request: a SERVER span named by route template (``POST /v1/chat/completions``), continuing the
  client's ``traceparent`` if sane; a ``dplb.route`` span with ``dplb.worker.id`` (= ``X-SG-Worker-ID``), the
  policy, the reason and the state age, and one ``dplb.candidate`` event per worker with its inputs, terms, score
  and eligibility; a CLIENT span per upstream attempt following the GenAI semantic conventions
  (``gen_ai.operation.name``, ``gen_ai.request.model``) whose context is injected as ``traceparent`` into the worker
  request, so vLLM's own ``llm_request`` span (``--otlp-traces-endpoint``) becomes its child. The route and client
  spans are children of the SERVER span.
- Export is batched on a background thread (BatchSpanProcessor); a failing or absent collector never fails or
  slows a request.
"""

from __future__ import annotations

import logging
import os
import time
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


class NoTrace:
    """The hooks of one request with tracing off: each does nothing (and returns what it was given). The base of
    :class:`RequestTrace`, whose hooks the proxy calls at the same points."""

    __slots__ = ()

    def dispatched(self, request_id: str) -> None:
        """The request was read and accepted and will be routed (``request_id``: its ``X-Request-Id``)."""

    def tenant(self, name: str) -> None:
        """The request's tenant is known (``dplb.tenant``; a configured name, bounded)."""

    def deciding(self) -> None:
        """A routing decision starts now."""

    def routed(self, d: Any) -> None:
        """The decision ``d`` (a :class:`dplb.policy.decision.Decision`) was made."""

    def attempt(self, head: bytes, worker: int, op: str, model: Any) -> bytes:
        """An attempt on ``worker`` starts (``op``: the route's GenAI operation; ``model``: the request's model,
        any JSON value); returns the request head to send, ``head`` (which ends with its blank line) or a copy
        with trace-context headers added."""
        return head

    def attempt_done(self, retry: Any) -> None:
        """The attempt ended; ``retry``: the error kind it is retried for elsewhere, or None."""

    def resumed(self, broken: int, tokens: int, body_bytes: int) -> None:
        """The stream broke on worker ``broken`` after ``tokens`` delivered tokens and is re-issued with a
        continuation body of ``body_bytes`` bytes: the one place the router changes a body."""

    def resume_refused(self, reason: str) -> None:
        """The broken stream is not resumed, for ``reason`` (:data:`dplb.obs.metrics.RESUME_REFUSALS`)."""

    def exemplar(self) -> dict[str, str] | None:
        """``{"trace_id": …}`` for an OpenMetrics exemplar, or None."""
        return None

    def end(self, status: int, exc: BaseException | None = None) -> None:
        """The request ended with ``status`` sent (0: none), or by raising ``exc``."""


NO_TRACE = NoTrace()


class Tracing:
    """Tracing on: makes each request's :class:`RequestTrace` with ``tracer`` (from :func:`make_tracer`)."""

    def __init__(self, tracer: Any) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.tracer = tracer
        self.propagator = TraceContextTextMapPropagator()

    def begin(self, scope: dict[str, Any], pattern: str | None) -> RequestTrace:
        """Start the SERVER span of the ASGI request ``scope`` (``pattern``: its route template, None for a path
        no route matches: span names stay bounded)."""
        return RequestTrace(self, scope, pattern or "other")


class RequestTrace(NoTrace):
    """The spans of one traced request (see the module docstring)."""

    __slots__ = ("_client", "_ctx", "_decide_ns", "_tracing", "server")

    def __init__(self, tracing: Tracing, scope: dict[str, Any], pattern: str) -> None:
        from opentelemetry.trace import SpanKind, set_span_in_context

        self._tracing = tracing
        carrier = {n.decode("latin-1"): v.decode("latin-1") for n, v in scope["headers"]
                   if n in (b"traceparent", b"tracestate")}
        parent = tracing.propagator.extract(carrier)
        method = scope["method"]
        self.server = tracing.tracer.start_span(f"{method} {pattern}", context=parent, kind=SpanKind.SERVER,
                                                attributes={"http.request.method": method, "http.route": pattern,
                                                            "url.path": scope["path"]})
        self._ctx = set_span_in_context(self.server)  # the parent of the route and client spans
        self._client: Any = None
        self._decide_ns = 0

    def dispatched(self, request_id: str) -> None:
        self.server.set_attribute("dplb.request_id", request_id)

    def tenant(self, name: str) -> None:
        self.server.set_attribute("dplb.tenant", name)

    def deciding(self) -> None:
        self._decide_ns = time.time_ns()

    def routed(self, d: Any) -> None:
        """The ``dplb.route`` span: the decision, with one event per candidate."""
        chosen = next((c for c in d.candidates if c.worker_id == d.worker), None)
        rs = self._tracing.tracer.start_span("dplb.route", context=self._ctx, start_time=self._decide_ns,
                                             attributes={
            "dplb.worker.id": -1 if d.worker is None else d.worker, "dplb.policy": d.policy,
            "dplb.reason": d.reason, "dplb.state_age_s": chosen.age_s if chosen is not None else -1.0,
            "dplb.preferred": -1 if d.preferred is None else d.preferred,
            "dplb.prefix_outcome": d.prefix_outcome() or ""})
        for c in d.candidates:
            rs.add_event("dplb.candidate", candidate_event_attributes(d, c))
        rs.end()

    def attempt(self, head: bytes, worker: int, op: str, model: Any) -> bytes:
        """Start the attempt's CLIENT span and inject its context into ``head``."""
        from opentelemetry.trace import SpanKind, set_span_in_context

        model = model if isinstance(model, str) else ""
        cs = self._client = self._tracing.tracer.start_span(
            f"{op} {model}".strip(), context=self._ctx, kind=SpanKind.CLIENT, attributes={
                "gen_ai.operation.name": op, "gen_ai.request.model": model, "dplb.worker.id": worker,
                "network.transport": "unix"})
        carrier: dict[str, str] = {}
        self._tracing.propagator.inject(carrier, context=set_span_in_context(cs))
        extra = "".join(f"{k}: {v}\r\n" for k, v in carrier.items()).encode()
        return head[:-2] + extra + b"\r\n"  # before the blank line

    def attempt_done(self, retry: Any) -> None:
        from opentelemetry.trace import Status, StatusCode

        cs, self._client = self._client, None
        if cs is not None:
            if retry is not None:
                cs.set_status(Status(StatusCode.ERROR, retry.code))
            cs.end()

    def resumed(self, broken: int, tokens: int, body_bytes: int) -> None:
        self.server.add_event("dplb.stream_resumed", {"dplb.worker.id": broken, "dplb.resume.delivered_tokens":
                                                      tokens, "dplb.resume.body_bytes": body_bytes})

    def resume_refused(self, reason: str) -> None:
        self.server.add_event("dplb.stream_resume_refused", {"dplb.resume.reason": reason})

    def exemplar(self) -> dict[str, str] | None:
        ctx = self.server.get_span_context()
        return {"trace_id": f"{ctx.trace_id:032x}"} if ctx.is_valid else None

    def end(self, status: int, exc: BaseException | None = None) -> None:
        from opentelemetry.trace import Status, StatusCode

        span = self.server
        if exc is not None:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        else:
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                span.set_status(Status(StatusCode.ERROR))
        span.end()
