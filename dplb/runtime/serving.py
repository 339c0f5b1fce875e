"""Serving ASGI apps with uvicorn on sockets DPLB binds itself (UDS with 0600, TCP), with DPLB owning signals.

Contract: :func:`bind_uds` creates a Unix socket with a private mode (uvicorn's own ``uds=`` makes it 0666) and
refuses to steal a socket another live process is serving; :class:`Server` is uvicorn's server minus its signal
handling, so the worker/router decide what SIGTERM means (drain first) and stop the server with
``server.should_exit = True``. ``make_server(max_head_bytes=N)`` (the router's edge) caps each request head (request
line + headers): uvicorn/httptools buffer a head without limit and concatenate it piece by piece, so one client
sending a 50 MB header cost the router 5 s of CPU and 50 MB of memory; over the cap the client gets a 431 and the
connection is closed. Malformed HTTP (a broken chunk of a request body too) gets a 400 in the same OpenAI error shape
as every other router error. The
same server gives each request a :class:`DisconnectHook` (a callback on client disconnect, instead of a task per
request awaiting ``receive()``) and writes a response head together with the body bytes sent right after it.
:func:`run_async` runs a process's main coroutine on uvloop (asyncio without it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
import struct
from collections.abc import Callable, Generator
from typing import Any

import uvicorn

from dplb.errors import openai_error_body
from dplb.runtime.direct import MAX_DIRECT_BODY

log = logging.getLogger("dplb.serving")


class Server(uvicorn.Server):
    """uvicorn server that leaves SIGINT/SIGTERM to its owner."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


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


def _small_body(scope: Any) -> bool:
    """Whether the request declares a ``Content-Length`` of at most :data:`MAX_DIRECT_BODY` bytes (a larger or
    chunked body goes to the app, which may refuse it before reading it)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return value.isdigit() and int(value) <= MAX_DIRECT_BODY
    return False


def bounded_protocol(max_head_bytes: int, on_reject: Callable[[str], None] | None = None,
                     direct: Any = None) -> type:
    """uvicorn's httptools protocol with request heads capped at ``max_head_bytes`` (431 + close above it) and
    OpenAI-shaped 400s for malformed HTTP. ``on_reject(code)`` is called for each (metrics). Each request's scope
    carries a :class:`DisconnectHook` under :data:`DISCONNECT_EXT`, and its response head and first body bytes
    are written together when sent back to back (:class:`_CorkedTransport`). ``direct``: a direct handler
    (:mod:`dplb.runtime.direct`) offered each request it ``wants`` once the body is complete, before any ASGI task."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    # The base class's callbacks, called as plain functions (no super() object and bound method per call: these
    # run several times a request).
    base = HttpToolsProtocol
    start_task, base_begin, base_url = base._start_asgi_task, base.on_message_begin, base.on_url
    base_headers_complete, base_body, base_complete = base.on_headers_complete, base.on_body, base.on_message_complete

    too_large = _error_response(431, b"Request Header Fields Too Large", "headers_too_large",
                                f"request line and headers exceed {max_head_bytes} bytes")
    bad_http = _error_response(400, b"Bad Request", "invalid_http", "malformed HTTP request")

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        _head_bytes = 0  # request line + header bytes parsed so far (exact)
        _raw_bytes = 0  # bytes read while the head is incomplete (bounds memory before a header completes)
        _in_head = True
        _too_large = False

        _peer_pid = 0  # SO_PEERCRED of a Unix-socket client, read once per connection
        _deferred: Any = None  # (cycle, app) held for the direct handler until the body is complete
        _idle_since = -1.0  # loop time the connection went idle after a response; -1.0 while a request is open
        _idle_timer: Any = None  # the connection's one keep-alive timer (see _keep_alive_due)

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._peer_pid = peer_pid(transport)

        def on_message_begin(self) -> None:
            self._in_head, self._head_bytes, self._raw_bytes = True, 0, 0
            base_begin(self)

        def on_url(self, url: bytes) -> None:
            self._head_bytes += len(url)
            base_url(self, url)

        def on_header(self, name: bytes, value: bytes) -> None:  # uvicorn's, inlined, and the head's size counted
            self._head_bytes += len(name) + len(value) + 4
            name = name.lower()
            value = value.rstrip(b" \t")  # llhttp keeps trailing whitespace, which RFC 9110 §5.5 excludes
            if name == b"expect" and value.lower() == b"100-continue":
                self.expect_100_continue = True
            self.headers.append((name, value))

        def on_headers_complete(self) -> None:
            self._in_head = False
            if self._head_bytes > max_head_bytes:
                self._too_large = True
                raise ValueError("request head too large")  # httptools stops parsing; send_400_response below
            self.scope["extensions"] = {DISCONNECT_EXT: DisconnectHook(self._peer_pid)}  # type: ignore[dict-item]
            prev = self.cycle
            base_headers_complete(self)
            cycle = self.cycle
            if cycle is not prev and cycle is not None:  # (an upgrade request makes no cycle)
                deferred = self._deferred
                if deferred is None or deferred[0] is not cycle:  # (a deferred one is corked if the app gets it)
                    cycle.transport = _CorkedTransport(self.transport)  # type: ignore[assignment]

        def _start_asgi_task(self, cycle: Any, app: Any) -> None:
            if direct is not None and cycle is self.cycle and cycle.more_body and not cycle.waiting_for_100_continue \
                    and _small_body(cycle.scope) and direct.wants(cycle.scope):
                self._deferred = (cycle, app)  # offered to the direct handler at on_message_complete
                return
            start_task(self, cycle, app)

        # A request held for the direct handler has no task waiting on its cycle's message event: its body is
        # collected here without the base's checks (an upgrade has no cycle; nothing was answered yet) and without
        # setting the event, which is set once if the request goes to a task (_hand_on): the state the base's
        # callbacks would have left it in.
        def on_body(self, body: bytes) -> None:
            deferred = self._deferred
            if deferred is None:
                base_body(self, body)
                return
            cycle = deferred[0]
            if len(cycle.body) + len(body) > MAX_DIRECT_BODY:  # the app reads it (the base pauses reading)
                self._deferred = None
                self._start_deferred(*deferred)
                base_body(self, body)
                return
            cycle.body += body

        def on_message_complete(self) -> None:
            deferred = self._deferred
            if deferred is None or deferred[0] is not self.cycle:
                base_complete(self)
                return
            self._deferred = None
            cycle, app = deferred
            cycle.more_body = False
            if not self._offer(cycle):
                self._start_deferred(cycle, app)

        def _start_deferred(self, cycle: Any, app: Any) -> None:
            """Start the ASGI task of a request held for the direct handler, which did not take it."""
            cycle.transport = _CorkedTransport(self.transport)
            self._hand_on(cycle, app)

        def _hand_on(self, cycle: Any, app: Any) -> None:
            """Run ``app`` as the task of a request held for the direct handler (see on_body)."""
            cycle.message_event.set()
            start_task(self, cycle, app)

        def _offer(self, cycle: Any) -> bool:
            # (the cycle writes on the bare transport: the direct handler writes once per read already, no cork)
            try:
                return bool(direct.begin(cycle, lambda a: self._hand_on(cycle, a)))
            except Exception:  # a bug in the handler: the request is not lost, the connection is closed
                log.exception("direct handler failed on %s %s", cycle.scope.get("method"), cycle.scope.get("path"))
                self.transport.close()
                return True

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
            self.flow.resume_reading()
            if self.pipeline:  # the next pipelined request starts (busy)
                self._idle_since = -1.0
                cycle, app = self.pipeline.pop()
                self._start_asgi_task(cycle, app)
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
            if deferred is not None:  # the client left before its body was complete: the app hears the disconnect
                self._start_deferred(*deferred)
            cycle = self.cycle
            if cycle is not None and cycle.disconnected:
                hook: Any = cycle.scope.get("extensions", {}).get(DISCONNECT_EXT)
                if hook is not None:
                    hook.fire()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if not self._in_head or self.transport.is_closing():
                return
            self._raw_bytes += len(data)
            if self._raw_bytes > max_head_bytes:  # a head still incomplete past the cap: stop reading it now
                self._too_large = True
                self.send_400_response("")

        def send_400_response(self, msg: str) -> None:
            code = "headers_too_large" if self._too_large else "invalid_http"
            if on_reject is not None:
                on_reject(code)
            cycle = self.cycle
            # No request open, or the bad bytes are the open request's own body (a malformed chunk) before its
            # answer began: answer 400; its app then sees a disconnect. Else (a pipelined request while the previous
            # one is still being answered, or its answer is streaming) a 400 would read as that answer: only close.
            if cycle is None or cycle.response_complete or (cycle.more_body and not cycle.response_started):
                self.transport.write(too_large if self._too_large else bad_http)
            self.transport.close()

    return BoundedHttpToolsProtocol


def make_server(app: Any, *, timeout_keep_alive: int = 75, graceful_s: float | None = 5.0,
                access_log: bool = False, max_head_bytes: int | None = None,
                on_reject: Callable[[str], None] | None = None, direct: Any = None) -> Server:
    """A :class:`Server` for ``app`` with uvloop + httptools when available, lifespan on, quiet logs.
    ``max_head_bytes``: cap request heads (see the module docstring); ``on_reject(code)`` counts those refusals;
    ``direct``: a direct handler (:mod:`dplb.runtime.direct`; needs ``max_head_bytes``)."""
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:  # pragma: no cover
        loop = "asyncio"
    http: Any = "httptools" if max_head_bytes is None else bounded_protocol(max_head_bytes, on_reject, direct)
    cfg = uvicorn.Config(
        app, loop=loop, http=http, lifespan="auto", log_level="info" if access_log else "warning",
        access_log=access_log, log_config=None,  # uvicorn's lines go through DPLB's logging format
        timeout_keep_alive=timeout_keep_alive, proxy_headers=False,  # DPLB is the edge: no X-Forwarded-* rewriting
        timeout_graceful_shutdown=int(graceful_s) if graceful_s is not None else None,
    )
    return Server(cfg)


def raise_fd_limit() -> tuple[int, int]:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit and return ``(old_soft, new_soft)``.

    Every proxied request holds two descriptors (client + worker connection), so a shell's usual soft limit of
    1024 caps the router near 500 concurrent requests with ``EMFILE`` accept errors; servers raise it themselves
    (systemd units also set ``LimitNOFILE``). Never lowers it; errors leave it unchanged."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            return soft, want
    return soft, soft


def bind_uds(path: str, mode: int = 0o600) -> socket.socket:
    """Bind and listen on a Unix socket at ``path`` with ``mode``.

    A leftover socket file from a dead process is replaced; a socket some live process still accepts on raises
    ``OSError`` (two workers must never share a socket). The parent directory must exist.
    """
    if os.path.exists(path) or os.path.islink(path):
        st = os.lstat(path)
        if not stat.S_ISSOCK(st.st_mode):
            raise OSError(f"{path} exists and is not a socket; refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(0.5)
        try:
            probe.connect(path)
        except OSError:
            log.info("removing stale socket %s", path)
            os.unlink(path)
        else:
            raise OSError(f"{path} is in use by another live process; stop it first")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o777 & ~mode)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, mode)
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def bind_tcp(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """Bind and listen on ``host:port`` (IPv4 or IPv6 literal or name) with SO_REUSEADDR; ``reuse_port`` adds
    SO_REUSEPORT (the processes of one router group listen on one port; the kernel spreads connections)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, socktype, proto, _, addr = infos[0]
    sock = socket.socket(family, socktype, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(addr)
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def run_async(coro: Any) -> int:
    """Run ``coro`` (a process's main coroutine, returning an exit code) to completion on uvloop, or on asyncio
    where uvloop is missing. Returns its exit code."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        import asyncio

        return int(asyncio.run(coro))
    return int(uvloop.run(coro))
