"""The one small interface between a DPLB worker and its inference engine (docs/DESIGN.md §8).

Contract
- An :class:`Engine` serves the OpenAI API as an ASGI app (``engine.app``) or, for out-of-process engines, on the
  worker's Unix socket itself (``engine.serves_uds``); and answers :meth:`Engine.stats` cheaply (no I/O for the sim
  engine, the latest scrape for vLLM), since the collector calls it every ``state_interval_ms``.
- Per-request figures (E2E latency, time to first byte, counts, errors) are measured for every engine the same way,
  by :class:`RequestStatsMiddleware` around the engine's app, and kept in :class:`RequestStats`.
- Every HTTP request on the worker's socket is registered while it is open (:class:`OpenRequest`, in
  :attr:`RequestStats.open` and in ``scope["extensions"]["dplb.request"]``): its ``X-Request-Id``, the client
  process (the router process, by ``SO_PEERCRED``) and whether that client has gone. An engine that can list and
  abort its requests (:class:`Reconcilable`: ``requests()`` and ``abort()``) lets the worker's reconciler find and
  abort orphans (docs/DESIGN.md §8.1).
- A request whose client disconnected is not an engine error: it is counted in ``requests_total``, not in
  ``errors_total``, and gives no latency sample.
- Engine differences stay behind this module: the collector, lifecycle and router never look past it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol

from dplb.errors import openai_error_body, stream_failure
from dplb.runtime.asgi import Message, Receive, Send, send_json
from dplb.runtime.serving import DISCONNECT_EXT

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

LATENCY_WINDOW = 10  # requests: the slot's "last 10 requests" figures (docs/DESIGN.md §3.3)


@dataclass(slots=True)
class EngineStats:
    """What the engine's scheduler says right now. Units: requests, fraction 0–1, tokens; ``kv_total_blocks``:
    the KV cache's capacity in blocks, ``kv_block_size``: tokens per block (0 when the engine does not say);
    ``max_loras``: LoRA adapters one batch can hold (vLLM ``--max-loras``; 0 when LoRA is off or unknown).
    ``progress_total``: a monotone count of the engine's work done (tokens generated + prompt tokens prefilled +
    iterations finished; only its changes matter), meaningful when ``progress_known`` (an engine that cannot tell
    leaves it False, and the router's stall check skips the worker, docs/DESIGN.md §6)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    max_num_seqs: int = 0
    cuda_oom_total: int = 0
    last_prompt_tokens: int = 0
    kv_total_blocks: int = 0
    kv_block_size: int = 0
    progress_total: int = 0
    progress_known: bool = False
    max_loras: int = 0


REQUEST_EXT = "dplb.request"  # scope["extensions"] key of a request's OpenRequest (set by RequestStatsMiddleware)


class OpenRequest:
    """One HTTP request open on the worker's socket: ``xrid`` (its ``X-Request-Id``, or None), ``peer_pid`` (the
    client process on the Unix socket, 0 when unknown), ``t0`` (``time.monotonic()`` at arrival). ``gone`` is True
    once the client's connection was lost before the response completed (the server's disconnect hook, or an
    ``http.disconnect`` the app received); ``closed`` once the app returned. An engine that knows them sets
    ``prompt_token_ids`` (the prompt's token ids, once tokenized) and ``cached_tokens`` (prompt tokens its prefix
    cache served, -1 until known): the worker's KV-event translation reads them (:mod:`dplb.worker.kv_translate`)."""

    __slots__ = ("_hook", "cached_tokens", "closed", "disconnected", "peer_pid", "prompt_token_ids", "t0", "xrid")

    def __init__(self, scope: Scope) -> None:
        xrid = None
        for k, v in scope.get("headers") or ():
            if k == b"x-request-id":
                xrid = v.decode("latin-1")
                break
        self.xrid = xrid
        self._hook: Any = (scope.get("extensions") or {}).get(DISCONNECT_EXT)
        self.peer_pid = int(getattr(self._hook, "peer_pid", 0) or 0)
        self.t0 = time.monotonic()
        self.disconnected = False
        self.closed = False
        self.prompt_token_ids: list[int] | None = None
        self.cached_tokens = -1

    @property
    def gone(self) -> bool:
        """True when the client left before the response completed."""
        return self.disconnected or bool(self._hook is not None and self._hook.gone)

    @property
    def live(self) -> bool:
        """True while the app still serves the request for a client that is still there."""
        return not self.closed and not self.gone


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One request the engine holds now. ``id``: the engine's own id (what :meth:`Reconcilable.abort` takes).
    ``owner``: the :class:`OpenRequest` it serves (the sim knows it), else the engine's external request id (vLLM:
    ``chatcmpl-<X-Request-Id>``, matched against the open requests' ``X-Request-Id``), or None for work that has no
    client by design (a ``background: true`` response). ``t0``: ``time.monotonic()`` when it entered the engine."""

    id: str
    owner: OpenRequest | str | None
    t0: float = 0.0


class Reconcilable(Protocol):
    """An engine whose requests the worker's reconciler can list and abort (docs/DESIGN.md §8.1)."""

    def requests(self) -> list[EngineRequest]:
        """Every request the engine holds now (waiting or running). Cheap; called on the serving loop each tick."""
        ...

    async def abort(self, request_id: str) -> None:
        """Abort engine request ``request_id`` (an :attr:`EngineRequest.id`); no-op when it is already gone."""


class Engine(Protocol):
    """An inference engine behind a worker."""

    name: str

    @property
    def app(self) -> ASGIApp | None:
        """ASGI app serving the OpenAI API and health (None if the engine serves the socket itself)."""
        ...

    async def start(self) -> None:
        """Load the model / start serving. Raises on failure (the worker exits non-zero with the message)."""

    def stats(self) -> EngineStats:
        """Current scheduler state. Must be cheap and must not block for long (called every tick)."""
        ...

    def metrics_text(self) -> bytes:
        """The engine's ``vllm:*`` metrics in Prometheus text format."""
        ...

    async def shutdown(self) -> None:
        """Stop the engine and release its resources. Idempotent."""


class RequestStats:
    """Rolling per-request figures for one worker, written by the middleware, read by the collector thread.

    ``avg_latency_s``/``avg_ttfb_s``: means over the last :data:`LATENCY_WINDOW` (10) completed requests, seconds
    (0 until one completes). TTFB = time to the first response body byte, which is TTFT for streaming requests.
    ``errors_total`` counts responses with status ≥ 500, responses the engine cut short and streams it ended with
    its own 5xx error event (:func:`dplb.errors.stream_failure`: vLLM's engine died under its API server); client
    4xx and requests whose client left first are not worker errors (nor latency samples).
    ``first_request_seconds`` is the E2E of the first request after the worker became ready; ``last_done_mono_ns``
    the CLOCK_MONOTONIC ns at which the last latency sample was taken (0 until one; how old the averages are).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lat: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self._ttfb: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self.requests_total = 0
        self.errors_total = 0
        self.inflight = 0
        self.open: set[OpenRequest] = set()  # every HTTP request open on the socket (serving loop only)
        self.first_request_seconds = 0.0
        self.last_done_mono_ns = 0  # CLOCK_MONOTONIC ns of the last latency sample (0: none yet)
        self.counting_first = False  # set once the worker is ready; the warm-up request is not "first"

    def begin(self) -> None:
        """A request entered the engine."""
        with self._lock:
            self.inflight += 1

    def end(self, e2e_s: float, ttfb_s: float | None, error: bool, gone: bool = False) -> None:
        """A request left the engine after ``e2e_s`` seconds (``ttfb_s`` None if no body byte was sent); ``error``:
        the engine failed it; ``gone``: the client left first (neither an error nor a latency sample)."""
        with self._lock:
            self.inflight -= 1
            self.requests_total += 1
            if error:
                self.errors_total += 1
                return
            if gone or not self.counting_first:
                return  # the warm-up request: not a sample of this worker's latency under real traffic
            self._lat.append(e2e_s)
            self.last_done_mono_ns = time.monotonic_ns()
            if ttfb_s is not None:
                self._ttfb.append(ttfb_s)
            if self.first_request_seconds == 0.0:
                self.first_request_seconds = e2e_s

    def averages(self) -> tuple[float, float]:
        """(mean E2E, mean TTFB) of the last 10 successful requests, seconds; 0.0 when none."""
        with self._lock:
            lat = sum(self._lat) / len(self._lat) if self._lat else 0.0
            tt = sum(self._ttfb) / len(self._ttfb) if self._ttfb else 0.0
        return lat, tt


# Paths that are requests to the model (timed and counted, refused while draining); everything else (health,
# metrics, models, tokenizer and render routes, reading a stored response) is not. Keep in step with the
# generating/pooling routes of dplb.router.routes.
TIMED_PATHS = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/messages", "/pooling",
    "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/v2/embed",
    "/v1/audio/transcriptions", "/v1/audio/translations", "/v1/chat/completions/batch", "/inference/v1/generate",
    "/generative_scoring", "/v1/systemone", "/invocations"})


_DRAINING = openai_error_body("worker is draining; retry on another worker", "service_unavailable", "worker_draining")


class RequestStatsMiddleware:
    """ASGI middleware that times model requests into a :class:`RequestStats` and can refuse new work.

    ``accepting()`` is consulted for every model request: when it returns False (draining) the request is answered
    503 ``{"error": …, "code": "worker_draining"}`` without reaching the engine, so the router retries elsewhere.
    Every HTTP request (model or not) is registered in ``stats.open`` while the app serves it (:class:`OpenRequest`).
    A model request that ends incomplete because its client left is not an error (``errors_total`` counts 5xx
    answers, responses the engine cut short and streams it failed with its own 5xx error event).
    """

    def __init__(self, app: ASGIApp, stats: RequestStats, accepting: Callable[[], bool]) -> None:
        self.app = app
        self.stats = stats
        self.accepting = accepting

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        req = OpenRequest(scope)
        ext = scope.get("extensions")
        scope["extensions"] = {**(ext or {}), REQUEST_EXT: req}

        async def watched_receive() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect":
                req.disconnected = True
            return message

        opened = self.stats.open
        opened.add(req)
        try:
            if scope["path"] in TIMED_PATHS:
                await self._timed(scope, watched_receive, send, req)
            else:
                await self.app(scope, watched_receive, send)
        finally:
            req.closed = True
            opened.discard(req)

    async def _timed(self, scope: Scope, receive: Receive, send: Send, req: OpenRequest) -> None:
        if not self.accepting():
            # x-dplb-draining tells the router nothing was started here, so it may send the request elsewhere.
            await send_json(send, 503, _DRAINING, [(b"x-dplb-draining", b"1"), (b"retry-after", b"1")])
            return
        stats = self.stats
        t0 = time.perf_counter()
        first: list[float] = []
        status = [0]
        complete = [False]
        tail = [b"", b""]  # the last two non-empty body messages (an engine's in-band failure event, then [DONE])

        async def timed_send(message: Message) -> None:
            t = message["type"]
            if t == "http.response.start":
                status[0] = message["status"]
            elif t == "http.response.body":
                body = message.get("body")
                if body:
                    if not first:
                        first.append(time.perf_counter() - t0)
                    tail[0], tail[1] = tail[1], body
                if not message.get("more_body", False):
                    complete[0] = True
            await send(message)

        stats.begin()
        try:
            await self.app(scope, receive, timed_send)
        finally:
            e2e = time.perf_counter() - t0
            gone = not complete[0] and req.gone
            failed = status[0] >= 500 or (not complete[0] and not gone) or (
                complete[0] and stream_failure(tail[0] + tail[1]) is not None)
            stats.end(e2e, first[0] if first else None, failed, gone)
