"""The one timer of a client connection of :func:`dplb.runtime.protocol.bounded_protocol`: keep-alive, the read
timeouts of an incomplete request and the lingering close, without a timer per request.

Contract: :class:`ConnectionTimer` is a mixin of the bounded protocol (before uvicorn's ``HttpToolsProtocol`` in its
bases). The protocol records instants (``_idle_since`` after a response, ``_head_since`` when a head began,
``_body_at`` at a read of an incomplete body) and calls :meth:`ConnectionTimer._arm` only when a read leaves a
request incomplete; the timer, when it fires, closes an idle connection past its keep-alive, answers 408
``request_timeout`` (``_count_timeout`` counts it) and closes one whose head or body came too slowly,
or re-arms itself at the deadline of what the connection waits for.

Lingering close (nginx's ``lingering_close``, ``ngx_http_set_lingering_close`` in src/http/ngx_http_request.c): a
connection closed after an answer sent while the client may still be sending — its request's body not all read
(an early 413, 401, 415, …), or bytes refused (400 ``invalid_http``, 431) — is not closed at once: closing a socket
with unread bytes makes the kernel answer them with a reset, and a client still uploading (one that sends no
``Expect: 100-continue``: Python's urllib, a raw socket) gets a broken pipe or a reset instead of the answer.
:meth:`ConnectionTimer.close_connection` shuts the writing side instead (the answer, then FIN) and reads on,
discarding, until the client closes its side, or ``total_s`` after the answer, or ``idle_s`` without a byte, or
``max_bytes`` discarded — then closes: the connection's :class:`LingerBounds` (``_linger_bounds``, set by the
protocol from its settings; by default :data:`LINGER_S`, :data:`LINGER_IDLE_S`, :data:`LINGER_BYTES`). Nothing read
is parsed; the request's app hears a disconnect at once, as if the connection were closed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, cast

from dplb.runtime.edge import DISCONNECT_EXT

#: Longest lingering close, seconds after the answer (nginx's ``lingering_time`` default).
LINGER_S: Final = 30.0
#: Lingering close: longest wait for the client's next byte, seconds (nginx's ``lingering_timeout`` default).
LINGER_IDLE_S: Final = 5.0
#: Lingering close: most bytes discarded (nginx has no such bound; at loopback speed 30 s is gigabytes). 64 MiB is
#: twice the default ``--max-body-bytes``: a body over the limit by that much still gets its answer read.
LINGER_BYTES: Final = 64 * 1024 * 1024


@dataclass(frozen=True)
class LingerBounds:
    """The bounds of a lingering close (module docstring): at most ``total_s`` seconds after the answer, ``idle_s``
    seconds without a byte from the client, ``max_bytes`` bytes discarded."""

    total_s: float = LINGER_S
    idle_s: float = LINGER_IDLE_S
    max_bytes: int = LINGER_BYTES


class ConnectionTimer:
    """The timer of one connection (see the module docstring). Class attributes set by the protocol: ``_timed``
    (read timeouts on), ``_head_s`` / ``_body_s`` (seconds), ``_slow_head`` / ``_slow_body`` (the 408s),
    ``_linger_bounds`` (when it is made) and ``_count_timeout`` (metrics)."""

    _timed = False
    _head_s = 0.0
    _body_s = 0.0
    _slow_head = b""
    _slow_body = b""
    _idle_since = -1.0  # loop time the connection went idle after a response; -1.0 while a request is open
    _head_since = 0.0  # loop time the incomplete head began (a new connection's first: when it was accepted)
    _body_at = 0.0  # loop time of the last read of an incomplete body
    _timer: Any = None  # the connection's one timer
    _in_head = True  # a head is incomplete (or none came yet on a new connection)
    _heard = False  # a byte of a head came on this connection
    _refuse_after: bytes | None = None  # the answer to bad bytes read after complete requests (sent after theirs)
    _active: Any = None  # the request being answered
    _linger_bounds: LingerBounds
    _linger_until = 0.0  # loop time a lingering close ends at the latest (0.0: not lingering)
    _linger_at = 0.0  # loop time of the last read while lingering
    _linger_left = 0  # bytes still discarded before the close
    cycle: Any
    flow: Any
    loop: Any
    transport: Any
    timeout_keep_alive: Any  # (uvicorn's; Any: compiled, a typed slot would refuse a float)

    def _count_timeout(self) -> None:
        """Count one 408 ``request_timeout`` (the protocol's metrics hook)."""

    # The connection's one timer. uvicorn arms a keep-alive timer after every response and cancels it at the
    # next request's first bytes (a timer made and cancelled per request). Here the timer stays armed: reads
    # and responses only record instants, and the timer, when it fires, asks _phase what the connection waits
    # for — the rest of a head (header timeout, from the head's first read), the rest of a body (body timeout,
    # from the last read), the next request (keep-alive, from the last response) or nothing of the client (a
    # request being answered: it lapses, and the next response arms it again) — then acts on the deadline or
    # re-arms itself at it. A read that leaves a head or a body incomplete (never the common request, whose
    # head and body come in one read) re-arms it earlier when its deadline is earlier (_arm).
    def _unset_keepalive_if_required(self) -> None:
        self._idle_since = -1.0

    def _phase(self) -> int:
        """What the connection waits for from the client: 0 nothing (a response is being written, or bad bytes
        wait for the answers before them), 1 the rest of a head, 2 the rest of a body, 3 the next request."""
        if self._refuse_after is not None:
            return 0
        active = self._active
        answering = active is not None and not active.response_complete
        if self._timed and self._in_head:
            return 0 if answering else 1
        cycle = self.cycle
        if self._timed and cycle is not None and cycle.more_body:
            return 0 if answering and active is not cycle else 2
        return 3 if self._idle_since >= 0.0 and not answering else 0

    def _deadline(self, phase: int) -> float:
        """The loop time at which ``phase`` (of :meth:`_phase`) times out."""
        if phase == 1:
            return self._head_since + self._head_s
        if phase == 2:
            cycle = self.cycle
            if self.flow.read_paused or cycle.waiting_for_100_continue:  # waiting on the app, not the client
                return float(self.loop.time()) + self._body_s
            return self._body_at + self._body_s
        return self._idle_since + self.timeout_keep_alive

    def _arm(self) -> None:
        """Make the timer fire by the current phase's deadline (re-armed earlier only when it must be)."""
        phase = self._phase()
        if phase == 0:
            return
        due = self._deadline(phase)
        timer = self._timer
        if timer is not None:
            if timer.when() <= due:
                return
            timer.cancel()
        self._timer = self.loop.call_at(due, self._due)

    def _due(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        phase = self._phase()
        if phase == 0:
            return
        due = self._deadline(phase)
        if self.loop.time() < due:
            self._timer = self.loop.call_at(due, self._due)
        elif phase == 3:
            # (uvicorn's method, closing the connection; looked up by name: compiled, an attribute declared here
            # would be a slot that hides it)
            cast(Any, self).timeout_keep_alive_handler()
        else:
            self._timed_out(phase)

    def _timed_out(self, phase: int) -> None:
        """408 (nothing of a response sent yet; none to a connection that sent nothing) and close: the head (phase
        1) or the body (2) came too slowly.
        A request whose body stopped is told through its hook, so the app records a 408, not a client gone."""
        self._count_timeout()
        cycle = self.cycle
        if phase == 1:
            if self._heard:  # (a connection that sent nothing is closed silently: it asked nothing)
                self.transport.write(self._slow_head)
        elif not cycle.response_started:
            hook: Any = cycle.scope.get("extensions", {}).get(DISCONNECT_EXT)
            if hook is not None:
                hook.timed_out = True
            self.transport.write(self._slow_body)
        self.transport.close()

    # ---- lingering close (module docstring) ------------------------------------------------------------------------
    def close_connection(self) -> None:
        """Close the client connection once the answers are written (a request's CorkedTransport closes through
        this): lingering when the client may still be sending and no answer is cut short, else at once."""
        active, cycle = self._active, self.cycle
        if (active is None or active.response_complete) and (
                self._refuse_after is not None or (cycle is not None and cycle.more_body)):
            self._linger()
        else:
            self.transport.close()

    def _linger(self) -> None:
        """Start the lingering close: the requests not answered hear a disconnect, nothing read is parsed any
        more, the writing side is shut once what is written went out, and the connection is read until a bound."""
        transport = self.transport
        if transport.is_closing() or self._linger_until:
            return
        for cycle in (self._active, self.cycle):
            if cycle is not None and not cycle.response_complete and not cycle.disconnected:
                cycle.disconnected = True
                cycle.message_event.set()
                hook: Any = cycle.scope.get("extensions", {}).get(DISCONNECT_EXT)
                if hook is not None:
                    hook.fire()
        if self._refuse_after is None:
            self._refuse_after = b""  # (the protocol parses nothing after it)
        now = float(self.loop.time())
        bounds = self._linger_bounds
        self._linger_until = now + bounds.total_s
        self._linger_at = now
        self._linger_left = bounds.max_bytes
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_at(min(self._linger_until, now + bounds.idle_s), self._linger_due)
        if self.flow.read_paused:
            self.flow.resume_reading()
        transport.write_eof()

    def _lingered(self, n: int) -> None:
        """``n`` bytes read (and discarded) while lingering."""
        self._linger_left -= n
        self._linger_at = float(self.loop.time())
        if self._linger_left <= 0:
            self.transport.close()

    def _linger_due(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        due = min(self._linger_until, self._linger_at + self._linger_bounds.idle_s)
        if self.loop.time() >= due:
            self.transport.close()
        else:
            self._timer = self.loop.call_at(due, self._linger_due)


__all__ = ["LINGER_BYTES", "LINGER_IDLE_S", "LINGER_S", "ConnectionTimer", "LingerBounds"]
