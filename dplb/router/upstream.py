"""HTTP/1.1 client to the workers over Unix domain sockets: one keep-alive connection (the transport; its pool is
:mod:`dplb.router.upstream_pool`, its errors are :mod:`dplb.errors`' ``Upstream*``).

Contract
- :meth:`UpstreamConn.send_request` writes the whole request at once; :meth:`UpstreamConn.response_head` waits for
  the status line and headers; :meth:`UpstreamConn.chunks` yields body bytes exactly as they arrive (no decoding,
  no buffering beyond what the socket delivered). Each wait has its own timeout (first byte, idle between chunks)
  and raises :class:`UpstreamTimeout`; a connection that closes before the message is complete raises
  :class:`UpstreamClosed`: :class:`UndeliveredRequest` when it ended with the request undelivered (ECONNRESET: unread
  by the worker; EPIPE: closed before our write) before one response byte came back — it reached no engine, the
  caller may send it again (``reused``: the connection came from the pool); never for a clean EOF (the worker read
  it: :data:`dplb.errors.RESEND_REASONS`) nor a close by the router itself (``abort``).
- A complete response on a keep-alive connection makes it :attr:`UpstreamConn.reusable`;
  :meth:`UpstreamConn.abort` closes it at once (client gone, error, timeout), which
  makes the engine abort the generation.
- Flow control: when the client reads slower than the worker writes, reading from the worker pauses
  (``pause_reading``) above :data:`HIGH_WATER` buffered bytes, so memory stays bounded.
- A connection may instead hand its response to a :class:`Sink` (``conn.sink``, the router's direct relay:
  :mod:`dplb.router.direct`): the head (from the parser's callback), then per socket read one call with the body
  chunks that read carried (``relay``, or ``complete`` for the read that ends the message) and a failure are then
  calls on the sink, and nothing is queued. The head is still recorded (``status``, ``headers``, the head future),
  so a sink may detach (``conn.sink = None``) before the body and leave the rest of the response to the awaitable
  API.

Parsing is done by ``httptools`` (the parser uvicorn uses); only framing lives here. The parser's body callback is
the C method ``append`` of a per-connection list: a body chunk costs no Python call; what a read's chunks are for
(the sink, the awaitable API's queue, the end of the message) is done once per read, after the parser returns, in
the order the parser met them.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
import types
from collections.abc import Awaitable, Callable
from typing import Any, Final

import httptools

from dplb.errors import UndeliveredRequest, UpstreamClosed, UpstreamError, UpstreamTimeout
from dplb.native import trait

HIGH_WATER: Final = 256 * 1024  # bytes buffered from a worker before we stop reading its socket
LOW_WATER: Final = 64 * 1024
# (Final: compiled, a C constant or static instead of a module-dict lookup and an attribute lookup per use.)
_monotonic: Final = time.monotonic


@trait
class Sink:
    """What a connection with ``sink`` set calls instead of queueing its response (see the module docstring).
    ``head`` comes once (from the parser, in the read that completes the head), then ``relay`` at the end of each
    socket read and ``complete`` at the end of the read that ends the message, or ``failed`` once (instead of what
    is left; after ``relay`` of the chunks that read carried before the fault) when the connection breaks or the
    response is malformed. ``chunks``: the body bytes of one read as the parser de-chunked them (none, one or
    several non-empty pieces; a chunk of the worker's framing may come in pieces over several reads); the list is
    the connection's, emptied after the call: the sink must not keep it. A mypyc trait (:func:`dplb.native.trait`):
    the direct relay's attempt, a subclass of its attempt class, takes it in as a second base, and compiled, the
    connection calls its methods through the trait's table instead of looking them up by name; each method here
    does nothing."""

    __slots__ = ()

    def head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """The response head: ``status`` and the worker's headers as parsed."""

    def due(self) -> None:
        """A time asked for with :meth:`UpstreamConn.wake_by` came (or an earlier one of the connection's timer):
        the sink checks its own deadline and asks again when it is not due yet."""

    def relay(self, chunks: list[bytes]) -> None:
        """The end of one socket read that did not end the message: its body ``chunks`` (maybe none); write them
        and what ``head`` produced."""

    def complete(self, chunks: list[bytes]) -> None:
        """The read that ended the message: its last body ``chunks`` (maybe none), then the response is
        complete."""

    def failed(self, exc: UpstreamError) -> None:
        """The connection broke or the response was malformed before it was complete."""


class UpstreamConn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection to a worker; one request at a time. ``reused``: it came from the pool
    (:meth:`dplb.router.upstream_pool.UpstreamPool.take_idle`)."""

    # (Slots: pure Python, attribute reads and writes per read stay the interpreter's cheapest kind whatever their
    # number; an instance dict stops sharing its keys past 30. Compiled, the class's own attributes are typed
    # slots anyway.)
    __slots__ = ("_bodies", "_buffered", "_chunks", "_complete", "_deadline", "_drained", "_error", "_feed",
                 "_got_head", "_head", "_head_error", "_heard", "_idle_s", "_parser", "_paused", "_sink_at",
                 "_sink_timer", "_tick_at", "_tick_s", "_timer", "_wakeup", "clock", "closed", "headers",
                 "keep_alive", "last_used", "loop", "reused", "sink", "status", "transport", "worker")

    def __init__(self, worker: int) -> None:
        self.worker = worker
        self.loop = asyncio.get_running_loop()  # (made by the loop's connection factory; asked once, not per use)
        self.clock: Callable[[], float] = self.loop.time  # (loop time, bound once per connection)
        self.transport: asyncio.Transport | None = None
        self._sink_timer: asyncio.TimerHandle | None = None  # see wake_by
        self._sink_at = 0.0
        self.last_used = _monotonic()
        self.reused = False  # taken from the pool (dplb.router.upstream_pool) at least once
        # The body chunks of the read being parsed: the parser's on_body is this list's C append (no Python call
        # per chunk); data_received hands them on and empties it before it returns. (httptools takes its callbacks
        # from the object it is given, once, at construction: a namespace of the connection's methods and the
        # append.)
        self._bodies: list[bytes] = []
        self._parser = httptools.HttpResponseParser(types.SimpleNamespace(
            on_header=self.on_header, on_headers_complete=self.on_headers_complete, on_body=self._bodies.append,
            on_message_complete=self.on_message_complete))
        self._feed: Callable[[bytes], None] = self._parser.feed_data  # (bound once: called per read)
        self._error: UpstreamError | None = None
        self.sink: Sink | None = None
        self._timer: asyncio.TimerHandle | None = None  # the body phase's one lazy timer (see chunks())
        self._chunks: collections.deque[bytes] = collections.deque()  # (one per connection: emptied per request)
        self._reset()
        self.closed = False

    def _reset(self) -> None:
        timer = self._timer
        if timer is not None:
            timer.cancel()
        self._timer = None
        self._deadline = self._tick_at = 0.0  # loop time of the idle timeout / of the next keep-alive tick
        self._idle_s = self._tick_s = 0.0
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        # The head: came (_got_head), or failed (_head_error: a close, a malformed response, the first-byte
        # timeout); the future exists only while response_head waits for it (a sink never needs one).
        self._got_head = False
        self._head_error: UpstreamError | None = None
        self._head: asyncio.Future[None] | None = None
        if self._chunks:
            self._chunks.clear()
        self._buffered = 0
        # What a body iteration waits on (BodyChunks.__anext__): resolved with the next chunk, b"" (a keep-alive
        # tick), failed at the end (StopAsyncIteration), with the idle timeout or the connection's error.
        self._wakeup: asyncio.Future[bytes] | None = None
        self._drained = False  # chunks were handed out since the body deadlines last moved
        self._complete = False
        self._paused = False
        self._heard = False  # a byte of the response came
        self.keep_alive = False

    # ---- asyncio.Protocol -------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        """Parse one read, then hand the body chunks it carried on: to the sink in one call, or to the awaitable
        API (the end of the message hands on the chunks before it itself: :meth:`on_message_complete`). A
        malformed response fails the connection after the chunks that came before the fault are handed on."""
        self._heard = True
        try:
            self._feed(data)
        except httptools.HttpParserUpgrade:  # pragma: no cover - workers never upgrade
            self._broken(UpstreamClosed("unexpected upgrade from worker"))
            return
        except httptools.HttpParserError as e:
            self._broken(UpstreamClosed(f"malformed response from worker: {e}"))
            return
        sink = self.sink
        bodies = self._bodies
        if sink is not None:
            if not self._complete:  # (else on_message_complete handed the read on with the end: nothing more)
                try:
                    sink.relay(bodies)
                finally:
                    bodies.clear()
        elif bodies:
            w = self._wakeup
            if w is not None and len(bodies) == 1 and not w.done():  # the usual: one chunk, waited for
                self._wakeup = None
                self._drained = True
                w.set_result(bodies[0])
                bodies.clear()
            else:
                self._hand_on(False)

    def connection_lost(self, exc: Exception | None) -> None:
        ours = self.closed  # the router closed it (abort, a failure): not the worker
        self.closed = True
        self._stop_sink_timer()
        if not self._complete:
            self._fail(self._lost(exc, ours))

    def _lost(self, exc: Exception | None, ours: bool) -> UpstreamClosed:
        """What a close (``exc``: connection_lost's) before the end of the response fails with: a
        :class:`UndeliveredRequest` when it may be sent again (the module docstring), else :class:`UpstreamClosed`."""
        if not self._heard and not ours:
            if isinstance(exc, ConnectionResetError):
                return UndeliveredRequest("reset")
            if isinstance(exc, BrokenPipeError):
                return UndeliveredRequest("epipe")
        return UpstreamClosed("the worker closed the connection before the response was complete")

    # ---- httptools callbacks ------------------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self._parser
        self.status = parser.get_status_code()
        self.keep_alive = parser.should_keep_alive()
        if self._head_error is None:
            self._got_head = True
            head = self._head
            if head is not None and not head.done():
                head.set_result(None)
        sink = self.sink
        if sink is not None:
            sink.head(self.status, self.headers)

    def on_message_complete(self) -> None:
        self._complete = True
        self._hand_on(True)

    # ---- internals -----------------------------------------------------------------------------------------------
    def _hand_on(self, ended: bool) -> None:
        """The chunks parsed so far, then the end of the message when it came (``ended``), to the sink (``relay``
        or ``complete``), or to the awaitable API: each chunk to the waiting iteration (the first) or the queue
        (reading paused above :data:`HIGH_WATER` bytes queued), the end to the iteration still waiting. The chunk
        list is emptied."""
        bodies = self._bodies
        sink = self.sink
        if sink is not None:
            try:
                if ended:
                    sink.complete(bodies)
                else:
                    sink.relay(bodies)
            finally:
                bodies.clear()
            return
        w = self._wakeup
        for body in bodies:
            if w is not None and not w.done():  # waited for (nothing is queued then): handed over as it is
                self._wakeup = None
                self._drained = True
                w.set_result(body)
                w = None
                continue
            self._chunks.append(body)
            self._buffered += len(body)
            if self._buffered > HIGH_WATER and not self._paused and self.transport is not None:
                self._paused = True
                self.transport.pause_reading()
        bodies.clear()
        if ended and w is not None and not w.done():  # the iteration waiting for a chunk ends
            self._wakeup = None
            self._stop_timer()
            _set_exception(w, StopAsyncIteration())

    def _broken(self, exc: UpstreamError) -> None:
        """The parser refused the read (``exc``): the chunks before the fault are handed on, then the connection
        fails."""
        self._hand_on(False)
        self._fail(exc)

    def _sink_due(self) -> None:
        self._sink_timer = None
        sink = self.sink
        if sink is not None:
            sink.due()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _stop_sink_timer(self) -> None:
        if self._sink_timer is not None:
            self._sink_timer.cancel()
            self._sink_timer = None

    def _fail_head(self, exc: UpstreamError) -> None:
        """The head will not come: :meth:`response_head` raises ``exc`` (nothing once the head came or failed)."""
        if self._got_head or self._head_error is not None:
            return
        self._head_error = exc
        head = self._head
        if head is not None and not head.done():
            _set_exception(head, exc)

    def _fail(self, exc: UpstreamError) -> None:
        self.closed = True
        self._fail_head(exc)
        w = self._wakeup
        if w is not None and not w.done():
            self._wakeup = None
            self._stop_timer()
            _set_exception(w, exc)
        self._error = exc
        if self.transport is not None:
            self.transport.close()
        sink, self.sink = self.sink, None
        if sink is not None:
            sink.failed(exc)

    # ---- API -----------------------------------------------------------------------------------------------------
    def wake_by(self, when: float) -> None:
        """Have ``sink.due()`` called at loop time ``when`` or earlier (the module docstring): the connection's timer
        is moved only when it would fire later than ``when``."""
        if self._sink_timer is not None:
            if self._sink_at <= when:
                return
            self._sink_timer.cancel()
        self._sink_at = when
        self._sink_timer = self.loop.call_at(when, self._sink_due)

    def send_request(self, head: bytes, body: bytes) -> None:
        """Write the request head and body (one write). The head must end with the blank line."""
        self._reset()
        self._error = None
        assert self.transport is not None
        self.transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            self.transport.write(body)

    async def response_head(self, timeout_s: float) -> tuple[int, list[tuple[bytes, bytes]]]:
        """Wait for the status and headers (the first-byte phase)."""
        if not self._got_head:
            error = self._head_error
            if error is not None:
                raise error
            head = self._head
            if head is None:
                head = self._head = self.loop.create_future()
            # A plain timer instead of asyncio.wait_for: no extra task or shield on the hot path.
            timer = self.loop.call_later(timeout_s, self.expire_head, timeout_s)
            try:
                await head
            finally:
                timer.cancel()
        return self.status, self.headers

    def expire_head(self, timeout_s: float) -> None:
        """The first-byte timeout passed (timed by the caller): :meth:`response_head` raises
        :class:`UpstreamTimeout` at once (nothing once the head came or failed)."""
        self._fail_head(UpstreamTimeout("first_byte", timeout_s))

    def chunks(self, idle_timeout_s: float, tick_s: float = 0.0) -> BodyChunks:
        """Body bytes as they arrive, until the message is complete (an async iterator: :class:`BodyChunks`).
        Raises :class:`UpstreamTimeout` after ``idle_timeout_s`` seconds without a byte. With ``tick_s`` > 0, an
        empty ``b""`` is yielded after every ``tick_s`` seconds of silence (SSE keep-alives); ticks do not extend
        the idle timeout. Time the caller spends between two items does not count as silence.

        One timer per response, not per chunk: a chunk only moves the deadlines, and the timer, when it fires
        early, re-arms itself at the later deadline (a timer per wait cost ~5 % of the router's CPU per token)."""
        return BodyChunks(self, idle_timeout_s, tick_s)

    def _on_timer(self) -> None:
        """The body phase's timer: expire the idle timeout, wake for a keep-alive tick, or re-arm at the next
        deadline. Not re-armed while nobody waits (the caller is busy between items: not silence)."""
        self._timer = None
        w = self._wakeup
        if w is None or w.done():
            return
        loop = self.loop
        now = loop.time()
        if now >= self._deadline:
            self._wakeup = None
            _set_exception(w, UpstreamTimeout("idle", self._idle_s))
            return
        if now >= self._tick_at:
            self._tick_at = now + self._tick_s
            self._wakeup = None
            w.set_result(b"")
            return
        self._timer = loop.call_at(min(self._deadline, self._tick_at), self._on_timer)

    @property
    def reusable(self) -> bool:
        """True after a complete keep-alive response on a live connection."""
        return self._complete and self.keep_alive and not self.closed and self.transport is not None \
            and not self.transport.is_closing()

    def abort(self) -> None:
        """Close now (the worker sees the disconnect and aborts the request)."""
        self.closed = True
        self._stop_sink_timer()
        self._stop_timer()
        if self.transport is not None:
            self.transport.abort()


class BodyChunks:
    """The async iterator :meth:`UpstreamConn.chunks` returns: one response body's chunks (its docstring).

    A class, not an async generator, so that mypyc compiles the module (it compiles no async generator), and
    :meth:`__anext__` a plain method: a waited-for chunk is handed to the waiting task by the parser, with no
    coroutine resumed per chunk. The end of the body, the idle timeout and a broken connection stop the
    connection's body timer; after a cancelled wait or an iteration abandoned part way it stops at its next expiry
    (it does nothing while nobody waits), or at :meth:`UpstreamConn.abort` or the next request's reset."""

    def __init__(self, conn: UpstreamConn, idle_timeout_s: float, tick_s: float) -> None:
        self._conn = conn
        self._idle_s = idle_timeout_s
        self._tick_s = tick_s
        self._tick = tick_s > 0.0
        conn._drained = False
        now = conn.loop.time()
        conn._idle_s, conn._tick_s = idle_timeout_s, tick_s
        conn._deadline = now + idle_timeout_s
        conn._tick_at = now + tick_s if self._tick else math.inf

    def __aiter__(self) -> BodyChunks:
        return self

    def __anext__(self) -> Awaitable[bytes]:
        """An awaitable of the next chunk (``b""``: a keep-alive tick): a coroutine of the chunk when one is queued
        (cheaper than a done future), else the connection's wake-up future, which the parser resolves with the next
        chunk, the body timer with a tick or fails with :class:`UpstreamTimeout`, and which fails with
        StopAsyncIteration at the end of the message or with the connection's :class:`UpstreamError`. Raises those
        two at once when they are known already."""
        conn = self._conn
        queue = conn._chunks  # (emptied only by the next request's reset)
        loop = conn.loop
        if queue:
            c = queue.popleft()
            conn._buffered -= len(c)
            if conn._paused and conn._buffered < LOW_WATER and conn.transport is not None:
                conn._paused = False
                conn.transport.resume_reading()
            conn._drained = True
            return _now(c)
        if conn._drained:  # the queue ran dry: the silence starts now
            conn._drained = False
            now = loop.time()
            conn._deadline = now + self._idle_s
            if self._tick:
                conn._tick_at = now + self._tick_s
        if conn._complete:
            conn._stop_timer()
            raise StopAsyncIteration
        error = conn._error
        if error is not None:
            conn._stop_timer()
            raise error
        conn._wakeup = wake = loop.create_future()
        if conn._timer is None:
            conn._timer = loop.call_at(min(conn._deadline, conn._tick_at), conn._on_timer)
        return wake


async def _now(chunk: bytes) -> bytes:
    """``chunk`` as an awaitable (a coroutine costs less than a done future)."""
    return chunk


def _set_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    """Fail ``fut`` and mark its exception retrieved: whoever awaits it still gets the exception, but a future
    nobody awaits any more (its client went away first) does not log "Future exception was never retrieved"."""
    fut.set_exception(exc)
    fut.exception()
