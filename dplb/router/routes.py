"""The router's endpoint table: which of vLLM's OpenAI-server routes are proxied, answered locally, fanned out to
every worker, or deliberately not routed (and why). ``tests/test_routes.py`` derives vLLM's own route table and
fails when vLLM serves a route that is in none of these sets.

Contract
- :data:`PROXY_ROUTES`: ``(method, path)`` → :class:`Route`; routed to one worker by the policy (same scoring,
  ``X-SG-Worker-ID``, byte-exact body, streamed back unchanged). ``path`` may contain one ``{response_id}``
  segment (matched by :func:`match`).
- :data:`LOCAL_ROUTES`: answered by the router itself; :data:`FANOUT_ROUTES`: sent to every selected worker
  (``--allow-runtime-lora``); :data:`NOT_ROUTED`: vLLM routes the router does not serve, each with the reason.
- Request bodies: ``json`` (``Content-Type`` JSON or absent), ``multipart`` (``multipart/form-data``, audio uploads;
  the ``model`` form field is read for model filtering, the prefix key is none), ``none`` (GET).
- :class:`ResponseIds` remembers which worker created which ``/v1/responses`` id (with ``--tenants``, also which
  tenant: :mod:`dplb.router.ownership`), and shares it with every router process on the segment through the
  response-id rings (:mod:`dplb.state.response_rings`).
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from dplb.native import mypyc_attr
from dplb.state.response_rings import NO_TENANT, ResponseRing, entry_value, id_key, value_worker


@dataclass(frozen=True, slots=True)
class Route:
    """One proxied route. ``body``: "json" | "multipart" | "none"; ``op``: the gen_ai operation name (traces);
    ``pinned``: the worker is the one that created the response named in the path (``/v1/responses/{id}``)."""

    path: str
    body: str = "json"
    op: str = "chat"
    pinned: bool = False


_JSON_POST = {
    "/v1/chat/completions": "chat", "/v1/completions": "text_completion", "/v1/embeddings": "embeddings",
    "/v1/responses": "chat", "/pooling": "embeddings", "/classify": "embeddings", "/score": "embeddings",
    "/v1/score": "embeddings", "/rerank": "embeddings", "/v1/rerank": "embeddings", "/v2/rerank": "embeddings",
    "/v2/embed": "embeddings", "/tokenize": "tokenize", "/detokenize": "tokenize", "/v1/messages": "chat",
    "/v1/messages/count_tokens": "tokenize", "/v1/chat/completions/batch": "chat",
    "/v1/chat/completions/render": "tokenize", "/v1/completions/render": "tokenize",
    "/v1/messages/render": "tokenize", "/v1/responses/render": "tokenize",
    "/v1/chat/completions/derender": "tokenize", "/v1/completions/derender": "tokenize",
    "/inference/v1/generate": "text_completion", "/generative_scoring": "embeddings", "/v1/systemone": "chat",
    "/invocations": "chat",
}
PROXY_ROUTES: dict[tuple[str, str], Route] = {
    **{("POST", p): Route(p, "json", op) for p, op in _JSON_POST.items()},
    ("POST", "/v1/audio/transcriptions"): Route("/v1/audio/transcriptions", "multipart", "transcription"),
    ("POST", "/v1/audio/translations"): Route("/v1/audio/translations", "multipart", "translation"),
    ("GET", "/v1/responses/{response_id}"): Route("/v1/responses/{response_id}", "none", "chat", True),
    ("POST", "/v1/responses/{response_id}/cancel"): Route("/v1/responses/{response_id}/cancel", "none", "chat",
                                                           True),
}
# PROXY_ROUTES by path, then method (match: no (method, path) key tuple made and hashed per request).
_BY_PATH: Final[dict[str, dict[str, Route]]] = {
    path: {m: r for (m, p), r in PROXY_ROUTES.items() if p == path} for (_, path) in PROXY_ROUTES}
#: Every proxied path (exact paths; the ``{response_id}`` ones are matched by prefix in :func:`match`).
PROXY_PATHS = frozenset(p for (_, p) in PROXY_ROUTES if "{" not in p)
RESPONSES_PREFIX = "/v1/responses/"
LOCAL_ROUTES = frozenset({("GET", "/health"), ("GET", "/ready"), ("GET", "/metrics"), ("GET", "/v1/models"),
                          ("GET", "/v1/models/{model}"), ("GET", "/debug/decisions"), ("GET", "/metrics/host")})
FANOUT_ROUTES = frozenset({("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter")})
NOT_ROUTED: dict[str, str] = {
    "/openapi.json": "a worker's API docs; the router's surface is this table",
    "/docs": "a worker's API docs", "/docs/oauth2-redirect": "a worker's API docs", "/redoc": "a worker's API docs",
    "/load": "one worker's load; the router publishes every worker's in /metrics and /debug/decisions",
    "/version": "one worker's vLLM version; the router exports dplb_build_info",
    "/kv_event_sources": "per-worker KV event endpoints (disaggregation); not meaningful behind one port",
    "/ping": "SageMaker health check; use /health or /ready",
    "/v1/realtime": "WebSocket: the router proxies HTTP only",
    "/scale_elastic_ep": "elastic expert-parallel administration of one engine",
    "/is_scaling_elastic_ep": "elastic expert-parallel administration of one engine",
    "/inference/v1/abort_requests": "needs the worker of each request id; abort by closing the client connection",
    "/adapters": "SageMaker's adapter API; use /v1/load_lora_adapter (fanned out to every worker)",
    "/adapters/{adapter_name}": "SageMaker's adapter API; use /v1/unload_lora_adapter (fanned out)",
}
_RESP_ID = re.compile(r"[A-Za-z0-9._:\-]{1,256}")


def match(method: str, path: str) -> tuple[Route, str | None] | None:
    """The proxied route for ``method path`` and the response id named in it (None when there is none, or when it is
    not 1..256 of ``[A-Za-z0-9._:-]``: never remembered); None when not proxied."""
    by_method = _BY_PATH.get(path)
    if by_method is not None:
        r = by_method.get(method)
        if r is not None:
            return r, None
    if path.startswith(RESPONSES_PREFIX):
        rest = path[len(RESPONSES_PREFIX):]
        if rest.endswith("/cancel"):
            rid, pattern = rest[: -len("/cancel")], ("POST", "/v1/responses/{response_id}/cancel")
        else:
            rid, pattern = rest, ("GET", "/v1/responses/{response_id}")
        if method == pattern[0]:  # an id the table cannot hold is routed by score; its worker answers the 404
            return PROXY_ROUTES[pattern], rid if _RESP_ID.fullmatch(rid) else None
    return None


def allowed_methods(path: str) -> str:
    """The ``Allow`` header value of a 405 on a proxied ``path`` (RFC 9110 §15.5.6: a 405 must list the target's
    methods), e.g. ``"POST"``; ``"GET"`` / ``"POST"`` for ``/v1/responses/{id}`` / ``…/{id}/cancel``."""
    methods = {m for (m, p) in PROXY_ROUTES if p == path}
    if path.startswith(RESPONSES_PREFIX):
        methods.add("POST" if path.endswith("/cancel") else "GET")
    return ", ".join(sorted(methods))


def is_proxy_path(path: str) -> bool:
    """True when ``path`` belongs to the proxy (any method: the proxy answers 405 for a wrong one)."""
    return path in PROXY_PATHS or path.startswith(RESPONSES_PREFIX)


#: The longest response id remembered (characters): vLLM's are ~40 (``resp_`` + a UUID's hex); a client-chosen
#: ``request_id`` may be any length, and the map holds ``capacity`` of them, so a longer one is not kept.
MAX_ID_CHARS = 256
_ID_RE = re.compile(rb'"id"\s*:\s*"([A-Za-z0-9._:\-]{1,%d})"' % MAX_ID_CHARS)


def response_id(head: bytes) -> str | None:
    """The first ``"id"`` in the first bytes of a ``/v1/responses`` answer (JSON: the response object's own id, its
    first field in vLLM; SSE: the id in ``response.created``), or None."""
    m = _ID_RE.search(head)
    return m.group(1).decode() if m else None


# Subclassed by dplb.router.ownership, which mypyc does not compile (with --tenants only): allowed (dplb.native).
@mypyc_attr(allow_interpreted_subclasses=True)
class ResponseIds:
    """Bounded LRU map response id → the worker that created it (``GET /v1/responses/{id}``, ``…/cancel`` and
    ``previous_response_id`` need that worker: vLLM keeps responses in the memory of the engine that made them),
    shared by every router process on the segment.

    Keyed by :func:`dplb.state.response_rings.id_key` (a 64-bit hash of the id: the module says why, and the odds of
    a collision); each value is a response ring's value word (the worker, and the tenant tag that
    :class:`dplb.router.ownership.OwnedResponseIds` fills in). ``capacity`` ids, oldest forgotten first, of at most
    :data:`MAX_ID_CHARS` characters (a longer one is not kept). ``rings()`` gives this process's response ring (its
    router slot's, None while it has none): every id remembered is appended to it, and the peers' entries are
    replayed into the map — before each :meth:`remember` (so this process's own binding of an id is the newest),
    on a lookup that misses (so the hot path of ordinary requests never reads a ring) and on :meth:`sync` (the
    router's monitor step: a rebinding by a peer reaches a process that still hits its old entry). A forgotten or
    unknown id is routed by the policy like any request (the worker that does not have it answers its own 404)."""

    def __init__(self, capacity: int, rings: Callable[[], ResponseRing | None] | None = None) -> None:
        self.capacity = capacity
        self._map: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._rings = rings

    def remember(self, response_id: str, worker: int, ex: Any = None) -> None:
        """``worker`` created ``response_id`` (``ex``, the creating request's exchange: its tenant, :meth:`tag`)."""
        if len(response_id) > MAX_ID_CHARS:
            return
        key, value = id_key(response_id), entry_value(worker, self.tag(ex))
        ring = self._rings() if self._rings is not None else None
        if ring is not None:
            self._absorb(ring)
            ring.append(key, value)
        self._put(key, value)

    def tag(self, ex: Any) -> int:
        """The tenant tag remembered for a response created by ``ex``: :data:`NO_TENANT` (without tenants)."""
        return NO_TENANT

    def entry(self, response_id: str) -> int | None:
        """The value word remembered for ``response_id`` (:func:`dplb.state.response_rings.entry_value`), or None:
        the local map first; on a miss, the peers' new ring entries are replayed and the map asked again."""
        key = id_key(response_id)
        m = self._map
        v = m.get(key)
        if v is None and self._rings is not None:
            ring = self._rings()
            if ring is not None and self._absorb(ring):
                v = m.get(key)
        return v

    def worker_of(self, response_id: str) -> int | None:
        """The worker that created ``response_id``, or None when unknown."""
        v = self.entry(response_id)
        return None if v is None else value_worker(v)

    def sync(self) -> None:
        """Replay the peers' new ring entries (the router's monitor step)."""
        ring = self._rings() if self._rings is not None else None
        if ring is not None:
            self._absorb(ring)

    def _absorb(self, ring: ResponseRing) -> bool:
        """Replay ``ring``'s new peer entries into the map; True when there were any."""
        new = ring.drain()
        if not new:
            return False
        for i in range(0, len(new), 2):
            self._put(new[i], new[i + 1])
        return True

    def _put(self, key: int, value: int) -> None:
        m = self._map
        m[key] = value
        m.move_to_end(key)
        if len(m) > self.capacity:
            m.popitem(last=False)

    def __len__(self) -> int:
        return len(self._map)


__all__ = ["FANOUT_ROUTES", "LOCAL_ROUTES", "MAX_ID_CHARS", "NOT_ROUTED", "PROXY_PATHS", "PROXY_ROUTES",
           "ResponseIds", "Route", "is_proxy_path", "match", "response_id"]
