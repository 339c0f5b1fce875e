"""The router process: Litestar for the local endpoints, the raw-ASGI :class:`Proxy` for the proxied routes.

Contract (DESIGN §4)
- ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings`` → :class:`dplb.router.proxy.Proxy`
  (dispatched before Litestar, so the hot path pays no framework cost).
- ``GET /v1/models``: the model list of the best ready worker (the next one if it fails); 503 when none answers —
  never a 500 because one worker is down. ``GET /health``: the process is alive. ``GET /ready``: 200 when ≥ 1
  worker is routable, else 503. ``GET /metrics``: Prometheus text. ``GET /debug/decisions?limit=N``: the last N
  decisions with every candidate's inputs, terms and score.
- With an API key, every path except ``public_paths`` needs ``Authorization: Bearer <key>`` (constant-time
  compare); failures are OpenAI-shaped 401s.
- The router starts before any worker is ready and answers 503 until one is.
- The HTTP edge is bounded: request heads over :data:`MAX_HEAD_BYTES` get 431 ``headers_too_large`` and malformed
  HTTP gets 400 ``invalid_http`` (both OpenAI-shaped, connection closed); an unexpected exception is logged with its
  traceback and answered with a bare OpenAI-shaped 500 ``internal_error`` — no traceback or path reaches a client.
- The open-file soft limit is raised to the hard limit at start (two descriptors per proxied request).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import signal
import time
from typing import Any

import msgspec
from litestar import Litestar, Request, Response, get
from litestar.exceptions import HTTPException
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OM_CONTENT_TYPE
from prometheus_client.openmetrics.exposition import generate_latest as om_generate_latest

from dplb import __version__
from dplb.config import RouterConfig
from dplb.errors import RouterErrorKind
from dplb.metrics import RouterMetrics, WorkerStateCollector
from dplb.router.proxy import PROXY_PATHS, Proxy, error_body
from dplb.router.state import RouterState
from dplb.router.upstream import UpstreamError, UpstreamPool, fetch
from dplb.serving import bind_tcp, make_server, raise_fd_limit
from dplb.shm_layout import unregister_router
from dplb.systemd import notify
from dplb.tracing import make_tracer
from dplb.tracing import shutdown as tracing_shutdown

log = logging.getLogger("dplb.router")
MAX_HEAD_BYTES = 64 * 1024  # request line + headers; more gets 431 (nginx allows 32 KiB, Node 16 KiB)
_TEXT_TYPE = CONTENT_TYPE_LATEST.replace("; charset=utf-8", "")
_METHODS = frozenset({"GET", "POST", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH"})
_ROUTES = frozenset({"/health", "/ready", "/metrics", "/v1/models", "/debug/decisions"}) | PROXY_PATHS


def _error(kind: RouterErrorKind, message: str, retry_after: int | None = None) -> Response[bytes]:
    headers = {"retry-after": str(retry_after)} if retry_after is not None else {}
    return Response(error_body(kind, message), status_code=kind.status, media_type="application/json",
                    headers=headers)


class RouterApp:
    """The whole router: state, proxy, Litestar app, and the top-level ASGI dispatch."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.metrics = RouterMetrics(__version__)
        self.state = RouterState(cfg, self.metrics)
        self.pool = UpstreamPool([cfg.socket_path(k) for k in range(self.state.num_workers)], cfg.connect_timeout_s)
        self.proxy = Proxy(cfg, self.state, self.pool)
        self.tracer = make_tracer()
        if self.tracer is not None:
            self.proxy.enable_tracing(self.tracer)
        self.metrics.registry.register(WorkerStateCollector(self._scrape_source))
        self._auth = ("bearer " + cfg.api_key).encode() if cfg.api_key else None
        self.litestar = self._build_litestar()

    def _scrape_source(self) -> tuple[Any, list[int], int, float | None, Any]:
        st = self.state
        snap = st.snapshot()
        d = st.dry_run(snap)
        registered = sum(1 for w in snap if w.registered) if snap is not None else 0
        return d, list(st.inflight), registered, st.policy.baseline_s, st.policy

    def _build_litestar(self) -> Litestar:
        state, cfg, metrics, pool = self.state, self.cfg, self.metrics, self.pool

        @get("/health", sync_to_thread=False)
        def health() -> dict[str, str]:
            return {"status": "ok"}

        @get("/ready", sync_to_thread=False)
        def ready() -> Response[Any]:
            ws = state.routable_workers()
            if not ws:
                return _error(RouterErrorKind.NONE_ROUTABLE, "no worker is ready", cfg.retry_after_s)
            return Response({"ready": True, "routable_workers": ws, "shm_segment_present": state.segment is not None})

        @get("/metrics", sync_to_thread=False)
        def metrics_endpoint(request: Request[Any, Any, Any]) -> Response[bytes]:
            # OpenMetrics when asked (Prometheus does with exemplar storage on): latency histograms then carry
            # trace-id exemplars.
            if "application/openmetrics-text" in request.headers.get("accept", ""):
                return Response(om_generate_latest(metrics.registry), media_type=OM_CONTENT_TYPE)
            # Litestar appends "; charset=utf-8" to text/* types itself: hand it the type without one (issue 16).
            return Response(generate_latest(metrics.registry), media_type=_TEXT_TYPE)

        @get("/v1/models")
        async def models() -> Response[Any]:
            for k in state.routable_workers():
                try:
                    status, body = await fetch(pool, k, "/v1/models", 5.0)
                except UpstreamError as e:
                    log.info("worker %d could not list models: %s", k, e)
                    continue
                if status == 200:
                    return Response(body, media_type="application/json", headers={"x-sg-worker-id": str(k)})
            return _error(RouterErrorKind.NONE_ROUTABLE, "no ready worker answered /v1/models", cfg.retry_after_s)

        @get("/debug/decisions", sync_to_thread=False)
        def decisions(limit: int = 50) -> list[dict[str, Any]]:
            if limit <= 0:
                raise HTTPException(status_code=400, detail="limit must be > 0")
            items = list(state.decisions)[-limit:]
            return [{"time": t, "request_id": rid, **d.to_dict()} for t, rid, d in reversed(items)]

        return Litestar(route_handlers=[health, ready, metrics_endpoint, models, decisions], debug=False,
                       logging_config=None, exception_handlers={HTTPException: _openai_http_error,
                                                                Exception: _internal_error})

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.litestar(scope, receive, send)  # type: ignore[arg-type]  # lifespan
            return
        path = scope["path"]
        status = [0]
        t0 = time.perf_counter()

        async def send_wrapper(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if path in PROXY_PATHS:
                try:
                    await self.proxy(scope, receive, send_wrapper)
                except Exception:
                    # A router bug must not leak a traceback or a non-OpenAI body: log it, answer a bare 500
                    # when nothing was sent yet (else the connection is cut mid-response).
                    log.exception("internal error handling %s %s", scope.get("method"), path)
                    if status[0]:
                        raise
                    self.metrics.rejected.labels(RouterErrorKind.INTERNAL.code).inc()
                    await _json(send_wrapper, 500, error_body(RouterErrorKind.INTERNAL, "internal error"))
            elif self._auth is not None and path not in self.cfg.public_paths and not self._authorized(scope):
                self.metrics.rejected.labels(RouterErrorKind.UNAUTHORIZED.code).inc()
                await _json(send_wrapper, 401, error_body(RouterErrorKind.UNAUTHORIZED, "missing or wrong API key"))
            else:
                await self.litestar(scope, receive, send_wrapper)  # type: ignore[arg-type]
        finally:
            route = path if path in _ROUTES else "other"
            method = scope["method"] if scope["method"] in _METHODS else "other"
            self.metrics.http_requests.labels(route, method, str(status[0])).inc()
            self.metrics.http_duration.labels(route, method).observe(time.perf_counter() - t0)

    def _authorized(self, scope: dict[str, Any]) -> bool:
        assert self._auth is not None
        for n, v in scope["headers"]:
            if n == b"authorization":
                return hmac.compare_digest(v[:7].lower() + v[7:], self._auth)
        return False


_HTTP_CODES = {400: "invalid_request", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed"}


def _openai_http_error(request: Request[Any, Any, Any], exc: HTTPException) -> Response[bytes]:
    """Litestar's own errors (unknown path, bad query parameter, …) in the OpenAI error shape, no internals."""
    status = exc.status_code
    code = _HTTP_CODES.get(status, "internal_error" if status >= 500 else "invalid_request")
    message = "internal error" if status >= 500 else (
        f"no route {request.method} {request.url.path}" if status == 404 else str(exc.detail))
    body = msgspec.json.encode({"error": {"message": message, "type": "server_error" if status >= 500 else
                                          "invalid_request_error", "code": code}})
    return Response(body, status_code=status, media_type="application/json")


def _internal_error(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    """Any other exception in a local route: logged with its traceback, answered without internals."""
    log.error("internal error handling %s %s", request.method, request.url.path, exc_info=exc)
    return Response(error_body(RouterErrorKind.INTERNAL, "internal error"), status_code=500,
                    media_type="application/json")


async def _json(send: Any, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def run_router(cfg: RouterConfig, ready_cb: Any = None) -> int:
    """Serve until SIGTERM/SIGINT. ``ready_cb()`` is called once the socket listens. Returns the exit code."""
    old, new = raise_fd_limit()
    if new != old:
        log.info("raised the open-file limit from %d to %d (two descriptors per proxied request)", old, new)
    app = RouterApp(cfg)
    server = make_server(app, graceful_s=5.0, access_log=cfg.access_log, max_head_bytes=MAX_HEAD_BYTES,
                         on_reject=lambda code: app.metrics.rejected.labels(code).inc())
    server.config.server_header = False  # upstream Server/Date headers pass through instead
    server.config.date_header = False
    sock = bind_tcp(cfg.host, cfg.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    monitor = asyncio.create_task(app.state.monitor())
    serve = asyncio.create_task(server.serve(sockets=[sock]))
    host, port = sock.getsockname()[:2]
    log.info("DPLB router listening on http://%s:%d (policy %s, %d workers, segment %s)", host, port,
             cfg.policy.name, app.state.num_workers, app.state.segment.path if app.state.segment else "missing")
    notify(f"READY=1\nSTATUS=routing on port {port}")
    if ready_cb is not None:
        ready_cb()
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({serve, stopped}, return_when=asyncio.FIRST_COMPLETED)
    server.should_exit = True
    with contextlib.suppress(Exception):
        await asyncio.wait_for(serve, 10)
    monitor.cancel()
    stopped.cancel()
    if app.state.segment is not None:
        unregister_router(app.state.segment.path)
    app.pool.close()
    if app.tracer is not None:
        tracing_shutdown(app.tracer)
    log.info("DPLB router stopped")
    return 0


__all__ = ["RouterApp", "run_router"]
