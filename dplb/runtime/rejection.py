"""The rejection path of the router's HTTP/1.1 server protocol (:mod:`dplb.runtime.protocol`): what it answers to
bytes it does not take, and when.

Contract: :class:`Rejection` is a mixin of the bounded protocol, between it and :class:`ConnectionTimer` (the
protocol's bases: ``Rejection``, then uvicorn's ``HttpToolsProtocol``). It owns the bounds of a request head and
the refusals:

- A head still incomplete after a read is bounded by its own raw bytes (:meth:`Rejection._head_read`: a pipelined
  body read with it never counts) and timed (the header timeout, :mod:`dplb.runtime.conn_timer`); over the cap
  (``_max_head``) it is refused as too large without being read further.
- Refused: bytes that are not HTTP and heads over the cap (400 ``invalid_http`` :data:`BAD_HTTP`, 431
  ``headers_too_large``), a ``Transfer-Encoding`` other than ``chunked`` (:data:`BAD_CODING`, set by the protocol
  while it reads the headers) and an ``Upgrade`` to anything but WebSocket that carries a body
  (:data:`BAD_UPGRADE`). Each refusal is counted once through ``_on_reject(code)``, its answer is OpenAI-shaped
  (:func:`dplb.runtime.edge.error_response`) and the connection is then closed — lingering
  (:meth:`ConnectionTimer._linger`) when the client may still be sending, so that it gets to read the answer.
- Order: bad bytes after complete requests not answered yet wait for those answers (nothing more is read); their
  400 (431) follows them (``_refuse_after``, written by the protocol's ``on_response_complete``). A 400 is never
  written where it would read as another request's answer (one still being answered): the connection is closed.

The protocol sets ``_max_head``, ``_on_reject`` and ``_too_large_answer`` when it is made, and counts ``_head_bytes``
(the head's parsed bytes) and sets ``_refusal`` while it reads a head.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, cast

from dplb.runtime.conn_timer import ConnectionTimer
from dplb.runtime.edge import error_response
from dplb.runtime.lane_cycle import LaneCycle

#: The answer to malformed HTTP (and a malformed chunk of a request body).
BAD_HTTP: Final = error_response(400, b"Bad Request", "invalid_http", "malformed HTTP request")
# Framings the router does not take, answered like malformed HTTP (and the connection closed), since reading them
# another way than a proxy in front does would desynchronise the connection (RFC 9112 §6.1, §9.9).
#: The answer to a ``Transfer-Encoding`` other than ``chunked``.
BAD_CODING: Final = error_response(400, b"Bad Request", "invalid_http",
                                   "Transfer-Encoding other than 'chunked' is not supported")
#: The answer to an ``Upgrade`` to anything but WebSocket on a request with a body.
BAD_UPGRADE: Final = error_response(400, b"Bad Request", "invalid_http",
                                    "the router switches protocols only to WebSocket: send this request without "
                                    "'Upgrade' (curl: --http1.1)")


class Rejection(ConnectionTimer):
    """The head bounds and the refusals of the bounded protocol (see the module docstring)."""

    _head_bytes = 0  # request line + header bytes parsed so far (exact)
    _raw_bytes = 0  # bytes of the incomplete head read so far (bounds memory); -1: it began in the current read
    _too_large = False
    _refusal: bytes | None = None  # the answer to a framing refused (the connection is then closed)
    _max_head: int  # the cap of a request head, bytes
    _on_reject: Callable[[str], None] | None  # counts a refusal by its code (metrics)
    _too_large_answer: bytes  # the 431
    # The protocol's, read here.
    _deferred: LaneCycle | None
    headers: Any

    def _head_read(self, n: int) -> None:
        """A read of ``n`` bytes left a head incomplete: bound the bytes it holds and time it. Only the head's
        own bytes count — a read that began it also carried the requests before it (a pipelined body), and of
        it only what was parsed of the head counts (a partial header held by the parser: one read at most)."""
        self._heard = True
        raw = self._raw_bytes
        if raw < 0:  # the head began in this read
            raw = self._head_bytes
            if self._timed and self.cycle is not None:  # (a new connection's first head is timed from the accept)
                self._head_since = self.loop.time()
        else:
            raw += n
        self._raw_bytes = raw
        if raw > self._max_head:  # a head still incomplete past the cap: stop reading it now
            self._too_large = True
            self._bad_bytes()
        elif self._timed:
            self._arm()

    def _bad_bytes(self) -> None:
        """Bytes that are not HTTP, or a head over the cap. After complete requests not answered yet they wait
        for those answers (nothing more is read); the 400 (431) then follows them and the connection closes
        (on_response_complete). Else they are answered at once (send_400_response)."""
        cycle = self.cycle
        if cycle is None or cycle.more_body or cycle.response_complete or cycle.disconnected:
            self.send_400_response("")
            return
        if self._on_reject is not None:
            self._on_reject("headers_too_large" if self._too_large else "invalid_http")
        self._refuse_after = self._too_large_answer if self._too_large else self._refusal or BAD_HTTP
        self.flow.pause_reading()

    def _unsupported_upgrade(self) -> None:
        """An ``Upgrade`` to anything but WebSocket: llhttp ends the request at its head and leaves the rest of
        the bytes to the other protocol, so a body would be lost (the app would read none) and then read as the
        next request. A request without a body is answered, then the connection closed; one with a body gets a
        400 instead of its app's answer (the app hears a disconnect), and the connection is closed."""
        cast(Any, self)._unsupported_upgrade_warning()  # (uvicorn's: looked up by name, as conn_timer's _due)
        cycle = self.cycle
        if not any(n == b"transfer-encoding" or (n == b"content-length" and v.strip(b"0"))
                   for n, v in self.headers):
            if cycle is not None:
                cycle.keep_alive = False
            self.flow.pause_reading()
            return
        if cycle is not None and not cycle.response_started:
            cycle.disconnected = True  # (before its task runs: its answer is never written, the 400 is)
        self._refusal = BAD_UPGRADE
        self.send_400_response("")

    def send_400_response(self, msg: str) -> None:
        """uvicorn's hook for bytes its parser refused (``msg`` unused): the 400 (431, or the framing's refusal)
        where it cannot be taken for another request's answer, then close (lingering); else close only."""
        code = "headers_too_large" if self._too_large else "invalid_http"
        if self._on_reject is not None:
            self._on_reject(code)
        cycle, active = self.cycle, self._active
        # No request open, or the bad bytes are the open request's own body (a malformed chunk) before its
        # answer began: answer 400; its app then sees a disconnect. Else (a pipelined request while the previous
        # one is still being answered, or its answer is streaming) a 400 would read as that answer: only close.
        idle = active is None or active is cycle or active.response_complete
        if idle and (cycle is None or cycle.response_complete
                     or ((cycle.more_body or self._refusal) and not cycle.response_started)):
            self.transport.write(self._too_large_answer if self._too_large else self._refusal or BAD_HTTP)
            if self._deferred is None:  # (the client may still be sending: it gets to read the answer)
                self._linger()
                return
        self.transport.close()


__all__ = ["BAD_CODING", "BAD_HTTP", "BAD_UPGRADE", "Rejection"]
