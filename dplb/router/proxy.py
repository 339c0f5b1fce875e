"""The proxy hot path: one raw ASGI handler for every proxied route of :mod:`dplb.router.routes` (chat,
completions, embeddings, responses, pooling, scoring, tokenize, audio, …; docs/DESIGN.md §4).

Contract
- The request body is read whole (bounded: 413 from Content-Length before reading, or as soon as the bytes read
  exceed the limit; a rejection sent before the body was read closes the connection, so the rest of the upload is
  read only as the server's lingering close discards it, bounded: :mod:`dplb.runtime.conn_timer`), peeked with
  msgspec for ``stream``, the model and the prompt (whose raw bytes go to the policy as they are), and forwarded
  **byte for byte**: the router never re-serialises it (the exceptions, opt-in: with ``--tenants``, the tenant
  gate may write one or two fields first: ``priority`` with ``--engine-priority``,
  ``stream_options`` for the usage ledger, :mod:`dplb.router.tenancy`; a stream resumed on another worker with
  ``--resume-streams``, :mod:`dplb.router.resume`).
- Every proxied response carries ``X-SG-Worker-ID: <k>`` and ``X-Request-Id``. Status, body and end-to-end headers
  pass through unchanged; hop-by-hop headers (RFC 9110 §7.6.1 + those named in ``Connection``) are never copied.
  A client's ``X-Request-Id`` is kept only when it is 1–128 characters of ``[A-Za-z0-9._:-]``; anything else (control
  characters, non-ASCII, too long) is replaced by a generated 32-hex-digit id, never echoed or logged.
- Router-made errors are OpenAI-shaped JSON with a bounded code (:class:`dplb.errors.RouterErrorKind`) and keep
  their real status (never wrapped in a 200 stream); 503s carry ``Retry-After``.
- Retry: once, on the next-best worker, only when nothing was generated: connect failure (no request byte sent),
  the worker's explicit ``503 worker_draining`` refusal, or a request its connection ended with undelivered
  (reset, EPIPE) — sent again first on a new connection to the same worker when the connection was a pooled one
  (:mod:`dplb.router.attempt`). Never after the response started.
  With ``--resume-streams`` a broken chat/completions stream is resumed instead (docs/DESIGN.md §14).
- A worker that dies, closes or goes idle mid-response: SSE streams get a final ``data: {"error": …}`` event, then
  the connection is closed without the terminating chunk (an abnormal close, never a clean ``[DONE]``); other
  bodies are cut (the client sees the short read).
- A client that disconnects makes the router abort the worker connection at once (the engine aborts the request).
- In-flight counts are released on every exit path (``finally``), and so is the request's tenant state
  (:meth:`dplb.router.tenancy.Gate.leave`: ledger, corrections, the fair queue's next request).
- Each try on a worker is one :class:`dplb.router.attempt.Attempt`; the request's state (route, body, peek,
  decision, head) lives on its :class:`Exchange`; tracing is the exchange's hooks (:mod:`dplb.obs.tracing`) on this
  one path.
- ``Content-Encoding: gzip``/``deflate`` bodies are decoded (bounded by ``max_body_bytes``: 413 past it) and the
  worker gets the plain body without the header; other encodings get 415 ``unsupported_content_encoding``.
- Model-aware: a request naming a ``model`` goes only to workers serving it (:mod:`dplb.router.models`); when
  every worker's list is known and none has it: 404 ``model_not_found`` listing the served names.
- ``/v1/responses``: the id of each created response is remembered with its worker (:class:`ResponseIds`, shared
  by every router process on the segment); ``GET /v1/responses/{id}``, ``POST …/{id}/cancel`` and a request with
  ``previous_response_id`` go to that worker (with ``--tenants``, only for the tenant that created it:
  :mod:`dplb.router.ownership`).
- With ``sse_keepalive_s``, an SSE response gets ``: keep-alive`` comment lines after that many seconds of worker
  silence, only between events.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from typing import Any, Final

from dplb.config import RouterConfig
from dplb.errors import RouterErrorKind, error_body
from dplb.obs.tracing import Tracing
from dplb.policy import RouteRequest
from dplb.policy.decision import NOTE_PREFIX_HIT_BYTES, PREFIX_PREDICTED_HEADER, REASON_ALL_OVER_CAP, REASON_NO_WORKERS
from dplb.router import resume
from dplb.router.allowlist import ambiguous
from dplb.router.attempt import Attempt, Upstreams
from dplb.router.exchange import REQ_OWN, Exchange, request_head, watch_disconnect
from dplb.router.intake import Rejected, check_head, duplicate_header_message, form_models, read_body, receive_body
from dplb.router.models import ServedModels
from dplb.router.ownership import OwnedResponseIds
from dplb.router.peek import Peek
from dplb.router.routes import PROXY_PATHS, ResponseIds, allowed_methods, match
from dplb.router.state import RouterState
from dplb.router.tenancy import Gate
from dplb.router.upstream_pool import UpstreamPool
from dplb.runtime.serving import DISCONNECT_EXT
from dplb.state.response_rings import ResponseRing
from dplb.tenants import DEFAULT_TENANT

log = logging.getLogger("dplb.router.proxy")
__all__ = ["PROXY_PATHS", "Exchange", "Proxy", "error_body"]
_RESPONSES = "/v1/responses"
_REQUEST_ID_RE: Final = re.compile(rb"[A-Za-z0-9._:\-]{1,128}")  # fullmatch: "$" would accept a trailing "\n"
# Why no worker was chosen → the error answered.
_NO_WORKER = {
    REASON_NO_WORKERS: (RouterErrorKind.NO_WORKERS, "no worker is registered yet; retry shortly"),
    REASON_ALL_OVER_CAP: (RouterErrorKind.ALL_OVER_CAP, "every worker is at its queue cap; retry shortly"),
}
_NONE_READY = (RouterErrorKind.NONE_ROUTABLE, "no worker is ready (starting, draining or stale)")
MAX_NAMED = 16  # workers named with their reason in a 503 no_routable_worker message
_NONE: Final[frozenset[int]] = frozenset()


class Proxy:
    """ASGI callable for the proxied routes. One instance per router process."""

    def __init__(self, cfg: RouterConfig, state: RouterState, pool: UpstreamPool, models: ServedModels) -> None:
        self.cfg = cfg
        self.state = state
        self.pool = pool
        self.models = models
        # With tenants, each response id is bound to its tenant too (dplb.router.ownership); either map is shared
        # with the other router processes on the segment through this process's response ring.
        def rings() -> ResponseRing | None:
            return state.slots.responses if state.slots is not None else None

        owned = OwnedResponseIds(cfg.response_ids, rings) if cfg.tenants_file is not None else None
        self.response_ids = owned if owned is not None else ResponseIds(cfg.response_ids, rings)
        state.on_tick.append(self.response_ids.sync)
        self.metrics = state.metrics
        self.upstreams = Upstreams(cfg, state, pool, self.response_ids)
        # Tenants (the API key, --tenants), their limits, the fair queue and the usage ledger (docs/DESIGN.md §15).
        self.gate = Gate(cfg, state, self.metrics.registry, self.upstreams.reject, models, owned)
        self.tracer: Any = None  # set by the app when OTEL_* asks for tracing (dplb.obs.tracing.make_tracer)
        self._tracing: Tracing | None = None
        self._req_skip = REQ_OWN
        # The features that need the ASGI path, all fixed at start (tracing aside: enable_tracing). The tenant gate
        # does not: the relay identifies and admits as the gate does (it declines what the gate refuses or queues).
        self._direct_ok = bool(cfg.direct_relay and not cfg.cors_allowed_origins and not cfg.resume_streams
                               and not cfg.sse_keepalive_s)

    def direct_enabled(self) -> bool:
        """Whether the direct relay (:mod:`dplb.router.direct`) may take a request now: ``--direct-relay`` is on and
        no feature that needs the ASGI path is (CORS, ``--resume-streams``, SSE keep-alives, tracing); the tenant
        gate (``--tenants``, ``--api-key``, ``--access-log``) does not need it (:meth:`Gate.admit_now`)."""
        return self._direct_ok and self.tracer is None

    # ---- helpers -------------------------------------------------------------------------------------------------
    async def _reject(self, ex: Exchange, kind: RouterErrorKind, message: str, worker: int | None = None) -> None:
        await self.upstreams.reject(ex, kind, message, worker)

    @staticmethod
    def route_request(peek: Peek, cannot_serve: frozenset[int]) -> RouteRequest:
        """The policy's view of the request: the workers that cannot serve it (model, pinned response) and its
        prompt's raw bytes (``messages`` JSON for chat, ``prompt`` for completions, ``input`` otherwise, as sent;
        what the policy's plugins derive from them is theirs: :mod:`dplb.policy.framework`)."""
        return RouteRequest(peek.messages or peek.prompt or peek.input or None, cannot_serve=cannot_serve)

    # ---- the handler -------------------------------------------------------------------------------------------
    def enable_tracing(self, tracer: Any) -> None:
        """Trace every request with ``tracer`` (see :mod:`dplb.obs.tracing`)."""
        self.tracer = tracer
        self._tracing = Tracing(tracer)
        self._req_skip = REQ_OWN | {b"traceparent", b"tracestate"}  # ours replace the client's

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await self.serve(Exchange(scope, receive, send))

    async def serve(self, ex: Exchange) -> None:
        """Handle one proxied request; ``ex.status`` is the status sent (0 while none was)."""
        scope = ex.scope
        found = match(scope["method"], scope["path"])
        if found is not None:
            ex.route, ex.pin = found
        if self._tracing is not None:
            ex.trace = self._tracing.begin(scope, found[0].path if found is not None else None)
        trace = ex.trace
        try:
            await self._handle(ex)
        except BaseException as e:
            trace.end(ex.status, e)
            raise
        trace.end(ex.status)

    async def _handle(self, ex: Exchange) -> None:
        clen, ctype, auth, encoding, repeated = scan_headers(ex)
        if repeated:  # (RFC 9110 §5.3: a field defined as one value; the router and the worker might read another)
            await self._reject(ex, RouterErrorKind.DUPLICATE_HEADER, duplicate_header_message(repeated))
            return
        if not self.gate.on:  # no tenants, key or access log: no tenant state (dplb.router.tenancy)
            ex.trace.tenant(DEFAULT_TENANT)
            await self._handle_known(ex, clen, ctype, encoding)
            return
        if not self.gate.identify(ex, auth):
            await self._reject(ex, RouterErrorKind.UNAUTHORIZED, "missing or wrong API key (Authorization: "
                               "Bearer <key>)")
            return
        try:
            await self._handle_known(ex, clen, ctype, encoding)
        finally:
            self.gate.leave(ex)

    async def _handle_known(self, ex: Exchange, clen: int, ctype: bytes, encoding: bytes) -> None:
        if ex.route is None:
            scope = ex.scope
            allow = allowed_methods(scope["path"])
            await self.upstreams.reject(ex, RouterErrorKind.METHOD_NOT_ALLOWED, f"{scope['method']} is not allowed "
                                        f"on {scope['path']} (allowed: {allow})",
                                        extra_headers=((b"allow", allow.encode()),))
            return
        try:
            exclude = await self._read(ex, clen, ctype, encoding)
        except Rejected as e:
            await self._reject(ex, e.kind, str(e))
            return
        if self._tracing is not None:
            ex.trace.dispatched(ex.rid.decode())
        await self._dispatch(ex, exclude)

    async def _read(self, ex: Exchange, clen: int, ctype: bytes, encoding: bytes) -> frozenset[int]:
        """Check the head, read and decode the body onto ``ex`` (``body``, ``peek``, ``decoded``); returns the
        workers that cannot serve the request. Raises :class:`Rejected`."""
        route = ex.route
        assert route is not None
        limit = self.cfg.max_body_bytes
        check_head(route, clen, ctype, encoding, limit)
        body = await receive_body(ex.receive, limit, ex.scope.get("extensions", {}).get(DISCONNECT_EXT))
        if body is None:
            raise Rejected(RouterErrorKind.BODY_TOO_LARGE, f"request body is over the {limit}-byte limit")
        return self.take_body(ex, body, encoding)

    def take_body(self, ex: Exchange, body: bytes, encoding: bytes) -> frozenset[int]:
        """Decode and peek the whole request ``body`` onto ``ex`` (``body``, ``peek``, ``decoded``;
        :func:`dplb.router.intake.read_body`: 400, 413, 415) and return the workers it must not go to: those not
        serving its model; all but the creator of the response it names (``ex.pin``, or ``previous_response_id``
        on ``/v1/responses``) when that worker is known. Raises :class:`Rejected`, also 404 ``model_not_found`` when
        every worker's list is known and none serves the model. The ASGI path and the direct relay
        (:mod:`dplb.router.direct`, after :func:`dplb.router.intake.check_head`) both read here."""
        route = ex.route
        assert route is not None
        ex.body, peek, model, ex.decoded = read_body(route, body, encoding, self.cfg.max_body_bytes)
        ex.peek = peek
        exclude = _NONE
        if isinstance(model, str) and model:  # "" is vLLM's default model, as an absent one
            models = self.models
            if models.none_serves(model):
                # A tenant with an allow-list learns only of its own models; one outside it is the gate's 403 (the
                # same answer whether or not the model exists: no oracle of the served names), and so is a form
                # whose model fields it cannot read as vLLM does, whatever the first field names.
                t = ex.tenant.tenant if ex.tenant is not None else None
                if t is None or (t.may_use(model) and not (t.models is not None and route.body == "multipart"
                                                           and ambiguous(form_models(ex.body)))):
                    served = [n for n in models.names() if t is None or t.may_use(n)]
                    raise Rejected(RouterErrorKind.MODEL_NOT_FOUND, f"The model `{model}` does not exist. Served "
                                   f"models: {', '.join(served) or '(none)'}")
            exclude = models.workers_not_serving(model)
        pin_id = ex.pin
        if pin_id is None and route.path == _RESPONSES and isinstance(peek.previous_response_id, str):
            pin_id = peek.previous_response_id
        if pin_id is not None:
            k = self.response_ids.worker_of(pin_id)
            if k is not None:
                exclude = frozenset(range(self.state.num_workers)) - {k}
        return exclude

    def decide(self, ex: Exchange) -> int | None:
        """One routing decision for ``ex`` (kept on it, recorded and traced); the chosen worker or None."""
        ex.trace.deciding()
        d = ex.decision = self.state.decide(ex.request, ex.rid.decode(), _tenant_name(ex))
        ex.trace.routed(d)
        return d.worker

    def choose(self, ex: Exchange) -> float:
        """:meth:`decide` for an untraced request, without the record: the decision is kept on ``ex``; returns
        its duration (seconds) for :meth:`record`, which the caller must call."""
        ex.decision, seconds = self.state.choose(ex.request)
        return seconds

    def record(self, ex: Exchange, seconds: float) -> None:
        """Record ``ex``'s decision made by :meth:`choose` in ``seconds`` (metrics, debug ring)."""
        self.state.record(ex.decision, seconds, ex.rid.decode(), _tenant_name(ex))

    async def _dispatch(self, ex: Exchange, exclude: frozenset[int]) -> None:
        ex.request = self.route_request(ex.peek, exclude)
        # Limits and the fair queue (dplb.router.tenancy); answered when False.
        if self.gate.on and not await self.gate.enter(ex):
            return
        worker = self.decide(ex)
        if worker is None:
            await self.no_worker(ex)
            return
        await self.place(ex, worker)

    async def no_worker(self, ex: Exchange) -> None:
        """Answer ``ex`` whose decision chose no worker: why (no worker yet, all over their cap, none ready: then
        each worker's reason, as the decision's candidates give it)."""
        d = ex.decision
        kind, message = _NO_WORKER.get(d.reason, _NONE_READY)
        if d.reason not in _NO_WORKER and d.candidates:
            whys = ", ".join(f"worker {c.worker_id}: {c.why}" for c in d.candidates[:MAX_NAMED])
            more = len(d.candidates) - MAX_NAMED
            message = f"no worker is ready ({whys}{f', {more} more' if more > 0 else ''}); retry shortly"
        await self._reject(ex, kind, message)

    def prepare(self, ex: Exchange) -> None:
        """After the decision: the request head for the workers (with the predicted prefix hit), the response-id
        capture and the stream tracking of ``ex``."""
        skip = self._req_skip
        ex.head = request_head(ex.scope, len(ex.body), ex.rid, ex.decoded, skip, True,
                               ex.fwd if skip is REQ_OWN else None)  # (tracing drops the client's trace headers)
        notes = ex.decision.notes
        if notes and (hit := notes.get(NOTE_PREFIX_HIT_BYTES)) is not None:  # the worker checks it (§5 staleness)
            ex.head = b"%s%s: %d\r\n\r\n" % (ex.head[:-2], PREFIX_PREDICTED_HEADER, hit)
        # /v1/responses: the response's id is known up front when the client chose it, else read from the answer.
        capture: Any = ex.route is not None and ex.route.path == _RESPONSES and ex.scope["method"] == "POST"
        ex.capture = ex.peek.request_id if capture and isinstance(ex.peek.request_id, str) else capture
        if self.cfg.resume_streams:
            ex.resume = resume.track(ex)

    async def place(self, ex: Exchange, worker: int, first: Attempt | None = None) -> None:
        """Serve ``ex`` on the chosen ``worker`` (retries included), watching for the client's disconnect.
        ``first``: an attempt the direct relay already sent (:mod:`dplb.router.direct`; ``ex`` is prepared)."""
        if first is None:
            self.prepare(ex)
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
            await self._attempts(ex, worker, first)
        finally:
            if watcher is not None:
                watcher.cancel()
            else:
                hook.callback = None

    async def _attempts(self, ex: Exchange, worker: int, first: Attempt | None) -> None:
        """Attempt ``worker`` (``first``: that attempt, already sent); retry once on the next-best worker when the
        attempt produced nothing. A tracked stream that broke is resumed on another worker
        (:mod:`dplb.router.resume`) with a retry of its own."""
        tried: set[int] = set()
        s = ex.resume
        while True:
            retry = await (first.resume() if first is not None else self._attempt(ex, worker).run())
            first = None
            if retry is None:
                if s is None or s.broken is None:
                    return
                body = await resume.prepare(self.upstreams, ex)
                if body is None:
                    return
                s.broken_on = worker  # logged and counted once a worker takes the continuation (resume.resumed)
                ex.body = body
                skip = self._req_skip
                ex.head = request_head(ex.scope, len(body), ex.rid, ex.decoded, skip, True,
                                       ex.fwd if skip is REQ_OWN else None)
                tried = {worker}
                why = "no other worker is ready to resume the stream"
            else:
                tried.add(worker)
                if len(tried) > 1 + (s is not None and s.resumes > 0):
                    await self._fail(ex, retry, "no worker could take the request")
                    return
                self.metrics.retries.inc()
                why = "the chosen worker was unreachable and no other is ready"
            ex.request.exclude = frozenset(tried)
            next_worker = self.decide(ex)
            if next_worker is None:
                await self._fail(ex, retry or RouterErrorKind.NONE_ROUTABLE, why)
                return
            worker = next_worker

    def _attempt(self, ex: Exchange, worker: int) -> Attempt:
        """A new attempt of ``ex`` on ``worker`` (resumable when its stream is tracked)."""
        s = ex.resume
        return Attempt(self.upstreams, ex, worker) if s is None else resume.ResumableAttempt(self.upstreams, ex,
                                                                                              worker, s)

    async def _fail(self, ex: Exchange, kind: RouterErrorKind, message: str) -> None:
        """The request cannot be placed: the router's error, or an error event when a resumed stream's head was
        already sent."""
        if ex.status:
            await resume.end_stream(self.upstreams, ex, "no_worker", message)
        else:
            await self._reject(ex, kind, message)


def _tenant_name(ex: Exchange) -> str:
    """The name of ``ex``'s tenant (:data:`DEFAULT_TENANT` when the gate is off)."""
    tk = ex.tenant
    return tk.tenant.name if tk is not None else DEFAULT_TENANT


def scan_headers(ex: Exchange) -> tuple[int, bytes, bytes, bytes, bytes]:
    """Set ``ex.rid`` (the client's ``X-Request-Id`` when sane, else a fresh 32-hex-digit id) and ``ex.fwd`` (the
    headers a worker gets, as :func:`dplb.router.exchange.request_head` renders them with
    :data:`dplb.router.exchange.REQ_OWN`; None when a ``Connection`` header lists names to drop too) and return
    (content-length: -1 absent, -2 malformed; content-type; authorization; content-encoding; the name of a
    one-value header the router reads that came more than once, ``content-type`` or ``authorization``, else b"").
    Repeated ``Content-Encoding`` headers are one comma list, in their order (RFC 9110 §5.3). One pass: the names
    it looks for are compared first (ASGI gives them in lower case)."""
    rid = b""
    clen = -1
    ctype = auth = encoding = repeated = b""
    seen_ctype = seen_auth = False
    listed = False
    headers: list[tuple[bytes, bytes]] = ex.scope["headers"]
    parts: list[bytes] = []
    for n, v in headers:
        if n == b"content-type":
            if seen_ctype:
                repeated = n
            ctype, seen_ctype = v, True
        elif n == b"content-length":
            clen = int(v) if v.isdigit() else -2
            continue
        elif n == b"host":
            continue
        elif n == b"x-request-id":
            rid = v
            continue
        elif n == b"authorization":
            if seen_auth:
                repeated = n
            auth, seen_auth = v, True
        elif n == b"content-encoding":
            encoding = encoding + b", " + v if encoding else v
        elif n in REQ_OWN:
            if n == b"connection":
                listed = True
            continue
        parts.append(n)  # (appends: cheaper than one += of a tuple, compiled and in CPython 3.11 alike)
        parts.append(b": ")
        parts.append(v)
        parts.append(b"\r\n")
    ex.fwd = None if listed else b"".join(parts)
    ex.rid = rid if rid and _REQUEST_ID_RE.fullmatch(rid) else _IDS.next()
    return clen, ctype, auth, encoding, repeated


_ID_BATCH: Final = 128  # request ids per draw from the OS's random source


class _RequestIds:
    """Fresh request ids: 32 hex digits (128 bits) of ``os.urandom`` each, drawn :data:`_ID_BATCH` ids at a time
    (one ``getrandom`` syscall per batch instead of one per request; a forked child draws its own: :meth:`forget`)."""

    def __init__(self) -> None:
        self.digits = b""  # hex digits of the current draw
        self.used = _ID_BATCH  # ids of it handed out

    def next(self) -> bytes:
        """A fresh request id."""
        used = self.used
        if used == _ID_BATCH:
            self.digits = os.urandom(16 * _ID_BATCH).hex().encode()
            used = 0
        self.used = used + 1
        at = used * 32
        return self.digits[at:at + 32]

    def forget(self) -> None:
        """Draw anew at the next id (a forked child must not repeat its parent's)."""
        self.used = _ID_BATCH


_IDS: Final = _RequestIds()


os.register_at_fork(after_in_child=_IDS.forget)
