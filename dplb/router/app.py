"""The router process: Litestar for the local endpoints, the raw-ASGI :class:`Proxy` for the proxied routes.

Contract (docs/DESIGN.md §4, §6)
- Every proxied route of :mod:`dplb.router.routes` (chat, completions, embeddings, responses, pooling, scoring,
  tokenize, audio, …) → :class:`dplb.router.proxy.Proxy` (dispatched before Litestar, so the hot path pays no
  framework cost).
- ``GET /v1/models``: the union of every ready worker's list (deduplicated by id, first worker first; each answer
  also refreshes the model side table); 503 when none answers — never a 500 because one worker is down.
  ``GET /v1/models/{model}`` (the SDK's ``models.retrieve``; the id may contain ``/``): that entry of the same
  union, or 404 ``model_not_found`` naming the served models.
    ``GET /health``: the process is alive. ``GET /ready``: 200 when ≥ 1 worker is routable and the host is not
  draining, else 503. ``GET /metrics``: Prometheus text; ``GET /metrics/host``: the host load report's families
  alone (:mod:`dplb.router.host_report`). ``GET /debug/decisions?limit=N``: the last N decisions with every candidate's
  inputs, terms and score (N at most the decisions kept, else 400 naming ``limit``; a tenant's key: its own,
  each reduced to the chosen worker and why: :mod:`dplb.router.privileges`). ``HEAD`` on every ``GET`` route
  answers like ``GET`` without a body; a wrong method is 405 ``method_not_allowed`` naming the allowed ones, as in
  its ``Allow`` header (``GET, HEAD, OPTIONS``).
- ``POST /v1/load_lora_adapter``, ``/v1/unload_lora_adapter``: fanned out to the workers
  (:mod:`dplb.router.fanout`) with ``--allow-runtime-lora``, else 404 ``route_disabled``; with keys, an
  operator's key only (:mod:`dplb.router.privileges`).
- CORS (``--cors-allowed-origins``, off by default): Litestar's CORS config answers preflights (``OPTIONS`` with
  ``Origin``, before the API key check, on every path) and adds the headers to local routes; proxied responses get
  the same headers from the same config. ``Access-Control-Allow-Methods``/``-Headers`` (and ``-Max-Age``) go on
  preflight answers only, as the Fetch standard's CORS protocol has them (Litestar adds them to every response;
  the local routes' send drops them). Every answer to a request with ``Origin`` carries ``Vary: Origin`` (unless
  ``*`` allows every origin), a refused origin's too; :data:`CORS_EXPOSE_HEADERS` lets a browser read
  ``Retry-After`` and the ``x-ratelimit-*`` headers.
- With an API key or a tenants file, every path except ``public_paths`` needs ``Authorization: Bearer <key>``
  (a tenant's key: :mod:`dplb.router.tenancy`; constant-time compare); failures are OpenAI-shaped 401s. SIGHUP
  reloads the tenants file; ``/debug/decisions`` entries name the request's tenant (a tenant's key sees only its
  own: :mod:`dplb.router.local`).
- The router starts before any worker is ready and answers 503 until one is.
- The HTTP edge is bounded: request heads over :data:`MAX_HEAD_BYTES` get 431 ``headers_too_large``, malformed
  HTTP gets 400 ``invalid_http``, a head or body too slow (``--header-timeout``, ``--body-timeout``) 408
  ``request_timeout`` (all OpenAI-shaped, connection closed; :mod:`dplb.runtime.protocol`); an unexpected exception
  is logged with its traceback and answered with a bare OpenAI-shaped 500 ``internal_error`` — no traceback or path
  reaches a client. A WebSocket handshake gets the 404 of an unrouted path (the router proxies HTTP only).
- The open-file soft limit is raised to the hard limit at start (two descriptors per proxied request).
- Under systemd, READY=1 once the socket listens, and WATCHDOG=1 from the run loop of :func:`run_router` while the
  event loop runs (every half ``WATCHDOG_USEC`` at most; :class:`dplb.runtime.sd_notify.Watchdog`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import time
from collections.abc import Coroutine
from typing import Any

from litestar.config.cors import CORSConfig
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from dplb import __version__, native
from dplb.config import RouterConfig
from dplb.errors import WWW_AUTHENTICATE, RouterErrorKind, bind_error, error_body, openai_error_body
from dplb.obs.metrics_host import HostReportCollector
from dplb.obs.metrics_router import RouterMetrics
from dplb.obs.metrics_scrape import KvTruthCollector, WorkerStateCollector
from dplb.obs.tracing import make_tracer
from dplb.obs.tracing import shutdown as tracing_shutdown
from dplb.router.agent import bind_agent, start_agent
from dplb.router.direct import DirectLane
from dplb.router.host_report import HostReporter
from dplb.router.http_count import MODELS_PREFIX, HttpCount
from dplb.router.intake import authorizations, duplicate_header_message
from dplb.router.local import build_local_app
from dplb.router.models import ServedModels
from dplb.router.orca import OrcaResponder
from dplb.router.proxy import Exchange, Proxy
from dplb.router.routes import NOT_ROUTED, is_proxy_path
from dplb.router.siblings import SingleProcess
from dplb.router.state import RouterState
from dplb.router.upstream_pool import UpstreamPool
from dplb.runtime.asgi import Message, send_json
from dplb.runtime.sd_notify import Watchdog, notify
from dplb.runtime.serving import bind_tcp, bind_uds, make_server, raise_fd_limit

log = logging.getLogger("dplb.router")
MAX_HEAD_BYTES = 64 * 1024  # request line + headers; more gets 431 (nginx allows 32 KiB, Node 16 KiB)
_TEXT_TYPE = CONTENT_TYPE_LATEST.replace("; charset=utf-8", "")
#: The response headers a browser client may read under CORS (``Access-Control-Expose-Headers``): the router's own
#: (the worker that answered, the request id), ``Retry-After`` (503/429, ``worker_stalled``: dplb.router.attempt)
#: and OpenAI's ``x-ratelimit-*`` (dplb.router.limits), which the OpenAI SDKs read to back off.
CORS_EXPOSE_HEADERS = ("x-sg-worker-id", "x-request-id", "retry-after",
                       *(f"x-ratelimit-{what}-{of}" for of in ("requests", "tokens", "concurrent")
                         for what in ("limit", "remaining", "reset")))
_HEAD_PATHS = frozenset({"/health", "/ready", "/metrics", "/metrics/host", "/v1/models", "/debug/decisions"})


class RouterApp:
    """The whole router: state, proxy, Litestar app, and the top-level ASGI dispatch."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.metrics = RouterMetrics(__version__)
        self.state = RouterState(cfg, self.metrics)
        self.pool = UpstreamPool([cfg.socket_path(k) for k in range(self.state.num_workers)], cfg.connect_timeout_s)
        self.models = ServedModels(self.state.num_workers)
        self.proxy = Proxy(cfg, self.state, self.pool, self.models)
        self.cors = CORSConfig(allow_origins=list(cfg.cors_allowed_origins), allow_methods=["*"], allow_headers=["*"],
                               expose_headers=list(CORS_EXPOSE_HEADERS)) if cfg.cors_allowed_origins else None
        self.tracer = make_tracer()
        if self.tracer is not None:
            self.proxy.enable_tracing(self.tracer)
        self.metrics.registry.register(WorkerStateCollector(self._scrape_source))
        self.metrics.registry.register(KvTruthCollector(lambda: (
            self.state.segment.kv_reader() if self.state.segment is not None else None, self.state.num_workers)))
        if cfg.processes == 1:  # a group's answer adds the merged figure instead (dplb.router.siblings)
            self.metrics.registry.register(SingleProcess())
        # The host load report (dplb.router.host_report): /metrics' Model Server Protocol families, the HAProxy
        # agent, the ORCA header and /ready's drain all read it.
        self.host = HostReporter(self.state, self.models)
        self.metrics.registry.register(HostReportCollector(lambda: self.host.report))
        self.host_registry = CollectorRegistry(auto_describe=False)  # GET /metrics/host: these families alone
        self.host_registry.register(HostReportCollector(lambda: self.host.report))
        #: The ORCA load report (dplb.router.orca): on proxied answers and the router's own errors there, and on a
        #: local route's 503 (not ready, draining), so that Envoy sees the host's utilization ≥ 1 wherever it asks.
        self.orca = OrcaResponder(cfg.orca, lambda: self.host.report) if cfg.orca != "off" else None
        self.proxy.upstreams.on_response_head = self.orca
        self._keyed = bool(cfg.api_key or cfg.tenants_file)  # local routes need a key (a tenant's, with --tenants)
        self._observe = HttpCount(self.metrics).observe  # dplb_http_requests_total and its duration histogram
        self.litestar = build_local_app(self)
        self._build_watch = native.StaleWatch(native.build())
        self.state.on_tick.append(self.check_build)

    def check_build(self) -> None:
        """A monitor hook: once the compiled build went stale under this router (its checkout edited or pulled),
        ``dplb_build_info{compiled="stale"}`` and one WARNING; back to ``"true"`` (one INFO) when the sources are
        the build's again. At most one stat pass every :data:`dplb.native.STALE_CHECK_S` seconds."""
        label = self._build_watch.poll(time.monotonic())
        if label is None:
            return
        self.metrics.set_build_label(label)
        if label == "stale":
            log.warning("the compiled build went stale under this router: %s changed since it was built; it keeps "
                        "running the build it started with, but a restart will be refused until you %s",
                        ", ".join(f"dplb/{p}" for p in self._build_watch.stale[:3]), native.FIXES)
        else:
            log.info("the compiled build is current again (its sources are back to the build's content)")

    def _scrape_source(self) -> tuple[Any, list[int], int, float | None, Any]:
        st = self.state
        snap = st.snapshot()
        d = st.dry_run(snap)
        registered = sum(1 for w in snap if w.registered) if snap is not None else 0
        return d, st.inflight_all(), registered, st.policy.baseline_s, st.policy

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            if scope["type"] == "websocket":
                await self._refuse_websocket(scope, send)
            else:
                await self.litestar(scope, receive, send)  # type: ignore[arg-type]  # lifespan
            return
        path = scope["path"]
        t0 = time.perf_counter()
        origin = self._origin(scope) if self.cors is not None else None
        if origin is not None and self.cors is not None and not self.cors.is_allow_all_origins:
            send = _vary_origin(send)  # the answer depends on Origin, allowed or not (a cache must key on it)
        if is_proxy_path(path) and (origin is None or scope["method"] != "OPTIONS"):
            # The hot path: the proxy records the status it sends on the exchange (no send wrapper).
            ex = Exchange(scope, receive, self._cors_send(send, origin) if origin else send)
            ex.t_start = t0
            await self.serve_proxy(ex, self.proxy.serve(ex))
            return
        status = [0]
        if scope["method"] == "HEAD" and (path in _HEAD_PATHS or path.startswith(MODELS_PREFIX)):  # every GET route
            scope = {**scope, "method": "GET"}
            send = _without_body(send)

        send_wrapper = _local_send(send, status, self.orca, scope, origin is not None and scope["method"] != "OPTIONS")
        try:
            if origin is not None and scope["method"] == "OPTIONS":
                assert self.cors is not None
                if self.cors.is_origin_allowed(origin):
                    await self.litestar(scope, receive, send_wrapper)  # type: ignore[arg-type]  # CORS preflight
                else:  # (Litestar's refusal is a text/plain 400)
                    kind = RouterErrorKind.CORS_ORIGIN
                    self.metrics.rejected.labels(kind.code).inc()
                    await send_json(send_wrapper, kind.status, error_body(
                        kind, f"origin {origin!r} is not allowed by CORS (--cors-allowed-origins)"))
            elif self._keyed and path not in self.cfg.public_paths and (refused := self._refusal(scope)):
                kind, message = refused
                self.metrics.rejected.labels(kind.code).inc()
                await send_json(self._cors_send(send_wrapper, origin) if origin else send_wrapper, kind.status,
                                error_body(kind, message),
                                [WWW_AUTHENTICATE] if kind is RouterErrorKind.UNAUTHORIZED else None)
            else:
                await self.litestar(scope, receive, send_wrapper)  # type: ignore[arg-type]
        finally:
            self._observe(path, scope["method"], status[0], t0)

    async def _refuse_websocket(self, scope: dict[str, Any], send: Any) -> None:
        """A WebSocket handshake (any path): the router proxies HTTP only: an OpenAI-shaped 404 (the ASGI denial
        response; a bare 403 where the server cannot send one), counted in the HTTP metrics as ``GET``."""
        t0, path = time.perf_counter(), scope["path"]
        reason = f" ({NOT_ROUTED[path]})" if path in NOT_ROUTED else ""
        body = openai_error_body(f"no route GET {path}{reason}", "invalid_request_error", "not_found")
        denial = "websocket.http.response" in scope.get("extensions", {})
        if denial:
            await send({"type": "websocket.http.response.start", "status": 404, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "websocket.http.response.body", "body": body} if denial else {"type": "websocket.close"})
        self._observe(path, "GET", 404 if denial else 403, t0)

    async def serve_proxy(self, ex: Exchange, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work``, the proxying of ``ex`` (from its start, or where the direct relay left it), then count it
        in the HTTP metrics. A router bug must not leak a traceback or a non-OpenAI body: it is logged and answered
        with a bare 500 (with the request's ``X-Request-Id``) when nothing was sent yet (else the connection is cut
        mid-response)."""
        scope = ex.scope
        try:
            await work
        except Exception:
            log.exception("internal error handling %s %s", scope.get("method"), scope["path"])
            if ex.status:
                raise
            self.metrics.rejected.labels(RouterErrorKind.INTERNAL.code).inc()
            ex.status = 500
            await send_json(ex.send, 500, error_body(RouterErrorKind.INTERNAL, "internal error"),
                            [(b"x-request-id", ex.rid)] if ex.rid else None)
        finally:
            self._observe(scope["path"], scope["method"], ex.status, ex.t_start)

    @staticmethod
    def _origin(scope: dict[str, Any]) -> str | None:
        for n, v in scope["headers"]:
            if n == b"origin":
                return v.decode("latin-1")
        return None

    def _cors_send(self, send: Any, origin: str) -> Any:
        """``send`` that adds the CORS response headers of :attr:`cors` (Litestar's own rules) to a proxied
        response for ``origin``."""
        cors = self.cors
        assert cors is not None
        extra = [(k.lower().encode(), v.encode()) for k, v in cors.simple_headers.items()]
        if not cors.is_allow_all_origins and cors.is_origin_allowed(origin):
            extra.append((b"access-control-allow-origin", origin.encode("latin-1")))

        async def wrapped(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        return wrapped

    def _refusal(self, scope: dict[str, Any]) -> tuple[RouterErrorKind, str] | None:
        """Why a keyed local route refuses ``scope``'s request (kind, message), or None when its key is good."""
        value, n = authorizations(scope["headers"])
        if n > 1:
            return RouterErrorKind.DUPLICATE_HEADER, duplicate_header_message(b"authorization")
        if n and self.proxy.gate.tenant_of(value) is not None:
            return None
        return RouterErrorKind.UNAUTHORIZED, "missing or wrong API key"


#: CORS response headers that belong on a preflight answer only (Fetch standard, CORS protocol: an actual response
#: carries Access-Control-Allow-Origin/-Credentials/-Expose-Headers); Litestar's CORS middleware puts them on every
#: response to a request with Origin.
_PREFLIGHT_ONLY = frozenset({b"access-control-allow-methods", b"access-control-allow-headers",
                             b"access-control-max-age"})


def _local_send(send: Any, status: list[int], orca: OrcaResponder | None, scope: dict[str, Any],
                actual_cors: bool) -> Any:
    """``send`` for a local route: records the status in ``status[0]``, adds the ORCA report to a 503 (``orca``,
    for ``scope``'s request), and with ``actual_cors`` (a non-preflight request with Origin) drops the
    preflight-only CORS headers (:data:`_PREFLIGHT_ONLY`)."""

    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            status[0] = message["status"]
            orca_503 = orca is not None and status[0] == 503
            if orca_503 or actual_cors:
                headers = [h for h in message.get("headers", [])
                           if not (actual_cors and bytes(h[0]).lower() in _PREFLIGHT_ONLY)]
                if orca is not None and orca_503:
                    orca(scope, headers)
                message = {**message, "headers": headers}
        await send(message)

    return wrapped


def _vary_origin(send: Any) -> Any:
    """``send`` that adds ``Vary: Origin`` to the response head unless a ``Vary`` header already names it (Litestar
    adds it to an allowed origin's local answer): every answer to a request with ``Origin`` under a list of allowed
    origins depends on it, a refused origin's (no ``Access-Control-Allow-Origin``) included (Fetch standard,
    §3.2.5 "CORS protocol and HTTP caches")."""

    async def wrapped(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            headers = message.get("headers", [])
            if not any(n.lower() == b"vary" and b"origin" in v.lower() for n, v in headers):
                message = {**message, "headers": [*headers, (b"vary", b"Origin")]}
        await send(message)

    return wrapped


def _without_body(send: Any) -> Any:
    """``send`` for a HEAD answered as GET: the same status and headers (Content-Length included), no body."""

    async def wrapped(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            message = {"type": "http.response.body", "body": b"", "more_body": message.get("more_body", False)}
        await send(message)

    return wrapped


async def run_router(cfg: RouterConfig, ready_cb: Any = None) -> int:
    """Serve until SIGTERM/SIGINT. ``ready_cb()`` is called once the socket listens. Returns the exit code."""
    old, new = raise_fd_limit()
    if new != old:
        log.info("raised the open-file limit from %d to %d (two descriptors per proxied request)", old, new)
    group = cfg.processes > 1
    try:  # before anything registers in the segment: a taken port leaves no trace
        sock = bind_tcp(cfg.host, cfg.port, reuse_port=group)
    except OSError as e:
        raise bind_error(cfg.host, cfg.port, e) from e
    agent_sock = bind_agent(cfg.host, cfg.agent_port) if cfg.agent_port and cfg.process_index == 0 else None
    app = RouterApp(cfg)
    lane = DirectLane(app.proxy, app.serve_proxy, app._observe, app.proxy.direct_enabled)
    # The start-up objects (modules, the app, its tables) leave the cyclic collector's generations: its passes,
    # triggered by the requests' allocations, stop traversing them (CPython's gc.freeze, meant for this).
    gc.collect()
    gc.freeze()
    server = make_server(app, graceful_s=5.0, access_log=cfg.access_log, max_head_bytes=MAX_HEAD_BYTES,
                         on_reject=lambda code: app.metrics.rejected.labels(code).inc(), direct=lane,
                         read_timeouts=(cfg.header_timeout_s, cfg.body_timeout_s),
                         serve_half_closed=cfg.serve_half_closed)
    server.config.server_header = False  # upstream Server/Date headers pass through instead
    server.config.date_header = False
    sockets = [sock]
    if group:  # this process's own socket: siblings fetch its metrics and decisions through it
        sockets.append(bind_uds(cfg.process_socket(cfg.process_index)))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, app.host.begin_drain, "drain requested (SIGUSR1)")
    loop.add_signal_handler(signal.SIGHUP, app.proxy.gate.reload)  # the tenants file (docs/DESIGN.md §15)
    monitor = asyncio.create_task(app.state.monitor())
    reporter = asyncio.create_task(app.host.run())
    agent = await start_agent(agent_sock, lambda: app.host.report) if agent_sock is not None else None
    refresher = asyncio.create_task(app.models.refresh_loop(app.pool, app.state.routable_workers, app.state.pid_of,
                                                            cfg.models_refresh_s))
    serve = asyncio.create_task(server.serve(sockets=sockets))
    host, port = sock.getsockname()[:2]
    log.info("DPLB router%s listening on http://%s:%d (policy %s, %d workers, segment %s, hot path %s)",
             f" process {cfg.process_index}/{cfg.processes}" if group else "", host, port, cfg.policy.name,
             app.state.num_workers, app.state.segment.path if app.state.segment else "missing", native.describe())
    notify(f"READY=1\nSTATUS=routing on port {port}")  # a group's children have no NOTIFY_SOCKET: a no-op
    if ready_cb is not None:
        ready_cb()
    stopped = asyncio.create_task(stop.wait())
    watchdog = Watchdog()
    await _run_until(serve, stopped, watchdog)
    if stopped.done() and not serve.done():  # report drain and keep serving before the socket closes
        notice = asyncio.create_task(app.host.drain_notice(cfg.drain_notice_s))
        await _run_until(serve, notice, watchdog)
    app.proxy.gate.close()  # requests still queued in the router are answered 503, none is left unanswered
    server.should_exit = True
    with contextlib.suppress(Exception):
        await asyncio.wait_for(serve, 10)
    monitor.cancel()
    reporter.cancel()
    if agent is not None:
        agent.close()
    refresher.cancel()
    stopped.cancel()
    app.state.close()
    if group:
        with contextlib.suppress(OSError):
            os.unlink(cfg.process_socket(cfg.process_index))
    app.pool.close()
    if app.tracer is not None:
        tracing_shutdown(app.tracer)
    log.info("DPLB router stopped")
    return 0


async def _run_until(serve: asyncio.Task[Any], stopped: asyncio.Task[Any], watchdog: Watchdog) -> None:
    """The run loop: wait until the server ends or a stop is asked for, pinging the systemd watchdog meanwhile
    (the loop's own liveness: a blocked event loop stops the pings and systemd restarts the router)."""
    tick = watchdog.interval_s / 2 if watchdog.enabled else None
    done: set[asyncio.Task[Any]] = set()
    while not done:
        watchdog.maybe_ping()
        done, _ = await asyncio.wait({serve, stopped}, timeout=tick, return_when=asyncio.FIRST_COMPLETED)


__all__ = ["RouterApp", "run_router"]
