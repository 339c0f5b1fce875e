"""A worker connection's awaitable API (:class:`dplb.router.upstream.UpstreamConn`, the ASGI path's): the response
head as ``response_head`` sees it whenever it comes (before the wait, during it, never: a close, the first-byte
timeout, one passed by the caller with ``expire_head``; on a connection used again), and the body as ``chunks()``
gives it (chunks queued before they are asked for and chunks waited for, keep-alive ticks that do not extend the
idle timeout, the idle timeout, a close mid-body, the end). Real Unix socket, a real peer writing the bytes; the
loop's exception handler must stay silent (no future failed that nobody awaits)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from dplb.errors import UndeliveredRequest, UpstreamClosed, UpstreamTimeout
from dplb.router.upstream import UpstreamConn
from dplb.router.upstream_pool import UpstreamPool

_OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-k: 1\r\n\r\nok"
_REQ = b"POST / HTTP/1.1\r\nhost: w\r\ncontent-length: 0\r\n\r\n"


def _run(tmp_path: Any, scenario: Any) -> None:
    path = str(tmp_path / "w.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen()
    errors: list[dict[str, object]] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
        pool = UpstreamPool([path], 1.0)
        conn = await pool.open(0)
        peer, _ = srv.accept()
        try:
            await scenario(pool, conn, peer)
        finally:
            peer.close()
            pool.close()
            await asyncio.sleep(0.02)

    asyncio.run(main())
    srv.close()
    assert not errors, errors


async def _until(cond: Any) -> None:
    for _ in range(200):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("timed out")


def test_head_before_and_during_the_wait_and_on_a_reused_connection(tmp_path: Any) -> None:
    async def scenario(pool: UpstreamPool, conn: UpstreamConn, peer: socket.socket) -> None:
        conn.send_request(_REQ, b"")
        peer.sendall(_OK)  # the head comes before anyone waits for it
        await _until(lambda: conn.status == 200)
        assert await conn.response_head(0.5) == (200, [(b"content-length", b"2"), (b"x-k", b"1")])
        assert b"".join([c async for c in conn.chunks(0.5)]) == b"ok"
        pool.release(conn)
        again = await pool.open(0)
        assert again is conn  # kept alive: the same connection, its head state reset
        again.send_request(_REQ, b"")
        waiting = asyncio.ensure_future(again.response_head(0.5))
        await asyncio.sleep(0.02)
        assert not waiting.done()
        peer.sendall(_OK.replace(b"200 OK", b"201 Created"))  # the head comes during the wait
        assert (await waiting)[0] == 201
        assert b"".join([c async for c in again.chunks(0.5)]) == b"ok"

    _run(tmp_path, scenario)


def test_head_that_never_comes(tmp_path: Any) -> None:
    async def scenario(pool: UpstreamPool, conn: UpstreamConn, peer: socket.socket) -> None:
        conn.send_request(_REQ, b"")
        with pytest.raises(UpstreamTimeout, match="first_byte"):  # the timer of the wait
            await conn.response_head(0.05)
        conn.expire_head(9.0)  # a second expiry changes nothing
        peer.sendall(_OK)  # a head after the timeout: still the timeout
        await _until(lambda: conn.status == 200)
        with pytest.raises(UpstreamTimeout, match=r"0\.05 s"):
            await conn.response_head(0.5)

    _run(tmp_path, scenario)


def test_head_expired_by_the_caller_and_a_close_before_the_wait(tmp_path: Any) -> None:
    async def scenario(pool: UpstreamPool, conn: UpstreamConn, peer: socket.socket) -> None:
        conn.send_request(_REQ, b"")
        conn.expire_head(3.0)  # timed by the caller (the direct relay): the wait raises at once
        with pytest.raises(UpstreamTimeout, match="3 s"):
            await asyncio.wait_for(conn.response_head(60.0), 0.5)
        peer.close()
        await _until(lambda: conn.closed)

        with pytest.raises(UpstreamTimeout):
            await conn.response_head(0.5)  # failed by the caller first: the close does not replace it

    _run(tmp_path, scenario)


def test_close_before_the_wait(tmp_path: Any) -> None:
    async def scenario(pool: UpstreamPool, conn: UpstreamConn, peer: socket.socket) -> None:
        conn.send_request(_REQ, b"")
        peer.close()  # the worker goes away before the head, and before anyone waits for it
        await _until(lambda: conn.closed)
        with pytest.raises(UpstreamClosed):
            await asyncio.wait_for(conn.response_head(60.0), 0.5)

    _run(tmp_path, scenario)


_SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def test_body_chunks_queued_waited_for_ticked_and_ended(tmp_path: Any) -> None:
    async def scenario(pool: UpstreamPool, conn: UpstreamConn, peer: socket.socket) -> None:
        conn.send_request(_REQ, b"")
        peer.sendall(_SSE_HEAD + _chunk(b"a") + _chunk(b"b"))  # two chunks queued before they are asked for
        await conn.response_head(0.5)
        await _until(lambda: len(conn._chunks) == 2)
        it = conn.chunks(5.0, 0.05).__aiter__()
        assert [await it.__anext__(), await it.__anext__()] == [b"a", b"b"]
        loop = asyncio.get_running_loop()
        loop.call_later(0.02, peer.sendall, _chunk(b"c"))  # one waited for
        assert await it.__anext__() == b"c"
        ticks = 0
        while ticks < 2:  # silence: keep-alive ticks
            assert await it.__anext__() == b""
            ticks += 1
        peer.sendall(_chunk(b"d") + b"0\r\n\r\n")  # the last chunk and the end in one read
        assert [c async for c in it] == [b"d"]
        assert conn.reusable

    _run(tmp_path, scenario)


def test_body_idle_timeout_not_extended_by_ticks(tmp_path: Any) -> None:
    async def scenario(pool: UpstreamPool, conn: UpstreamConn, peer: socket.socket) -> None:
        conn.send_request(_REQ, b"")
        peer.sendall(_SSE_HEAD + _chunk(b"a"))
        await conn.response_head(0.5)
        got: list[bytes] = []
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(UpstreamTimeout, match="idle"):
            async for c in conn.chunks(0.3, 0.05):
                got.append(c)
        waited = asyncio.get_running_loop().time() - t0
        assert got[0] == b"a" and set(got[1:]) == {b""} and len(got) >= 3, got  # ticks, then the timeout
        assert 0.25 < waited < 2.0, waited  # the ticks did not extend it

    _run(tmp_path, scenario)


def test_body_close_mid_body_raises_the_connection_error(
tmp_path: Any) -> None:
    async def scenario(pool: UpstreamPool, conn: UpstreamConn, peer: socket.socket) -> None:
        conn.send_request(_REQ, b"")
        peer.sendall(_SSE_HEAD + _chunk(b"a"))
        await conn.response_head(0.5)
        it = conn.chunks(5.0).__aiter__()
        assert await it.__anext__() == b"a"
        asyncio.get_running_loop().call_later(0.02, peer.close)  # closed while the iteration waits
        with pytest.raises(UpstreamClosed):
            await it.__anext__()
        with pytest.raises(UpstreamClosed):  # and asked again: at once
            await it.__anext__()

    _run(tmp_path, scenario)


async def _used_once(pool: UpstreamPool, conn: UpstreamConn, peer: socket.socket) -> UpstreamConn:
    """``conn`` answered once, released, and taken again from the pool (the same connection, ``reused``)."""
    conn.send_request(_REQ, b"")
    peer.sendall(_OK)
    await conn.response_head(0.5)
    assert b"".join([c async for c in conn.chunks(0.5)]) == b"ok"
    pool.release(conn)
    again = pool.take_idle(0)
    assert again is conn and again.reused
    return again


@pytest.mark.parametrize("how", ["reset", "epipe"])
def test_a_pooled_connection_that_ends_with_the_request_undelivered(tmp_path: Any, how: str) -> None:
    """A request on a reused connection that the peer closes with the request unread (reset), or that the peer had
    closed before the write (epipe): UndeliveredRequest with that reason, the request may go again."""
    async def scenario(pool: UpstreamPool, conn: UpstreamConn, peer: socket.socket) -> None:
        again = await _used_once(pool, conn, peer)
        if how == "epipe":
            peer.close()  # before the write, which the loop has not heard of yet
            again.send_request(_REQ, b"")
        else:
            again.send_request(_REQ, b"")
            await asyncio.sleep(0.02)
            peer.close()  # the request unread
        with pytest.raises(UndeliveredRequest) as got:
            await again.response_head(0.5)
        assert got.value.reason == how

    _run(tmp_path, scenario)


def test_a_close_after_a_response_byte_or_the_request_read_is_not_undelivered(tmp_path: Any) -> None:
    """Not undelivered: a connection closed after the first response byte (mid status line) or after the peer read
    the request (a clean EOF: it may be in the engine), and one the router aborted itself. A new connection reset
    with the request unread is undelivered too (not ``reused``: the caller tries another worker)."""
    async def scenario(pool: UpstreamPool, conn: UpstreamConn, peer: socket.socket) -> None:
        conn.send_request(_REQ, b"")
        await asyncio.sleep(0.02)
        peer.close()  # unread
        with pytest.raises(UndeliveredRequest, match="reset"):
            await conn.response_head(0.5)
        assert not conn.reused

    _run(tmp_path, scenario)
    (tmp_path / "w.sock").unlink()

    async def one_byte(pool: UpstreamPool, conn: UpstreamConn, peer: socket.socket) -> None:
        again = await _used_once(pool, conn, peer)
        again.send_request(_REQ, b"")
        peer.recv(65536)
        peer.sendall(b"H")  # one byte of the status line, then the close
        await asyncio.sleep(0.02)
        peer.shutdown(socket.SHUT_WR)
        with pytest.raises(UpstreamClosed) as got:
            await again.response_head(0.5)
        assert not isinstance(got.value, UndeliveredRequest)

    _run(tmp_path, one_byte)
    (tmp_path / "w.sock").unlink()

    async def ours(pool: UpstreamPool, conn: UpstreamConn, peer: socket.socket) -> None:
        again = await _used_once(pool, conn, peer)
        again.send_request(_REQ, b"")
        again.abort()
        with pytest.raises(UpstreamClosed) as got:
            await again.response_head(0.5)
        assert not isinstance(got.value, UndeliveredRequest)

    _run(tmp_path, ours)
    (tmp_path / "w.sock").unlink()

    async def read_then_closed(pool: UpstreamPool, conn: UpstreamConn, peer: socket.socket) -> None:
        again = await _used_once(pool, conn, peer)
        again.send_request(_REQ, b"")
        await asyncio.sleep(0.02)
        peer.recv(65536)
        peer.close()
        with pytest.raises(UpstreamClosed) as got:
            await again.response_head(0.5)
        assert not isinstance(got.value, UndeliveredRequest)

    _run(tmp_path, read_then_closed)
