"""One upstream attempt of a proxied request (Envoy's ``UpstreamRequest`` is the model): connect to the chosen
worker, send the request, relay the response head and body to the client, and account for how it ended.

Contract
- :class:`Attempt` goes ``open`` → ``send`` → ``await_head`` → ``relay_body`` → ``settle``; each step that ends
  the attempt sets its :class:`dplb.router.health.Outcome`, and ``settle`` (always run) acts on that outcome alone: the
  connection goes back to the pool or is aborted (:attr:`Outcome.reusable`), the router's state hears it once
  (:meth:`dplb.router.state.RouterState.report`: worker health and the policy's latency baseline), and the
  duration is recorded under :attr:`Outcome.recorded`. The in-flight count of the worker is held for the whole
  attempt.
- :meth:`Attempt.run` returns the error kind to retry on another worker for, or None when the request is done
  (answered, or the client left). Only an attempt that produced nothing is retried: a connect failure (no request
  byte sent) or the worker's ``503 worker_draining`` refusal (:data:`RETRY`).
- A request whose connection ended with it undelivered, before one response byte (:class:`dplb.errors.
  UndeliveredRequest`: an idle keep-alive close that crossed it, a dying worker) reached no engine: on a pooled
  connection it is sent again, once, on a new one to the same worker (counted, noted on the decision:
  :meth:`Attempt.undelivered`); on a new connection, or when the worker refuses one, the attempt is ``UNREACHABLE``
  (retried on another worker). Never after a response byte.
- A worker that breaks off mid-response: an SSE stream gets a final ``data: {"error": …}`` event and is left
  without its terminating chunk (the server closes the connection abnormally); other bodies are cut. A client that
  leaves makes the attempt abort the worker connection (the engine aborts the request).
- A stream the worker itself ends with a 5xx error event (:func:`dplb.errors.stream_failure`: vLLM's engine died
  under its API server, which sends the event, then ``data: [DONE]``, then a clean end) is relayed unchanged — the
  worker's own answer — and accounted as :attr:`Outcome.FAILED_STREAM`. The relay only keeps a reference to each
  of the last two chunks; they are looked at once, when the response completes (:meth:`Attempt.stream_end`).
- :class:`Upstreams` is what every attempt of a router process shares (configuration, pool, state, metric
  children) and the router's own error responses (:meth:`Upstreams.reject`).
- Tracing is the request's hooks (:mod:`dplb.obs.tracing`) called on this same path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any, Final

from dplb.config import RouterConfig
from dplb.errors import (
    WWW_AUTHENTICATE,
    ConnectFailed,
    RouterErrorKind,
    UndeliveredRequest,
    UpstreamClosed,
    UpstreamError,
    UpstreamTimeout,
    error_body,
    stream_failure,
    worker_stalled_message,
)
from dplb.obs.fastmetrics import HistogramChild
from dplb.obs.tracing import NO_TRACE
from dplb.router.exchange import Exchange, response_headers
from dplb.router.health import UNREACHABLE_S, Outcome
from dplb.router.routes import ResponseIds, response_id
from dplb.router.state import RouterState
from dplb.router.upstream import UpstreamConn
from dplb.router.upstream_pool import UpstreamPool

log = logging.getLogger("dplb.router.proxy")
# Read per request: module constants (compiled, a C static instead of a module-dict and an attribute lookup; an enum
# member is read through the enum class's __getattr__ hook, ~4x a plain class attribute, in either build).
_perf_counter: Final = time.perf_counter
_NO_ANSWER: Final = Outcome.NO_ANSWER
_DRAINING: Final = Outcome.DRAINING
_BROKEN: Final = Outcome.BROKEN
_FAILED_STREAM: Final = Outcome.FAILED_STREAM
_of_status: Final = Outcome.of_status
_NO_TRACE: Final = NO_TRACE
_KEEPALIVE: Final = b": keep-alive\n\n"
_ERROR_KEY: Final = b'"error"'  # in an SSE error event (dplb.errors.stream_failure parses it)
_CAPTURE_MAX: Final = 65536  # bytes of an answer searched for its response id
# Rejections answered before the request body was read.
_BODY_UNREAD: Final = frozenset({RouterErrorKind.UNAUTHORIZED, RouterErrorKind.METHOD_NOT_ALLOWED,
                          RouterErrorKind.UNSUPPORTED_MEDIA, RouterErrorKind.BODY_TOO_LARGE,
                          RouterErrorKind.UNSUPPORTED_ENCODING})
# The outcomes retried on another worker (nothing was generated) and the error kind each is answered with when no
# other worker can take the request.
RETRY: Final = {Outcome.UNREACHABLE: RouterErrorKind.UPSTREAM_UNREACHABLE,
                Outcome.DRAINING: RouterErrorKind.NONE_ROUTABLE}


class Upstreams:
    """What every attempt of one router process shares: ``cfg``, ``state``, ``pool``, ``response_ids`` and the
    per-worker ``X-SG-Worker-ID`` values and metric children (looked up once)."""

    def __init__(self, cfg: RouterConfig, state: RouterState, pool: UpstreamPool, response_ids: ResponseIds) -> None:
        self.cfg = cfg
        self.state = state
        self.pool = pool
        self.response_ids = response_ids
        self.metrics = state.metrics
        n = state.num_workers
        self.worker_ids = [str(k).encode() for k in range(n)]
        self.ttfb: list[HistogramChild] = [self.metrics.upstream_ttfb.labels(str(k)) for k in range(n)]
        self._durations: list[dict[str, HistogramChild]] = [{} for _ in range(n)]  # per worker, by outcome label
        #: Called with (scope, response headers) before a worker's response head is relayed (the ORCA load report:
        #: :mod:`dplb.router.orca`); it may append headers (the direct relay passes an empty list: what the hook
        #: appends goes after the worker's headers and the router's, as on the ASGI path).
        self.on_response_head: Callable[[dict[str, Any], list[tuple[bytes, bytes]]], None] | None = None

    def duration(self, worker: int, label: str) -> HistogramChild:
        """The ``dplb_upstream_request_duration_seconds`` child of ``worker`` and outcome ``label``."""
        children = self._durations[worker]
        child = children.get(label)
        if child is None:
            child = children[label] = self.metrics.upstream_duration.labels(str(worker), label)
        return child

    async def reject(self, ex: Exchange, kind: RouterErrorKind, message: str, worker: int | None = None, *,
                     retry_after: int | None = None, extra_headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
        """Answer ``ex`` with one of the router's own errors: OpenAI-shaped JSON with ``kind``'s status,
        ``Retry-After`` on 503/429 and ``worker_stalled`` (``retry_after`` seconds, else ``--retry-after``),
        ``X-SG-Worker-ID`` when a worker is named, the ORCA load report when the request asks for one (the hook
        :attr:`on_response_head`: a host that has no routable worker or drains answers only such errors, and they
        carry its utilization ≥ 1 to Envoy), then ``extra_headers``; closes the connection when the request body was
        not read."""
        if kind is RouterErrorKind.REQUEST_TIMEOUT:  # the edge answered (and counted) it and closed: record the 408
            ex.status = kind.status
            return
        self.metrics.rejected.labels(kind.code).inc()
        if kind is RouterErrorKind.CLIENT_CLOSED:  # nobody to answer: record the 499, send nothing
            ex.status = kind.status
            return
        body = error_body(kind, message)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"x-request-id", ex.rid)]
        if kind.status in (503, 429) or kind is RouterErrorKind.WORKER_STALLED:
            wait = self.cfg.retry_after_s if retry_after is None else retry_after
            headers.append((b"retry-after", str(wait).encode()))
        if worker is not None:
            headers.append((b"x-sg-worker-id", self.worker_ids[worker]))
        if self.on_response_head is not None:
            self.on_response_head(ex.scope, headers)
        if kind is RouterErrorKind.UNAUTHORIZED:
            headers.append(WWW_AUTHENTICATE)
        if kind in _BODY_UNREAD:
            # Close instead of keep-alive: uvicorn would otherwise read and discard the rest of the body, however
            # large (a 100 MB upload was consumed whole after its 413); the server's lingering close discards it only
            # up to a bound (dplb.runtime.conn_timer), so that a client still uploading gets to read this answer.
            headers.append((b"connection", b"close"))
        headers += extra_headers
        ex.status = kind.status
        await ex.send({"type": "http.response.start", "status": kind.status, "headers": headers})
        await ex.send({"type": "http.response.body", "body": body})


class Attempt:
    """One attempt of ``ex`` on ``worker``: ``conn`` (None until open), ``status`` (the worker's, 0 until its head
    came), ``outcome`` (how it ended so far), ``t0`` (``perf_counter`` seconds when connected), ``t_first`` (at the
    first body byte, or None), ``sent`` (the request head written, b"": ``ex.head``, as the direct relay writes it)."""

    __slots__ = ("conn", "ex", "is_sse", "outcome", "sent", "stalled", "status", "t0", "t_first", "up", "worker")

    def __init__(self, up: Upstreams, ex: Exchange, worker: int) -> None:
        self.up = up
        self.ex = ex
        self.worker = worker
        self.conn: UpstreamConn | None = None
        self.status = 0
        self.outcome = _NO_ANSWER  # an attempt cut short before the response head (e.g. by an exception)
        self.t0 = 0.0
        self.t_first: float | None = None
        self.is_sse = False
        self.stalled = False  # cut by the router: the worker's engine stalled (cut_stalled)
        self.sent = b""

    def cut_stalled(self) -> bool:
        """Fail this attempt now because its worker stalled (:mod:`dplb.policy.stall`): the worker connection is
        aborted, and the attempt answers 504 ``worker_stalled`` (before the response head) or ends an SSE stream with
        that error event. True the first time (the caller counts it)."""
        if self.stalled:
            return False
        self.stalled = True
        if self.conn is not None:
            self.conn.abort()
        return True

    async def run(self) -> RouterErrorKind | None:
        """The whole attempt; returns the error kind to retry elsewhere for (:data:`RETRY`), or None when done."""
        self.up.state.acquire(self.worker, self)
        return await self._complete(self._open_and_send())

    async def resume(self) -> RouterErrorKind | None:
        """The rest of an attempt whose request was sent by the direct relay (:mod:`dplb.router.direct`), which
        stopped before relaying the response head (a timeout, a close, a draining refusal): what :meth:`run`
        returns."""
        return await self._complete(self._open_and_send() if self.conn is None else None)

    async def _complete(self, first: Coroutine[Any, Any, bool] | None) -> RouterErrorKind | None:
        """After ``first`` (open and send; None when already sent): the head, the body, then :meth:`settle` on every
        path."""
        may_retry = False
        try:
            if (first is None or await first) and await self.await_head():
                await self.relay_body()
            may_retry = True  # not cut short by an exception
        finally:
            retry = self.settle(may_retry)
        return retry

    def settle(self, may_retry: bool) -> RouterErrorKind | None:
        """The attempt is over; account for it by its outcome: pool or abort the connection, report to the state,
        record the duration; then (even when that raises) close the trace's attempt span and release the worker.
        ``may_retry``: whether a retry elsewhere is looked up (False when an exception cut the attempt short, and
        for the direct relay, which settles only once the response started or the client left). Returns the error
        kind to retry elsewhere for (:data:`RETRY`), or None. The ASGI path's attempts and the direct relay's
        (:mod:`dplb.router.direct`) end here."""
        ex, up, outcome, conn = self.ex, self.up, self.outcome, self.conn
        retry = None
        try:
            if conn is not None:
                ex.conn = None
                if outcome.reusable:
                    up.pool.release(conn)  # complete response: kept if the connection is keep-alive
                else:
                    conn.abort()
            if ex.tenant is not None:  # the last attempt decides what the tenant's ledger counts
                ex.tenant.failed = outcome.failed
            end = _perf_counter()
            t_first = self.t_first
            up.state.report(self.worker, outcome, end - ex.t_start, None if t_first is None else t_first - ex.t_start)
            label = outcome.recorded
            if label is not None:  # (the hot path: no call of the no-op trace's exemplar, None)
                trace = ex.trace
                up.duration(self.worker, label).observe(end - self.t0,
                                                        None if trace is _NO_TRACE else trace.exemplar())
            if may_retry:
                retry = RETRY.get(outcome)
        finally:
            if ex.trace is not _NO_TRACE:  # (the hot path: no call for the no-op hook)
                ex.trace.attempt_done(retry)
            up.state.release(self.worker, self)
        return retry

    async def _open_and_send(self) -> bool:
        """Connect and send the request; False when the attempt ends here (its outcome set)."""
        ex = self.ex
        route = ex.route
        assert route is not None
        head = ex.trace.attempt(ex.head, self.worker, route.op, ex.peek.model)
        return await self.open() and await self.send(head)

    async def open(self, fresh: bool = False) -> bool:
        """Connect to the worker (pooled or new; ``fresh``: new); False when it cannot be reached (outcome
        ``UNREACHABLE``)."""
        pool = self.up.pool
        try:
            self.conn = await (pool.connect(self.worker) if fresh else pool.open(self.worker))
        except ConnectFailed as e:
            log.warning("worker %d unreachable before sending (%s); skipping it for %.0f s and retrying on another "
                        "worker", self.worker, e, UNREACHABLE_S)
            self.outcome = Outcome.UNREACHABLE
            return False
        self.ex.conn = self.conn  # aborted by the disconnect watcher
        self.t0 = _perf_counter()
        return True

    async def send(self, head: bytes) -> bool:
        """Send the request (``head`` ends with its blank line); False when the attempt ends before it (the client
        left, or the worker stalled while connecting: answered 504 ``worker_stalled``)."""
        ex, conn = self.ex, self.conn
        assert conn is not None
        if ex.gone:  # the client left before this attempt (between a retry's two attempts)
            self.outcome = Outcome.CLIENT_LEFT_EARLY
            return False
        if self.stalled:  # cut while connecting
            self.outcome = Outcome.STALLED
            await self.up.reject(ex, RouterErrorKind.WORKER_STALLED, self._stall_message(), self.worker)
            return False
        self.sent = head
        conn.send_request(head, ex.body)
        return True

    async def undelivered(self, reason: str) -> bool:
        """The connection ended with the request undelivered (``reason``: :data:`dplb.errors.RESEND_REASONS`). A
        pooled one: counted in ``dplb_upstream_resends_total``, the decision's ``resent`` set, the request sent again
        on a new connection to the same worker and its head awaited (:meth:`await_head`'s result). A new one (the
        worker is going away): outcome ``UNREACHABLE``, False, as when that worker refuses the new connection."""
        ex, up = self.ex, self.up
        if self.conn is None or not self.conn.reused:
            log.warning("worker %d: a new connection ended with request %s undelivered (%s); retrying on another "
                        "worker", self.worker, ex.rid.decode(), reason)
            self.outcome = Outcome.UNREACHABLE
            return False
        up.metrics.resends.labels(reason).inc()
        ex.decision.resent = reason
        log.info("worker %d: the pooled connection ended before answering request %s (%s); sending it again on a "
                 "new connection", self.worker, ex.rid.decode(), reason)
        self.conn.abort()
        self.conn = ex.conn = None
        return await self.open(fresh=True) and await self.send(self.sent or ex.head) and await self.await_head()

    async def await_head(self) -> bool:
        """Wait for the worker's response head and relay it; True when the body follows. A timeout or a close
        before the head is answered with the router's own error."""
        ex, up, conn, worker = self.ex, self.up, self.conn, self.worker
        assert conn is not None
        try:
            status, up_headers = await conn.response_head(up.cfg.first_byte_timeout_s)
        except UpstreamTimeout as timeout:  # one name per class: compiled, a name is one typed variable
            self.outcome = Outcome.TIMEOUT
            conn.abort()
            await self.no_head(RouterErrorKind.UPSTREAM_TIMEOUT, f"worker {worker}: {timeout}")
            return False
        except UpstreamClosed as e:
            if ex.gone:
                self.outcome = Outcome.CLIENT_LEFT_EARLY
                return False
            if self.stalled:
                self.outcome = Outcome.STALLED
                await up.reject(ex, RouterErrorKind.WORKER_STALLED, self._stall_message(), worker)
                return False
            if isinstance(e, UndeliveredRequest):  # reached no engine
                return await self.undelivered(e.reason)
            log.warning("worker %d closed the connection before answering request %s (%s)", worker,
                        ex.rid.decode(), e)
            await self.no_head(RouterErrorKind.UPSTREAM_FAILED, f"worker {worker} closed the connection before "
                               "answering")
            return False
        out = self.accept_head(status, up_headers)
        return out is not None and await self.start_response(status, out)

    def accept_head(self, status: int, up_headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]] | None:
        """The worker's response head arrived: time to first byte recorded, the headers for the client (the ORCA
        hook may add some); None for a ``503 worker_draining`` refusal (outcome ``DRAINING``: nothing was generated,
        safe to send elsewhere)."""
        up, worker = self.up, self.worker
        up.ttfb[worker].observe(_perf_counter() - self.t0)
        out, self.is_sse, draining = response_headers(up_headers, up.worker_ids[worker], self.ex.rid)
        if up.on_response_head is not None:
            up.on_response_head(self.ex.scope, out)
        if status == 503 and draining:
            self.outcome = _DRAINING
            return None
        return out

    async def start_response(self, status: int, headers: list[tuple[bytes, bytes]]) -> bool:
        """Relay the worker's response head (``status``, ``headers`` for the client) to the client; True: the body
        follows."""
        if self.ex.tenant is not None:  # x-ratelimit-* headers, usage metering (dplb.router.tenancy)
            self.ex.tenant.head(status, headers, self.is_sse)
        self.status = self.ex.status = status
        await self.ex.send({"type": "http.response.start", "status": status, "headers": headers})
        self.outcome = _BROKEN  # from here on, a relay that does not complete is a broken response
        return True

    async def no_head(self, kind: RouterErrorKind, message: str) -> None:
        """The worker gave no response head (timeout, or it closed the connection): answer the router's error."""
        await self.up.reject(self.ex, kind, message, self.worker)

    async def relay_body(self) -> None:
        """Relay the body chunk by chunk as it arrives (``: keep-alive`` comments between SSE events after
        ``sse_keepalive_s`` of silence), then end the response."""
        ex, conn, cfg = self.ex, self.conn, self.up.cfg
        assert conn is not None
        capture = self._capture_start()
        keepalive = cfg.sse_keepalive_s if self.is_sse else 0.0
        try:
            if capture is None and not keepalive and ex.tenant is None:
                prior, last = await self._relay_plain(conn.chunks(cfg.idle_timeout_s))
            else:
                prior, last = await self._relay_hooked(conn.chunks(cfg.idle_timeout_s, keepalive), capture, keepalive)
        except UpstreamError as e:
            await self._broken(e)
            return
        if ex.gone:
            self.outcome = Outcome.CLIENT_LEFT
            return
        await ex.send({"type": "http.response.body", "body": b"", "more_body": False})
        self.outcome = self.stream_end(prior, last)

    def stream_end(self, prior: bytes, last: bytes) -> Outcome:
        """The outcome of a response the worker completed, whose last two body chunks were ``prior`` and ``last``:
        :attr:`Outcome.FAILED_STREAM` (logged) when it is a stream the worker ended with its own 5xx error event,
        else by its status."""
        status = self.status
        if self.is_sse and status < 300 and (_ERROR_KEY in last or _ERROR_KEY in prior):  # (no copy when absent)
            why = stream_failure(prior + last)
            if why is not None:
                log.warning("worker %d failed stream %s with its own error event (%s); relayed as it is, counted as "
                            "an upstream error", self.worker, self.ex.rid.decode(), why)
                return _FAILED_STREAM
        return _of_status(status)

    async def _relay_plain(self, chunks: AsyncIterator[bytes]) -> tuple[bytes, bytes]:
        """The body loop when no feature looks at the chunks: each one is sent as it came (the common case, kept
        to the few operations per chunk it needs). Returns the last two chunks (for :meth:`stream_end`)."""
        ex = self.ex
        send = ex.send
        prior = last = b""
        async for chunk in chunks:
            if ex.gone:
                break
            if self.t_first is None:
                self.t_first = _perf_counter()
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            prior = last
            last = chunk
        return prior, last

    async def _relay_hooked(self, chunks: AsyncIterator[bytes], capture: bytes | None,
                            keepalive: float) -> tuple[bytes, bytes]:
        """The body loop with keep-alive comments, the response-id capture and the tenant's meter. Returns the
        last two chunks the worker sent (for :meth:`stream_end`)."""
        ex = self.ex
        send = ex.send
        at_boundary = True  # a keep-alive comment may only go between SSE events
        prior = last = b""
        async for chunk in chunks:
            if ex.gone:
                break
            if not chunk:
                if at_boundary:
                    await send({"type": "http.response.body", "body": _KEEPALIVE, "more_body": True})
                continue
            if self.t_first is None:
                self.t_first = _perf_counter()
            prior = last
            last = chunk
            if ex.tenant is not None and not (chunk := ex.tenant.chunk(chunk)):
                continue  # held back until its SSE event is complete (dplb.router.usage)
            if capture is not None:
                capture = self._capture_id(capture + chunk)
            if keepalive:
                at_boundary = chunk.endswith((b"\n\n", b"\r\n\r\n"))
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        return prior, last

    async def _broken(self, e: UpstreamError) -> None:
        """The worker broke off mid-body: end an SSE stream with an error event; the response stays incomplete
        (the client connection is closed abnormally: :meth:`Exchange.cut`)."""
        evt = self.broken_event(e)
        if evt is not None:
            await self.ex.send({"type": "http.response.body", "body": evt, "more_body": True})
        if not self.ex.gone:
            self.ex.cut()

    def broken_event(self, e: UpstreamError) -> bytes | None:
        """The worker broke off mid-body (``e``): set the outcome (the client left, the worker stalled, timed out
        or broke) and return the SSE error event that ends the stream, or None (not SSE, or nobody to tell)."""
        if self.ex.gone:
            self.outcome = Outcome.CLIENT_LEFT
            return None
        if self.stalled:
            self.outcome = Outcome.STALLED
            if not self.is_sse:
                return None
            return b"data: " + error_body(RouterErrorKind.WORKER_STALLED, self._stall_message()) + b"\n\n"
        timeout = isinstance(e, UpstreamTimeout)
        self.outcome = Outcome.TIMEOUT if timeout else Outcome.BROKEN
        log.warning("worker %d broke off a response mid-body (%s); closing the client stream with an error",
                    self.worker, e)
        if not self.is_sse:
            return None
        kind = RouterErrorKind.UPSTREAM_TIMEOUT if timeout else RouterErrorKind.UPSTREAM_FAILED
        return b"data: " + error_body(kind, f"worker {self.worker} stopped mid-response: {e}") + b"\n\n"

    def _stall_message(self) -> str:
        """The ``worker_stalled`` message, its advice worded by how many other workers are routable now."""
        others = len([k for k in self.up.state.routable_workers() if k != self.worker])
        return worker_stalled_message(self.worker, self.up.cfg.stall_after_s, others)

    def _capture_start(self) -> bytes | None:
        """The response-id capture for a successful ``POST /v1/responses``: remembers a client-chosen id at once
        (None), or returns b"" to look for the id in the answer; None when there is nothing to capture."""
        capture = self.ex.capture
        if not capture or self.status >= 300:
            return None
        if isinstance(capture, str):
            self.up.response_ids.remember(capture, self.worker, self.ex)
            return None
        return b""

    def _capture_id(self, head: bytes) -> bytes | None:
        """Look for the response id in ``head`` (the answer so far): remember it and return None when found or
        after :data:`_CAPTURE_MAX` bytes, else return ``head`` to keep looking."""
        rid = response_id(head)
        if rid is not None:
            self.up.response_ids.remember(rid, self.worker, self.ex)
            return None
        return head if len(head) < _CAPTURE_MAX else None


__all__ = ["RETRY", "Attempt", "Upstreams"]
