"""Protocol-level fuzz of the lean request cycle (dplb.runtime.protocol): the same raw bytes sent to a server with a
direct handler and to one without (uvicorn's own path, the oracle) must get byte-identical answers.

Inputs (hypothesis): 1–3 pipelined requests cut at random places (sent in separate writes, sometimes with a pause
between them): ``POST`` mostly, with a ``Content-Length`` or chunked body (empty, small, sometimes over the direct
limit), ``Expect: 100-continue`` sometimes, random extra headers in random case, a query string or a
percent-encoded path, HTTP/1.0 or ``Connection: close`` sometimes. The path picks what the handler does with a
request it is offered: answer it at once with a :class:`DirectResponse` (Content-Length or chunked), answer it on a
later loop iteration, decline it, hand it to the ASGI app at once or on a later iteration (as the relay does after a
first-byte timeout). Every answer echoes what its answerer saw (method, paths, query, HTTP version, headers, body),
so equal bytes mean the handler saw the request the app sees and answered it as uvicorn would.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dplb.runtime.direct import MAX_DIRECT_BODY, DirectResponse
from dplb.runtime.serving import bind_tcp, make_server

READ_TIMEOUT_S = 5.0


def _echo(scope: dict[str, Any], body: bytes) -> tuple[list[tuple[bytes, bytes]], list[bytes]]:
    """The answer to a request: (headers, body parts); chunked (no Content-Length) when the path says so."""
    seen = repr((scope["method"], scope["path"], scope["raw_path"], scope["query_string"], scope["http_version"],
                 scope["headers"], len(body), hashlib.sha1(body).hexdigest())).encode()
    if "chunked" in scope["path"]:
        return [(b"content-type", b"text/plain")], [seen[:10], seen[10:]]
    return [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(seen))], [seen]


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    if "asgi" not in scope or "state" not in scope:  # (an app gets uvicorn's whole scope)
        await send({"type": "http.response.start", "status": 500, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})
        return
    body = b""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    headers, parts = _echo(scope, body)
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    for part in parts:
        await send({"type": "http.response.body", "body": part, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def _answer(cycle: Any) -> None:
    out = DirectResponse(cycle)
    headers, parts = _echo(cycle.scope, bytes(cycle.body))
    out.start(200, headers)
    for part in parts:
        out.body(part)
    out.end()


class _Handler:
    """What the direct handler does with a request depends on its path's first segment."""

    def __init__(self) -> None:
        self.offered = 0

    def wants(self, scope: dict[str, Any]) -> bool:
        return bool(scope["method"] == "POST")

    def begin(self, cycle: Any, start: Any) -> bool:
        self.offered += 1
        path = cycle.scope["path"]
        loop = asyncio.get_running_loop()
        if path.startswith("/decline"):
            return False
        if path.startswith("/start"):
            start(_app)
        elif path.startswith("/later-start"):
            loop.call_later(0.002, start, _app)
        elif path.startswith("/later"):
            loop.call_later(0.002, _answer, cycle)
        else:
            _answer(cycle)
        return True


class _Servers:
    """A server with the direct handler and one without, on one event loop in a thread."""

    def __init__(self) -> None:
        self.handler = _Handler()
        self.loop = asyncio.new_event_loop()
        socks = [bind_tcp("127.0.0.1", 0), bind_tcp("127.0.0.1", 0)]
        self.ports = [s.getsockname()[1] for s in socks]
        cap = 16384  # (below the largest body: a pipelined head read with a body counts only its own bytes)
        self.servers = [make_server(_app, max_head_bytes=cap, graceful_s=None, direct=self.handler),
                        make_server(_app, max_head_bytes=cap, graceful_s=None)]
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._serve(socks),), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not all(s.started for s in self.servers):
            assert time.monotonic() < deadline, "servers did not start"
            time.sleep(0.01)

    async def _serve(self, socks: list[socket.socket]) -> None:
        await asyncio.gather(*(srv.serve(sockets=[s]) for srv, s in zip(self.servers, socks, strict=True)))

    def stop(self) -> None:
        for srv in self.servers:
            srv.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def servers() -> Iterator[_Servers]:
    s = _Servers()
    yield s
    s.stop()


# ---- inputs ---------------------------------------------------------------------------------------------------------
name_chars = st.sampled_from("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.!#$%&'*+^`|~")
value_chars = st.sampled_from("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.,;:=/\"'()<>@[]{}?")
extra_header = st.tuples(st.text(name_chars, min_size=1, max_size=12).filter(
    lambda n: n.lower() not in ("content-length", "transfer-encoding", "expect", "connection", "upgrade", "host",
                                "keep-alive", "te", "trailer")),
    st.text(value_chars, max_size=20).map(str.strip))
payload = st.one_of(st.binary(max_size=300), st.just(b""), st.just(b"x" * (MAX_DIRECT_BODY + 100)))


@st.composite
def request(draw: Any) -> tuple[bytes, bool]:
    """One framed request; (its bytes, whether its answer closes the connection)."""
    method = draw(st.sampled_from(["POST"] * 6 + ["GET", "PUT"]))
    path = draw(st.sampled_from(["/direct", "/direct-chunked", "/later", "/later-chunked", "/decline", "/start",
                                 "/later-start-chunked", "/start-chunked"]))
    path += draw(st.sampled_from(["", "", "/a%20b", "?q=1&r=%2F", "/x?y", "#f", "/x?y#f"]))
    version = draw(st.sampled_from(["1.1"] * 5 + ["1.0"]))
    data = draw(payload) if method != "GET" else b""
    lines = [f"{method} {path} HTTP/{version}", "Host: fuzz"]
    for name, value in draw(st.lists(extra_header, max_size=4)):
        lines.append(f"{name}: {value}")
    expect = draw(st.integers(0, 5)) == 0 and method == "POST"
    if expect:
        lines.append(draw(st.sampled_from(["Expect: 100-continue", "expect: 100-Continue"])))
    close = version == "1.0"  # (uvicorn keeps no HTTP/1.0 connection alive, Connection: keep-alive or not)
    if version == "1.0" and draw(st.booleans()):
        lines.append("Connection: keep-alive")
    elif version == "1.1" and draw(st.integers(0, 6)) == 0:
        lines.append("Connection: close")
        close = True
    if version == "1.0" or draw(st.integers(0, 3)):
        lines.append(f"{draw(st.sampled_from(['Content-Length', 'content-length', 'CONTENT-LENGTH']))}: {len(data)}")
        framed = data
    else:
        lines.append("Transfer-Encoding: chunked")
        cuts = sorted(draw(st.sets(st.integers(1, max(1, len(data) - 1)), max_size=3))) if data else []
        parts = [data[i:j] for i, j in zip([0, *cuts], [*cuts, len(data)], strict=True) if data[i:j]]
        framed = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + framed, close


@st.composite
def exchange(draw: Any) -> tuple[list[bytes], list[float], int, bool]:
    """Pipelined requests cut into pieces; (pieces, pause before each, answers expected, the last one closes)."""
    reqs = draw(st.lists(request(), min_size=1, max_size=3))
    n, close = len(reqs), False
    for i, (_, closes) in enumerate(reqs):
        if closes:  # nothing after it is answered
            n, close = i + 1, True
            break
    data = b"".join(r for r, _ in reqs[:n])  # (nothing is sent after a request that closes the connection)
    cuts = sorted(draw(st.sets(st.integers(1, len(data) - 1), max_size=5)))
    pieces = [data[i:j] for i, j in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    pauses = [draw(st.sampled_from([0.0, 0.0, 0.003])) for _ in pieces]
    return pieces, pauses, n, close


# ---- the client -------------------------------------------------------------------------------------------------
def _responses(buf: bytes) -> tuple[int, bytes]:
    """How many final responses ``buf`` holds complete (100 Continue not counted) and the bytes after them."""
    n = 0
    while True:
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            return n, buf
        head = buf[:end]
        if head.startswith(b"HTTP/1.1 100 "):
            buf = buf[end + 4:]
            continue
        m = re.search(rb"\r\ncontent-length: (\d+)", head)
        if m is None and b"\r\ntransfer-encoding: chunked" not in head:  # (HTTP/1.0: delimited by the close)
            return n + 1, b""
        if m is not None:
            total = end + 4 + int(m.group(1))
            if len(buf) < total:
                return n, buf
        else:
            total = buf.find(b"\r\n0\r\n\r\n", end)
            if total < 0 and buf[end + 4:end + 9] != b"0\r\n\r\n":
                return n, buf
            total = (total + 7) if total >= 0 else end + 9
        n, buf = n + 1, buf[total:]


def _talk(port: int, pieces: list[bytes], pauses: list[float], n: int, close: bool) -> bytes:
    """Send the pieces and read until ``n`` answers are in (and the close, when the last one closes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT_S) as s:
        for piece, pause in zip(pieces, pauses, strict=True):
            if pause:
                time.sleep(pause)
            s.sendall(piece)
        got = b""
        deadline = time.monotonic() + READ_TIMEOUT_S
        while _responses(got)[0] < n or close:
            assert time.monotonic() < deadline, f"no answer: {got[-300:]!r}"
            try:
                chunk = s.recv(1 << 20)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                break
            got += chunk
        return re.sub(rb"\r\ndate: [^\r]*", b"", got)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                   HealthCheck.function_scoped_fixture])
@given(exchange())
def test_lean_cycle_answers_byte_for_byte_as_uvicorns(servers: _Servers, ex: tuple[list[bytes], list[float], int,
                                                                                    bool]) -> None:
    pieces, pauses, n, close = ex
    direct = _talk(servers.ports[0], pieces, pauses, n, close)
    oracle = _talk(servers.ports[1], pieces, pauses, n, close)
    assert direct == oracle
    assert _responses(direct)[0] == n


def test_the_fuzzed_requests_reach_the_handler(servers: _Servers) -> None:
    """The example above exercises the lean path (a request the handler is offered), not only uvicorn's."""
    before = servers.handler.offered
    req = b"POST /direct HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nhi"
    assert _responses(_talk(servers.ports[0], [req, req], [0.0, 0.0], 2, False))[0] == 2
    assert servers.handler.offered == before + 2
