"""The proxy hot path: one raw ASGI handler for every proxied route of :mod:`dplb.router.routes` (chat,
completions, embeddings, responses, pooling, scoring, tokenize, audio, …; DESIGN §4).

Contract
- The request body is read whole (bounded: 413 from Content-Length before reading, or as soon as the bytes read
  exceed the limit; a rejection sent before the body was read closes the connection, so the rest of the upload is
  not read), peeked with msgspec for ``stream`` and the prefix key, and forwarded **byte for byte**: the
  router never re-serialises it.
- Every proxied response carries ``X-SG-Worker-ID: <k>`` and ``X-Request-Id``. Status, body and end-to-end headers
  pass through unchanged; hop-by-hop headers (RFC 9110 §7.6.1 + those named in ``Connection``) are never copied.
  A client's ``X-Request-Id`` is kept only when it is 1–128 characters of ``[A-Za-z0-9._:-]``; anything else (control
  characters, non-ASCII, too long) is replaced by a generated 32-hex-digit id, never echoed or logged.
- Router-made errors are OpenAI-shaped JSON with a bounded code (:class:`dplb.errors.RouterErrorKind`) and keep
  their real status (never wrapped in a 200 stream); 503s carry ``Retry-After``.
- Retry: once, on the next-best worker, only when nothing was generated: connect failure (no request byte sent),
  or the worker's explicit ``503 worker_draining`` refusal. Never after the response started.
- A worker that dies, closes or goes idle mid-response: SSE streams get a final ``data: {"error": …}`` event, then
  the connection is closed without the terminating chunk (an abnormal close, never a clean ``[DONE]``); other
  bodies are cut (the client sees the short read).
- A client that disconnects makes the router abort the worker connection at once (the engine aborts the request).
- In-flight counts are released on every exit path (``finally``).
- ``Content-Encoding: gzip``/``deflate`` bodies are decoded (bounded by ``max_body_bytes``: 413 past it) and the
  worker gets the plain body without the header; other encodings get 415 ``unsupported_content_encoding``.
- Model-aware: a request naming a ``model`` goes only to workers serving it (:mod:`dplb.router.models`); when
  every worker's list is known and none has it: 404 ``model_not_found`` listing the served names.
- ``/v1/responses``: the id of each created response is remembered with its worker (:class:`ResponseIds`);
  ``GET /v1/responses/{id}``, ``POST …/{id}/cancel`` and a request with ``previous_response_id`` go to that worker.
- With ``sse_keepalive_s``, an SSE response gets ``: keep-alive`` comment lines after that many seconds of worker
  silence, only between events.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import Callable
from typing import Any

import msgspec

from dplb.config import RouterConfig
from dplb.errors import RouterErrorKind
from dplb.policy import RouteRequest
from dplb.policy.decision import REASON_ALL_OVER_CAP, REASON_NO_WORKERS
from dplb.policy.prefix import MAX_PREFIX_BLOCKS, block_hashes
from dplb.router.exchange import REQ_OWN, Exchange, request_head, response_headers, watch_disconnect
from dplb.router.intake import Peek, Rejected, check_head, excluded, read_body, receive_body
from dplb.router.models import ServedModels
from dplb.router.routes import PROXY_PATHS, ResponseIds, Route, match, response_id
from dplb.router.state import UNREACHABLE_S, RouterState
from dplb.router.upstream import ConnectFailed, UpstreamClosed, UpstreamError, UpstreamPool, UpstreamTimeout
from dplb.runtime.serving import DISCONNECT_EXT

log = logging.getLogger("dplb.router.proxy")
__all__ = ["PROXY_PATHS", "Exchange", "Proxy", "error_body"]
_KEEPALIVE = b": keep-alive\n\n"
_RESPONSES = "/v1/responses"
_REQUEST_ID_RE = re.compile(rb"[A-Za-z0-9._:\-]{1,128}")  # fullmatch: "$" would accept a trailing "\n"
# Rejections answered before the request body was read.
_BODY_UNREAD = frozenset({RouterErrorKind.UNAUTHORIZED, RouterErrorKind.METHOD_NOT_ALLOWED,
                          RouterErrorKind.UNSUPPORTED_MEDIA, RouterErrorKind.BODY_TOO_LARGE,
                          RouterErrorKind.UNSUPPORTED_ENCODING})


def error_body(kind: RouterErrorKind, message: str) -> bytes:
    """OpenAI-shaped error JSON for one of the router's own errors."""
    return msgspec.json.encode({"error": {"message": message, "type": kind.type, "code": kind.code}})


class Proxy:
    """ASGI callable for the proxied routes. One instance per router process."""

    def __init__(self, cfg: RouterConfig, state: RouterState, pool: UpstreamPool, models: ServedModels) -> None:
        self.cfg = cfg
        self.state = state
        self.pool = pool
        self.models = models
        self.response_ids = ResponseIds(cfg.response_ids)
        self.metrics = state.metrics
        self._auth = b"bearer " + cfg.api_key.encode() if cfg.api_key else None
        self.tracer: Any = None  # set by the app when OTEL_* asks for tracing (dplb.obs.tracing.make_tracer)
        self._req_skip = REQ_OWN
        n = state.num_workers
        self._worker_ids = [str(k).encode() for k in range(n)]  # X-SG-Worker-ID values
        self._ttfb_children = [self.metrics.upstream_ttfb.labels(str(k)) for k in range(n)]
        self._duration_children: dict[tuple[int, str], Any] = {}
        self._block_bytes = cfg.policy.prefix_block_bytes if cfg.policy.prefix_on else 0
        # Called with (scope, response headers) before a worker's response head is sent (the ORCA header).
        self.on_response_head: Callable[[dict[str, Any], list[tuple[bytes, bytes]]], None] | None = None

    # ---- helpers -------------------------------------------------------------------------------------------------
    async def _reject(self, ex: Exchange, kind: RouterErrorKind, message: str, worker: int | None = None) -> None:
        self.metrics.rejected.labels(kind.code).inc()
        body = error_body(kind, message)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"x-request-id", ex.rid)]
        if kind.status in (503, 429):
            headers.append((b"retry-after", str(self.cfg.retry_after_s).encode()))
        if worker is not None:
            headers.append((b"x-sg-worker-id", self._worker_ids[worker]))
        if kind in _BODY_UNREAD:
            # Close instead of keep-alive: uvicorn would otherwise read and discard the rest of the body, however
            # large (a 100 MB upload was consumed whole after its 413).
            headers.append((b"connection", b"close"))
        ex.status = kind.status
        await ex.send({"type": "http.response.start", "status": kind.status, "headers": headers})
        await ex.send({"type": "http.response.body", "body": body})

    def _route_request(self, peek: Peek, cannot_serve: frozenset[int]) -> RouteRequest:
        """The policy's view of the request: the workers that cannot serve it (model, pinned response) and the
        chained block keys of its prompt bytes (raw ``messages`` JSON for chat, ``prompt`` for completions,
        ``input`` otherwise, as sent; see :mod:`dplb.policy.prefix`) when prefix scoring is on."""
        if not self._block_bytes:
            return RouteRequest(cannot_serve=cannot_serve)
        raw = peek.messages or peek.prompt or peek.input
        return RouteRequest(block_hashes(raw, self._block_bytes, MAX_PREFIX_BLOCKS) if raw else None,
                            cannot_serve=cannot_serve)

    # ---- the handler -------------------------------------------------------------------------------------------
    def enable_tracing(self, tracer: Any) -> None:
        """Trace every request with ``tracer`` (see :mod:`dplb.obs.tracing`)."""
        self.tracer = tracer
        self._req_skip = REQ_OWN | {b"traceparent", b"tracestate"}  # ours replace the client's

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await self.serve(Exchange(scope, receive, send))

    async def serve(self, ex: Exchange) -> None:
        """Handle one proxied request; ``ex.status`` is the status sent (0 while none was)."""
        if self.tracer is None:
            await self._handle(ex, None)
        else:
            await self._handle_traced(ex)

    async def _handle_traced(self, ex: Exchange) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        scope = ex.scope
        carrier = {n.decode("latin-1"): v.decode("latin-1") for n, v in scope["headers"]
                   if n in (b"traceparent", b"tracestate")}
        parent = TraceContextTextMapPropagator().extract(carrier)
        found = match(scope["method"], scope["path"])  # the route's pattern: span names stay bounded
        pattern = found[0].path if found is not None else "other"
        route = f"{scope['method']} {pattern}"
        with self.tracer.start_as_current_span(route, context=parent, kind=SpanKind.SERVER, attributes={
                "http.request.method": scope["method"], "http.route": pattern, "url.path": scope["path"]},
                ) as span:
            await self._handle(ex, span)
            span.set_attribute("http.response.status_code", ex.status)
            if ex.status >= 500:
                span.set_status(Status(StatusCode.ERROR))

    async def _handle(self, ex: Exchange, span: Any) -> None:
        scope = ex.scope
        rid = b""
        clen = -1
        ctype = b""
        auth = b""
        encoding = b""
        for n, v in scope["headers"]:
            if n == b"x-request-id":
                rid = v
            elif n == b"content-length":
                clen = int(v) if v.isdigit() else -2
            elif n == b"content-type":
                ctype = v
            elif n == b"authorization":
                auth = v
            elif n == b"content-encoding":
                encoding = v
        ex.rid = rid if _REQUEST_ID_RE.fullmatch(rid) else os.urandom(16).hex().encode()  # 32 hex chars
        if self._auth is not None and not _ct_equal(auth.lower()[:7] + auth[7:], self._auth):
            await self._reject(ex, RouterErrorKind.UNAUTHORIZED, "missing or wrong API key (Authorization: "
                               "Bearer <key>)")
            return
        found = match(scope["method"], scope["path"])
        if found is None:
            await self._reject(ex, RouterErrorKind.METHOD_NOT_ALLOWED, f"{scope['method']} is not allowed "
                               f"on {scope['path']}")
            return
        route, pin_id = found
        limit = self.cfg.max_body_bytes
        try:
            check_head(route, ctype, encoding)
            if clen > limit:
                raise Rejected(RouterErrorKind.BODY_TOO_LARGE, f"request body of {clen} bytes is over the "
                               f"{limit}-byte limit")
            body = await receive_body(ex.receive, limit)
            if body is None:
                raise Rejected(RouterErrorKind.BODY_TOO_LARGE, f"request body is over the {limit}-byte limit")
            body, peek, model, decoded = read_body(route, body, encoding, limit)
            exclude = excluded(route, peek, model, pin_id, self.models, self.response_ids, self.state.num_workers)
        except Rejected as e:
            await self._reject(ex, e.kind, str(e))
            return
        if span is not None:
            span.set_attribute("dplb.request_id", ex.rid.decode())
        await self._dispatch(ex, body, peek, span, route, exclude, decoded)

    async def _dispatch(self, ex: Exchange, body: bytes, peek: Peek, span: Any, route: Route,
                        exclude: frozenset[int], decoded: bool) -> None:
        state = self.state
        rid_s = ex.rid.decode()
        t_decide = time.time_ns() if span is not None else 0
        req = self._route_request(peek, exclude)
        d = state.decide(req, rid_s)
        if span is not None:
            self._route_span(d, t_decide)
        if d.worker is None:
            if d.reason == REASON_NO_WORKERS:
                kind, msg = RouterErrorKind.NO_WORKERS, "no worker is registered yet; retry shortly"
            elif d.reason == REASON_ALL_OVER_CAP:
                kind, msg = RouterErrorKind.ALL_OVER_CAP, "every worker is at its queue cap; retry shortly"
            else:
                kind, msg = RouterErrorKind.NONE_ROUTABLE, "no worker is ready (starting, draining or stale)"
            await self._reject(ex, kind, msg)
            return
        # Untraced, the head ends with its blank line; traced, the attempt's traceparent goes before it.
        head = request_head(ex.scope, len(body), ex.rid, decoded, self._req_skip, span is None)
        # /v1/responses: the response's id is known up front when the client chose it, else read from the answer.
        capture: Any = route.path == _RESPONSES and ex.scope["method"] == "POST"
        if capture and isinstance(peek.request_id, str):
            capture = peek.request_id
        tried: set[int] = set()
        worker = d.worker
        # The router's own server reports a disconnect through a hook; another ASGI server through receive().
        hook: Any = (ex.scope.get("extensions") or {}).get(DISCONNECT_EXT)
        watcher = None
        if hook is None:
            watcher = asyncio.ensure_future(watch_disconnect(ex))
        elif hook.gone:
            ex.gone = True
        else:
            hook.callback = ex.client_gone
        try:
            while True:
                state.acquire(worker)
                try:
                    if span is None:
                        retry = await self._attempt(ex, worker, head, body, capture)
                    else:
                        retry = await self._forward(ex, worker, head, body, (route.op, peek.model), capture)
                finally:
                    state.release(worker)
                if retry is None:
                    return
                tried.add(worker)
                if len(tried) > 1:
                    await self._reject(ex, retry, "no worker could take the request")
                    return
                self.metrics.retries.inc()
                req.exclude = frozenset(tried)
                d2 = state.decide(req, rid_s)
                if d2.worker is None:
                    await self._reject(ex, retry, "the chosen worker was unreachable and no other is ready")
                    return
                worker = d2.worker
                if span is not None:
                    self._route_span(d2, time.time_ns())
        finally:
            if watcher is not None:
                watcher.cancel()
            else:
                hook.callback = None

    def _exemplar(self) -> dict[str, str] | None:
        """``{"trace_id": …}`` of the current request when tracing (an OpenMetrics exemplar), else None."""
        if self.tracer is None:
            return None
        from opentelemetry.trace import get_current_span

        ctx = get_current_span().get_span_context()
        return {"trace_id": f"{ctx.trace_id:032x}"} if ctx.is_valid else None

    def _route_span(self, d: Any, start_ns: int) -> None:
        """The ``dplb.route`` span: the decision, with one event per candidate."""
        from dplb.obs.tracing import candidate_event_attributes

        chosen = next((c for c in d.candidates if c.worker_id == d.worker), None)
        rs = self.tracer.start_span("dplb.route", start_time=start_ns, attributes={
            "dplb.worker.id": -1 if d.worker is None else d.worker, "dplb.policy": d.policy,
            "dplb.reason": d.reason, "dplb.state_age_s": chosen.age_s if chosen is not None else -1.0,
            "dplb.preferred": -1 if d.preferred is None else d.preferred,
            "dplb.prefix_outcome": d.prefix_outcome() or ""})
        for c in d.candidates:
            rs.add_event("dplb.candidate", candidate_event_attributes(d, c))
        rs.end()

    async def _forward(self, ex: Exchange, worker: int, head: bytes, body: bytes, genai: tuple[str, Any],
                       capture: Any) -> RouterErrorKind | None:
        """:meth:`_attempt` when tracing: a CLIENT span wraps the attempt and its context is injected into ``head``
        (which lacks its blank line). ``genai`` = (operation, model)."""
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        op = genai[0]
        model = genai[1] if isinstance(genai[1], str) else ""
        cs = self.tracer.start_span(f"{op} {model}".strip(), kind=SpanKind.CLIENT, attributes={
            "gen_ai.operation.name": op, "gen_ai.request.model": model, "dplb.worker.id": worker,
            "network.transport": "unix"})
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier, context=set_span_in_context(cs))
        extra = "".join(f"{k}: {v}\r\n" for k, v in carrier.items()).encode()
        try:
            retry = await self._attempt(ex, worker, head + extra + b"\r\n", body, capture)
            if retry is not None:
                cs.set_status(Status(StatusCode.ERROR, retry.code))
            return retry
        finally:
            cs.end()

    def _outcome_metric(self, worker: int, outcome: str) -> Any:
        key = (worker, outcome)
        child = self._duration_children.get(key)
        if child is None:
            child = self._duration_children[key] = self.metrics.upstream_duration.labels(str(worker), outcome)
        return child

    async def _attempt(self, ex: Exchange, worker: int, head: bytes, body: bytes,
                       capture: Any) -> RouterErrorKind | None:
        """Send to ``worker`` and stream back. Returns an error kind to retry elsewhere, or None when done.
        ``head`` ends with its blank line. ``capture``: False, True (remember the response id found in the answer)
        or the id itself."""
        cfg = self.cfg
        send = ex.send
        try:
            conn = await self.pool.open(worker)
        except ConnectFailed as e:
            log.warning("worker %d unreachable before sending (%s); skipping it for %.0f s and retrying on another "
                        "worker", worker, e, UNREACHABLE_S)
            self.state.mark_unreachable(worker, self.state.pid_of(worker))
            return RouterErrorKind.UPSTREAM_UNREACHABLE
        ex.conn = conn  # aborted by the disconnect watcher
        started = False
        outcome = "upstream_error"
        status = 0
        t0 = time.perf_counter()
        try:
            if ex.gone:  # the client left before this attempt (between a retry's two attempts)
                outcome = "client_disconnect"
                return None
            conn.send_request(head, body)
            try:
                status, up_headers = await conn.response_head(cfg.first_byte_timeout_s)
            except UpstreamTimeout as e:
                outcome = "timeout"
                conn.abort()
                await self._reject(ex, RouterErrorKind.UPSTREAM_TIMEOUT, f"worker {worker}: {e}", worker)
                return None
            except UpstreamClosed as e:
                if ex.gone:
                    outcome = "client_disconnect"
                    return None
                log.warning("worker %d closed the connection before answering request %s (%s)", worker,
                            ex.rid.decode(), e)
                await self._reject(ex, RouterErrorKind.UPSTREAM_FAILED, f"worker {worker} closed the connection "
                                   "before answering", worker)
                return None
            self._ttfb_children[worker].observe(time.perf_counter() - t0)
            out, is_sse, draining = response_headers(up_headers, self._worker_ids[worker], ex.rid)
            if self.on_response_head is not None:
                self.on_response_head(ex.scope, out)
            if status == 503 and draining:
                outcome = "draining"  # the worker refused before doing anything: safe to send elsewhere
                return RouterErrorKind.NONE_ROUTABLE
            ex.status = status
            await send({"type": "http.response.start", "status": status, "headers": out})
            started = True
            t_first = None
            if capture and status < 300:
                if isinstance(capture, str):
                    self.response_ids.remember(capture, worker)
                    capture = False
                else:
                    capture = b""  # the answer's first bytes, until the id is found
            else:
                capture = False
            keepalive = cfg.sse_keepalive_s if is_sse else 0.0
            at_boundary = True  # a keep-alive comment may only go between SSE events
            try:
                async for chunk in conn.chunks(cfg.idle_timeout_s, keepalive):
                    if ex.gone:
                        break
                    if not chunk:
                        if at_boundary:
                            await send({"type": "http.response.body", "body": _KEEPALIVE, "more_body": True})
                        continue
                    if t_first is None:
                        t_first = time.perf_counter()
                    if capture is not False:
                        capture = self._capture_id(capture + chunk, worker)
                    if keepalive:
                        at_boundary = chunk.endswith((b"\n\n", b"\r\n\r\n"))
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except UpstreamError as e:
                if ex.gone:
                    outcome = "client_disconnect"
                    return None
                outcome = "timeout" if isinstance(e, UpstreamTimeout) else "upstream_error"
                log.warning("worker %d broke off a response mid-body (%s); closing the client stream with an "
                            "error", worker, e)
                conn.abort()
                if is_sse:
                    kind = RouterErrorKind.UPSTREAM_TIMEOUT if outcome == "timeout" else RouterErrorKind.UPSTREAM_FAILED
                    evt = b"data: " + error_body(kind, f"worker {worker} stopped mid-response: {e}") + b"\n\n"
                    await send({"type": "http.response.body", "body": evt, "more_body": True})
                return None  # response left incomplete: the server closes the connection abnormally
            if ex.gone:
                outcome = "client_disconnect"
                conn.abort()
                return None
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            outcome = "ok" if status < 400 else ("upstream_4xx" if status < 500 else "upstream_5xx")
            if status < 400:
                self.state.policy.observe_latency(time.perf_counter() - ex.t_start,
                                                  None if t_first is None else t_first - ex.t_start)
            return None
        finally:
            ex.conn = None
            if outcome in ("ok", "upstream_4xx", "upstream_5xx"):
                self.pool.release(conn)  # complete response: keep the connection if it is keep-alive
            else:
                conn.abort()
            if started or outcome in ("upstream_error", "timeout"):
                failed = outcome in ("upstream_error", "timeout") or (outcome == "upstream_5xx" and status != 503)
                self.state.record_outcome(worker, failed)
            if started or outcome not in ("upstream_error", "draining"):
                self._outcome_metric(worker, outcome).observe(time.perf_counter() - t0,
                                                              self._exemplar() if self.tracer is not None else None)

    def _capture_id(self, head: bytes, worker: int) -> bytes | bool:
        """Look for the response id in ``head`` (the answer so far): remember it and return False when found or
        after 64 KiB, else return ``head`` to keep looking."""
        rid = response_id(head)
        if rid is not None:
            self.response_ids.remember(rid, worker)
            return False
        return head if len(head) < 65536 else False


def _ct_equal(a: bytes, b: bytes) -> bool:
    import hmac

    return hmac.compare_digest(a, b)
