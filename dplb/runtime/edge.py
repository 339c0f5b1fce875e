"""The small parts of the router's HTTP/1.1 edge that :mod:`dplb.runtime.protocol` puts around uvicorn's protocol.

Contract
- :class:`DisconnectHook`: a request's ``scope["extensions"][DISCONNECT_EXT]``; fired once when the client's
  connection is lost before the response completed; ``timed_out`` says the edge closed it because the client was
  too slow (``--body-timeout``: the edge answered 408 already); :meth:`DisconnectHook.cut` is the app's way to end
  its response abnormally (closed without completing it) without the server taking it for an app error.
- :class:`CorkedTransport`: the response head held until the next write (the body) or the end of the loop
  iteration, so a head and a body sent back to back go out in one ``send()``; its ``close()`` closes through the
  protocol's ``close_connection()`` (the bounded protocol's lingering close) when it has one.
- :func:`error_response`: a complete OpenAI-shaped error response with ``connection: close`` (the edge's own
  refusals: 400, 408, 431).
- :func:`close_delimited`: makes an HTTP/1.0 request's ASGI cycle frame a response without Content-Length by
  closing the connection (RFC 9112 §6.3: HTTP/1.0 has no chunked coding), as :class:`dplb.runtime.direct.
  DirectResponse` does for the direct relay.
- :func:`peer_pid`: the client process of a Unix-socket connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Callable
from typing import Any, Final

from dplb.errors import openai_error_body

DISCONNECT_EXT: Final = "dplb.disconnect"  # scope["extensions"] key of a request's DisconnectHook (the router's server)


def error_response(status: int, reason: bytes, code: str, message: str) -> bytes:
    """The bytes of a whole ``status`` response with an OpenAI-shaped JSON body (``invalid_request_error``,
    ``code``, ``message``) and ``connection: close``."""
    body = openai_error_body(message, "invalid_request_error", code)
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (status, reason, len(body)) + body)


class DisconnectHook:
    """``scope["extensions"]["dplb.disconnect"]`` of a request served by the bounded protocol: ``gone`` turns
    True and ``callback()`` (set by the app, once) is called when the client's connection is lost before the
    response completed — what uvicorn's ``receive()`` reports as ``http.disconnect``, without a task awaiting it.
    ``timed_out``: True when the edge closed the connection because the request body stopped coming for
    ``--body-timeout`` (the client got a 408 already; the app records it as such, not as the client leaving).
    ``peer_pid``: the client process on a Unix socket (``SO_PEERCRED``, read once per connection; 0 on TCP or when
    unknown) — a worker tells which router process sent a request by it (docs/DESIGN.md §8.1). ``conn``: the
    server protocol whose ``cut_response(hook)`` :meth:`cut` calls (None: nothing to cut)."""

    __slots__ = ("callback", "conn", "gone", "peer_pid", "timed_out")

    def __init__(self, peer_pid: int = 0, conn: Any = None) -> None:
        self.gone = False
        self.timed_out = False
        self.peer_pid = peer_pid
        self.conn = conn
        self.callback: Callable[[], None] | None = None

    def cut(self) -> None:
        """End the request's response abnormally, the rest of it never coming (a worker broke off mid-body): the
        connection is closed without the response's end, and the request counts as disconnected, so its app
        returns with the response incomplete as after the client left — not an app error (uvicorn logs "ASGI
        callable returned without completing response" at ERROR for that)."""
        if self.conn is not None:
            self.conn.cut_response(self)

    def fire(self) -> None:
        """Mark the client gone and call the app's callback (once)."""
        self.gone = True
        cb, self.callback = self.callback, None
        if cb is not None:
            cb()


class CorkedTransport:
    """The client transport as a request's response sees it: the response head is held until the next write
    (the body) or the end of the event-loop iteration, so a head and a body sent back to back go out in one
    ``send()``. Everything else is passed through."""

    __slots__ = ("_held", "_transport")

    def __init__(self, transport: Any) -> None:
        self._transport = transport
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        """Write ``data``; a response head (the first write of a response) is held until the next write."""
        held = self._held
        if held is None:
            if data.startswith(b"HTTP/1.1 "):  # the head: hold it (the first write of the response)
                self._held = data
                asyncio.get_running_loop().call_soon(self._flush)
                return
            self._transport.write(data)
            return
        self._held = None
        self._transport.write(held + data)

    def _flush(self) -> None:
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            with contextlib.suppress(RuntimeError):  # writing shut meanwhile (a lingering close): dropped, as if closed
                self._transport.write(held)

    def close(self) -> None:
        """Write what is held, then close the connection: through the protocol's ``close_connection()`` when it
        has one (the bounded protocol's lingering close), else the transport's ``close()``."""
        self._flush()
        closer = getattr(self._transport.get_protocol(), "close_connection", None)
        if closer is not None:
            closer()
        else:
            self._transport.close()

    def is_closing(self) -> bool:
        """The transport's ``is_closing()``."""
        return bool(self._transport.is_closing())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


_FRAMED: Final = (b"content-length", b"transfer-encoding")


def close_delimited(cycle: Any) -> None:
    """Make ``cycle`` (uvicorn's ``RequestResponseCycle`` of an HTTP/1.0 request, not kept alive) send a response
    that has no Content-Length as its bare bytes, delimited by the close (RFC 9112 §6.3), instead of uvicorn's
    ``transfer-encoding: chunked``, which an HTTP/1.0 client does not know. A response with a Content-Length, a HEAD
    answer, a 204 or 304 are unchanged. Done by wrapping the cycle's ``send`` (an instance attribute), so HTTP/1.1
    requests pay nothing. An ``Expect: 100-continue`` is ignored, as RFC 9110 §10.1.1 requires of HTTP/1.0 (no
    1xx is sent to an HTTP/1.0 client)."""
    cycle.waiting_for_100_continue = False
    send = cycle.send
    bare = [False]

    async def send_10(message: Any) -> None:
        if not cycle.response_started:
            if (message["type"] == "http.response.start" and message["status"] not in (204, 304)
                    and cycle.scope["method"] != "HEAD"
                    and not any(n.lower() in _FRAMED for n, _ in message.get("headers", ()))):
                cycle.chunked_encoding = False  # (uvicorn then adds no transfer-encoding)
                bare[0] = True
        elif bare[0] and message["type"] == "http.response.body" and not cycle.response_complete:
            cycle.expected_content_length = len(message.get("body", b""))  # (uvicorn checks the bytes against it)
        await send(message)

    cycle.send = send_10


_PEERCRED: Final = struct.Struct("3i")  # struct ucred: pid, uid, gid (Linux)


def peer_pid(transport: Any) -> int:
    """The pid of the process at the other end of a Unix-socket ``transport`` (``SO_PEERCRED``, Linux); 0 for TCP,
    other platforms or any error (never raises)."""
    try:
        sock = transport.get_extra_info("socket")
        if sock is None or sock.family != socket.AF_UNIX:
            return 0
        return int(_PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))[0])
    except (OSError, AttributeError, struct.error, ValueError):
        return 0


__all__ = ["DISCONNECT_EXT", "CorkedTransport", "DisconnectHook", "close_delimited", "error_response", "peer_pid"]
