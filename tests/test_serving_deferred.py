"""A request held for the direct handler (dplb.runtime.serving) reaches the ASGI app whole whichever way it leaves
the handler: declined, handed on by the handler (``start``), or past the direct body limit mid-body; its body may
come in several reads and behind another request on the same connection (pipelining). The app reads it with
``receive()``, which waits on the cycle's message event: the held request's event must be set when it is handed
on."""

from __future__ import annotations

import asyncio
from typing import Any

from dplb.runtime.direct import MAX_DIRECT_BODY, DirectResponse
from dplb.runtime.serving import bind_tcp, make_server


async def _echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    out = scope["path"].encode() + b":" + str(len(body)).encode() + b":" + body[:8]
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(out))]})
    await send({"type": "http.response.body", "body": out})


class _Direct:
    def wants(self, scope: dict[str, Any]) -> bool:
        return bool(scope["method"] == "POST")

    def begin(self, cycle: Any, start: Any) -> bool:
        path = cycle.scope["path"]
        if path == "/decline":
            return False
        if path == "/continue":
            start(_echo)
            return True
        r = DirectResponse(cycle)
        out = b"direct:%d" % len(cycle.body)
        r.start(200, [(b"content-length", b"%d" % len(out))])
        r.body(out)
        r.end()
        return True


def _post(path: str, body: bytes) -> bytes:
    return b"POST %s HTTP/1.1\r\nhost: t\r\ncontent-length: %d\r\n\r\n" % (path.encode(), len(body)) + body


async def _answer(reader: asyncio.StreamReader) -> bytes:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 200"), head
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    return await reader.readexactly(length)


async def _scenario() -> None:
    sock = bind_tcp("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = make_server(_echo, max_head_bytes=16384, graceful_s=None, direct=_Direct())
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        r, w = await asyncio.open_connection("127.0.0.1", port)
        for path in ("/decline", "/continue", "/direct"):
            req = _post(path, b"abcdefghij")  # the body in three reads
            w.write(req[:-10])
            await w.drain()
            await asyncio.sleep(0.05)
            w.write(req[-10:-4])
            await w.drain()
            await asyncio.sleep(0.05)
            w.write(req[-4:])
            expect = b"direct:10" if path == "/direct" else path.encode() + b":10:abcdefgh"
            assert await _answer(r) == expect
        # Pipelined: all three in one write, answered in order (one queued behind another goes to the app).
        w.write(b"".join(_post(p, b"xyz") for p in ("/continue", "/direct", "/decline")))
        assert [await _answer(r) for _ in range(3)] == [b"/continue:3:xyz", b"/direct:3:xyz", b"/decline:3:xyz"]
        # Past the direct limit mid-body: the app reads all of it.
        big = b"B" * (MAX_DIRECT_BODY + 1000)
        req = _post("/direct", big)
        w.write(req[:MAX_DIRECT_BODY // 2])
        await w.drain()
        await asyncio.sleep(0.05)
        w.write(req[MAX_DIRECT_BODY // 2:])
        assert await _answer(r) == b"/direct:%d:BBBBBBBB" % len(big)
        w.close()
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


def test_held_requests_reach_the_app_whole() -> None:
    asyncio.run(_scenario())
