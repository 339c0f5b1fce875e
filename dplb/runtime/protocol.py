"""The HTTP/1.1 server protocol of the router and the workers: uvicorn's httptools protocol, bounded, with a lean
request cycle for the requests a direct handler may take.

Contract
- :func:`bounded_protocol` is uvicorn's ``HttpToolsProtocol`` with request heads capped (431 + close above the cap;
  the raw bytes of an incomplete head are bounded too), OpenAI-shaped 400s for malformed HTTP (that rejection path
  is :mod:`dplb.runtime.rejection`, a base of the protocol class), a
  :class:`DisconnectHook` in each request's scope (``scope["extensions"][DISCONNECT_EXT]``), the response head
  written together with the first body bytes (:class:`CorkedTransport`) and one keep-alive timer per connection
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
  then hears the disconnect (its hook fires, its ASGI ``receive`` reports it), not only the last one parsed. Bad
  bytes (or a head over the cap) after complete requests wait for their answers: 400 (431) after them, then close.
  The head cap counts the head's own bytes, never a pipelined body read with it.
- Read timeouts (``timeouts``, the router's ``--header-timeout`` / ``--body-timeout``): a head not complete that
  long after its first byte (a new connection's first: after the accept), or a body silent that long between two
  reads, gets 408 ``request_timeout`` (when nothing of a response is being written, and not to a connection that
  sent nothing) and the connection is closed;
  ``on_reject`` counts it. Checked by the connection's one timer (:mod:`dplb.runtime.conn_timer`): nothing per request.
- HTTP/1.0 (never kept alive): a response without Content-Length is its bare bytes, delimited by the close.
- EOF from the client is its leaving (its requests are aborted), unless ``serve_half_closed`` and its requests
  are complete: they are answered, then the connection is closed.
- A close after an answer sent while the client may still be sending (a body not read, bytes refused: 400, 431)
  lingers (:mod:`dplb.runtime.conn_timer`), so that the client gets to read the answer, within the bounds given
  (``linger``, :class:`~dplb.runtime.conn_timer.LingerBounds`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, Final
from urllib.parse import unquote

from httptools import HttpParserError, HttpParserUpgrade, parse_url
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from dplb.runtime.conn_timer import LingerBounds
from dplb.runtime.direct import MAX_DIRECT_BODY
from dplb.runtime.edge import (
    DISCONNECT_EXT,
    CorkedTransport,
    DisconnectHook,
    close_delimited,
    error_response,
    peer_pid,
)
from dplb.runtime.lane_cycle import LaneCycle
from dplb.runtime.rejection import BAD_CODING as _BAD_CODING
from dplb.runtime.rejection import Rejection

log = logging.getLogger("dplb.serving")

#: Requests queued behind the one being answered on a connection (HTTP/1.1 pipelining) before the router stops
#: reading it. uvicorn stops at the first, and a connection not read does not report its client leaving: the
#: request being answered ran to its end. Each queued request's body is bounded by uvicorn's read pause (64 KiB).
MAX_QUEUED: Final = 8


_BASE: Final = HttpToolsProtocol
# The base class's callbacks, called as plain functions (no super() object and bound method per call: these run
# several times a request).
_start_task: Final = _BASE._start_asgi_task
_base_headers_complete: Final = _BASE.on_headers_complete
_base_body: Final = _BASE.on_body
_base_complete: Final = _BASE.on_message_complete


class ProtocolSettings:
    """What :func:`bounded_protocol` was given, prepared once (the answers it sends, the handler's bound methods)
    and shared by every connection of the server."""

    def __init__(self, max_head_bytes: int, on_reject: Callable[[str], None] | None, direct: Any,
                 timeouts: tuple[float, float] | None, serve_half_closed: bool,
                 linger: LingerBounds | None = None) -> None:
        self.max_head_bytes = max_head_bytes
        self.on_reject = on_reject
        self.direct = direct
        self.wants: Any = getattr(direct, "wants", None)  # (bound once: asked per request)
        self.begin: Any = getattr(direct, "begin", None)
        self.too_large = error_response(431, b"Request Header Fields Too Large", "headers_too_large",
                                        f"request line and headers exceed {max_head_bytes} bytes")
        self.timed = timeouts is not None
        self.head_s, self.body_s = timeouts if timeouts is not None else (0.0, 0.0)
        self.slow_head = error_response(408, b"Request Timeout", "request_timeout",
                                        f"the request head did not arrive within {self.head_s:g} s")
        self.slow_body = error_response(408, b"Request Timeout", "request_timeout",
                                        f"the request body stopped coming for {self.body_s:g} s")
        self.serve_half_closed = serve_half_closed
        self.linger = linger if linger is not None else LingerBounds()


class BoundedHttpToolsProtocol(Rejection, HttpToolsProtocol):
    """uvicorn's ``HttpToolsProtocol`` bounded and extended as the module docstring says, configured by its
    :class:`ProtocolSettings` (:func:`bounded_protocol` makes the factory that passes them)."""

    _peer_pid = 0  # SO_PEERCRED of a Unix-socket client, read once per connection
    _deferred: LaneCycle | None = None  # the request held for the direct handler until its body is complete
    _on_response: Callable[[], None]
    # uvicorn's attributes read per request, declared here: compiled, each is a typed slot instead of an entry of
    # the instance's __dict__ (a generic attribute lookup per use). uvicorn's code writes them too, so each is
    # typed as uvicorn sets it (Any where it starts at None).
    parser: Any
    expect_100_continue: bool
    limit_concurrency: int | None
    headers: Any
    url: bytes
    root_path: str
    server_state: Any
    pipeline: Any
    app: Any
    scope: Any
    server: Any
    client: Any
    scheme: Any
    app_state: dict[str, Any]
    asgi_version: Any

    def __init__(self, config: Any, server_state: Any, app_state: dict[str, Any],
                 _loop: Any = None, *, settings: ProtocolSettings) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._settings = settings
        self._max_head, self._on_reject, self._too_large_answer = (settings.max_head_bytes, settings.on_reject,
                                                                   settings.too_large)
        self._linger_bounds = settings.linger
        self._direct = settings.direct
        self._wants, self._begin = settings.wants, settings.begin
        self._timed, self._head_s, self._body_s = settings.timed, settings.head_s, settings.body_s
        self._slow_head, self._slow_body = settings.slow_head, settings.slow_body

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._peer_pid = peer_pid(transport)
        self._on_response = self.on_response_complete  # (a lane cycle's on_response, bound once)
        if self._timed:  # a connection that sends nothing is a head that never comes
            self._head_since = self.loop.time()
            self._timer = self.loop.call_at(self._head_since + self._head_s, self._due)

    def on_message_begin(self) -> None:  # uvicorn's, inlined (one call less per request)
        self._in_head, self._head_bytes, self._raw_bytes = True, 0, -1
        self.url = b""
        self.expect_100_continue = False
        self.headers = []
        self.scope = {  # (+ "asgi" and "state": _asgi_keys)
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
        self.url = self.url + url

    def on_header(self, name: bytes, value: bytes) -> None:  # uvicorn's, inlined, and the head's size counted
        self._head_bytes += len(name) + len(value) + 4
        name = name.lower()
        if value and value[-1] in (32, 9):  # llhttp keeps trailing whitespace (space, tab), which RFC 9110 §5.5
            value = value.rstrip(b" \t")  # excludes (compiled, the test costs a fifth of the call)
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        elif name == b"transfer-encoding" and value.lower() != b"chunked":  # (llhttp reads the last coding only)
            self._refusal = _BAD_CODING
        headers: list[tuple[bytes, bytes]] = self.headers
        headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._head_bytes > self._max_head:
            self._too_large = True
            raise ValueError("request head too large")  # httptools stops parsing; send_400_response below
        if self._refusal is not None:
            raise ValueError("framing refused")
        scope: dict[str, Any] = self.scope
        scope["extensions"] = {DISCONNECT_EXT: DisconnectHook(self._peer_pid, self)}
        if self._direct is not None and self._lane(scope):
            return
        scope["asgi"] = {"version": self.asgi_version, "spec_version": "2.3"}  # (_asgi_keys, inlined)
        scope["state"] = self.app_state.copy()
        prev = self.cycle
        _base_headers_complete(self)
        cycle = self.cycle
        if cycle is not prev and cycle is not None:  # (an upgrade request makes no cycle)
            cycle.transport = CorkedTransport(self.transport)
            if not cycle.keep_alive and scope["http_version"] == "1.0":
                close_delimited(cycle)
            if prev is None or prev.response_complete:  # started now (else queued, as uvicorn decided)
                self._active = cycle
            elif len(self.pipeline) < MAX_QUEUED:  # queued: uvicorn stopped reading; read on (MAX_QUEUED)
                self.flow.resume_reading()

    def _lane(self, scope: dict[str, Any]) -> bool:
        """uvicorn's ``on_headers_complete`` for a request the direct handler may take: the scope completed the
        same way, a :class:`LaneCycle`, held until the body is complete — or, queued behind another request,
        queued as uvicorn queues it (see on_response_complete). False (nothing done but the scope's method) for
        any other request."""
        parser = self.parser
        if self.expect_100_continue or self.limit_concurrency is not None or parser.get_method() != b"POST" \
                or parser.should_upgrade():
            return False
        scope["method"] = "POST"
        if not self._wants(scope):  # (first: a handler that takes nothing now costs uvicorn's path the least)
            return False
        headers: list[tuple[bytes, bytes]] = self.headers
        sized = listed = False
        for name, value in headers:
            if name == b"content-length":  # within the direct limit (llhttp refuses a second one)
                if not value.isdigit() or int(value) > MAX_DIRECT_BODY:
                    return False
                sized = True
            elif name == b"connection":
                listed = True
        if not sized:
            return False  # chunked: the app reads it (it may refuse it before reading it)
        keep_alive: bool = parser.should_keep_alive()
        if keep_alive and not listed:  # llhttp keeps alive without a Connection header only HTTP/1.1 (no string made)
            version = "1.1"
        else:
            version = parser.get_http_version()
            if version != "1.1":
                scope["http_version"] = version
                keep_alive = keep_alive and version != "1.0"
        raw_path = self.url
        query: bytes | None = b""
        # A plain path ("/…" without "?", "%", "#"; searched for by code: `b"?" in path` makes and drops a
        # TypeError first) is its own raw path and has no query: parse_url only for the others.
        if raw_path[:1] != b"/" or 63 in raw_path or 37 in raw_path or 35 in raw_path:
            url: Any = parse_url(raw_path)  # (Any: its query is None when absent, not the stubs' bytes)
            raw_path, query = url.path, url.query
        path = raw_path.decode("ascii")
        if "%" in path:
            path = unquote(path)
        root = self.root_path
        if root:
            path, raw_path = root + path, root.encode("ascii") + raw_path
        scope["path"] = path
        scope["raw_path"] = raw_path
        scope["query_string"] = query or b""
        prev = self.cycle
        cycle = self.cycle = LaneCycle(scope, self.transport, self.flow, self.server_state.default_headers,
                                       keep_alive, self._on_response)
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
            _base_body(self, body)
            return
        if len(cycle.body) + len(body) > MAX_DIRECT_BODY:  # the app reads it (the base pauses reading)
            self._deferred = None
            self._start_deferred(cycle)
            _base_body(self, body)
            return
        cycle.body.extend(body)

    def on_message_complete(self) -> None:
        cycle = self._deferred
        if cycle is None:
            _base_complete(self)
            return
        self._deferred = None
        cycle.more_body = False
        # (the cycle writes on the bare transport: the direct handler writes once per read already, no cork)
        try:
            taken = self._begin(cycle, lambda a: self._hand_on(cycle, a))
        except Exception:  # a bug in the handler: the request is not lost, the connection is closed
            log.exception("direct handler failed on %s %s", cycle.scope.get("method"), cycle.scope.get("path"))
            self.transport.close()
            return
        if not taken:
            self._start_deferred(cycle)

    def _start_deferred(self, cycle: LaneCycle) -> None:
        """Start the ASGI task of a request held for the direct handler, which did not take it."""
        cycle.transport = CorkedTransport(self.transport)
        self._hand_on(cycle, self.app)

    def _hand_on(self, cycle: LaneCycle, app: Any) -> None:
        """Run ``app`` as the task of a request held for the direct handler (see on_body)."""
        self._asgi_keys(cycle.scope)
        cycle.to_asgi(self)
        if not cycle.keep_alive and cycle.scope["http_version"] == "1.0":
            close_delimited(cycle)
        _start_task(self, cycle, app)

    def cut_response(self, hook: DisconnectHook) -> None:
        """End the response of the request whose hook is ``hook`` abnormally (:meth:`DisconnectHook.cut`): that
        request is marked disconnected and the connection closed through its cycle's transport (a held head is
        written first)."""
        for cycle in (self._active, self.cycle):
            if cycle is not None and cycle.scope.get("extensions", {}).get(DISCONNECT_EXT) is hook:
                cycle.disconnected = True
                cycle.transport.close()
                return

    def pause_writing(self) -> None:
        super().pause_writing()
        d = getattr(self.cycle, "direct", None)
        if d is not None and d.source is not None:
            d.source.pause_reading()

    def resume_writing(self) -> None:
        super().resume_writing()
        d = getattr(self.cycle, "direct", None)
        if d is not None and d.source is not None:
            d.source.resume_reading()

    def _count_timeout(self) -> None:
        if self._settings.on_reject is not None:
            self._settings.on_reject("request_timeout")

    def on_response_complete(self) -> None:  # uvicorn's, with the connection's timer
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
            if self._timed and cycle.more_body:  # its body's clock starts now
                self._body_at = self.loop.time()
                self._arm()
            return
        refusal = self._refuse_after
        if refusal is not None:  # bad bytes came after the requests now answered: their 400, then close
            if self._linger_until:  # (closing already: nothing is answered any more)
                return
            transport = self._active.transport if self._active is not None else self.transport
            transport.write(refusal)
            if transport is self.transport:
                self.close_connection()
            else:
                transport.close()  # (a CorkedTransport: what it holds, then close_connection)
            return
        now = self._idle_since = self.loop.time()
        if self._timed and self._in_head:  # the next head began while this one was answered
            self._arm()
        elif self._timer is None:
            self._timer = self.loop.call_at(now + self.timeout_keep_alive, self._due)

    def shutdown(self) -> None:
        """The server's graceful shutdown (uvicorn's, plus): a connection in its lingering close (its answer written,
        its writing side shut: :mod:`dplb.runtime.conn_timer`) closes at once, as one whose last answer is complete
        does, instead of holding the shutdown up to the lingering bounds."""
        if self._linger_until:
            self.transport.close()
            return
        super().shutdown()

    def eof_received(self) -> bool | None:  # type: ignore[override]  # (asyncio.Protocol allows True)
        """The client shut its sending side. With ``serve_half_closed`` (the settings), complete requests not
        answered yet are answered, the last one with ``connection: close`` (True: the transport stays open for
        writing); otherwise, or with no such request, the EOF closes the connection (the client left)."""
        cycle = self.cycle
        if not self._settings.serve_half_closed or cycle is None or cycle.more_body or cycle.response_complete \
                or self._linger_until:
            return None
        cycle.keep_alive = False
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
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

    def data_received(self, data: bytes) -> None:  # uvicorn's, inlined, then the bounds of an incomplete request
        self._idle_since = -1.0  # (uvicorn's _unset_keepalive_if_required: busy, see above)
        if self._refuse_after is not None:  # bad bytes were read: nothing after them is parsed
            if self._linger_until:
                self._lingered(len(data))
            return
        try:
            self.parser.feed_data(data)
        except HttpParserError:
            self.logger.warning("Invalid HTTP request received.")
            self._bad_bytes()
            return
        except HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade()
        if self._in_head:
            if not self.transport.is_closing():
                self._head_read(len(data))
        elif self._timed:
            cycle = self.cycle
            if cycle is not None and cycle.more_body and not self.transport.is_closing():
                self._body_at = self.loop.time()
                self._arm()


def bounded_protocol(max_head_bytes: int, on_reject: Callable[[str], None] | None = None,
                     direct: Any = None, timeouts: tuple[float, float] | None = None,
                     serve_half_closed: bool = False,
                     linger: LingerBounds | None = None) -> Callable[..., BoundedHttpToolsProtocol]:
    """The factory of :class:`BoundedHttpToolsProtocol` (what uvicorn's ``Config(http=...)`` takes): uvicorn's
    httptools protocol with request heads capped at ``max_head_bytes`` (431 + close above it) and OpenAI-shaped
    400s for malformed HTTP. ``on_reject(code)`` is called for each (metrics). Each request's scope
    carries a :class:`DisconnectHook` under :data:`DISCONNECT_EXT`, and its response head and first body bytes
    are written together when sent back to back (:class:`CorkedTransport`). ``direct``: a direct handler
    (:mod:`dplb.runtime.direct`) offered each request it ``wants`` once the body is complete, before any ASGI task
    (the request gets a :class:`LaneCycle`). ``timeouts``: ``(header_s, body_s)``, the
    read timeouts of the module docstring (None: none, as on the workers). ``serve_half_closed``: answer complete
    requests whose client shut its sending side, then close (else that EOF is the client leaving). ``linger``: the
    bounds of a lingering close (None: :class:`~dplb.runtime.conn_timer.LingerBounds`' defaults)."""
    settings = ProtocolSettings(max_head_bytes, on_reject, direct, timeouts, serve_half_closed, linger)
    return functools.partial(BoundedHttpToolsProtocol, settings=settings)


__all__ = ["DISCONNECT_EXT", "DisconnectHook", "LaneCycle", "bounded_protocol", "peer_pid"]
