"""Flow control of a direct response (:class:`dplb.runtime.direct.DirectResponse`): while its client reads slower
than it is written, the response's ``source`` is paused (``pause_reading``) once the client transport's write buffer
crosses its high-water mark and resumed (``resume_reading``) once it drained — the router's direct relay stops
reading the worker's socket meanwhile. Real server protocol, real TCP socket; the client does not read at first."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from dplb.runtime.direct import DirectResponse
from dplb.runtime.serving import bind_tcp, make_server

CHUNK = b"x" * 65536
CHUNKS = 64  # 4 MiB: far over any write buffer's high-water mark and the socket buffers


class _Source:
    """Writes the body a chunk per loop iteration while not paused (as the relay writes per worker read)."""

    def __init__(self, out: DirectResponse) -> None:
        self.out = out
        self.left = CHUNKS
        self.paused = False
        self.calls: list[str] = []
        self.loop = asyncio.get_running_loop()

    def pause_reading(self) -> None:
        self.calls.append("pause")
        self.paused = True

    def resume_reading(self) -> None:
        self.calls.append("resume")
        self.paused = False
        self.loop.call_soon(self.produce)

    def produce(self) -> None:
        if self.paused or not self.left:
            return
        self.left -= 1
        self.out.body(CHUNK)
        self.out.flush()
        if not self.left:
            self.out.source = None
            self.out.end()
            return
        self.loop.call_soon(self.produce)


class _Direct:
    def __init__(self) -> None:
        self.sources: list[_Source] = []

    def wants(self, scope: dict[str, Any]) -> bool:
        return True

    def begin(self, cycle: Any, start: Any) -> bool:
        out = DirectResponse(cycle)
        out.start(200, [(b"content-length", b"%d" % (len(CHUNK) * CHUNKS))])
        src = _Source(out)
        out.source = src
        self.sources.append(src)
        src.produce()
        return True


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:  # (never reached: the handler takes all)
    raise AssertionError(scope)


async def _scenario() -> None:
    sock = bind_tcp("127.0.0.1", 0)
    port = sock.getsockname()[1]
    direct = _Direct()
    server = make_server(_app, max_head_bytes=16384, graceful_s=None, direct=direct)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(("127.0.0.1", port))
        client.setblocking(False)
        client.send(b"POST /x HTTP/1.1\r\nhost: t\r\ncontent-length: 2\r\n\r\n{}")
        for _ in range(500):  # the client reads nothing: the response stops at the high-water mark
            await asyncio.sleep(0.01)
            if direct.sources and direct.sources[0].paused:
                break
        src = direct.sources[0]
        assert src.calls == ["pause"] and 0 < src.left < CHUNKS
        await asyncio.sleep(0.1)
        left = src.left
        assert src.paused and src.left == left  # nothing more is produced while paused
        got = bytearray()
        loop = asyncio.get_running_loop()
        while True:  # the client reads: the response resumes and completes
            data = await asyncio.wait_for(loop.sock_recv(client, 1 << 20), 10)
            got += data
            head, sep, body = bytes(got).partition(b"\r\n\r\n")
            if sep and len(body) == len(CHUNK) * CHUNKS:
                break
        assert head.startswith(b"HTTP/1.1 200 OK") and body == CHUNK * CHUNKS
        assert src.calls[:2] == ["pause", "resume"] and src.left == 0
        client.close()
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


def test_a_slow_client_pauses_the_source_and_resumes_it() -> None:
    asyncio.run(_scenario())
