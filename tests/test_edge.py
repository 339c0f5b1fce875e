"""The router's HTTP/1.1 edge with clients that are slow, pipeline, half-close or speak HTTP/1.0 (dplb.runtime.protocol):
a head or body that stops coming gets 408 and a close within its timeout (counted in the metrics); bad bytes after
valid pipelined requests wait for their answers; a large pipelined body does not count against the next head's cap;
an HTTP/1.0 client never gets chunked framing; a half-closed complete request is answered with
``--serve-half-closed``; 401s carry their challenge, and CORS and WebSocket refusals are OpenAI-shaped. Real router
and sim worker, on the direct relay and on the ASGI path, raw sockets."""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from cluster import Cluster, cluster

TIMEOUT_S = 1.0  # --header-timeout and --body-timeout of the stack
CHAT = {"model": "dplb-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture(scope="module", params=["direct", "asgi"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    flags = ["--header-timeout", str(TIMEOUT_S), "--body-timeout", str(TIMEOUT_S), "--serve-half-closed"]
    if request.param == "asgi":
        flags.append("--no-direct-relay")
    with cluster(str(tmp_path_factory.mktemp("edge")), 1, router_args=flags) as c:
        yield c


def _post(body: dict | bytes, version: str = "1.1", path: str = "/v1/chat/completions", extra: bytes = b"") -> bytes:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return (b"POST %s HTTP/%s\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n"
            % (path.encode(), version.encode(), len(raw), extra)) + raw


HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


def _read_all(s: socket.socket, limit_s: float = 10.0) -> tuple[bytes, float]:
    """Everything until the router closes the connection, and the seconds that took."""
    t0 = time.monotonic()
    s.settimeout(limit_s)
    got = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return got, time.monotonic() - t0
        got += chunk


def _responses(data: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """The responses in ``data`` (Content-Length or chunked; one without either runs to the end)."""
    out = []
    while data:
        end = data.index(b"\r\n\r\n")
        lines = data[:end].decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
        rest = data[end + 4:]
        if "content-length" in headers:
            n = int(headers["content-length"])
            body, data = rest[:n], rest[n:]
        elif headers.get("transfer-encoding") == "chunked":
            body, i = b"", 0
            while True:
                j = rest.index(b"\r\n", i)
                size = int(rest[i:j], 16)
                if size == 0:
                    data = rest[j + 4:]
                    break
                body += rest[j + 2:j + 2 + size]
                i = j + 2 + size + 2
        else:
            body, data = rest, b""
        out.append((int(lines[0].split()[1]), headers, body))
    return out


def _rejected(c: Cluster, reason: str) -> float:
    return c.metric("dplb_requests_rejected_total", {"reason": reason}) or 0.0


def _http_status_count(c: Cluster, status: str) -> float:
    text = httpx.get(c.url + "/metrics", timeout=5).text
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith("dplb_http_requests_total{") and f'status="{status}"' in line)


def _assert_408_then_closed(got: bytes, took: float) -> None:
    [(status, headers, body)] = _responses(got)
    assert status == 408 and headers["connection"] == "close", got
    assert json.loads(body)["error"]["code"] == "request_timeout", body
    assert TIMEOUT_S * 0.8 <= took <= TIMEOUT_S * 3, took


@pytest.mark.parametrize("sent", [b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le"],
                         ids=["nothing", "half-head"])
def test_a_head_that_stops_coming_gets_408_and_a_close(stack: Cluster, sent: bytes) -> None:
    before = _rejected(stack, "request_timeout")
    with socket.create_connection(("127.0.0.1", stack.port)) as s:
        s.sendall(sent)
        got, took = _read_all(s)
    if sent:
        _assert_408_then_closed(got, took)
    else:  # a connection that asked nothing is closed without an answer
        assert got == b"" and TIMEOUT_S * 0.8 <= took <= TIMEOUT_S * 3, (got, took)
    assert _rejected(stack, "request_timeout") == before + 1


def test_a_head_after_a_kept_alive_response_is_timed_from_its_first_byte(stack: Cluster) -> None:
    with socket.create_connection(("127.0.0.1", stack.port)) as s:
        s.sendall(HEALTH)
        time.sleep(TIMEOUT_S * 1.5)  # idle (keep-alive, 75 s), not a head: not timed out
        s.sendall(b"GET /health HTTP/1.1\r\nHo")
        got, took = _read_all(s)
    first, second = _responses(got)
    assert first[0] == 200 and second[0] == 408, got
    assert took <= TIMEOUT_S * 3, took


def test_a_body_that_stops_coming_gets_408_counted_once(stack: Cluster) -> None:
    before = {r: _rejected(stack, r) for r in ("request_timeout", "client_closed_request")}
    status_before = _http_status_count(stack, "408")
    raw = json.dumps(CHAT).encode()
    with socket.create_connection(("127.0.0.1", stack.port)) as s:
        s.sendall(_post(raw)[:-10])
        _assert_408_then_closed(*_read_all(s))
    time.sleep(0.2)  # (the app records its 408 once it hears the close)
    assert _rejected(stack, "request_timeout") == before["request_timeout"] + 1
    assert _rejected(stack, "client_closed_request") == before["client_closed_request"]
    assert _http_status_count(stack, "408") == status_before + 1


def test_a_slow_body_that_keeps_coming_is_served(stack: Cluster) -> None:
    """The body timeout is the silence between reads, not the whole upload's time."""
    data = _post(CHAT)
    with socket.create_connection(("127.0.0.1", stack.port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head_end = data.index(b"\r\n\r\n") + 4
        s.sendall(data[:head_end])
        for i in range(6):  # 2.4 timeouts in all, never silent for one
            time.sleep(TIMEOUT_S * 0.4)
            s.sendall(data[head_end + 8 * i:head_end + 8 * i + 8])
        s.sendall(data[head_end + 48:])
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        got, _ = _read_all(s)
    assert [r[0] for r in _responses(got)] == [200, 200], got


def test_bad_bytes_after_valid_pipelined_requests_wait_for_their_answers(stack: Cluster) -> None:
    before = _rejected(stack, "invalid_http")
    with socket.create_connection(("127.0.0.1", stack.port)) as s:
        s.sendall(_post(CHAT) + HEALTH + b"JUNK JUNK\r\n\r\n")
        got, _ = _read_all(s)
    rs = _responses(got)
    assert [r[0] for r in rs] == [200, 200, 400], got
    assert json.loads(rs[0][2])["object"] == "chat.completion"
    assert json.loads(rs[2][2])["error"]["code"] == "invalid_http" and rs[2][1]["connection"] == "close"
    assert _rejected(stack, "invalid_http") == before + 1


def test_a_large_pipelined_body_does_not_count_against_the_next_head(stack: Cluster) -> None:
    """A body over the 64 KiB head cap, then the next request's head cut in two: the same read carries the body and
    the head's start."""
    big = {**CHAT, "max_tokens": 1, "messages": [{"role": "user", "content": "x" * 100_000}]}
    with socket.create_connection(("127.0.0.1", stack.port)) as s:
        s.sendall(_post(big) + HEALTH[:20])
        time.sleep(0.3)
        s.sendall(HEALTH[20:] + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        got, _ = _read_all(s)
    assert [r[0] for r in _responses(got)] == [200, 200, 200], got[:500]


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "whole"])
def test_an_http10_client_gets_no_chunked_framing(stack: Cluster, stream: bool) -> None:
    with socket.create_connection(("127.0.0.1", stack.port)) as s:
        s.sendall(_post({**CHAT, "stream": stream}, version="1.0"))
        got, _ = _read_all(s)
    [(status, headers, body)] = _responses(got)
    assert status == 200 and "transfer-encoding" not in headers and headers["connection"] == "close", got[:600]
    if stream:  # delimited by the close: the whole stream, bare
        assert "content-length" not in headers and not re.search(rb"^[0-9a-f]+\r\n", body), body[:200]
        assert body.startswith(b"data: {") and body.endswith(b"data: [DONE]\n\n"), body[-200:]
    else:
        assert json.loads(body)["object"] == "chat.completion"


def test_a_half_closed_complete_request_is_answered(stack: Cluster) -> None:
    with socket.create_connection(("127.0.0.1", stack.port)) as s:
        s.sendall(_post({**CHAT, "stream": True}) + HEALTH)
        s.shutdown(socket.SHUT_WR)
        got, _ = _read_all(s)
    rs = _responses(got)
    assert [r[0] for r in rs] == [200, 200] and rs[1][1]["connection"] == "close", got[-600:]
    assert rs[0][2].endswith(b"data: [DONE]\n\n"), rs[0][2][-200:]


def test_a_half_closed_incomplete_request_is_the_client_leaving(stack: Cluster) -> None:
    before = _rejected(stack, "client_closed_request")
    with socket.create_connection(("127.0.0.1", stack.port)) as s:
        s.sendall(_post(CHAT)[:-5])
        s.shutdown(socket.SHUT_WR)
        got, took = _read_all(s)
    assert got == b"" and took < TIMEOUT_S * 0.8  # closed at once, not after the body timeout
    deadline = time.monotonic() + 5
    while _rejected(stack, "client_closed_request") != before + 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)


MIB = 2**20
_CHUNKED = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" \
           b"Transfer-Encoding: chunked\r\n\r\n"
# A whole request a client sends before it reads anything (Python's urllib, a raw socket: no Expect: 100-continue),
# over a bound the router answers before reading it all, and the answer: (status, error code).
UPLOADS = {
    "body over --max-body-bytes": (_post(b"x" * (36 * MIB)), 413, "body_too_large"),  # the 32 MiB default
    "chunked body over it": (_CHUNKED + (b"100000\r\n" + b"x" * MIB + b"\r\n") * 48 + b"0\r\n\r\n", 413,
                             "body_too_large"),
    "head over 64 KiB": (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"y" * (16 * MIB) + b"\r\n\r\n", 431,
                         "headers_too_large"),
    "bad chunk": (_CHUNKED + b"zz\r\n" + b"x" * (16 * MIB), 400, "invalid_http"),
}


@pytest.mark.parametrize("case", list(UPLOADS))
def test_a_client_still_uploading_reads_the_early_answer(stack: Cluster, case: str) -> None:
    """The router answers before reading the whole request, then closes the nginx way (lingering close): the
    writing side shut after the answer, the rest of the upload read and discarded, so the client's send completes
    and it reads the answer, then the end. Before, the router closed at once: the unread bytes made the kernel
    reset the connection, and the client got a broken pipe or a reset instead of the 413."""
    data, status, code = UPLOADS[case]
    with socket.create_connection(("127.0.0.1", stack.port), timeout=30) as s:
        s.sendall(data)
        got, took = _read_all(s)
    [(got_status, headers, body)] = _responses(got)
    assert got_status == status and headers["connection"] == "close", got[:300]
    assert json.loads(body)["error"]["code"] == code, body
    assert took < TIMEOUT_S, took  # the end follows the answer (not a timeout's)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with cluster(str(tmp_path_factory.mktemp("keyed")), 1,
                 router_args=["--api-key", "k", "--cors-allowed-origins", "https://ok.example"]) as c:
        yield c


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/models"])
def test_a_401_carries_the_bearer_challenge(keyed: Cluster, path: str) -> None:
    r = httpx.post(keyed.url + path, json=CHAT) if path != "/v1/models" else httpx.get(keyed.url + path)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.headers
    assert r.json()["error"]["code"] == "invalid_api_key"


def test_a_cors_preflight_from_another_origin_is_an_openai_error(keyed: Cluster) -> None:
    before = _rejected(keyed, "cors_origin_not_allowed")
    r = httpx.options(keyed.url + "/v1/chat/completions",
                      headers={"Origin": "https://bad.example", "Access-Control-Request-Method": "POST"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "cors_origin_not_allowed", r.text
    assert "access-control-allow-origin" not in r.headers
    assert _rejected(keyed, "cors_origin_not_allowed") == before + 1
    ok = httpx.options(keyed.url + "/v1/chat/completions",
                       headers={"Origin": "https://ok.example", "Access-Control-Request-Method": "POST"})
    assert ok.status_code == 204 and ok.headers["access-control-allow-origin"] == "https://ok.example"


def test_a_websocket_handshake_gets_the_readme_404(keyed: Cluster) -> None:
    with socket.create_connection(("127.0.0.1", keyed.port)) as s:
        s.sendall(b"GET /v1/realtime HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
        got, _ = _read_all(s)
    [(status, headers, body)] = _responses(got)
    assert status == 404 and headers["content-type"] == "application/json", got
    err = json.loads(body)["error"]
    assert err["code"] == "not_found" and "WebSocket" in err["message"], err
