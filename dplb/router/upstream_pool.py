"""The keep-alive pool of connections to the workers' Unix sockets, and a one-shot request over it.

Contract
- :meth:`UpstreamPool.open` returns a connected :class:`dplb.router.upstream.UpstreamConn`: an idle pooled one
  (:meth:`UpstreamPool.take_idle`, marked ``reused``) or a new one (:meth:`UpstreamPool.connect`). Connecting raises
  :class:`dplb.errors.ConnectFailed` (socket missing, refused, connect timeout): nothing was sent, so the caller may
  retry on another worker.
- A connection goes back to the pool only after a complete response on a keep-alive connection
  (:meth:`UpstreamPool.release`); idle ones older than :data:`POOL_IDLE_S` (the workers keep theirs 75 s) or found
  closed are dropped when met; at most :data:`POOL_MAX_PER_WORKER` wait per worker, newest taken first.
- :func:`fetch`: one small request (``/v1/models``, the LoRA fan-out) on a pooled or new connection.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Final

from dplb.errors import ConnectFailed
from dplb.router.upstream import UpstreamConn

POOL_IDLE_S: Final = 20.0  # pooled connections idle longer are closed (workers keep idle connections 75 s)
POOL_MAX_PER_WORKER: Final = 256
# (Final: compiled, a C constant or static instead of a module-dict lookup and an attribute lookup per use.)
_monotonic: Final = time.monotonic


class UpstreamPool:
    """Keep-alive connections per worker socket. ``socket_paths[k]``: worker k's socket."""

    def __init__(self, socket_paths: list[str], connect_timeout_s: float = 5.0) -> None:
        self.socket_paths = socket_paths
        self.connect_timeout_s = connect_timeout_s
        self._idle: list[collections.deque[UpstreamConn]] = [collections.deque() for _ in socket_paths]

    async def open(self, worker: int) -> UpstreamConn:
        """A pooled live connection to ``worker`` or a new one. Raises :class:`ConnectFailed`."""
        c = self.take_idle(worker)
        if c is not None:
            return c
        return await self.connect(worker)

    async def connect(self, worker: int) -> UpstreamConn:
        """A new connection to ``worker`` (never a pooled one), within ``connect_timeout_s``. Raises
        :class:`ConnectFailed`."""
        loop = asyncio.get_running_loop()
        try:
            _, proto = await asyncio.wait_for(
                loop.create_unix_connection(lambda: UpstreamConn(worker), self.socket_paths[worker]),
                self.connect_timeout_s,
            )
        except (OSError, TimeoutError) as e:
            raise ConnectFailed(f"cannot connect to worker {worker} at {self.socket_paths[worker]}: {e}") from e
        return proto

    def take_idle(self, worker: int) -> UpstreamConn | None:
        """A pooled live connection to ``worker`` (marked ``reused``), or None when none is idle (no connect: the
        caller that cannot wait for one uses :meth:`open`)."""
        idle = self._idle[worker]
        now = _monotonic()
        while idle:
            c = idle.pop()
            if not c.closed and c.transport is not None and not c.transport.is_closing() \
                    and now - c.last_used < POOL_IDLE_S:
                c.reused = True
                return c
            c.abort()
        return None

    def release(self, conn: UpstreamConn) -> None:
        """Return ``conn`` to the pool if it can carry another request, else close it."""
        idle = self._idle[conn.worker]
        if conn.reusable and len(idle) < POOL_MAX_PER_WORKER:
            conn.last_used = _monotonic()
            idle.append(conn)
        else:
            conn.abort()

    def drop(self, worker: int) -> None:
        """Close every idle connection to ``worker`` (it restarted or went away)."""
        idle = self._idle[worker]
        while idle:
            idle.pop().abort()

    def close(self) -> None:
        """Close every idle connection."""
        for k in range(len(self._idle)):
            self.drop(k)


async def fetch(pool: UpstreamPool, worker: int, path: str, timeout_s: float, body: bytes | None = None,
                content_type: bytes = b"application/json") -> tuple[int, bytes]:
    """A small ``GET path`` (or ``POST`` of ``body``) to ``worker`` (``/v1/models``, the LoRA fan-out): (status,
    body); ``timeout_s`` per phase. Raises :class:`dplb.errors.UpstreamError`."""
    conn = await pool.open(worker)
    ok = False
    try:
        if body is None:
            head = f"GET {path} HTTP/1.1\r\nhost: dplb-worker\r\n\r\n".encode()
        else:
            head = (f"POST {path} HTTP/1.1\r\nhost: dplb-worker\r\ncontent-length: {len(body)}\r\n".encode()
                    + b"content-type: " + content_type + b"\r\n\r\n")
        conn.send_request(head, body or b"")
        status, _ = await conn.response_head(timeout_s)
        body = b"".join([c async for c in conn.chunks(timeout_s)])
        ok = True
        return status, body
    finally:
        if ok:
            pool.release(conn)
        else:
            conn.abort()


__all__ = ["POOL_IDLE_S", "POOL_MAX_PER_WORKER", "UpstreamPool", "fetch"]
