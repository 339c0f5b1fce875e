"""The router's local routes: one Litestar app for ``/health``, ``/ready``, ``/metrics``, ``/metrics/host``,
``/v1/models``, ``/v1/models/{model}``, the LoRA fan-out and ``/debug/decisions`` (the contract of each is in
:mod:`dplb.router.app`'s docstring), and Litestar's own errors in the OpenAI shape.

Contract: :func:`build_local_app` reads the router's parts (:class:`RouterParts`: state, config, metrics, pool,
served models, host report, the proxy's tenant gate, CORS) from the router it is given; it owns no state. A wrong
method is 405 ``method_not_allowed`` naming the allowed methods, with an ``Allow`` that lists ``HEAD`` beside
``GET``; an unknown path 404 ``not_found``; any other exception a logged 500 ``internal_error`` without internals.

Tenant isolation (:func:`caller`; the rules are :mod:`dplb.router.privileges`): a tenant with a ``models``
allow-list sees only its models in ``/v1/models``, ``/v1/models/{model}`` and their 404; the LoRA fan-out is an
operator's (``--api-key``'s key, a tenant with ``admin = true``; an operator with a ``models`` list only for the
adapters it names); ``/debug/decisions`` shows a tenant's key only its own tenant's decisions, each without the
other workers' load and the shared prefix index's verdict (:func:`dplb.router.privileges.decision_view`); a keyed
``/metrics`` or ``/metrics/host`` only to an operator's key. Operators, and every caller of a router without
keys, see everything, whole.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

import msgspec
from litestar import Litestar, Request, Response, get, post
from litestar.config.cors import CORSConfig
from litestar.exceptions import HTTPException
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OM_CONTENT_TYPE
from prometheus_client.openmetrics.exposition import generate_latest as om_generate_latest

from dplb.config import RouterConfig
from dplb.errors import RouterErrorKind, error_body, openai_error_body
from dplb.obs.metrics_router import RouterMetrics
from dplb.router.fanout import fan_out, parse_workers
from dplb.router.host_report import HostReporter, stalled_list
from dplb.router.models import ServedModels
from dplb.router.privileges import decision_view, lora_refusal, operator_refusal
from dplb.router.proxy import Proxy
from dplb.router.siblings import SCOPE_PROCESS, fetch_siblings, merge_decisions, merge_metrics
from dplb.router.state import RouterState
from dplb.router.upstream_pool import UpstreamPool
from dplb.tenants import Tenant

log = logging.getLogger("dplb.router")
_TEXT_TYPE = CONTENT_TYPE_LATEST.replace("; charset=utf-8", "")


def _error(kind: RouterErrorKind, message: str, retry_after: int | None = None) -> Response[bytes]:
    headers = {"retry-after": str(retry_after)} if retry_after is not None else {}
    return Response(error_body(kind, message), status_code=kind.status, media_type="application/json",
                    headers=headers)


class RouterParts(Protocol):
    """What the local routes read of the router (:class:`dplb.router.app.RouterApp` has these)."""

    cfg: RouterConfig
    state: RouterState
    metrics: RouterMetrics
    pool: UpstreamPool
    models: ServedModels
    host: HostReporter
    host_registry: Any
    proxy: Proxy
    cors: CORSConfig | None


def build_local_app(app: RouterParts) -> Litestar:
    """The Litestar app of ``app``'s local routes (see the module docstring)."""
    state, cfg, metrics, pool, served = app.state, app.cfg, app.metrics, app.pool, app.models

    @get("/health", sync_to_thread=False)
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @get("/ready", sync_to_thread=False)
    def ready() -> Response[Any]:
        if app.host.draining:
            return _error(RouterErrorKind.NONE_ROUTABLE, "this host is draining", cfg.retry_after_s)
        ws = state.routable_workers()
        if not ws:  # in panic too: the host has no routable worker, a front balancer should look elsewhere (§5.1)
            panic = state.routable_workers(panic=True)
            stalled = state.stalled_workers()
            return _error(RouterErrorKind.NONE_ROUTABLE, "no worker is ready" + (
                f"; requests are served by panic routing among workers {panic} on heartbeat probation"
                if panic else "") + (f"; engine stalled: {stalled_list(stalled)}" if stalled else ""),
                cfg.retry_after_s)
        return Response({"ready": True, "routable_workers": ws, "shm_segment_present": state.segment is not None})

    def operator_only(request: Request[Any, Any, Any]) -> Response[bytes] | None:
        """The 403 of a non-operator tenant's key on an operator's route that needs a key (module docstring)."""
        path = request.scope["path"]
        why = None if path in cfg.public_paths else operator_refusal(caller(request), path)
        return _error(*why) if why is not None else None

    @get("/metrics")
    async def metrics_endpoint(request: Request[Any, Any, Any]) -> Response[bytes]:
        if (refused := operator_only(request)) is not None:
            return refused
        source: Any = metrics.registry
        # A group answers for all its processes (dplb.router.siblings); ?scope=process for this one alone.
        if cfg.processes > 1 and request.query_params.get("scope") != SCOPE_PROCESS:
            source = merge_metrics(metrics.registry.collect(), cfg.process_index,
                                   await fetch_siblings(cfg, "/metrics", request.headers.get("authorization")),
                                   cfg.processes)
        # OpenMetrics when asked (Prometheus does with exemplar storage on): latency histograms then carry
        # trace-id exemplars.
        if "application/openmetrics-text" in request.headers.get("accept", ""):
            # allow-utf-8: names stay as they are (the default escaping rewrote vllm:* to vllm_*, and Prometheus
            # then stored no vllm:* series from the router); every DPLB name is a legacy-valid name anyway.
            return Response(om_generate_latest(source, escaping="allow-utf-8"), media_type=OM_CONTENT_TYPE)
        # Litestar appends "; charset=utf-8" to text/* types itself: hand it the type without one.
        return Response(generate_latest(source), media_type=_TEXT_TYPE)

    @get("/metrics/host", sync_to_thread=False)
    def host_metrics(request: Request[Any, Any, Any]) -> Response[bytes]:
        if (refused := operator_only(request)) is not None:
            return refused
        # The host report's families only (the Endpoint Picker's metrics-data-source `path`): a few hundred
        # bytes from the stored report, whatever the worker count; the same for every process of a group.
        return Response(generate_latest(app.host_registry), media_type=_TEXT_TYPE)

    async def union() -> tuple[dict[str, dict[str, object]], str] | None:
        """Every ready worker's model entries by id (first worker first) and the workers that answered; None
        when none did."""
        ks = state.routable_workers()
        answers = await asyncio.gather(*(served.refresh(pool, k, state.pid_of(k)) for k in ks))
        seen: dict[str, dict[str, object]] = {}
        for entries in answers:
            for e in entries or ():
                seen.setdefault(str(e["id"]), e)
        if not any(a is not None for a in answers):
            return None
        return seen, ",".join(str(k) for k, a in zip(ks, answers, strict=True) if a is not None)

    def caller(request: Request[Any, Any, Any]) -> Tenant | None:
        """The tenant of the request's key; None when the gate is off or the path is public and no known key came
        (then nothing is restricted)."""
        gate = app.proxy.gate
        return gate.tenant_of(request.headers.get("authorization", "").encode()) if gate.on else None

    def allowed(request: Request[Any, Any, Any], entries: dict[str, dict[str, object]]) -> dict[str, dict[str, object]]:
        """The entries the caller's tenant may use (its ``models`` allow-list; all without one, or for a caller
        without a key on a public path)."""
        tenant = caller(request)
        if tenant is None or tenant.models is None:
            return entries
        return {k: e for k, e in entries.items() if tenant.may_use(k)}

    @get("/v1/models")
    async def models(request: Request[Any, Any, Any]) -> Response[Any]:
        got = await union()
        if got is None:
            return _error(RouterErrorKind.NONE_ROUTABLE, "no ready worker answered /v1/models", cfg.retry_after_s)
        return Response(msgspec.json.encode({"object": "list", "data": list(allowed(request, got[0]).values())}),
                        media_type="application/json", headers={"x-sg-worker-id": got[1]})

    @get("/v1/models/{model_id:path}")
    async def model(request: Request[Any, Any, Any], model_id: str) -> Response[Any]:
        got = await union()
        if got is None:
            return _error(RouterErrorKind.NONE_ROUTABLE, "no ready worker answered /v1/models", cfg.retry_after_s)
        mine = allowed(request, got[0])
        entry = mine.get(model_id.lstrip("/"))
        if entry is None:
            return _error(RouterErrorKind.MODEL_NOT_FOUND, f"The model `{model_id.lstrip('/')}` does not exist. "
                          f"Served models: {', '.join(sorted(mine)) or '(none)'}")
        return Response(msgspec.json.encode(entry), media_type="application/json",
                        headers={"x-sg-worker-id": got[1]})

    async def lora(request: Request[Any, Any, Any]) -> Response[bytes]:
        if not cfg.allow_runtime_lora:
            return _error(RouterErrorKind.ROUTE_DISABLED, f"{request.url.path} is off; start the router with "
                          "--allow-runtime-lora (and the vLLM workers with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)")
        body = await request.body()
        why = lora_refusal(caller(request), body)  # before anything about the workers is said
        if why is not None:
            return _error(*why)
        try:
            chosen = parse_workers(request.query_params.get("workers"), state.num_workers)
        except ValueError as e:
            raise HTTPException(status_code=400, detail=str(e)) from None
        ks = chosen if chosen is not None else state.routable_workers()
        if not ks:
            return _error(RouterErrorKind.NONE_ROUTABLE, "no worker is ready", cfg.retry_after_s)
        status, body = await fan_out(pool, served, ks, request.url.path, body, state.pid_of)
        return Response(body, status_code=status, media_type="application/json")

    @post("/v1/load_lora_adapter", status_code=200)
    async def load_lora(request: Request[Any, Any, Any]) -> Response[bytes]:
        return await lora(request)

    @post("/v1/unload_lora_adapter", status_code=200)
    async def unload_lora(request: Request[Any, Any, Any]) -> Response[bytes]:
        return await lora(request)

    @get("/debug/decisions")
    async def decisions(request: Request[Any, Any, Any]) -> list[dict[str, Any]]:
        most = cfg.debug_ring * cfg.processes
        raw = request.query_params.get("limit")
        n = min(DECISIONS_LIMIT, most) if raw is None else _decisions_limit(raw, most)
        tenant = caller(request)
        mine = None if tenant is None or tenant.operator else tenant.name  # None: every tenant's, whole
        items = [e for e in state.decisions if mine is None or e[2] == mine][-n:]
        own = [{"time": t, "request_id": rid, "tenant": who, **d.to_dict()} for t, rid, who, d in reversed(items)]
        if mine is not None:  # the candidates' load and the prefix index are every tenant's traffic
            own = [decision_view(d) for d in own]
        if cfg.processes == 1:
            return own
        if request.query_params.get("scope") == SCOPE_PROCESS:
            return [{**d, "process": cfg.process_index} for d in own]
        each = min(n, cfg.debug_ring)  # what one sibling holds
        return merge_decisions(own, cfg.process_index, await fetch_siblings(cfg, f"/debug/decisions?limit={each}",
                                                                       request.headers.get("authorization")), n)

    return Litestar(route_handlers=[health, ready, metrics_endpoint, host_metrics, models, model, decisions,
                                    load_lora, unload_lora],
                    debug=False, logging_config=None, cors_config=app.cors,
                    exception_handlers={HTTPException: _openai_http_error, Exception: _internal_error})


DECISIONS_LIMIT = 50  # /debug/decisions without ?limit=: the 50 most recent decisions

def _decisions_limit(raw: str, most: int) -> int:
    """``?limit=`` of ``/debug/decisions``: a positive integer (decimal digits) up to ``most``, the decisions the
    router keeps (its ring, times the processes of a group). Raises :class:`HTTPException` 400 naming the parameter
    and what it accepts (Litestar's own message says only "Validation failed"), for a number above ``most`` too:
    no more can be shown, and a 20-digit limit is a mistake, not a request for everything."""
    digits = raw.lstrip("0") if raw.isascii() and raw.isdigit() else ""
    n = int(digits) if 0 < len(digits) <= len(str(most)) else 0
    if not 0 < n <= most:
        raise HTTPException(status_code=400, detail=f"query parameter 'limit' must be a positive integer up to "
                            f"{most} (the number of most recent decisions; the router keeps the last {most}; "
                            f"default {DECISIONS_LIMIT}), got {raw[:40]!r}")
    return n


_HTTP_CODES = {400: "invalid_request", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed"}


def _openai_http_error(request: Request[Any, Any, Any], exc: HTTPException) -> Response[bytes]:
    """Litestar's own errors (unknown path, bad query parameter, …) in the OpenAI error shape, no internals."""
    status = exc.status_code
    code = _HTTP_CODES.get(status, "internal_error" if status >= 500 else "invalid_request")
    message = "internal error" if status >= 500 else (
        f"no route {request.method} {request.url.path}" if status == 404 else str(exc.detail))
    body = openai_error_body(message, "server_error" if status >= 500 else "invalid_request_error", code)
    headers = exc.headers if status < 500 else None
    if status == 405:  # the proxy's words, and an Allow that lists HEAD where GET is (RFC 9110 §15.5.6)
        got = {k.lower(): v for k, v in (headers or {}).items()}.get("allow", "")
        methods = {m.strip() for m in got.split(",") if m.strip()}
        allow = ", ".join(sorted(methods | ({"HEAD"} if "GET" in methods else set())))
        headers = {"allow": allow}
        body = openai_error_body(f"{request.method} is not allowed on {request.url.path} (allowed: {allow})",
                                 "invalid_request_error", code)
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def _internal_error(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    """Any other exception in a local route: logged with its traceback, answered without internals."""
    log.error("internal error handling %s %s", request.method, request.url.path, exc_info=exc)
    return Response(error_body(RouterErrorKind.INTERNAL, "internal error"), status_code=500,
                    media_type="application/json")


__all__ = ["DECISIONS_LIMIT", "RouterParts", "build_local_app"]
