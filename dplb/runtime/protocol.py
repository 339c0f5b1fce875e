"""The HTTP/1.1 server protocol of the router and the workers: uvicorn's httptools protocol, bounded, with a lean
request cycle for the requests a direct handler may take.

Contract
- :func:`bounded_protocol` is uvicorn's ``HttpToolsProtocol`` with request heads capped (431 + close above the cap;
  the raw bytes of an incomplete head are bounded too), OpenAI-shaped 400s for malformed HTTP, a
  :class:`DisconnectHook` in each request's scope (``scope["extensions"][DISCONNECT_EXT]``), the response head
  written together with the first body bytes (:class:`_CorkedTransport`) and one keep-alive timer per connection
  (uvicorn's closing rule, timed from the same instants).
- Given a direct handler (:mod:`dplb.runtime.direct`), a request the handler may take — ``POST``, a
  ``Content-Length`` of at most :data:`MAX_DIRECT_BODY`, no ``Expect: 100-continue``, no upgrade, no
  ``limit_concurrency``, and ``wants`` says yes — gets a :class:`LaneCycle` instead of uvicorn's
  ``RequestResponseCycle``: the same class (a subclass), with the same scope, body and response state, minus what
  only an ASGI app uses (the cycle's ``asyncio.Event`` and loggers, the scope's ``asgi`` and ``state`` keys), made
  by a call with no keywords. Its body is collected without uvicorn's body callbacks and, once complete, the
  handler's ``begin`` is called. One queued behind another request on its connection (pipelining) is queued as
  uvicorn queues it and offered only if its body is still coming when its turn comes (else the app gets it). If the
  request goes to the ASGI app after all (declined, handed on with ``start``, the client gone before the body was
  complete), the protocol completes it first (the scope's two keys, :meth:`LaneCycle.to_asgi`): from then on it is
  uvicorn's cycle in every respect.
- Every other request (all of them without a direct handler, as on the workers) takes uvicorn's own path.
- Pipelining: up to :data:`MAX_QUEUED` requests queue behind the one being answered while the connection is still
  read (uvicorn stops reading at the first), so a client that leaves is seen at once; the request being answered
  then hears the disconnect (its hook fires, its ASGI ``receive`` reports it), not only the last one parsed.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

from httptools import HttpParserError, HttpParserUpgrade, parse_url
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from dplb.errors import openai_error_body
from dplb.runtime.direct import MAX_DIRECT_BODY
from dplb.runtime.lane_cycle import LaneCycle

log = logging.getLogger("dplb.serving")

#: Requests queued behind the one being answered on a connection (HTTP/1.1 pipelining) before the router stops
#: reading it. uvicorn stops at the first, and a connection not read does not report its client leaving: the
#: request being answered ran to its end. Each queued request's body is bounded by uvicorn's read pause (64 KiB).
MAX_QUEUED = 8


def _error_response(status: int, reason: bytes, kind_code: str, message: str) -> bytes:
    body = openai_error_body(message, "invalid_request_error", kind_code)
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (status, reason, len(body)) + body)


DISCONNECT_EXT = "dplb.disconnect"  # scope["extensions"] key of a request's DisconnectHook (the router's server)


class DisconnectHook:
    """``scope["extensions"]["dplb.disconnect"]`` of a request served by :func:`bounded_protocol`: ``gone`` turns
    True and ``callback()`` (set by the app, once) is called when the client's connection is lost before the
    response completed — what uvicorn's ``receive()`` reports as ``http.disconnect``, without a task awaiting it.
    ``peer_pid``: the client process on a Unix socket (``SO_PEERCRED``, read once per connection; 0 on TCP or when
    unknown) — a worker tells which router process sent a request by it (docs/DESIGN.md §8.1)."""

    __slots__ = ("callback", "gone", "peer_pid")

    def __init__(self, peer_pid: int = 0) -> None:
        self.gone = False
        self.peer_pid = peer_pid
        self.callback: Callable[[], None] | None = None

    def fire(self) -> None:
        self.gone = True
        cb, self.callback = self.callback, None
        if cb is not None:
            cb()


class _CorkedTransport:
    """The client transport as a request's response sees it: the response head is held until the next write
    (the body) or the end of the event-loop iteration, so a head and a body sent back to back go out in one
    ``send()``. Everything else is passed through."""

    __slots__ = ("_held", "_transport")

    def __init__(self, transport: Any) -> None:
        self._transport = transport
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
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
            self._transport.write(held)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return bool(self._transport.is_closing())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid (Linux)


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


def bounded_protocol(max_head_bytes: int, on_reject: Callable[[str], None] | None = None,
                     direct: Any = None) -> type:
    """uvicorn's httptools protocol with request heads capped at ``max_head_bytes`` (431 + close above it) and
    OpenAI-shaped 400s for malformed HTTP. ``on_reject(code)`` is called for each (metrics). Each request's scope
    carries a :class:`DisconnectHook` under :data:`DISCONNECT_EXT`, and its response head and first body bytes
    are written together when sent back to back (:class:`_CorkedTransport`). ``direct``: a direct handler
    (:mod:`dplb.runtime.direct`) offered each request it ``wants`` once the body is complete, before any ASGI task
    (the request gets a :class:`LaneCycle`; see the module docstring)."""
    # The base class's callbacks, called as plain functions (no super() object and bound method per call: these
    # run several times a request).
    base = HttpToolsProtocol
    start_task = base._start_asgi_task
    base_headers_complete, base_body, base_complete = base.on_headers_complete, base.on_body, base.on_message_complete

    wants: Any = getattr(direct, "wants", None)  # (bound once: asked per request)
    begin: Any = getattr(direct, "begin", None)
    too_large = _error_response(431, b"Request Header Fields Too Large", "headers_too_large",
                                f"request line and headers exceed {max_head_bytes} bytes")
    bad_http = _error_response(400, b"Bad Request", "invalid_http", "malformed HTTP request")
    # Framings the router does not take, answered like malformed HTTP (and the connection closed), since reading
    # them another way than a proxy in front does would desynchronise the connection (RFC 9112 §6.1, §9.9).
    bad_coding = _error_response(400, b"Bad Request", "invalid_http",
                                 "Transfer-Encoding other than 'chunked' is not supported")
    bad_upgrade = _error_response(400, b"Bad Request", "invalid_http",
                                  "the router switches protocols only to WebSocket: send this request without "
                                  "'Upgrade' (curl: --http1.1)")

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        _head_bytes = 0  # request line + header bytes parsed so far (exact)
        _raw_bytes = 0  # bytes read while the head is incomplete (bounds memory before a header completes)
        _in_head = True
        _too_large = False
        _refusal: bytes | None = None  # the answer to a framing refused (the connection is then closed)

        _peer_pid = 0  # SO_PEERCRED of a Unix-socket client, read once per connection
        _deferred: LaneCycle | None = None  # the request held for the direct handler until its body is complete
        _active: Any = None  # the request being answered (self.cycle is the last one parsed: maybe queued behind it)
        _idle_since = -1.0  # loop time the connection went idle after a response; -1.0 while a request is open
        _idle_timer: Any = None  # the connection's one keep-alive timer (see _keep_alive_due)
        _on_response: Callable[[], None]

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._peer_pid = peer_pid(transport)
            self._on_response = self.on_response_complete  # (a lane cycle's on_response, bound once)

        def on_message_begin(self) -> None:  # uvicorn's, inlined (one call less per request)
            self._in_head, self._head_bytes, self._raw_bytes = True, 0, 0
            self.url = b""
            self.expect_100_continue = False
            self.headers = []
            self.scope = {  # type: ignore[typeddict-item]  # (+ "asgi" and "state": _asgi_keys)
                "type": "http",
                "http_version": "1.1",
                "server": self.server,
                "client": self.client,
                "scheme": self.scheme,
                "root_path": self.root_path,
                "headers": self.headers,
            }

        def _asgi_keys(self, scope: Any) -> None:
            """The scope's keys only an ASGI app reads, added once the request is known to go to one."""
            scope["asgi"] = {"version": self.asgi_version, "spec_version": "2.3"}
            scope["state"] = self.app_state.copy()

        def on_url(self, url: bytes) -> None:  # uvicorn's, inlined
            self._head_bytes += len(url)
            self.url += url

        def on_header(self, name: bytes, value: bytes) -> None:  # uvicorn's, inlined, and the head's size counted
            self._head_bytes += len(name) + len(value) + 4
            name = name.lower()
            value = value.rstrip(b" \t")  # llhttp keeps trailing whitespace, which RFC 9110 §5.5 excludes
            if name == b"expect" and value.lower() == b"100-continue":
                self.expect_100_continue = True
            elif name == b"transfer-encoding" and value.lower() != b"chunked":  # (llhttp reads the last coding only)
                self._refusal = bad_coding
            self.headers.append((name, value))

        def on_headers_complete(self) -> None:
            self._in_head = False
            if self._head_bytes > max_head_bytes:
                self._too_large = True
                raise ValueError("request head too large")  # httptools stops parsing; send_400_response below
            if self._refusal is not None:
                raise ValueError("framing refused")
            scope = self.scope
            scope["extensions"] = {DISCONNECT_EXT: DisconnectHook(self._peer_pid)}  # type: ignore[dict-item]
            if direct is not None and self._lane(scope):
                return
            scope["asgi"] = {"version": self.asgi_version, "spec_version": "2.3"}  # (_asgi_keys, inlined)
            scope["state"] = self.app_state.copy()
            prev = self.cycle
            base_headers_complete(self)
            cycle = self.cycle
            if cycle is not prev and cycle is not None:  # (an upgrade request makes no cycle)
                cycle.transport = _CorkedTransport(self.transport)  # type: ignore[assignment]
                if prev is None or prev.response_complete:  # started now (else queued, as uvicorn decided)
                    self._active = cycle
                elif len(self.pipeline) < MAX_QUEUED:  # queued: uvicorn stopped reading; read on (MAX_QUEUED)
                    self.flow.resume_reading()

        def _lane(self, scope: Any) -> bool:
            """uvicorn's ``on_headers_complete`` for a request the direct handler may take: the scope completed the
            same way, a :class:`LaneCycle`, held until the body is complete — or, queued behind another request,
            queued as uvicorn queues it (see on_response_complete). False (nothing done but the scope's method) for
            any other request."""
            parser = self.parser
            if self.expect_100_continue or self.limit_concurrency is not None or parser.get_method() != b"POST" \
                    or parser.should_upgrade():
                return False
            scope["method"] = "POST"
            if not wants(scope):  # (first: a handler that takes nothing now costs uvicorn's path the least)
                return False
            for name, value in self.headers:  # a Content-Length within the direct limit (the first one: see begin)
                if name == b"content-length":
                    if not value.isdigit() or int(value) > MAX_DIRECT_BODY:
                        return False
                    break
            else:
                return False  # chunked: the app reads it (it may refuse it before reading it)
            version = parser.get_http_version()
            if version != "1.1":
                scope["http_version"] = version
            url = parse_url(self.url)
            raw_path = url.path
            path = raw_path.decode("ascii")
            if "%" in path:
                path = unquote(path)
            root = self.root_path
            if root:
                path, raw_path = root + path, root.encode("ascii") + raw_path
            scope["path"] = path
            scope["raw_path"] = raw_path
            scope["query_string"] = url.query or b""
            prev = self.cycle
            cycle = self.cycle = LaneCycle(scope, self.transport, self.flow, self.server_state.default_headers,
                                           version != "1.0" and parser.should_keep_alive(), self._on_response)
            if prev is None or prev.response_complete:
                self._deferred = self._active = cycle
            else:  # pipelined: queued as uvicorn queues it, the connection still read up to MAX_QUEUED
                self.pipeline.appendleft((cycle, self.app))
                if len(self.pipeline) >= MAX_QUEUED:
                    self.flow.pause_reading()
            return True

        # A held request's body is collected here without the base's checks (an upgrade has no cycle; nothing was
        # answered yet) and without a message event (no task waits on it; to_asgi makes one, set, if it goes to a
        # task): the state the base's callbacks would have left it in.
        def on_body(self, body: bytes) -> None:
            cycle = self._deferred
            if cycle is None:
                base_body(self, body)
                return
            if len(cycle.body) + len(body) > MAX_DIRECT_BODY:  # the app reads it (the base pauses reading)
                self._deferred = None
                self._start_deferred(cycle)
                base_body(self, body)
                return
            cycle.body += body

        def on_message_complete(self) -> None:
            cycle = self._deferred
            if cycle is None:
                base_complete(self)
                return
            self._deferred = None
            cycle.more_body = False
            # (the cycle writes on the bare transport: the direct handler writes once per read already, no cork)
            try:
                taken = begin(cycle, lambda a: self._hand_on(cycle, a))
            except Exception:  # a bug in the handler: the request is not lost, the connection is closed
                log.exception("direct handler failed on %s %s", cycle.scope.get("method"), cycle.scope.get("path"))
                self.transport.close()
                return
            if not taken:
                self._start_deferred(cycle)

        def _start_deferred(self, cycle: LaneCycle) -> None:
            """Start the ASGI task of a request held for the direct handler, which did not take it."""
            cycle.transport = _CorkedTransport(self.transport)  # type: ignore[assignment]
            self._hand_on(cycle, self.app)

        def _hand_on(self, cycle: LaneCycle, app: Any) -> None:
            """Run ``app`` as the task of a request held for the direct handler (see on_body)."""
            self._asgi_keys(cycle.scope)
            cycle.to_asgi(self)
            start_task(self, cycle, app)

        def pause_writing(self) -> None:
            super().pause_writing()
            d = getattr(self.cycle, "direct", None)
            if d is not None and d.pause is not None:
                d.pause()

        def resume_writing(self) -> None:
            super().resume_writing()
            d = getattr(self.cycle, "direct", None)
            if d is not None and d.resume is not None:
                d.resume()

        # Keep-alive: uvicorn arms a timer after every response and cancels it at the next request's first bytes
        # (a timer made and cancelled per request). Here the connection's one timer stays armed: data arriving only
        # marks the connection busy, a response marks it idle since then, and the timer, when it fires, closes an
        # idle connection whose time is up, re-arms itself at the idle one's later deadline, or lapses while busy
        # (the next response arms it again). The same closing rule, timed from the same instants.
        def _unset_keepalive_if_required(self) -> None:
            self._idle_since = -1.0

        def on_response_complete(self) -> None:  # uvicorn's, with the keep-alive timer above
            self.server_state.total_requests += 1
            if self.transport.is_closing():
                return
            flow = self.flow
            if flow.read_paused:
                flow.resume_reading()
            if self.pipeline:  # the next pipelined request starts (busy)
                self._idle_since = -1.0
                cycle, app = self.pipeline.pop()
                self._active = cycle
                if type(cycle) is not LaneCycle:
                    self._start_asgi_task(cycle, app)
                elif cycle is self.cycle and cycle.more_body:  # its body still coming: held for the direct handler
                    self._deferred = cycle
                else:  # complete already (its body came while it was queued): the app's
                    self._start_deferred(cycle)
                return
            now = self._idle_since = self.loop.time()
            if self._idle_timer is None:
                self._idle_timer = self.loop.call_at(now + self.timeout_keep_alive, self._keep_alive_due)

        def _keep_alive_due(self) -> None:
            self._idle_timer = None
            since = self._idle_since
            if since < 0.0 or self.transport.is_closing():
                return
            due = since + self.timeout_keep_alive
            if self.loop.time() >= due:
                self.timeout_keep_alive_handler()
            else:
                self._idle_timer = self.loop.call_at(due, self._keep_alive_due)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._idle_timer is not None:
                self._idle_timer.cancel()
                self._idle_timer = None
            deferred, self._deferred = self._deferred, None
            super().connection_lost(exc)
            # uvicorn tells the last request parsed (self.cycle); with requests pipelined behind it, the one being
            # answered is another, and it must hear the disconnect too (its engine request is aborted, its worker
            # released). Queued requests never started: nothing to tell.
            active, last = self._active, self.cycle
            if active is not None and active is not last and not active.response_complete:
                active.disconnected = True
                active.message_event.set()
            if deferred is not None:  # the client left before its body was complete: the app hears the disconnect
                self._start_deferred(deferred)
            for cycle in (active, last) if active is not last else (last,):
                if cycle is not None and cycle.disconnected:
                    hook: Any = cycle.scope.get("extensions", {}).get(DISCONNECT_EXT)
                    if hook is not None:
                        hook.fire()

        def data_received(self, data: bytes) -> None:  # uvicorn's, inlined, then the raw head's bound
            self._idle_since = -1.0  # (uvicorn's _unset_keepalive_if_required: busy, see above)
            try:
                self.parser.feed_data(data)
            except HttpParserError:
                self.logger.warning("Invalid HTTP request received.")
                self.send_400_response("Invalid HTTP request received.")
                return
            except HttpParserUpgrade:
                if self._should_upgrade():
                    self.handle_websocket_upgrade()
                else:
                    self._unsupported_upgrade()
            if not self._in_head or self.transport.is_closing():
                return
            self._raw_bytes += len(data)
            if self._raw_bytes > max_head_bytes:  # a head still incomplete past the cap: stop reading it now
                self._too_large = True
                self.send_400_response("")

        def _unsupported_upgrade(self) -> None:
            """An ``Upgrade`` to anything but WebSocket: llhttp ends the request at its head and leaves the rest of
            the bytes to the other protocol, so a body would be lost (the app would read none) and then read as the
            next request. A request without a body is answered, then the connection closed; one with a body gets a
            400 instead of its app's answer (the app hears a disconnect), and the connection is closed."""
            self._unsupported_upgrade_warning()
            cycle = self.cycle
            if not any(n == b"transfer-encoding" or (n == b"content-length" and v.strip(b"0"))
                       for n, v in self.headers):
                if cycle is not None:
                    cycle.keep_alive = False
                self.flow.pause_reading()
                return
            if cycle is not None and not cycle.response_started:
                cycle.disconnected = True  # (before its task runs: its answer is never written, the 400 is)
            self._refusal = bad_upgrade
            self.send_400_response("")

        def send_400_response(self, msg: str) -> None:
            code = "headers_too_large" if self._too_large else "invalid_http"
            if on_reject is not None:
                on_reject(code)
            cycle, active = self.cycle, self._active
            # No request open, or the bad bytes are the open request's own body (a malformed chunk) before its
            # answer began: answer 400; its app then sees a disconnect. Else (a pipelined request while the previous
            # one is still being answered, or its answer is streaming) a 400 would read as that answer: only close.
            idle = active is None or active is cycle or active.response_complete
            if idle and (cycle is None or cycle.response_complete
                         or ((cycle.more_body or self._refusal) and not cycle.response_started)):
                self.transport.write(too_large if self._too_large else self._refusal or bad_http)
            self.transport.close()

    return BoundedHttpToolsProtocol


__all__ = ["DISCONNECT_EXT", "DisconnectHook", "LaneCycle", "bounded_protocol", "peer_pid"]
