"""Serving ASGI apps with uvicorn on sockets DPLB binds itself (UDS with 0600, TCP), with DPLB owning signals.

Contract: :func:`bind_uds` creates a Unix socket with a private mode (uvicorn's own ``uds=`` makes it 0666) and
refuses to steal a socket another live process is serving; :class:`Server` is uvicorn's server minus its signal
handling, so the worker/router decide what SIGTERM means (drain first) and stop the server with
``server.should_exit = True``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
from collections.abc import Generator
from typing import Any

import uvicorn

log = logging.getLogger("dplb.serving")


class Server(uvicorn.Server):
    """uvicorn server that leaves SIGINT/SIGTERM to its owner."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def make_server(app: Any, *, timeout_keep_alive: int = 75, graceful_s: float | None = 5.0,
                access_log: bool = False) -> Server:
    """A :class:`Server` for ``app`` with uvloop + httptools when available, lifespan on, quiet logs."""
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:  # pragma: no cover
        loop = "asyncio"
    cfg = uvicorn.Config(
        app, loop=loop, http="httptools", lifespan="auto", log_level="info" if access_log else "warning",
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


def bind_tcp(host: str, port: int) -> socket.socket:
    """Bind and listen on ``host:port`` (IPv4 or IPv6 literal or name) with SO_REUSEADDR."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, socktype, proto, _, addr = infos[0]
    sock = socket.socket(family, socktype, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(addr)
    sock.listen(2048)
    sock.setblocking(False)
    return sock
