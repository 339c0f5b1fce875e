"""Answering a request from the server protocol's callbacks, without an ASGI task (the router's direct relay).

Contract
- A *direct handler* is what :func:`dplb.runtime.serving.make_server` may be given besides the ASGI app:
  ``wants(scope)`` (cheap: may this request skip the ASGI task?) is asked when a request's head is parsed (the
  scope has its method and headers; its path and HTTP version not yet), and ``begin(cycle, start)`` once its body is
  complete (``cycle``: a :class:`dplb.runtime.lane_cycle.LaneCycle`, uvicorn's cycle made lean). ``begin`` returns
  False to have the request served by the ASGI app as usual (nothing may have been done for it then), or True when
  it took the request: it then answers it with a
  :class:`DirectResponse` on ``cycle``, or hands it to a coroutine with ``start(app)`` (an ASGI callable run as the
  request's task, exactly as the server runs its app: its exceptions are logged and answered 500).
- Only a ``POST`` whose body can be held whole without pausing the socket (``Content-Length`` at most
  :data:`MAX_DIRECT_BODY`), without ``Expect: 100-continue``, and that is not queued behind another on its
  connection (pipelining) is offered to ``wants`` and ``begin``; anything else goes to the ASGI app.
- :class:`DirectResponse` writes one response on the cycle's transport the way uvicorn's ASGI ``send`` does
  (the same status line, framing — Content-Length passed through, else chunked, or for HTTP/1.0 the bare bytes
  delimited by the close — ``connection: close`` when the
  connection is not kept alive, the cycle's state flags and its ``on_response`` callback, which starts the next
  pipelined request or arms the keep-alive timer), minus the per-message ASGI work. Writes are collected and go out
  in one ``write`` per :meth:`DirectResponse.flush`. Its ``source`` (a :class:`Source`) is paused and resumed when
  the client's transport crosses its write-buffer marks. :meth:`DirectResponse.unsent` says whether no byte of the
  response was written yet (its owner may still answer something else instead).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, Protocol

from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from dplb.runtime.lane_cycle import LaneCycle

_STATUS_LINE: Final = STATUS_LINE  # (Final: compiled, a C static instead of a module-dict lookup per use)
#: Largest request body a direct handler is offered (bytes): uvicorn pauses reading above 64 KiB until its app reads.
MAX_DIRECT_BODY: Final = 65536
_NO_BODY_STATUS: Final = (204, 304)
#: ``b"%x\r\n" % n`` for n < 4096: the size line of a body chunk of n bytes (a tuple item is ~20x cheaper than the
#: formatting; SSE events are a few hundred bytes), larger chunks formatted.
_SIZE_LINE_MAX: Final = 4096
_SIZE_LINES: Final = tuple(b"%x\r\n" % n for n in range(_SIZE_LINE_MAX))
#: The end of a response head after its header lines, by ``2 * closing + chunked`` (closing: not kept alive):
#: what uvicorn's ``send`` adds.
_ENDS: Final = (
    b"\r\n",
    b"transfer-encoding: chunked\r\n\r\n",
    b"connection: close\r\n\r\n",
    b"connection: close\r\ntransfer-encoding: chunked\r\n\r\n",
)


def header_lines(headers: list[tuple[bytes, bytes]]) -> bytes:
    """``headers`` as the lines of a head: ``name: value\r\n`` each, in their order."""
    return b"".join([n + b": " + v + b"\r\n" for n, v in headers])


class Source(Protocol):
    """What feeds a :class:`DirectResponse` (the router's direct relay: its attempt, reading the worker's socket)."""

    def pause_reading(self) -> None:
        """The client reads slower than the source writes: stop producing until :meth:`resume_reading`."""

    def resume_reading(self) -> None:
        """The client's write buffer drained: produce again."""


class DirectResponse:
    """One response written straight to ``cycle``'s transport (a :class:`dplb.runtime.lane_cycle.LaneCycle`).

    ``start(status, headers)`` once, ``body(data)`` per chunk (or ``write(chunks)``: several, then a flush), then
    ``end()`` (complete) or ``cut()`` (abnormal end: the connection is closed without the terminating chunk).
    ``flush()`` writes what is pending. ``source``: what
    feeds the response (a :class:`Source`, set by the owner, or None): the protocol calls its ``pause_reading()``
    and ``resume_reading()`` at the client transport's write-buffer marks."""

    __slots__ = ("chunked", "cycle", "head", "pending", "source", "transport")

    def __init__(self, cycle: LaneCycle) -> None:
        self.cycle = cycle
        self.transport = cycle.transport
        self.pending: list[bytes] = []
        self.chunked = False
        self.head = b""  # the response head, once start made it
        self.source: Source | None = None
        cycle.direct = self

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """The status line and ``headers`` (names in lower case, as uvicorn's ``send`` writes them), framed as
        uvicorn frames an ASGI response: with a Content-Length the body goes as it is, else chunked
        (:meth:`start_lines` with the headers rendered)."""
        sized = False
        for name, _ in headers:
            if name == b"content-length":
                sized = True
                break
        self.start_lines(status, header_lines(headers), sized)

    def start_lines(self, status: int, lines: bytes, sized: bool) -> None:
        """:meth:`start` with the headers rendered already: ``lines`` (``name: value\r\n`` each, names in lower
        case; the cycle's default headers go first) and whether they carry a Content-Length (``sized``)."""
        cycle = self.cycle
        cycle.response_started = True
        cycle.waiting_for_100_continue = False
        defaults = cycle.default_headers
        if defaults:
            lines = header_lines(defaults) + lines
        chunked = not sized and status not in _NO_BODY_STATUS
        closing = not cycle.keep_alive
        if chunked and closing and cycle.scope["http_version"] == "1.0":
            chunked = False  # HTTP/1.0 has no chunked coding: the close delimits the body (RFC 9112 §6.3)
        self.chunked = chunked
        head = _STATUS_LINE[status] + lines + _ENDS[2 * closing + chunked]
        self.pending.append(head)
        self.head = head

    def body(self, data: bytes) -> None:
        """Body bytes (chunk-framed when the response is chunked; not empty then: an empty chunk ends a chunked
        body)."""
        if self.chunked:
            n = len(data)
            self.pending += (_SIZE_LINES[n] if n < _SIZE_LINE_MAX else b"%x\r\n" % n, data, b"\r\n")
        else:
            self.pending.append(data)

    def _bodies(self, chunks: list[bytes]) -> None:
        """:meth:`body` of each of ``chunks`` (non-empty), in one call."""
        pending = self.pending
        if self.chunked:
            for data in chunks:
                n = len(data)
                pending.append(_SIZE_LINES[n] if n < _SIZE_LINE_MAX else b"%x\r\n" % n)
                pending.append(data)
                pending.append(b"\r\n")
        else:
            pending += chunks

    def write(self, chunks: list[bytes]) -> None:
        """:meth:`body` of each of ``chunks`` (non-empty pieces, maybe none: what one read of the source brought),
        then :meth:`flush`: one ``write`` for them and whatever was pending. The usual read of a stream, one chunk
        and nothing pending, is one join of a tuple: no list, no other call (a Python call per read fewer in the
        pure build)."""
        if len(chunks) == 1 and self.chunked and not self.pending:
            data = chunks[0]
            n = len(data)
            data = b"".join((_SIZE_LINES[n] if n < _SIZE_LINE_MAX else b"%x\r\n" % n, data, b"\r\n"))
            if not self.cycle.disconnected:
                self.transport.write(data)
            return
        if chunks:
            self._bodies(chunks)
        self.flush()

    def end(self, then: Callable[[], None] | None = None, chunks: list[bytes] | None = None) -> None:
        """Complete the response: the last body ``chunks`` if any (as :meth:`write`), the terminating chunk,
        flush, ``then()`` (the caller's accounting, run once the client's bytes are written: off the response's
        latency), close unless kept alive, then the cycle's ``on_response`` (next pipelined request, keep-alive
        timer)."""
        if chunks:
            self._bodies(chunks)
        if self.chunked:
            self.pending.append(b"0\r\n\r\n")
        self.flush()
        if then is not None:
            then()
        cycle = self.cycle
        cycle.response_complete = True
        cycle.direct = None
        if not cycle.keep_alive:
            self.transport.close()
        cycle.on_response()

    def cut(self) -> None:
        """End abnormally: flush, then close the connection (the client sees the response cut short)."""
        self.flush()
        self.cycle.direct = None
        self.transport.close()

    def unsent(self) -> bool:
        """True while no byte of the response was written: not started, or its head still pending (no flush since
        :meth:`start`); the owner may then drop what is pending and answer otherwise."""
        pending = self.pending
        return not self.head or (bool(pending) and pending[0] is self.head)

    def flush(self) -> None:
        """Write the pending bytes in one ``write`` (nothing once the client is gone)."""
        pending = self.pending
        if pending:
            data = pending[0] if len(pending) == 1 else b"".join(pending)
            pending.clear()
            if not self.cycle.disconnected:
                self.transport.write(data)


__all__ = ["MAX_DIRECT_BODY", "DirectResponse", "Source", "header_lines"]
