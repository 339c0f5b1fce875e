"""The router's server keeps uvicorn's keep-alive rule with one timer per connection (dplb.runtime.serving): an idle
connection is closed ``timeout_keep_alive`` seconds after its last response, a busy one (requests following each
other, or one request longer than the timeout) never is."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from dplb.runtime.serving import bind_tcp, make_server

TIMEOUT_S = 1
REQUEST = b"GET /x HTTP/1.1\r\nhost: t\r\n\r\n"
SLOW = b"GET /slow HTTP/1.1\r\nhost: t\r\n\r\n"


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    if scope["path"] == "/slow":
        await asyncio.sleep(TIMEOUT_S * 1.5)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def _answer(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert await reader.readexactly(2) == b"ok"


async def _closed_after(reader: asyncio.StreamReader, t0: float) -> float:
    """Seconds from ``t0`` until the server closes the connection."""
    assert await asyncio.wait_for(reader.read(1), TIMEOUT_S * 4) == b""
    return time.monotonic() - t0


async def _scenario() -> None:
    sock = bind_tcp("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = make_server(_app, timeout_keep_alive=TIMEOUT_S, max_head_bytes=16384, graceful_s=None)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        # Idle after one response: closed one timeout later.
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(REQUEST)
        await _answer(r)
        idle = await _closed_after(r, time.monotonic())
        assert TIMEOUT_S * 0.8 <= idle <= TIMEOUT_S * 2.5
        w.close()
        # Requests every 0.4 timeouts for 2.4 timeouts: open throughout, then closed one timeout after the last.
        r, w = await asyncio.open_connection("127.0.0.1", port)
        t_end = time.monotonic() + TIMEOUT_S * 2.4
        while time.monotonic() < t_end:
            w.write(REQUEST)
            await _answer(r)
            await asyncio.sleep(TIMEOUT_S * 0.4)
        w.write(REQUEST)
        await _answer(r)
        after = await _closed_after(r, time.monotonic())
        assert TIMEOUT_S * 0.8 <= after <= TIMEOUT_S * 2.5
        w.close()
        # A request longer than the timeout is answered; the idle time counts from its response.
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(REQUEST)
        await _answer(r)
        w.write(SLOW)
        await _answer(r)
        after = await _closed_after(r, time.monotonic())
        assert TIMEOUT_S * 0.8 <= after <= TIMEOUT_S * 2.5
        w.close()
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


def test_keep_alive_closes_idle_connections_only() -> None:
    asyncio.run(_scenario())
