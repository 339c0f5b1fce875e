"""The exact bytes of the heads the router writes: the request head a worker receives
(:func:`dplb.router.exchange.request_head`) and the response head a direct-relayed client receives
(:func:`dplb.router.exchange.response_headers` then :meth:`dplb.runtime.direct.DirectResponse.start`, and the
direct relay's one pass, :func:`dplb.router.exchange.response_lines` then ``start_lines``). Golden bytes: a change
to how they are built must leave them byte for byte the same."""

from __future__ import annotations

from typing import Any

from dplb.router.exchange import REQ_OWN, Exchange, request_head, response_headers, response_lines
from dplb.router.proxy import scan_headers
from dplb.runtime.direct import DirectResponse, header_lines
from dplb.runtime.lane_cycle import LaneCycle


def _scope(headers: list[tuple[bytes, bytes]], path: str = "/v1/completions", raw: bytes | None = b"/v1/completions",
           qs: bytes = b"") -> dict[str, Any]:
    scope: dict[str, Any] = {"method": "POST", "path": path, "query_string": qs, "headers": headers}
    if raw is not None:
        scope["raw_path"] = raw
    return scope


def test_request_head_bytes() -> None:
    hdrs = [(b"host", b"client"), (b"content-type", b"application/json"), (b"content-length", b"12"),
            (b"x-request-id", b"theirs"), (b"expect", b"100-continue"), (b"accept", b"*/*"),
            (b"transfer-encoding", b"identity"), (b"user-agent", b"t/1"), (b"accept", b"text/plain")]
    assert request_head(_scope(hdrs), 12, b"rid-1", False, REQ_OWN, True) == (
        b"POST /v1/completions HTTP/1.1\r\nhost: dplb-worker\r\ncontent-length: 12\r\nx-request-id: rid-1\r\n"
        b"content-type: application/json\r\naccept: */*\r\nuser-agent: t/1\r\naccept: text/plain\r\n\r\n")
    # Connection-listed names are hop-by-hop; a decoded body drops its Content-Encoding; no blank line without end.
    hdrs = [(b"connection", b"keep-alive, X-Drop ,"), (b"x-drop", b"1"), (b"content-encoding", b"gzip"),
            (b"x-keep", b"2"), (b"traceparent", b"00-ab")]
    assert request_head(_scope(hdrs), 0, b"r", True, REQ_OWN | {b"traceparent"}, False) == (
        b"POST /v1/completions HTTP/1.1\r\nhost: dplb-worker\r\ncontent-length: 0\r\nx-request-id: r\r\n"
        b"x-keep: 2\r\n")
    assert request_head(_scope([(b"content-encoding", b"gzip")]), 3, b"r", False, REQ_OWN, True) == (
        b"POST /v1/completions HTTP/1.1\r\nhost: dplb-worker\r\ncontent-length: 3\r\nx-request-id: r\r\n"
        b"content-encoding: gzip\r\n\r\n")
    # The query string: appended to a path without one; raw_path missing: the decoded path encoded.
    assert request_head(_scope([], raw=None, qs=b"a=1"), 0, b"r", False, REQ_OWN, True) == (
        b"POST /v1/completions?a=1 HTTP/1.1\r\nhost: dplb-worker\r\ncontent-length: 0\r\nx-request-id: r\r\n\r\n")
    assert request_head(_scope([], raw=b"/v1/x?b=2", qs=b"b=2"), 0, b"r", False, REQ_OWN, True).startswith(
        b"POST /v1/x?b=2 HTTP/1.1\r\n")


def test_scan_headers_renders_the_forwarded_headers() -> None:
    """scan_headers renders the headers a worker gets in the same pass that reads the ones the router needs:
    request_head with those lines writes what it writes filtering the headers itself (None: a Connection header,
    which it must filter), and reads the same content-length, content-type, authorization and encoding."""
    heads = [
        [(b"host", b"h"), (b"content-type", b"application/json"), (b"content-length", b"12"), (b"user-agent", b"u")],
        [(b"host", b"client"), (b"content-type", b"a/b"), (b"content-length", b"x2"), (b"x-request-id", b"theirs"),
         (b"expect", b"100-continue"), (b"accept", b"*/*"), (b"transfer-encoding", b"identity"),
         (b"authorization", b"Bearer k"), (b"te", b"trailers"), (b"accept", b"text/plain"), (b"keep-alive", b"5"),
         (b"content-encoding", b"gzip"), (b"traceparent", b"00-ab"), (b"x-request-id", b"bad id")],
        [(b"connection", b"keep-alive, X-Drop"), (b"x-drop", b"1"), (b"x-keep", b"2")],
        [],
    ]
    for hdrs in heads:
        ex = Exchange(_scope(hdrs), None, None)
        clen, ctype, auth, encoding, repeated = scan_headers(ex)
        last = {n: v for n, v in hdrs}
        assert (ctype, auth, encoding, repeated) == (last.get(b"content-type", b""), last.get(b"authorization", b""),
                                                      last.get(b"content-encoding", b""), b"")
        raw = last.get(b"content-length")
        assert clen == (-1 if raw is None else int(raw) if raw.isdigit() else -2)
        if any(n == b"connection" for n, _ in hdrs):
            assert ex.fwd is None
            continue
        assert ex.fwd is not None and len(ex.rid) == 32
        for decoded in (False, True):
            assert request_head(ex.scope, 7, ex.rid, decoded, REQ_OWN, True, ex.fwd) == request_head(
                ex.scope, 7, ex.rid, decoded, REQ_OWN, True), (hdrs, decoded)
    ex = Exchange(_scope([(b"x-request-id", b"good-id.1:2_3")]), None, None)
    scan_headers(ex)
    assert ex.rid == b"good-id.1:2_3"


def _cycle(keep_alive: bool = True, default_headers: list[tuple[bytes, bytes]] | None = None) -> LaneCycle:
    """A request's cycle as the protocol makes it (no transport: nothing is flushed here)."""
    cycle = LaneCycle({"http_version": "1.1"}, None, None, default_headers or [], keep_alive, lambda: None)
    cycle.waiting_for_100_continue = True  # (start() clears it)
    return cycle


def _head(status: int, up: list[tuple[bytes, bytes]], **cycle: Any) -> tuple[bytes, bool, bool, DirectResponse]:
    out, sse, draining = response_headers(up, b"3", b"rid-9")
    resp = DirectResponse(_cycle(**cycle))
    resp.start(status, out)
    assert len(resp.pending) == 1 and resp.cycle.response_started and not resp.cycle.waiting_for_100_continue
    return resp.pending[0], sse, draining, resp


def test_direct_response_head_bytes() -> None:
    up = [(b"Date", b"Thu, 03 Dec 2026 14:00:00 GMT"), (b"Server", b"uvicorn"), (b"Content-Length", b"42"),
          (b"Content-Type", b"application/json"), (b"X-Request-Id", b"worker-rid"), (b"X-SG-Worker-ID", b"7"),
          (b"Keep-Alive", b"timeout=5"), (b"content-length", b"43")]
    head, sse, draining, resp = _head(200, up)
    assert head == (b"HTTP/1.1 200 OK\r\ndate: Thu, 03 Dec 2026 14:00:00 GMT\r\nserver: uvicorn\r\n"
                    b"content-length: 42\r\ncontent-type: application/json\r\ncontent-length: 43\r\n"
                    b"x-sg-worker-id: 3\r\nx-request-id: rid-9\r\n\r\n")
    assert (sse, draining, resp.chunked) == (False, False, False)
    # No Content-Length: chunked; the server's default headers first; not kept alive: connection: close.
    up = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"Connection", b"close, X-Hop"), (b"x-hop", b"1"),
          (b"Transfer-Encoding", b"chunked"), (b"x-dplb-draining", b"1"), (b"cache-control", b"no-cache")]
    head, sse, draining, resp = _head(503, up, keep_alive=False, default_headers=[(b"server", b"dplb"),
                                                                                  (b"date", b"today")])
    assert head == (b"HTTP/1.1 503 Service Unavailable\r\nserver: dplb\r\ndate: today\r\n"
                    b"content-type: text/event-stream; charset=utf-8\r\ncache-control: no-cache\r\n"
                    b"x-sg-worker-id: 3\r\nx-request-id: rid-9\r\nconnection: close\r\ntransfer-encoding: chunked\r\n"
                    b"\r\n")
    assert (sse, draining, resp.chunked) == (True, True, True)
    # A name listed in Connection is dropped, and is not the draining marker unless the worker sent it.
    out, sse, draining = response_headers([(b"connection", b"x-dplb-draining, content-type"),
                                           (b"content-type", b"text/event-stream"), (b"x-b", b"1"),
                                           (b"content-type", b"text/plain")], b"1", b"r")
    assert (out, sse, draining) == ([(b"x-b", b"1"), (b"x-sg-worker-id", b"1"), (b"x-request-id", b"r")], True, False)
    out, sse, _ = response_headers([(b"Content-Type", b"text/plain"), (b"content-type", b"text/event-stream")],
                                   b"1", b"r")
    assert sse and out[:2] == [(b"content-type", b"text/plain"), (b"content-type", b"text/event-stream")]
    head, _, _, resp = _head(204, [])
    assert head == b"HTTP/1.1 204 No Content\r\nx-sg-worker-id: 3\r\nx-request-id: rid-9\r\n\r\n"
    assert not resp.chunked
    # The same cycle's default headers changing between requests (uvicorn rebuilds the list once a second).
    cyc = _cycle(default_headers=[(b"date", b"one")])
    for day in (b"one", b"two"):
        cyc.default_headers = [(b"date", day)]
        resp = DirectResponse(cyc)
        resp.start(200, [(b"content-length", b"0")])
        assert resp.pending[0] == b"HTTP/1.1 200 OK\r\ndate: " + day + b"\r\ncontent-length: 0\r\n\r\n"


# Worker heads for the one-pass renderer: the usual ones, names in any case, duplicates, hop-by-hop and the router's
# own names, the draining marker, SSE, names it does not know, and a Connection header (then the general filter).
_UP_HEADS: list[list[tuple[bytes, bytes]]] = [
    [],
    [(b"date", b"d"), (b"server", b"uvicorn"), (b"content-length", b"2"), (b"content-type", b"application/json"),
     (b"x-request-id", b"w")],
    [(b"Date", b"d"), (b"SERVER", b"s"), (b"Content-Length", b"42"), (b"X-Request-Id", b"w"), (b"X-SG-Worker-ID", b"7"),
     (b"Keep-Alive", b"timeout=5"), (b"content-length", b"43"), (b"X-Custom", b"Value ")],
    [(b"content-type", b"text/event-stream; charset=utf-8"), (b"Transfer-Encoding", b"chunked"),
     (b"x-dplb-draining", b"1"), (b"cache-control", b"no-cache"), (b"TE", b"trailers"), (b"upgrade", b"h2c")],
    [(b"Content-Type", b"text/plain"), (b"content-type", b"text/event-stream"), (b"X-DPLB-Draining", b"")],
    [(b"proxy-authenticate", b"x"), (b"trailer", b"x"), (b"vary", b"accept"), (b"content-encoding", b"gzip")],
    [(b"connection", b"x-dplb-draining, content-type"), (b"content-type", b"text/event-stream"), (b"x-b", b"1")],
    [(b"x-a", b"1"), (b"Connection", b"close")],
]


def test_response_lines_match_response_headers() -> None:
    """The direct relay's one pass renders exactly what response_headers then start render (None only where the
    worker's head has a Connection header), and start_lines writes the same head as start."""
    for up in _UP_HEADS:
        out, sse, draining = response_headers(up, b"3", b"rid-9")
        got = response_lines(up, b"3", b"rid-9")
        if any(n.lower() == b"connection" for n, _ in up):
            assert got is None, up
            continue
        sized = any(n == b"content-length" for n, _ in out)
        assert got == (header_lines(out), sized, sse, draining), up
        for status in (200, 204, 503):
            for keep_alive in (True, False):
                a, b = DirectResponse(_cycle(keep_alive)), DirectResponse(_cycle(keep_alive))
                a.start(status, out)
                b.start_lines(status, got[0], got[1])
                assert a.pending == b.pending and a.chunked == b.chunked, (up, status, keep_alive)


def test_scan_headers_names_a_repeated_one_value_header_and_joins_encodings() -> None:
    """A second ``Content-Type`` or ``Authorization`` is named (the proxy answers 400 ``duplicate_header``; the
    direct relay declines), whatever the values; repeated ``Content-Encoding`` headers are one list in their order
    (RFC 9110 §5.3), as one ``gzip, gzip`` header is; other repeated headers are forwarded as they came."""
    cases = [
        ([(b"authorization", b"Bearer a"), (b"authorization", b"Bearer a")], b"authorization"),
        ([(b"authorization", b""), (b"authorization", b"Bearer a")], b"authorization"),
        ([(b"content-type", b"application/json"), (b"content-type", b"text/plain")], b"content-type"),
        ([(b"accept", b"a"), (b"accept", b"b"), (b"authorization", b"x")], b""),
    ]
    for hdrs, want in cases:
        assert scan_headers(Exchange(_scope(hdrs), None, None))[4] == want, hdrs
    ex = Exchange(_scope([(b"content-encoding", b"gzip"), (b"x", b"1"), (b"content-encoding", b"deflate")]), None,
                  None)
    assert scan_headers(ex)[3:] == (b"gzip, deflate", b"")
