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
request awaiting ``receive()``) and writes a response head together with the body bytes sent right after it. The
protocol itself (:func:`bounded_protocol`, and the lean request cycle of the direct relay's requests) lives in
:mod:`dplb.runtime.protocol` and is re-exported here. :func:`run_async` runs a process's main coroutine on uvloop
(asyncio without it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
from collections.abc import Callable, Generator
from typing import Any

import uvicorn

from dplb.runtime.conn_timer import LingerBounds
from dplb.runtime.protocol import DISCONNECT_EXT, DisconnectHook, LaneCycle, bounded_protocol, peer_pid

log = logging.getLogger("dplb.serving")


class Server(uvicorn.Server):
    """uvicorn server that leaves SIGINT/SIGTERM to its owner."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def make_server(app: Any, *, timeout_keep_alive: int = 75, graceful_s: float | None = 5.0,
                access_log: bool = False, max_head_bytes: int | None = None,
                on_reject: Callable[[str], None] | None = None, direct: Any = None,
                read_timeouts: tuple[float, float] | None = None, serve_half_closed: bool = False,
                linger: LingerBounds | None = None) -> Server:
    """A :class:`Server` for ``app`` with uvloop + httptools when available, lifespan on, quiet logs.
    ``max_head_bytes``: cap request heads (see the module docstring); ``on_reject(code)`` counts those refusals;
    ``direct``: a direct handler (:mod:`dplb.runtime.direct`); ``read_timeouts``: ``(header_s, body_s)``, 408 and
    close for a request head not complete within header_s seconds or a body silent for body_s;
    ``serve_half_closed``: answer a complete request whose client shut its sending side (else it is aborted);
    ``linger``: the bounds of the lingering close (None: the defaults of :class:`LingerBounds`). The last five need
    ``max_head_bytes`` (:func:`bounded_protocol`)."""
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:  # pragma: no cover
        loop = "asyncio"
    http: Any = "httptools" if max_head_bytes is None else bounded_protocol(
        max_head_bytes, on_reject, direct, read_timeouts, serve_half_closed, linger)
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


__all__ = ["DISCONNECT_EXT", "DisconnectHook", "LaneCycle", "Server", "bind_tcp", "bind_uds", "bounded_protocol",
           "make_server", "peer_pid", "raise_fd_limit", "run_async"]
