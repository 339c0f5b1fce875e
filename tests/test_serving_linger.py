"""The lingering close of the router's server (dplb.runtime.conn_timer, nginx's lingering_close): after an answer
sent while the client is still uploading, the writing side is shut and the rest is read and discarded — but never
unboundedly: the connection is closed after the idle bound without a byte, after the total bound however the
client trickles, and after the byte bound however fast it sends. In-process server, bounds made small through the
server's ``linger`` setting (no class attribute patched: the protocol class may be compiled, tests/test_native.py)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from dplb.runtime.conn_timer import LingerBounds
from dplb.runtime.serving import bind_tcp, make_server

IDLE_S, TOTAL_S, BYTES = 0.5, 2.0, 1 << 20
HEAD = b"POST /up HTTP/1.1\r\nhost: t\r\ncontent-length: 1000000000\r\n\r\n"


async def _refuse(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """413 at once, the body unread, as the router's proxy answers a body over its limit."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-length", b"2"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": b"no"})


@contextlib.contextmanager
def _serving(linger: LingerBounds) -> Iterator[tuple[Any, socket.socket, threading.Thread]]:
    """The refusing server with ``linger`` bounds on a thread of its own: (server, its socket, the thread); asked to
    exit when the block ends."""
    sock = bind_tcp("127.0.0.1", 0)
    server = make_server(_refuse, max_head_bytes=16384, graceful_s=None, linger=linger)
    loop = asyncio.new_event_loop()
    task = loop.create_task(server.serve(sockets=[sock]))
    t = threading.Thread(target=loop.run_until_complete, args=(task,), daemon=True)
    t.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield server, sock, t
    finally:
        server.should_exit = True
        t.join(10)


@pytest.fixture
def port() -> Iterator[int]:
    with _serving(LingerBounds(total_s=TOTAL_S, idle_s=IDLE_S, max_bytes=BYTES)) as (_, sock, _t):
        yield sock.getsockname()[1]


def _answered(port: int) -> socket.socket:
    """A connection whose request got its 413 and the end of the answer (the router's writing side shut)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(HEAD + b"x" * 65536)
    got = b""
    while chunk := s.recv(65536):
        got += chunk
    assert got.startswith(b"HTTP/1.1 413") and got.endswith(b"no"), got
    return s


def _closed(s: socket.socket) -> bool:
    """Whether the server closed the connection for good: bytes sent to it now are refused with a reset."""
    try:
        s.sendall(b"x")
        time.sleep(0.05)
        s.sendall(b"x")
        time.sleep(0.05)
        s.sendall(b"x")
    except OSError:
        return True
    return False


def test_an_idle_client_is_closed_after_the_idle_bound(port: int) -> None:
    s = _answered(port)
    time.sleep(IDLE_S * 0.4)
    assert not _closed(s)  # still read (and discarded)
    time.sleep(IDLE_S * 2)
    assert _closed(s)


def test_a_trickling_client_is_closed_after_the_total_bound(port: int) -> None:
    s = _answered(port)
    t0 = time.monotonic()
    while not _closed(s):
        assert time.monotonic() - t0 < TOTAL_S * 2, "lingering past its total bound"
        time.sleep(IDLE_S / 4)
    assert time.monotonic() - t0 >= TOTAL_S * 0.7


def test_a_fast_client_is_closed_after_the_byte_bound(port: int) -> None:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    sent = 0
    with pytest.raises(OSError):  # reset once the bound was read: the client cannot push its gigabyte through
        s.sendall(HEAD)
        while sent < 200 * BYTES:
            s.sendall(b"x" * 65536)
            sent += 65536
    assert sent < 20 * BYTES, sent  # the bound, plus what the two sockets' buffers hold


@pytest.mark.parametrize("refused", ["413", "400"])
def test_a_lingering_connection_does_not_hold_a_shutdown(refused: str) -> None:
    """A graceful shutdown closes a lingering connection at once, whether its refused request was complete on the
    server's side (413: the answer ended the request) or not (400 for a bad chunk mid-body: the request's cycle
    never completed, and the connection held the shutdown for the whole idle bound)."""
    with _serving(LingerBounds(total_s=30.0, idle_s=5.0, max_bytes=BYTES)) as (server, sock, t):
        s = socket.create_connection(sock.getsockname()[:2], timeout=10)
        if refused == "413":
            s.sendall(HEAD + b"x" * 65536)
        else:
            s.sendall(b"POST /up HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n" + b"x" * 65536)
        got = b""
        while chunk := s.recv(65536):  # the whole answer, then the server's EOF: lingering now
            got += chunk
        assert got.startswith(f"HTTP/1.1 {refused}".encode()), got
        t0 = time.monotonic()
        server.should_exit = True
        t.join(10)
        took = time.monotonic() - t0
        assert not t.is_alive() and took < 2.0, took
        assert _closed(s)
