"""A worker connection's :class:`dplb.router.upstream.Sink` side (the direct relay's): whatever way the worker's
chunked response is cut into socket reads — byte by byte, a chunk split in its size line, its data or its CRLF,
several chunks and the end in one read, the head with the first chunks, a chunk above the size-line table — the
sink gets the head once, then one call per read with that read's body pieces (``relay``, or ``complete`` for the
read that ends the message, exactly once), the pieces joined are the body, and a
:class:`dplb.runtime.direct.DirectResponse` fed by it writes at most one client write per read whose bytes are the
response re-chunked, de-chunking to the same body. A sink that detaches at the head leaves the rest of the same
read to ``chunks()``; malformed framing after a valid chunk in one read: the valid piece first, then ``failed``.
The direct relay's attempt keeps the last two body pieces of the whole response across reads (what its
failed-stream check, ``Attempt.stream_end``, looks at), as a relay of one piece at a time did.
Real Unix sockets on both sides (the worker's peer writes each planned read and waits until it was read). Pure build
only: an interpreted class cannot take in the compiled Sink trait."""

from __future__ import annotations

import asyncio
import random
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httptools
import pytest

from dplb import native
from dplb.errors import UpstreamError
from dplb.router.upstream import Sink, UpstreamConn
from dplb.router.upstream_pool import UpstreamPool
from dplb.runtime.direct import DirectResponse
from dplb.runtime.lane_cycle import LaneCycle

_REQ = b"POST / HTTP/1.1\r\nhost: w\r\ncontent-length: 0\r\n\r\n"
_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
# A test sink subclasses the Sink trait, which a compiled build refuses to interpreted classes (the compiled relay is
# covered end to end by tests/test_direct_relay.py).
pytestmark = pytest.mark.skipif(bool(native.compiled_modules()), reason="a test sink: pure build only")
EVENTS = [b"data: {\"i\": %d, \"text\": \"%s\"}\n\n" % (i, b"t" * (i * 7 % 300)) for i in range(40)]
EVENTS.insert(7, b"data: " + b"x" * 5000 + b"\n\n")  # above the size-line table (4096)
BODY = b"".join(EVENTS)
WIRE = _HEAD + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in EVENTS) + b"0\r\n\r\n"


def _plans() -> list[list[bytes]]:
    """Ways to cut WIRE into reads."""
    head = len(_HEAD)
    first = head + len(b"%x\r\n" % len(EVENTS[0])) + len(EVENTS[0]) + 2
    cuts = [
        [head, first],  # the head alone, then each chunk... (below: the rest in one read)
        [head - 3, head + 1, head + 4, first - 1],  # inside the head, the size line, the data, the CRLF
        [first + 3],  # the head with the first chunk and part of the second's size line
        list(range(1, 300)),  # byte by byte at first
        [],  # everything in one read
    ]
    rng = random.Random(7)
    for _ in range(6):
        cuts.append(sorted(rng.sample(range(1, len(WIRE)), rng.randint(2, 60))))
    plans = [[WIRE[a:b] for a, b in zip([0, *c], [*c, len(WIRE)], strict=True)] for c in cuts]
    k = head  # each chunk alone
    each = [WIRE[:head]]
    for e in EVENTS:
        n = len(b"%x\r\n" % len(e)) + len(e) + 2
        each.append(WIRE[k:k + n])
        k += n
    each.append(WIRE[k:])
    return [*plans, each]


class _Relay(Sink):
    """A sink as the direct relay drives a :class:`DirectResponse`: the head, one write per read, the end; every
    call recorded."""

    def __init__(self, out: DirectResponse | None) -> None:
        self.out = out
        self.calls: list[tuple[str, Any]] = []

    def head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.calls.append(("head", status))
        if self.out is not None:
            self.out.start(status, [(n, v) for n, v in headers if n != b"transfer-encoding"])

    def relay(self, chunks: list[bytes]) -> None:
        self.calls.append(("relay", list(chunks)))
        if self.out is not None:
            self.out.write(chunks)

    def complete(self, chunks: list[bytes]) -> None:
        self.calls.append(("complete", list(chunks)))
        if self.out is not None:
            self.out.end(None, chunks)

    def failed(self, exc: UpstreamError) -> None:
        self.calls.append(("failed", exc))


class _Writes:
    """The client's real transport, its writes recorded."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)
        self.transport.write(data)

    def close(self) -> None:
        self.transport.close()


def _dechunk(wire: bytes) -> tuple[bytes, bytes]:
    """(head, body) of a client response as a client parses it; asserts it is complete and its framing canonical."""
    head, _, rest = wire.partition(b"\r\n\r\n")
    body = bytearray()
    done: list[bool] = []

    class P:
        def on_body(self, b: bytes) -> None:
            body.extend(b)

        def on_message_complete(self) -> None:
            done.append(True)

    httptools.HttpResponseParser(P()).feed_data(wire)
    assert done, wire[-200:]
    k = 0
    while True:  # canonical: lower-case hex without leading zeros, no extension
        line, _, rest2 = rest[k:].partition(b"\r\n")
        n = int(line, 16)
        assert line == b"%x" % n
        if n == 0:
            assert rest2 == b"\r\n"
            break
        k += len(line) + 2 + n + 2
    return head, bytes(body)


def _run(tmp_path: Any, scenario: Callable[..., Awaitable[None]]) -> None:
    wpath, cpath = str(tmp_path / "w.sock"), str(tmp_path / "c.sock")
    worker, client = socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)
    worker.bind(wpath)
    worker.listen()
    client.bind(cpath)
    client.listen()
    errors: list[dict[str, object]] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda loop, ctx: errors.append(ctx))
        pool = UpstreamPool([wpath], 1.0)
        conn = await pool.open(0)
        peer, _ = worker.accept()
        transport, _ = await loop.create_unix_connection(asyncio.Protocol, cpath)
        reader, _ = client.accept()
        try:
            await scenario(conn, peer, transport, reader)
        finally:
            for s in (peer, reader):
                s.close()
            transport.close()
            pool.close()
            await asyncio.sleep(0.02)

    asyncio.run(main())
    worker.close()
    client.close()
    assert not errors, errors


async def _until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll ``cond`` every 2 ms until it holds; AssertionError after ``timeout_s`` (generous: a loaded -n 2 run on 2
    cores once took longer than the 0.8 s this allowed)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.002)


async def _send_reads(conn: UpstreamConn, peer: socket.socket, reads: list[bytes], calls: Callable[[], int]) -> None:
    """Write each planned read and wait until the connection read it (one more sink call, or the bytes queued)."""
    for piece in reads:
        before = calls()
        peer.sendall(piece)
        await _until(lambda before=before: calls() > before)


def _recv_all(reader: socket.socket, until: bytes) -> bytes:
    reader.settimeout(5)
    got = b""
    while not got.endswith(until):
        got += reader.recv(1 << 20)
    return got


def test_every_cut_of_a_stream_relays_it_byte_exact_one_write_per_read(tmp_path: Any) -> None:
    async def scenario(conn: UpstreamConn, peer: socket.socket, transport: Any, reader: socket.socket) -> None:
        for reads in _plans():
            assert b"".join(reads) == WIRE
            writes = _Writes(transport)
            cycle = LaneCycle({"http_version": "1.1"}, writes, None, [], True, lambda: None)
            sink = _Relay(DirectResponse(cycle))
            conn.send_request(_REQ, b"")
            conn.sink = sink
            await _send_reads(conn, peer, reads, lambda sink=sink: len(sink.calls))
            kinds = [k for k, _ in sink.calls]
            assert kinds.count("head") == 1 and kinds[-1] == "complete" and kinds.count("complete") == 1, kinds
            assert "failed" not in kinds
            pieces = [p for k, arg in sink.calls if k != "head" for p in arg]
            assert all(pieces) and b"".join(pieces) == BODY
            # the head, then one call per read (at least one per planned read: the kernel may cut one in two)
            assert len(sink.calls) >= len(reads) + 1
            assert len(writes.writes) <= len(sink.calls) - 1 and all(writes.writes)  # at most one write per read
            head, body = _dechunk(_recv_all(reader, b"0\r\n\r\n"))
            assert head.startswith(b"HTTP/1.1 200 OK") and body == BODY
            assert conn.reusable
            conn.sink = None

    _run(tmp_path, scenario)


def test_a_sink_detached_at_the_head_leaves_the_rest_of_the_read_to_chunks(tmp_path: Any) -> None:
    class Detach(_Relay):
        def __init__(self, conn: UpstreamConn) -> None:
            super().__init__(None)
            self.conn = conn

        def head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
            super().head(status, headers)
            self.conn.sink = None

    async def scenario(conn: UpstreamConn, peer: socket.socket, transport: Any, reader: socket.socket) -> None:
        conn.send_request(_REQ, b"")
        sink = Detach(conn)
        conn.sink = sink
        cut = len(_HEAD) + 300  # the head, two chunks, part of the third, in one read
        peer.sendall(WIRE[:cut])
        assert await conn.response_head(1.0) == (200, [(b"content-type", b"text/event-stream"),
                                                       (b"transfer-encoding", b"chunked")])
        it = conn.chunks(1.0)
        got = [await it.__anext__()]
        peer.sendall(WIRE[cut:])
        got += [x async for x in it]
        assert b"".join(got) == BODY and sink.calls == [("head", 200)]

    _run(tmp_path, scenario)


def test_malformed_framing_after_a_chunk_in_one_read_relays_the_chunk_then_fails(tmp_path: Any) -> None:
    async def scenario(conn: UpstreamConn, peer: socket.socket, transport: Any, reader: socket.socket) -> None:
        conn.send_request(_REQ, b"")
        sink = _Relay(None)
        conn.sink = sink
        peer.sendall(_HEAD)
        await _until(lambda: len(sink.calls) == 2)
        peer.sendall(b"5\r\nhello\r\nzz\r\n")
        await _until(lambda: len(sink.calls) == 4)
        assert sink.calls[:3] == [("head", 200), ("relay", []), ("relay", [b"hello"])]
        assert sink.calls[3][0] == "failed" and "malformed" in str(sink.calls[3][1])
        assert conn.closed and conn.sink is None

    _run(tmp_path, scenario)


# vLLM's stream error event for EngineDeadError, then [DONE] (as tests/test_stream_failure.py sends them).
_DEAD = (b'data: {"error": {"message": "EngineCore died", "type": "InternalServerError", "param": null, '
         b'"code": 500}}\n\n')
_DONE = b"data: [DONE]\n\n"
_TOKENS = [b'data: {"id":"x","choices":[{"index":0,"text":"t%d"}]}\n\n' % i for i in range(6)]


def _wire(events: list[bytes]) -> bytes:
    return _HEAD + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"


class _Out:
    """What a :class:`dplb.router.direct.DirectAttempt` writes to its client response, recorded (the accounting
    ``then`` is not run: the attempt has no router around it)."""

    def __init__(self) -> None:
        self.reads: list[list[bytes]] = []

    def write(self, chunks: list[bytes]) -> None:
        self.reads.append(list(chunks))

    def end(self, then: Any, chunks: list[bytes]) -> None:
        self.reads.append(list(chunks))


def _attempt(conn: UpstreamConn) -> Any:
    """A real DirectAttempt as it is past its response head (a 200 SSE stream): its relay, complete and stream_end
    unchanged; the head the parser reports is taken as read (the client response is :class:`_Out`)."""
    from types import SimpleNamespace

    from dplb.router.direct import DirectAttempt
    from dplb.router.health import Outcome

    class Past(DirectAttempt):
        __slots__ = ()

        def head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
            assert status == 200

    att = Past.__new__(Past)
    att.ex, att.worker, att.conn, att.out = SimpleNamespace(rid=b"r1", gone=False, tenant=None), 0, conn, _Out()
    att.status, att.is_sse, att.t_first, att.outcome = 200, True, None, Outcome.BROKEN
    att.clock, att.idle_s, att.deadline = conn.clock, 5.0, 0.0
    att.prior = att.last = b""
    return att


def test_the_direct_relay_keeps_the_last_two_chunks_across_reads(tmp_path: Any) -> None:
    """stream_end sees the last two body pieces of the whole response, however the reads group them: vLLM's error
    event and [DONE] in one read, in two reads, [DONE] alone with the end, everything in one read — a failed
    stream each time; the same events followed by more tokens are not; and for every cut (random ones too) the two
    pieces kept are the last two the parser produced, as a relay that saw one chunk at a time kept them."""
    from dplb.router.health import Outcome

    events = [*_TOKENS, _DEAD, _DONE]
    failed = _wire(events)
    ev_at = failed.index(b"%x\r\n" % len(_DEAD) + _DEAD)
    done_at = failed.index(b"%x\r\n" % len(_DONE) + _DONE)
    end_at = len(failed) - 5
    plans: list[tuple[list[bytes], list[int], Outcome | None]] = [
        (events, [ev_at], Outcome.FAILED_STREAM),  # the error event, [DONE] and the end in one read
        (events, [ev_at, done_at], Outcome.FAILED_STREAM),  # the error event alone, then [DONE] with the end
        (events, [ev_at, done_at, end_at], Outcome.FAILED_STREAM),  # ... and the end alone
        (events, [len(_HEAD)], Outcome.FAILED_STREAM),  # the whole body in one read
        (events, [], Outcome.FAILED_STREAM),  # the head and the whole body in one read
        (events, [done_at + 1, end_at], Outcome.FAILED_STREAM),  # [DONE]'s size line cut
        ([*_TOKENS[:2], _DEAD, _DONE, *_TOKENS[2:], _DONE], [len(_HEAD)], Outcome.OK),  # not at the end
    ]
    rng = random.Random(11)
    for _ in range(12):  # random cuts: whatever they find, as a relay of one chunk at a time would
        plans.append((events, sorted(rng.sample(range(1, len(failed)), rng.randint(1, 25))), None))

    async def scenario(conn: UpstreamConn, peer: socket.socket, transport: Any, reader: socket.socket) -> None:
        for evs, cuts, want in plans:
            wire = _wire(evs)
            reads = [wire[a:b] for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True)]
            att = _attempt(conn)
            conn.send_request(_REQ, b"")
            conn.sink = att
            await _send_reads(conn, peer, reads[:-1], lambda att=att: len(att.out.reads))
            peer.sendall(reads[-1])
            await _until(lambda att=att: att.outcome is not Outcome.BROKEN)
            pieces = [p for read in att.out.reads for p in read]
            assert b"".join(pieces) == b"".join(evs) and all(pieces)
            assert (att.prior, att.last) == (pieces[-2], pieces[-1]), (cuts, pieces[-3:])
            if want is None:
                want = att.stream_end(pieces[-2], pieces[-1])
            assert att.outcome is want, (cuts, att.out.reads[-2:])
            conn.sink = None

    _run(tmp_path, scenario)
