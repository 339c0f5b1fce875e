"""The direct relay: a proxied request served from the protocols' callbacks, with no task or coroutine when all goes
well (docs/DESIGN.md §4, "The direct relay").

Contract
- :class:`DirectLane` is the router's direct handler (:mod:`dplb.runtime.direct`). It takes the common request:
  ``POST`` on a proxied route other than ``/v1/responses``, ``Content-Length`` body, no ``Content-Encoding``, while
  no feature that reads or rewrites the request or its chunks beyond the tenant gate is on (tracing,
  ``--resume-streams``, SSE keep-alives, CORS) and ``--no-direct-relay`` is not given. Anything else, and a request
  the edge checks or the gate refuse (a missing or wrong API key, a tenant's limit or allow-list), goes to the ASGI
  path (:class:`dplb.router.proxy.Proxy`) untouched: the lane declines before it decides.
- With the gate on (``--tenants``, ``--api-key``, ``--access-log``) the lane does the gate's work as the ASGI path
  does: :meth:`Gate.identify` (the same constant-time key lookup) while it reads the request,
  :meth:`Gate.admit_now` before it decides (the ASGI path's admission when it admits at once; a request its tenant's
  limits refuse or the fair queue would hold declines, nothing taken), the ticket's head (``x-ratelimit-*``) and
  chunks (the usage meter, the fair queue's charge, a usage event the router asked for taken out) as it relays, and
  :meth:`Gate.leave` (ledger, ``dplb_tenant_*``, the access-log line, the queue's pump) once the attempt is
  settled, after the response's last bytes; a request continued on the ASGI path leaves when that coroutine ends.
- Once it decided, the lane owns the request and the behaviour is the ASGI path's, step for step: the same
  Exchange, decision, request head, :class:`dplb.router.attempt.Attempt` accounting (``settle``, the outcome, the
  worker's release, the HTTP metrics). It continues on the ASGI path — a coroutine, exactly the code the proxy runs
  — whenever the simple case ends: no worker chosen, no idle pooled connection to the chosen worker, and before the
  response head reached the client, a first-byte timeout, a close, a stall or a ``503 worker_draining``
  (:meth:`Attempt.resume`, then the proxy's retry).
- :class:`DirectAttempt` relays the worker's answer from the upstream connection's callbacks
  (:class:`dplb.router.upstream.Sink`): the head, then the chunks of each socket read and the end, in one client
  write per socket read. It keeps a reference to each of the last two chunks (across reads), looked at once at the
  end (a stream the worker failed with its own error event: :meth:`dplb.router.attempt.Attempt.stream_end`). The
  first-byte and idle timeouts are deadlines checked by the worker connection's one timer
  (:meth:`dplb.router.upstream.UpstreamConn.wake_by`), which outlives the request: no timer per request. A
  worker that breaks off mid-body ends an SSE stream with the same error event and cuts the connection; a client
  that leaves aborts the worker connection. Slow client: the worker's socket stops being read while the client's
  write buffer is over its high-water mark.
- Latency: what the request and its answer do not need waits until they are written. The decision is recorded
  (metrics, debug ring) and the worker acquired after the request is written to the worker (synchronously, before
  any other callback can run: the next decision sees both); the attempt is accounted (``settle``, the HTTP
  metrics) after the response's last bytes are written to the client, before a pipelined request may start.
- A router bug (an exception from any step the lane runs once it decided: the decision and the policy's plugins,
  the request's write, the response head, a chunk, the end, a timer) ends the request as the ASGI path ends it,
  by the ASGI path's own code: the attempt is settled (the worker released), then the exception is re-raised in a
  coroutine continued on the ASGI path (:meth:`dplb.router.app.RouterApp.serve_proxy`), which logs it and answers
  the bare OpenAI-shaped 500 when no response byte reached the client, else cuts the connection; the HTTP metrics
  count it there. An exception while the lane reads the request declines it: the ASGI path reads it again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, Final

from dplb.errors import UpstreamError, UpstreamTimeout
from dplb.obs.fastmetrics import CounterChild
from dplb.obs.metrics import DIRECT_PATHS
from dplb.router.attempt import Attempt, Upstreams
from dplb.router.exchange import Exchange, response_headers, response_lines
from dplb.router.health import Outcome
from dplb.router.intake import Rejected, check_head
from dplb.router.proxy import Proxy, scan_headers
from dplb.router.routes import match
from dplb.router.tenancy import Gate
from dplb.router.upstream import Sink, UpstreamConn
from dplb.runtime.direct import DirectResponse, header_lines
from dplb.runtime.edge import DISCONNECT_EXT, DisconnectHook
from dplb.runtime.lane_cycle import LaneCycle

log = logging.getLogger("dplb.router")
_RESPONSES: Final = "/v1/responses"
# (Final: compiled, a C static instead of a module-dict and an attribute lookup per use; see dplb.router.attempt.)
_perf_counter: Final = time.perf_counter
_BROKEN: Final = Outcome.BROKEN
_CLIENT_LEFT_EARLY: Final = Outcome.CLIENT_LEFT_EARLY
_DRAINING: Final = Outcome.DRAINING

#: ``(ex, work)`` → a coroutine that runs ``work`` as the ASGI path runs a proxied request (its error handling and
#: HTTP metrics: :meth:`dplb.router.app.RouterApp.serve_proxy`).
Runner = Callable[[Exchange, Coroutine[Any, Any, None]], Coroutine[Any, Any, None]]
#: ``(path, method, status, t0)``: count a finished request in the HTTP metrics.
Observer = Callable[[str, str, int, float], None]


class DirectLane:
    """The router's direct handler: ``wants`` and ``begin`` (:mod:`dplb.runtime.direct`). ``enabled()`` says whether
    the features that need the ASGI path are all off (checked per request: tracing may be enabled after start)."""

    def __init__(self, proxy: Proxy, run: Runner, observe: Observer, enabled: Callable[[], bool]) -> None:
        self.proxy = proxy
        self.up: Upstreams = proxy.upstreams
        self.run = run
        self.observe = observe
        self.enabled = enabled
        self.gate: Gate = proxy.gate
        cfg = proxy.cfg
        self.limit = cfg.max_body_bytes
        self.first_byte_s = cfg.first_byte_timeout_s  # (read per request: the frozen config's, once)
        self.idle_s = cfg.idle_timeout_s
        counter = proxy.metrics.direct_relay
        self.n_direct: CounterChild
        self.n_continued: CounterChild
        self.n_declined: CounterChild
        self.n_direct, self.n_continued, self.n_declined = (counter.labels(p) for p in DIRECT_PATHS)

    def wants(self, scope: dict[str, Any]) -> bool:
        """Whether the request may skip the ASGI task (asked at the end of its head)."""
        return scope["method"] == "POST" and self.enabled()

    def begin(self, cycle: LaneCycle, start: Callable[[Any], None]) -> bool:
        """Serve the request of ``cycle`` (its body complete); False (nothing done) to leave it to the ASGI path."""
        try:
            ex = self._read(cycle)
        except Exception:  # a router bug: the ASGI path runs the same checks, meets it and answers it
            ex = None
        if ex is None:
            self.n_declined.inc()
            return False
        proxy = self.proxy
        held: Attempt | None = None  # the attempt holding the worker, once acquired (a bug settles it)
        conn: UpstreamConn | None = None
        try:
            # (a ticket: the gate identified it) Refused or to be queued: declined, nothing taken.
            if ex.tenant is not None and not self.gate.admit_now(ex):
                self.n_declined.inc()
                return False
            seconds = proxy.choose(ex)  # from here on the request is this lane's (tracing is off: nothing to trace)
            worker = ex.decision.worker
            if worker is None:
                proxy.record(ex, seconds)
                self._continue(ex, start, proxy.no_worker(ex))
                return True
            conn = self.up.pool.take_idle(worker)
            proxy.prepare(ex)
            if conn is None:  # held now, as the ASGI path holds it right after its decision: the next one sees it
                proxy.record(ex, seconds)
                attempt = Attempt(self.up, ex, worker)
                self.up.state.acquire(worker, attempt)
                held = attempt
                self._continue(ex, start, proxy.place(ex, worker, attempt))
                return True
            hook: DisconnectHook = ex.scope["extensions"][DISCONNECT_EXT]
            hook.callback = ex.client_gone
            held = direct = DirectAttempt(self, ex, worker, conn, cycle, start, hook)
            direct.begin()
            proxy.record(ex, seconds)  # once the request is on its way to the worker
        except Exception as e:
            self._failed(ex, cycle, start, e, held, conn)
        return True

    def _failed(self, ex: Exchange, cycle: Any, start: Callable[[Any], None], exc: Exception, held: Attempt | None,
                conn: UpstreamConn | None) -> None:
        """``exc`` was raised once the lane decided (module docstring): release what the request holds, then
        continue on the ASGI path, which logs it and answers."""
        if isinstance(held, DirectAttempt) and ex.conn is not None:  # sent, the worker acquired
            held.crash(exc)
            return
        ex.scope["extensions"][DISCONNECT_EXT].callback = None
        cycle.direct = None
        if conn is not None:
            conn.sink = None
        if held is not None and not isinstance(held, DirectAttempt):
            _settle(held)
        elif conn is not None:
            conn.abort()
        self._continue(ex, start, _reraise(exc))

    def _read(self, cycle: LaneCycle) -> Exchange | None:
        """The request's Exchange with its body read and peeked, or None when the lane declines it."""
        scope = cycle.scope
        found = match("POST", scope["path"])
        if found is None or found[0].path == _RESPONSES:
            return None
        ex = Exchange(scope, None, None)  # (receive and send: the cycle's, given to the ASGI app if it continues)
        ex.route, ex.pin = found
        clen, ctype, auth, encoding, repeated = scan_headers(ex)
        if repeated or encoding or clen < 0 or clen != len(cycle.body):  # (the ASGI path answers a repeated one)
            return None
        gate = self.gate
        if gate.on and not gate.identify(ex, auth):  # the ASGI path answers the 401
            return None
        proxy = self.proxy
        try:  # the ASGI path's checks (it answers what they refuse)
            check_head(ex.route, clen, ctype, encoding, self.limit)
            exclude = proxy.take_body(ex, bytes(cycle.body), encoding)
        except Rejected:
            return None
        ex.request = proxy.route_request(ex.peek, exclude)
        return ex

    def _continue(self, ex: Exchange, start: Callable[[Any], None], work: Coroutine[Any, Any, None]) -> None:
        """Go on with ``work`` on the ASGI path (a task on the request's cycle); an identified request leaves the
        gate when it ends, as on the ASGI path."""
        self.n_continued.inc()
        run = self.run
        if ex.tenant is not None:
            work = _gated(self.gate, ex, work)

        async def app(scope: Any, receive: Any, send: Any) -> None:
            ex.receive, ex.send = receive, send  # (the cycle's, as the ASGI path's exchange has them)
            await run(ex, work)

        start(app)


class DirectAttempt(Attempt, Sink):
    """An :class:`Attempt` relayed from callbacks: ``begin`` sends the request on the pooled ``conn``; the
    connection's :class:`dplb.router.upstream.Sink` calls do the rest."""

    __slots__ = ("clock", "deadline", "hook", "idle_s", "lane", "last", "out", "prior", "start")

    def __init__(self, lane: DirectLane, ex: Exchange, worker: int, conn: UpstreamConn, cycle: LaneCycle,
                 start: Callable[[Any], None], hook: DisconnectHook) -> None:
        super().__init__(lane.up, ex, worker)
        self.lane = lane
        self.conn = conn
        self.start = start
        self.hook = hook  # the request's disconnect hook (its callback is the exchange's client_gone until _done)
        self.out = DirectResponse(cycle)
        self.idle_s = lane.idle_s
        self.clock = conn.clock
        self.deadline = 0.0  # loop time of the first-byte timeout, then of the idle timeout
        self.prior = self.last = b""  # the last two body chunks (looked at once, by stream_end)

    def begin(self) -> None:
        """Send the request, then acquire the worker (nothing can run in between: the next decision sees it) and
        ask for the first-byte deadline (the connection's timer)."""
        ex, conn = self.ex, self.conn
        assert conn is not None
        conn.sink = self
        self.t0 = _perf_counter()
        conn.send_request(ex.head, ex.body)
        self.up.state.acquire(self.worker, self)
        ex.conn = conn
        self.deadline = self.clock() + self.lane.first_byte_s
        conn.wake_by(self.deadline)

    # ---- before the response head: anything unusual continues on the ASGI path -----------------------------
    def _first_byte_late(self) -> None:
        conn = self.conn
        assert conn is not None
        conn.sink = None
        conn.expire_head(self.lane.first_byte_s)
        self._resume()

    def _resume(self) -> None:
        """Hand the attempt to the ASGI path (the response head was not relayed): :meth:`Attempt.resume` answers
        the timeout, close or stall, or retries a draining refusal elsewhere."""
        self.out.cycle.direct = None
        self.lane._continue(self.ex, self.start, self.lane.proxy.place(self.ex, self.worker, self))

    def accept_lines(self, status: int, up_headers: list[tuple[bytes, bytes]]) -> tuple[bytes, bool] | None:
        """:meth:`Attempt.accept_head` for a head written as bytes (the direct relay's
        :meth:`dplb.runtime.direct.DirectResponse.start_lines`): the header lines for the client and whether they
        carry a Content-Length; None for a ``503 worker_draining`` refusal. The response-head hook gets a list of
        its own to append to (its headers go after the others, as on the ASGI path)."""
        up, worker, ex = self.up, self.worker, self.ex
        up.ttfb[worker].observe(_perf_counter() - self.t0)
        got = response_lines(up_headers, up.worker_ids[worker], ex.rid)
        if got is None:  # a Connection header: the general filter
            out, self.is_sse, draining = response_headers(up_headers, up.worker_ids[worker], ex.rid)
            lines = header_lines(out)
            sized = any(n == b"content-length" for n, _ in out)
        else:
            lines, sized, self.is_sse, draining = got
        hook = up.on_response_head
        if hook is not None:
            extra: list[tuple[bytes, bytes]] = []
            hook(ex.scope, extra)
            if extra:
                lines += header_lines(extra)
                sized = sized or any(n == b"content-length" for n, _ in extra)
        if status == 503 and draining:
            self.outcome = _DRAINING
            return None
        return lines, sized

    # ---- Sink (each call guarded: a router bug ends the request as on the ASGI path, see crash) ---------------------
    def head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        try:
            if status == 503 or self.ex.gone:
                self.conn.sink = None  # type: ignore[union-attr]  # a draining refusal, or nobody to answer
                self._resume()
                return
            got = self.accept_lines(status, headers)
            assert got is not None  # (None: a draining refusal, a 503, taken above)
            lines, sized = got
            tk = self.ex.tenant
            if tk is not None:  # (x-ratelimit-* headers, none from a plain gate; the usage meter)
                extra: list[tuple[bytes, bytes]] = []
                tk.head(status, extra, self.is_sse)
                if extra:
                    lines += header_lines(extra)
            self.status = self.ex.status = status
            self.out.start_lines(status, lines, sized)
            self.outcome = _BROKEN  # from here on, a relay that does not complete is a broken response
            self.out.source = self  # (pause_reading / resume_reading at the client's write-buffer marks)
            self.deadline = self.clock() + self.idle_s
            self.conn.wake_by(self.deadline)  # type: ignore[union-attr]
        except Exception as e:
            self.crash(e)

    def relay(self, chunks: list[bytes]) -> None:
        try:
            n = len(chunks)
            if n:
                if self.t_first is None:
                    self.t_first = _perf_counter()
                self.deadline = self.clock() + self.idle_s  # (once per read: its chunks came at the same time)
                self.prior = chunks[-2] if n > 1 else self.last
                self.last = chunks[-1]
                if self.ex.tenant is not None:
                    chunks = self.ex.tenant.chunks(chunks)  # (a usage event the router asked for: taken out)
            self.out.write(chunks)
        except Exception as e:
            self.crash(e)

    def complete(self, chunks: list[bytes]) -> None:
        try:
            n = len(chunks)
            if n:
                if self.t_first is None:
                    self.t_first = _perf_counter()
                self.prior = chunks[-2] if n > 1 else self.last
                self.last = chunks[-1]
                if self.ex.tenant is not None:
                    chunks = self.ex.tenant.chunks(chunks)
            self.outcome = self.stream_end(self.prior, self.last)
            # accounted once the client has its bytes, before a pipelined request starts
            self.out.end(self._done, chunks)
        except Exception as e:
            self.crash(e)

    def failed(self, exc: UpstreamError) -> None:
        try:
            if not self.status:  # before the head: the ASGI path answers (or the client left)
                if self.ex.gone:
                    self.outcome = _CLIENT_LEFT_EARLY
                    self._done()
                    return
                self._resume()
                return
            self._break(exc)
        except Exception as e:
            self.crash(e)

    def due(self) -> None:
        """The connection's timer: the first-byte timeout before the head, the idle timeout after it (no chunk for
        ``idle_s`` seconds); not due yet, it is asked for again at the deadline (the last chunk moved it)."""
        conn = self.conn
        assert conn is not None
        try:
            if self.clock() < self.deadline:
                conn.wake_by(self.deadline)
            elif not self.status:
                self._first_byte_late()
            else:
                conn.sink = None
                conn.abort()
                self._break(UpstreamTimeout("idle", self.idle_s))
        except Exception as e:
            self.crash(e)

    def crash(self, exc: Exception) -> None:
        """A router bug (``exc``) while this attempt relays: detached from the worker connection (aborted) and
        the client's flow control, settled when it still holds the worker, then ended as the ASGI path ends it
        (module docstring): continued there, re-raising ``exc``, with what is pending written first when the
        response head was, dropped (and the response not started) when it was not. Once settled and counted
        (the bug was in the accounting, after the response's last bytes), logged here and the connection cut."""
        ex, out, conn = self.ex, self.out, self.conn
        assert conn is not None
        conn.sink = None
        out.cycle.direct = None
        out.source = None
        self.hook.callback = None
        if ex.conn is None:  # settled and counted already (_done)
            log.error("internal error handling POST %s", ex.scope["path"], exc_info=exc)
            out.cut()
            return
        _settle(self)  # (aborts the connection: the outcome is not a complete response)
        if out.unsent():  # nothing reached the client: the ASGI path answers the 500
            out.pending.clear()
            out.cycle.response_started = False
            ex.status = 0
        else:
            out.flush()
        self.lane._continue(ex, self.start, _reraise(exc))

    # ---- after the response head -------------------------------------------------------------------------------

    def _break(self, exc: UpstreamError) -> None:
        """The worker broke off mid-body: the SSE error event, then the client connection is cut."""
        evt = self.broken_event(exc)
        if evt is not None:
            self.out.body(evt)
        self.out.cut()
        self._done()

    def pause_reading(self) -> None:
        """The client's write buffer is over its high-water mark: stop reading the worker's socket."""
        conn = self.conn
        if conn is not None and conn.transport is not None:
            conn.transport.pause_reading()

    def resume_reading(self) -> None:
        """The client's write buffer drained: read the worker's socket again."""
        conn = self.conn
        if conn is not None and conn.transport is not None and not conn.closed:
            conn.transport.resume_reading()

    def _done(self) -> None:
        """Account for the attempt (as :meth:`Attempt.run` does on its way out), leave the gate (an identified
        request) and count the request. The connection's timer stays armed (a pooled connection's next request uses
        it; it finds no sink otherwise)."""
        ex = self.ex
        if self.conn is not None:
            self.conn.sink = None
        self.out.source = None  # (no reference cycle left for the collector)
        self.hook.callback = None
        try:
            self.settle(False)  # nothing to retry: the response started, or the client left
        finally:
            try:
                if ex.tenant is not None:
                    self.lane.gate.leave(ex)
            finally:
                self.lane.observe(ex.scope["path"], "POST", ex.status, ex.t_start)
                self.lane.n_direct.inc()


def _settle(attempt: Attempt) -> None:
    """Settle ``attempt`` cut short by a router bug (as :meth:`Attempt._complete` does); a failure of the
    accounting itself is logged (the bug being handled is answered all the same)."""
    try:
        attempt.settle(False)
    except Exception:
        log.exception("settling an attempt cut short by an internal error failed")


async def _gated(gate: Gate, ex: Exchange, work: Coroutine[Any, Any, None]) -> None:
    """``work`` continued on the ASGI path, then ``ex`` leaves ``gate`` (as :meth:`Proxy.serve` ends it)."""
    try:
        await work
    finally:
        gate.leave(ex)


async def _reraise(exc: Exception) -> None:
    """The work continued on the ASGI path for a router bug on the lane: raise it there."""
    raise exc


__all__ = ["DirectAttempt", "DirectLane"]
