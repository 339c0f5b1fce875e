"""Hardening, bad input and security: a hypothesis fuzz of the router's HTTP surface, oversized heads and
bodies, absurd values, request-id sanitising, API-key exemptions, file modes and other users, and the soak smoke.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import pwd
import re
import socket
import stat
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any
from unittest import mock
from urllib.parse import quote

import httpx
import pytest
from cluster import (
    ROOT,
    Cluster,
    LaunchedCluster,
    assert_no_internals,
    cluster,
    proc_stats,
    router_cmd,
    settled_fds,
    wait_for,
    worker_get,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dplb.config import PolicyConfig, RouterConfig
from dplb.errors import RouterErrorKind
from dplb.router.app import RouterApp
from dplb.router.proxy import _REQUEST_ID_RE
from dplb.runtime.conn_timer import LINGER_BYTES

#: Error codes the router itself may answer with (RouterErrorKind + Litestar's mapped errors); never internal_error.
ROUTER_CODES = {k.code for k in RouterErrorKind} - {"internal_error"} | {"invalid_request", "not_found",
                                                                          "method_not_allowed"}
BODY_LIMIT = 65536


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Two fast sim workers (64-token context, 1 ms steps) and a router with a 64 KiB body limit."""
    fast = ["--sim-max-model-len", "64", "--sim-decode-step-s", "0.001", "--sim-decode-step-s-per-seq", "0"]
    with cluster(str(tmp_path_factory.mktemp("fuzz")), 2, worker_args={0: fast, 1: fast},
                 router_args=["--max-body-bytes", str(BODY_LIMIT)]) as c:
        yield c


# ---- the fuzz ------------------------------------------------------------------------------------------------------
PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models", "/health", "/ready", "/metrics",
         "/debug/decisions", "/debug/decisions?limit=-1", "/debug/decisions?limit=99999999999999999999999",
         "/v1/chat/completions?x=1", "/v1/../v1/models", "/%00", "/v1/chat/completions/", "//v1/completions", "/"]
junk = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**80), max_value=2**80) | st.floats(allow_nan=False)
    | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
request_like = st.fixed_dictionaries({
    "model": st.sampled_from(["dplb-sim", "nope", ""]) | junk,
}, optional={
    "prompt": st.text(max_size=40) | junk, "messages": st.just([{"role": "user", "content": "hi"}]) | junk,
    "max_tokens": st.integers(min_value=-3, max_value=70) | st.integers() | junk, "n": st.integers(-2, 3) | junk,
    "stream": st.booleans() | junk, "stream_options": st.just({"include_usage": True}) | junk, "extra": junk,
})
bodies = st.one_of(
    request_like.map(lambda d: json.dumps(d).encode()),
    junk.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=200),  # mostly invalid UTF-8 / invalid JSON
    request_like.map(lambda d: json.dumps(d).encode()[: max(1, len(json.dumps(d)) // 2)]),  # truncated
    st.just(b"{" * 5000 + b"}" * 5000), st.just(b'{"model": 1e999}'), st.just(b"x" * (BODY_LIMIT + 1)),
    st.just(b""),
)
header_value = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=60).map(str.strip)
headers = st.dictionaries(
    st.sampled_from(["content-type", "x-request-id", "authorization", "accept", "content-encoding", "connection",
                     "traceparent", "x-sg-worker-id", "expect", "accept-encoding", "te", "upgrade"])
    | st.from_regex(r"\Ax-[a-z0-9-]{1,20}\Z"),
    st.sampled_from(["application/json", "text/plain", "application/json; charset=utf-8", "multipart/form-data",
                     "close", "keep-alive", "gzip", "100-continue"]) | header_value,
    max_size=5)
methods = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "FOO"])
random_path = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=30).map(
    lambda t: "/" + quote(t, safe="/?=&"))


def _check(r: httpx.Response) -> str:
    """One response: no router-made 5xx, router errors OpenAI-shaped with a known code, nothing internal."""
    text = r.text
    assert_no_internals(text)
    if "x-sg-worker-id" in r.headers:
        return "worker"
    assert r.status_code < 500, (r.status_code, text[:300])
    if r.status_code >= 400 and r.request.method != "HEAD":
        err = json.loads(text)["error"]
        assert err["code"] in ROUTER_CODES and isinstance(err["message"], str) and err["type"], err
    return "router"


def test_fuzz_the_router_http_surface(fuzz: Cluster) -> None:
    """Random methods, paths, headers and bodies: never a router-made 5xx, only OpenAI-shaped errors with known
    codes, no internals; the router stays up, in-flight returns to 0, RSS and descriptors do not grow."""
    pid = fuzz.router.pid  # type: ignore[union-attr]
    seen: Counter[tuple[str, int]] = Counter()
    clients = [httpx.Client(timeout=15)]

    @settings(max_examples=300, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(method=methods, path=st.sampled_from(PATHS) | random_path, hdrs=headers, body=bodies)
    def one(method: str, path: str, hdrs: dict[str, str], body: bytes) -> None:
        try:
            r = clients[-1].request(method, fuzz.url + path, headers=hdrs, content=body if method != "GET" else None)
        except httpx.RemoteProtocolError:
            # A rejection before the body was read closes the connection; the client may see that close first.
            assert path.split("?")[0] in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings") or \
                "100-continue" in hdrs.values(), (method, path, hdrs)
            return
        seen[(_check(r), r.status_code)] += 1

    def quiet() -> tuple[int, dict[str, int]]:
        wait_for(lambda: all(fuzz.metric("dplb_worker_requests_inflight", {"worker": str(k)}) == 0
                             for k in range(2)), 10, "in-flight back to 0")
        clients[-1].close()  # drop keep-alive connections so descriptors can be compared
        clients.append(httpx.Client(timeout=15))
        return proc_stats(pid)[0], settled_fds(pid)

    one()
    rss0, fds0 = quiet()
    one()  # the same 300 requests again: nothing may accumulate
    rss1, fds1 = quiet()
    assert fuzz.router is not None and fuzz.router.poll() is None
    assert httpx.get(fuzz.url + "/health").status_code == 200
    assert fds1["other"] == fds0["other"], (fds0, fds1)
    assert rss1 - rss0 < 4 * 2**20, (rss0, rss1)
    assert {s for (who, s) in seen if who == "worker"} and {s for (who, s) in seen if who == "router"}, seen
    assert "Traceback" not in fuzz.router_log()
    clients[-1].close()


# ---- explicit bad input -----------------------------------------------------------------------------------------------
def _raw(c: Cluster, data: bytes, timeout: float = 5) -> bytes:
    with socket.create_connection(("127.0.0.1", c.port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
    return out


def test_oversized_heads_get_431_and_malformed_http_400(fuzz: Cluster) -> None:
    pid = fuzz.router.pid  # type: ignore[union-attr]
    rss0 = proc_stats(pid)[0]
    for head in (b"x-big: " + b"a" * 100_000, b"\r\n".join(b"x-h%d: %s" % (i, b"b" * 1000) for i in range(100)),
                 b"x-ok: 1"):
        resp = _raw(fuzz, b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n" + head + b"\r\n\r\n")
        if head == b"x-ok: 1":
            assert resp.startswith(b"HTTP/1.1 200"), resp[:100]
            continue
        assert resp.startswith(b"HTTP/1.1 431"), resp[:100]
        assert json.loads(resp.partition(b"\r\n\r\n")[2])["error"]["code"] == "headers_too_large"
    # A 100 MB header streamed in: the router answers 431 once past the cap and buffers none of it, then discards
    # the rest only up to its lingering close's bound (dplb.runtime.conn_timer.LINGER_BYTES) and closes.
    sent = 0
    with socket.create_connection(("127.0.0.1", fuzz.port), timeout=5) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-huge: ")
        with pytest.raises(OSError):
            for _ in range(100 * 16):
                s.sendall(b"a" * 65536)
                sent += 65536
    assert sent < LINGER_BYTES + 16 * 2**20, sent
    assert proc_stats(pid)[0] - rss0 < 4 * 2**20
    for bad in (b"GARBAGE\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                b"content-length: 99999999999999999999999\r\n\r\n"):
        resp = _raw(fuzz, bad)
        assert resp.startswith(b"HTTP/1.1 400"), resp[:100]
        assert json.loads(resp.partition(b"\r\n\r\n")[2])["error"]["code"] == "invalid_http"
    assert (fuzz.metric("dplb_requests_rejected_total", {"reason": "headers_too_large"}) or 0) >= 3
    assert httpx.get(fuzz.url + "/health").status_code == 200


def test_malformed_chunked_body_gets_an_openai_400(fuzz: Cluster) -> None:
    """A request body whose chunked framing is broken (a chunk size that is not hex, a chunk longer than its size)
    is answered 400 ``invalid_http`` in the OpenAI shape, not a connection closed without an answer; the router
    keeps serving."""
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    for body in (b"5\r\n{\"a\":\r\nzz\r\n1}\r\n0\r\n\r\n", b"2\r\n{}xxxxxx\r\n0\r\n\r\n"):
        resp = _raw(fuzz, head + body)
        assert resp.startswith(b"HTTP/1.1 400"), resp[:200]
        assert json.loads(resp.partition(b"\r\n\r\n")[2])["error"]["code"] == "invalid_http"
    assert httpx.get(fuzz.url + "/health").status_code == 200


@pytest.mark.parametrize("coding", [b"gzip, chunked", b"foo, chunked", b"deflate, chunked", b"identity"])
def test_a_transfer_coding_other_than_chunked_is_refused(fuzz: Cluster, coding: bytes) -> None:
    """llhttp frames a body by the last coding alone: ``gzip, chunked`` would be read as plain chunked, and a proxy
    in front that reads it otherwise would see another request boundary. The router answers 400 ``invalid_http``
    and closes; ``Chunked`` in any case is fine."""
    body = b'{"model": "dplb-sim", "prompt": "x", "max_tokens": 1}'
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: "
    resp = _raw(fuzz, head + coding + b"\r\n\r\n" + chunked + b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
    assert resp.startswith(b"HTTP/1.1 400") and resp.count(b"HTTP/1.1 ") == 1, resp[:300]
    assert json.loads(resp.partition(b"\r\n\r\n")[2])["error"]["code"] == "invalid_http"
    resp = _raw(fuzz, head + b"Chunked\r\nconnection: close\r\n\r\n" + chunked)
    assert resp.startswith(b"HTTP/1.1 200"), resp[:300]


@pytest.mark.parametrize("split", [False, True], ids=["one-write", "body-later"])
def test_an_upgrade_the_router_does_not_speak_loses_nothing_and_smuggles_nothing(fuzz: Cluster, split: bool) -> None:
    """``Upgrade: h2c`` (what ``curl --http2`` sends on http://): llhttp stops at the head and leaves the rest to the
    other protocol. A request with a body gets 400 ``invalid_http`` saying what to do, and its body is never read as
    a request of its own (before, a body in a later segment was: ``GET /debug/...`` was answered 200); one without
    a body is answered, then the connection closed."""
    body = b'{"model": "dplb-sim", "prompt": "x", "max_tokens": 1}'
    smuggled = b"GET /debug/decisions?limit=1 HTTP/1.1\r\nhost: x\r\n\r\n"
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nconnection: Upgrade, "
            b"HTTP2-Settings\r\nupgrade: h2c\r\nhttp2-settings: AAMAAABkAAQAoAAAAAIAAAAA\r\ncontent-length: %d\r\n\r\n"
            % len(smuggled))
    with socket.create_connection(("127.0.0.1", fuzz.port), timeout=5) as s:
        s.sendall(head if split else head + smuggled)
        if split:
            time.sleep(0.3)
            with contextlib.suppress(OSError):
                s.sendall(smuggled)
        out = b""
        with contextlib.suppress(OSError):
            while chunk := s.recv(65536):
                out += chunk
    assert out.startswith(b"HTTP/1.1 400") and out.count(b"HTTP/1.1 ") == 1, out[:400]
    assert "Upgrade" in json.loads(out.partition(b"\r\n\r\n")[2])["error"]["message"]
    resp = _raw(fuzz, b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: Upgrade\r\nupgrade: h2c\r\n\r\n" + smuggled)
    assert resp.startswith(b"HTTP/1.1 200") and resp.count(b"HTTP/1.1 ") == 1, resp[:400]
    assert httpx.post(fuzz.url + "/v1/completions", json=json.loads(body), timeout=30).status_code == 200


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_100_mb_body_is_refused_without_being_read(fuzz: Cluster, framing: str) -> None:
    """A real 100 MB upload: 413 arrives while the client is still sending, and the router reads and discards the
    rest only up to its lingering close's bound (dplb.runtime.conn_timer.LINGER_BYTES), then closes: the client
    cannot push the 100 MB through."""
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n" + (
        b"content-length: 104857600\r\n\r\n" if framing == "content-length" else b"transfer-encoding: chunked\r\n\r\n")
    chunk = b"x" * 2**20
    piece = chunk if framing == "content-length" else b"100000\r\n" + chunk + b"\r\n"
    s = socket.create_connection(("127.0.0.1", fuzz.port), timeout=10)
    got = bytearray()

    def reader() -> None:
        while b"\r\n\r\n" not in got or b"}" not in got:
            try:
                data = s.recv(65536)
            except OSError:
                return
            if not data:
                return
            got.extend(data)

    t = threading.Thread(target=reader)
    t.start()
    sent = 0
    try:
        s.sendall(head)
        for _ in range(100):
            s.sendall(piece)
            sent += len(chunk)
    except OSError:
        pass
    t.join(10)
    s.close()
    assert bytes(got).startswith(b"HTTP/1.1 413"), bytes(got[:200])
    assert b"body_too_large" in got and b"connection: close" in got
    assert sent < LINGER_BYTES + 16 * 2**20, f"the router read {sent >> 20} MB of a rejected body"


def test_a_wrong_method_on_a_local_route_is_an_openai_405_with_allow(fuzz: Cluster) -> None:
    """Regression: the 405 of a local route (``DELETE /health``) dropped the ``Allow`` header RFC 9110 requires."""
    r = httpx.request("DELETE", fuzz.url + "/health", timeout=10)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed", r.text
    assert "GET" in r.headers.get("allow", ""), r.headers


GET_ROUTES = ["/health", "/ready", "/metrics", "/metrics/host", "/v1/models", "/v1/models/dplb-sim",
              "/debug/decisions"]


@pytest.mark.parametrize(("method", "path"), [("DELETE", "/v1/models"), ("POST", "/health"), ("PUT", "/metrics"),
                                              ("POST", "/debug/decisions"), ("DELETE", "/v1/models/dplb-sim"),
                                              ("GET", "/v1/load_lora_adapter")])
def test_a_local_405_names_the_allowed_methods_and_its_allow_is_true(fuzz: Cluster, method: str, path: str) -> None:
    """Regression: a local route's 405 said only "Method Not Allowed" (a proxied route's names the allowed methods)
    and its ``Allow: GET, OPTIONS`` left out HEAD, which those routes answer. Every method it lists is served."""
    r = httpx.request(method, fuzz.url + path, timeout=10)
    allow = r.headers.get("allow", "")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed", r.text
    assert r.json()["error"]["message"] == f"{method} is not allowed on {path} (allowed: {allow})", r.text
    assert allow == ("OPTIONS, POST" if "lora" in path else "GET, HEAD, OPTIONS"), allow
    for m in allow.split(", "):
        if m != "POST":  # (a POST to the LoRA route is a real load)
            assert httpx.request(m, fuzz.url + path, timeout=10).status_code != 405, m


@pytest.mark.parametrize("path", GET_ROUTES)
def test_head_is_served_on_every_local_get_route(fuzz: Cluster, path: str) -> None:
    """Regression: HEAD on ``/debug/decisions`` (and ``/v1/models/{id}``) was a 405 though GET is served."""
    g, h = httpx.get(fuzz.url + path, timeout=10), httpx.head(fuzz.url + path, timeout=10)
    assert h.status_code == g.status_code and h.content == b"", (path, h.status_code, g.status_code)


@pytest.mark.parametrize(("ctype", "status"), [
    ("application/json", 200), ("application/vnd.api+json", 200), ("application/merge-patch+json; charset=utf-8", 200),
    ("Application/VND.API+JSON", 200), ("text/json", 415), ("application/jsonx", 415), ("text/plain+json", 415),
    (None, 200), ("", 200)])
def test_structured_syntax_json_types_are_json(fuzz: Cluster, ctype: str | None, status: int) -> None:
    """Regression: ``Content-Type: application/vnd.api+json`` was 415; FastAPI (vLLM) takes any ``application/*+json``
    (RFC 6839 §3.1). A request with no Content-Type (None: no header; "": an empty one) is read as JSON, as FastAPI
    does, and the README's 415 row says so."""
    body = json.dumps({"model": "dplb-sim", "prompt": "hi", "max_tokens": 1})
    r = httpx.post(fuzz.url + "/v1/completions", content=body, timeout=30,
                   headers={} if ctype is None else {"content-type": ctype})
    assert ("content-type" in r.request.headers) == (ctype is not None), r.request.headers
    assert r.status_code == status, r.text
    if status == 415:
        assert r.json()["error"]["code"] == "unsupported_media_type" and "+json" in r.json()["error"]["message"]


@pytest.mark.parametrize(("text", "half"), [
    (r'"\ud800"', r"\ud800"), (r'"\ud800", "max_tokens": 1', r"\ud800"), (r'"a\udc00b"', r"\udc00"),
    (r'"\ud800\ud800"', r"\ud800"), (r'"\uDBFF x \uDC00"', r"\uDBFF"), (r'"\\\ud800"', r"\ud800"),
    (r'"\ud83d\ude00"', None), (r'"\\ud800"', None)])
def test_a_lone_surrogate_escape_is_named_in_the_400(fuzz: Cluster, text: str, half: str | None) -> None:
    """Regression: ``"\\ud800"`` in a body got 400 "JSON is malformed: unexpected end of hex escape" (or "Input data
    was truncated"): the decoder's words for a lone UTF-16 surrogate escape. A whole pair (or an escaped backslash
    before ``ud800``) is no lone surrogate and reaches a worker."""
    body = '{"model": "dplb-sim", "max_tokens": 1, "prompt": ' + text + "}"
    r = httpx.post(fuzz.url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                   timeout=30)
    if half is None:
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    assert f"invalid \\u escape: lone surrogate {half}" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize(("method", "path", "allow"), [
    ("GET", "/v1/chat/completions", "POST"), ("PUT", "/v1/completions", "POST"),
    ("DELETE", "/v1/responses/resp_1", "GET"), ("GET", "/v1/responses/resp_1/cancel", "POST")])
def test_a_wrong_method_on_a_proxied_route_is_an_openai_405_with_allow(fuzz: Cluster, method: str, path: str,
                                                                       allow: str) -> None:
    """Regression: the proxy's own 405 (``GET /v1/chat/completions``) had no ``Allow`` header (RFC 9110 §15.5.6)."""
    r = httpx.request(method, fuzz.url + path, timeout=10)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed", r.text
    assert r.headers.get("allow") == allow, r.headers
    assert f"allowed: {allow}" in r.json()["error"]["message"]


def test_a_response_id_the_router_cannot_remember_is_the_workers_404_not_a_405(fuzz: Cluster) -> None:
    """Regression: ``GET /v1/responses/a%20b`` (an id outside the remembered alphabet) was the proxy's 405 "GET is
    not allowed", with GET the right method; it is routed by score like any unknown id and the worker says 404."""
    for rid in ("a%20b", "x" * 300):
        r = httpx.get(f"{fuzz.url}/v1/responses/{rid}", timeout=10)
        assert r.status_code == 404 and "x-sg-worker-id" in r.headers, (r.status_code, r.text)


@pytest.mark.parametrize("depth", [1000, 5000])
def test_deeply_nested_json_is_an_openai_400(fuzz: Cluster, depth: int) -> None:
    """JSON nested deeper than the decoder's recursion limit, as the whole body or inside a valid request, is 400
    ``invalid_json`` (not a 500 ``internal_error``); the same request nested 50 deep reaches a worker."""
    def nested(n: int) -> str:
        return '{"a":' * n + "1" + "}" * n

    def request(n: int) -> str:
        return '{"model": "dplb-sim", "prompt": "x", "max_tokens": 1, "x": ' + nested(n) + "}"

    for body in (nested(depth), request(depth)):
        r = httpx.post(fuzz.url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                       timeout=10)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
        assert "nested too deeply" in r.json()["error"]["message"]
    r = httpx.post(fuzz.url + "/v1/completions", content=request(50), headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 200 and r.headers["x-sg-worker-id"] in ("0", "1"), r.text


@pytest.mark.parametrize("body", [
    {"max_tokens": 10**30}, {"max_tokens": -1}, {"n": -1}, {"n": 0}, {"max_tokens": "many"}, {"stream": 12},
])
def test_absurd_values_get_the_workers_400(fuzz: Cluster, body: dict[str, Any]) -> None:
    r = httpx.post(fuzz.url + "/v1/completions", json={"model": "dplb-sim", "prompt": "x", **body}, timeout=10)
    assert r.status_code == 400 and r.headers["x-sg-worker-id"] in ("0", "1"), r.text
    assert "error" in r.json()


# ---- request ids, internals ------------------------------------------------------------------------------------------
def test_request_ids_are_sanitised(fuzz: Cluster) -> None:
    assert _REQUEST_ID_RE.fullmatch(b"abc\n") is None and _REQUEST_ID_RE.fullmatch(b"a-b.c:d_1") is not None
    body = json.dumps({"model": "dplb-sim", "prompt": "x", "max_tokens": 1}).encode()
    cases = {b"good-id_1.2:3": True, b"a" * 129: False, b"r\xc3\xa9q": False, b"has space": False,
             b"semi;colon": False, b"a" * 128: True, b"\xff\xfe": False}
    for rid, kept in cases.items():
        resp = _raw(fuzz, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: "
                    b"application/json\r\ncontent-length: %d\r\nx-request-id: %s\r\n\r\n%s" % (len(body), rid, body))
        head = resp.partition(b"\r\n\r\n")[0].lower()
        assert head.startswith(b"http/1.1 200"), resp[:200]
        echoed = re.search(rb"\r\nx-request-id: ([^\r]*)", head).group(1)  # type: ignore[union-attr]
        if kept:
            assert echoed == rid.lower()
        else:
            assert re.fullmatch(rb"[0-9a-f]{32}", echoed), echoed
        worker = int(re.search(rb"\r\nx-sg-worker-id: (\d)", head).group(1))  # type: ignore[union-attr]
        recs = worker_get(fuzz.sock(worker), "/debug/requests").json()
        assert any(e["x_request_id"] and e["x_request_id"].lower() == echoed.decode() for e in recs), echoed


class _Boom:
    """Raises ``exc`` when tested for truth: planted where the proxy reads a plain attribute."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __bool__(self) -> bool:
        raise self.exc


def test_router_bug_is_an_openai_500_without_internals(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """In-process: a proxy or local route that raises gives a bare OpenAI-shaped 500 (the traceback is logged).
    The faults are planted in objects of modules that are never compiled (the tenant gate's ``on``, read first
    thing by the proxy; the config's ``socket_path``, which ``/ready`` reaches without a segment): the proxy and the
    router state may be mypyc-compiled (scripts/build_native.sh), and compiled instances cannot be patched."""
    app = RouterApp(RouterConfig(PolicyConfig(), run_dir=str(tmp_path), num_workers=1,
                                 shm_path=str(tmp_path / "absent")))

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as cl:
            with mock.patch.object(app.proxy.gate, "on", _Boom(RuntimeError("boom at /root/secret.py"))), \
                    mock.patch.object(RouterConfig, "socket_path", side_effect=KeyError("/tmp/x.py")):
                return [await cl.post("/v1/completions", json={"model": "m"}), await cl.get("/ready")]

    for r in asyncio.run(main()):
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error", r.text
        assert_no_internals(r.text)


# ---- security -----------------------------------------------------------------------------------------------------------
def test_api_key_exemptions_are_configurable_and_compared_in_constant_time(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with cluster(str(tmp_path), 1, router_args=["--api-key", "s3cret", "--api-key-exempt", "/health"],
                 wait_router_ready=False) as c:
        key = {"authorization": "Bearer s3cret"}
        assert httpx.get(c.url + "/health").status_code == 200
        for path in ("/metrics", "/ready", "/v1/models", "/debug/decisions"):
            r = httpx.get(c.url + path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
            assert httpx.get(c.url + path, headers=key).status_code == 200, path
        assert c.router is not None
        c.router.terminate()
        c.router.wait(10)
        # `--api-key-exempt ''`: nothing is open, not even /health (start_router would wait for /health 200).
        c.router = subprocess.Popen(router_cmd("--host", "127.0.0.1", "--port", str(c.port), "--run-dir",
                                             c.run_dir, "--api-key", "s3cret", "--api-key-exempt", ""), env=c.env(),
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: _status(c.url + "/health") == 401, 30, "the router without exemptions")
        assert httpx.get(c.url + "/health", headers=key).status_code == 200
    r = subprocess.run(router_cmd("--api-key", "k", "--api-key-exempt", "/v1/chat/completions"),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "cannot be exempt" in r.stderr and "Traceback" not in r.stderr
    app = RouterApp(RouterConfig(PolicyConfig(), run_dir=str(tmp_path), num_workers=1, shm_path=str(tmp_path / "x"),
                                 api_key="s3cret"))
    with mock.patch("hmac.compare_digest", wraps=hmac.compare_digest) as cmp:
        assert app._refusal({"headers": [(b"authorization", b"Bearer s3cret")]}) is None
        assert app._refusal({"headers": [(b"authorization", b"Bearer s3cres")]}) is not None
    assert cmp.call_count == 2


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=1).status_code
    except httpx.HTTPError:
        return 0


_PROBE = """
import errno, socket, sys
res = []
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1]); res.append("connected")
except OSError as e:
    res.append(errno.errorcode.get(e.errno, str(e.errno)))
try:
    open(sys.argv[2], "rb").read(4); res.append("read")
except OSError as e:
    res.append(errno.errorcode.get(e.errno, str(e.errno)))
print(" ".join(res))
"""


def _probe_as_nobody(sock: str, seg: str) -> str:
    nobody = pwd.getpwnam("nobody")
    r = subprocess.run(["/usr/bin/python3", "-c", _PROBE, sock, seg], user=nobody.pw_uid, group=nobody.pw_gid,
                       extra_groups=[], capture_output=True, text=True, timeout=30, cwd="/")
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_modes_and_other_users_cannot_reach_workers_or_segment(tmp_path) -> None:  # type: ignore[no-untyped-def]
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user (nobody)")
    with LaunchedCluster(1, [], workdir=str(tmp_path)) as lc:
        sock = os.path.join(lc.run_dir, "worker-0.sock")
        mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)  # noqa: E731
        assert (mode(lc.run_dir), mode(sock), mode(lc.shm_path)) == (0o700, 0o600, 0o600)
        assert _probe_as_nobody(sock, lc.shm_path) == "EACCES EACCES"
        os.chmod(lc.run_dir, 0o711)  # even with a traversable directory the socket's own mode refuses
        try:
            assert _probe_as_nobody(sock, lc.shm_path) == "EACCES EACCES"
        finally:
            os.chmod(lc.run_dir, 0o700)
        assert worker_get(sock, "/health").status_code == 200  # the owner can


# ---- soak smoke ---------------------------------------------------------------------------------------------------------
def test_soak_script_smoke() -> None:
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "soak.py"), "--duration-s", "12",
                        "--warmup-s", "4", "--rate", "15", "--sample-s", "3", "--json"],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0 and "soak: PASS" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    fig = json.loads(r.stdout.strip().splitlines()[-2])
    assert fig["errors"] == 0 and fig["requests"] >= 200 and fig["inflight_after"] == [0.0] * 4
    assert fig["rss_growth_pct"] < 5 and fig["fd_growth"] <= 0
