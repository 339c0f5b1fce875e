"""The router's local routes: one Litestar app for ``/health``, ``/ready``, ``/metrics``, ``/metrics/host``,
``/v1/models``, ``/v1/models/{model}``, the LoRA fan-out and ``/debug/decisions`` (the contract of each is in
:mod:`dplb.router.app`'s docstring), and Litestar's own errors in the OpenAI shape.

Contract: :func:`build_local_app` reads the router's parts (:class:`RouterParts`: state, config, metrics, pool,
served models, host report, the proxy's tenant gate, CORS) from the router it is given; it owns no state. A wrong
method is 405 ``method_not_allowed`` naming the allowed methods, with an ``Allow`` that lists ``HEAD`` beside
``GET``; an unknown path 404 ``not_found``; any other exception a logged 500 ``internal_error`` without internals.

Tenant isolation (:func:`caller`): a tenant with a ``models`` allow-list sees only its models in ``/v1/models``,
``/v1/models/{model}`` and their 404, and may load or unload through the fan-out only an adapter its list names
(403 ``model_not_allowed``); ``/debug/decisions`` shows a tenant's key only its own tenant's decisions, without
the fields drawn from the prefix index every tenant shares (:func:`without_prefix`: they would say whether another
tenant sent a prompt), while ``--api-key``'s key (tenant ``default``) and a router without keys see every
tenant's, whole.
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
from dplb.router.fanout import fan_out, lora_name, parse_workers
from dplb.router.host_report import HostReporter
from dplb.router.models import ServedModels
from dplb.router.proxy import Proxy
from dplb.router.siblings import SCOPE_PROCESS, fetch_siblings, merge_decisions, merge_metrics
from dplb.router.state import RouterState
from dplb.router.upstream import UpstreamPool
from dplb.tenants import DEFAULT_TENANT, Tenant

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
            return _error(RouterErrorKind.NONE_ROUTABLE, "no worker is ready" + (
                f"; requests are served by panic routing among workers {panic} on heartbeat probation"
                if panic else ""), cfg.retry_after_s)
        return Response({"ready": True, "routable_workers": ws, "shm_segment_present": state.segment is not None})

    @get("/metrics")
    async def metrics_endpoint(request: Request[Any, Any, Any]) -> Response[bytes]:
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
    def host_metrics() -> Response[bytes]:
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
        try:
            chosen = parse_workers(request.query_params.get("workers"), state.num_workers)
        except ValueError as e:
            raise HTTPException(status_code=400, detail=str(e)) from None
        ks = chosen if chosen is not None else state.routable_workers()
        if not ks:
            return _error(RouterErrorKind.NONE_ROUTABLE, "no worker is ready", cfg.retry_after_s)
        body = await request.body()
        tenant = caller(request)
        if tenant is not None and tenant.models is not None:
            name = lora_name(body)
            if not tenant.may_use(name):
                return _error(RouterErrorKind.MODEL_NOT_ALLOWED, f"tenant {tenant.name} may load or unload only "
                              f"the adapters its models list names ({', '.join(sorted(tenant.models))}), not "
                              f"`{name}`")
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
        mine = None if tenant is None or tenant.name == DEFAULT_TENANT else tenant.name  # None: every tenant's
        items = [e for e in state.decisions if mine is None or e[2] == mine][-n:]
        own = [{"time": t, "request_id": rid, "tenant": who, **d.to_dict()} for t, rid, who, d in reversed(items)]
        if mine is not None:  # the prefix index is every tenant's: its view would tell of other tenants' prompts
            own = [without_prefix(d) for d in own]
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

#: The decision fields drawn from the prefix index all tenants share (``dplb.policy.decision.Decision.to_dict``):
#: the worker that held the longest match and the hit/spill/miss outcome; per candidate every ``prefix_*`` input,
#: the ``prefix`` term and the score it is part of.
_PREFIX_FIELDS = ("preferred", "prefix_outcome")


def without_prefix(entry: dict[str, Any]) -> dict[str, Any]:
    """A ``/debug/decisions`` entry (``Decision.to_dict`` plus time, request id, tenant) without what the shared
    prefix index says (:data:`_PREFIX_FIELDS`): shown to a tenant's key, those told whether any other tenant had
    sent the same prompt (a miss, then a hit on the worker another tenant used). The weights stay (configuration)."""
    out = {k: v for k, v in entry.items() if k not in _PREFIX_FIELDS}
    cands = []
    for c in entry.get("candidates") or ():
        cand = {k: v for k, v in c.items() if not k.startswith("prefix") and k != "score"}
        if isinstance(c.get("terms"), dict):
            cand["terms"] = {k: v for k, v in c["terms"].items() if k != "prefix"}
        cands.append(cand)
    out["candidates"] = cands
    return out


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


__all__ = ["DECISIONS_LIMIT", "RouterParts", "build_local_app", "without_prefix"]
