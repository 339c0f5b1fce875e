"""The direct relay (dplb/router/direct.py) with ``--api-key`` and ``--access-log`` on, against the ASGI path
(``--no-direct-relay``), with real router and sim worker processes: the relay takes the keyed request, a missing or
wrong key is declined and answered by the ASGI path's 401, and both paths leave the same tenant ledger, metrics,
debug ring and access-log lines. The key's parser is fuzzed on both paths (hypothesis)."""

from __future__ import annotations

import gzip
import json
import re
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cluster import Cluster, Routers, both_paths, cluster, wait_for
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dplb.ops.usage import read_ledger

KEY = "s3cret-Key_1.x~y+z/w=="
GOOD = f"Bearer {KEY}"
CHAT = {"model": "dplb-sim", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}
_VOLATILE = re.compile(rb'"(id|created|system_fingerprint)":\s*("[^"]*"|\d+)')
# (path, JSON body or raw text, Authorization value or None): each asked the same of both paths.
REQUESTS: list[tuple[str, Any, str | None]] = [
    ("/v1/chat/completions", CHAT, GOOD),
    ("/v1/chat/completions", {**CHAT, "stream": True, "max_tokens": 6}, GOOD),
    ("/v1/chat/completions", {**CHAT, "stream": True, "max_tokens": 5,
                              "stream_options": {"include_usage": True}}, GOOD),  # the engine's usage in a stream
    ("/v1/completions", {"model": "dplb-sim", "prompt": "abc", "max_tokens": 3}, f"bearer   {KEY}"),
    ("/v1/completions", {"model": "dplb-sim", "prompt": "abc", "max_tokens": 5, "stream": True}, f"BEARER {KEY}"),
    ("/v1/chat/completions", CHAT, None),  # 401: no key
    ("/v1/chat/completions", CHAT, "Bearer wrong"),  # 401
    ("/v1/chat/completions", CHAT, KEY),  # 401: no scheme
    ("/v1/chat/completions", CHAT, f"Bearer\t{KEY}"),  # 401: the scheme is "bearer " exactly, as on the ASGI path
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, GOOD),  # the worker's 400
    ("/v1/chat/completions", {**CHAT, "model": "no-such-model"}, GOOD),  # the router's 404 (declined)
    ("/v1/completions", "not json", GOOD),  # the router's 415 (declined)
    ("/v1/embeddings", {"model": "dplb-sim", "input": "hello"}, GOOD),
]
UNAUTHORIZED = 4  # the 401s of the table
# The samples both paths must leave alike: every counter and histogram count of the tenant ledger, the HTTP
# requests, the upstream outcomes, the router's refusals and decisions (durations and timings differ run to run).
_COMPARED = re.compile(r"^(dplb_tenant_\w+|dplb_http_requests_total|dplb_upstream_request_duration_seconds_count"
                       r"|dplb_requests_rejected_total|dplb_router_decisions_total)(\{.*\})? ")
_ACCESS = re.compile(r"(\S+) tenant=(\S+) status=(\d+) outcome=(\S+) queue_wait_ms=(\d+) prompt_tokens=(\S+) "
                     r"completion_tokens=(\S+)")


def _direct(c: Cluster) -> dict[str, float]:
    return {p: c.metric("dplb_direct_relay_requests_total", {"path": p}) or 0.0
            for p in ("direct", "continued", "declined")}


def _samples(c: Cluster) -> dict[str, str]:
    text = httpx.get(c.url + "/metrics", timeout=5).text
    out = {}
    for line in text.splitlines():
        if _COMPARED.match(line) and "_bucket" not in line and "_sum" not in line and "_created" not in line \
                and 'route="/ready"' not in line:  # (the harness polls /ready until the router is up: 1 or more)
            name, _, value = line.rpartition(" ")
            out[name] = value
    return out


def _ask(c: Cluster) -> list[tuple[int, list[tuple[str, str]], bytes]]:
    """Each of :data:`REQUESTS` on one keep-alive client (a new one after an answer that closed the connection):
    (status, headers without the volatile ones, body with its ids and timestamps masked)."""
    out = []
    client = httpx.Client(timeout=30)
    try:
        client.post(c.url + "/v1/completions", json={"model": "dplb-sim", "prompt": "w", "max_tokens": 1},
                    headers={"authorization": GOOD, "x-request-id": "warm"})  # the pool
        for i, (path, body, auth) in enumerate(REQUESTS):
            headers = {"content-type": "application/json" if not isinstance(body, str) else "text/plain",
                       "x-request-id": f"same-{i}"}
            if auth is not None:
                headers["authorization"] = auth
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            r = client.post(c.url + path, content=data, headers=headers)
            kept = sorted((k, v) for k, v in r.headers.multi_items() if k not in ("date", "content-length"))
            out.append((r.status_code, kept, _VOLATILE.sub(rb'"\1":X', r.content)))
            if r.headers.get("connection") == "close":
                client.close()
                client = httpx.Client(timeout=30)
    finally:
        client.close()
    return out


def _ledger(c: Cluster) -> tuple[dict[str, str], list[tuple[str, str, int]], list[tuple[str, ...]]]:
    """The compared samples, the debug ring (request id, tenant, worker) and the access-log lines of ``c``'s router
    (its log holds every router's of the test: the caller takes the new part)."""
    time.sleep(0.3)  # (the last response's accounting runs after its last byte)
    ring = httpx.get(c.url + "/debug/decisions?limit=100", headers={"authorization": GOOD}, timeout=5)
    assert ring.status_code == 200, ring.text
    decisions = sorted((d["request_id"], d["tenant"], d["worker"]) for d in ring.json())
    return _samples(c), decisions, [m.groups() for m in _ACCESS.finditer(c.router_log())]


def test_keyed_direct_relay_answers_and_accounts_as_the_asgi_path(tmp_path: Path) -> None:
    """With ``--api-key`` and ``--access-log``: the same status, headers and body for every request of the table
    from the relay as from the ASGI path, the same tenant ledger and other counters, the same debug ring and the
    same access-log lines; the relay took the keyed requests and declined the 401s (the ASGI path answered them)."""
    flags = ["--api-key", KEY, "--access-log"]
    with cluster(str(tmp_path), 1, router_args=flags) as c:
        direct = _ask(c)
        counts = _direct(c)
        d_samples, d_ring, d_log = _ledger(c)
        c.start_router(*flags, "--no-direct-relay")
        asgi = _ask(c)
        assert _direct(c) == {"direct": 0, "continued": 0, "declined": 0}
        a_samples, a_ring, a_log = _ledger(c)
    for (path, body, auth), d, a in zip(REQUESTS, direct, asgi, strict=True):
        assert d == a, (path, body, auth)
    assert [s for s, _, _ in direct].count(401) == UNAUTHORIZED
    # The 401s, the 404 and the 415 declined; the rest (and the pool's warm-up request) taken.
    assert counts["declined"] == UNAUTHORIZED + 2, counts
    assert counts["direct"] + counts["continued"] == len(REQUESTS) + 1 - UNAUTHORIZED - 2, counts
    assert counts["continued"] <= 1, counts
    assert d_samples == a_samples
    assert any(k.startswith("dplb_tenant_tokens_total") and 'kind="completion"' in k for k in d_samples), d_samples
    assert d_ring == a_ring and {t for _, t, _ in d_ring} == {"default"}
    a_log = a_log[len(d_log):]  # (one log file for both routers)
    assert d_log == a_log and len(d_log) == len(REQUESTS) + 1 - UNAUTHORIZED, d_log  # (a 401 has no tenant)


def _one(path: str, body: bytes, rid: str, auth: bytes | None, close: bool = False) -> bytes:
    return (b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"x-request-id: %s\r\n%s%s\r\n%s" % (path.encode(), len(body), rid.encode(),
                                                 b"authorization: %s\r\n" % auth if auth is not None else b"",
                                                 b"connection: close\r\n" if close else b"", body))


def _talk(port: int, data: bytes) -> bytes:
    """Write ``data`` on one connection and read until the router closes it."""
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=15) as s:
        s.sendall(data)
        while chunk := s.recv(65536):
            got += chunk
    return re.sub(rb"date: [^\r]*\r\n", b"", _VOLATILE.sub(rb'"\1":X', got))


def test_pipelined_requests_with_a_bad_key_in_the_middle(tmp_path: Path) -> None:
    """Three requests written back to back on one connection, the middle one with a wrong key: the relay router
    writes exactly the bytes the ASGI path writes (answers in order, the same 401, the same close)."""
    body = b'{"model": "dplb-sim", "prompt": "p", "max_tokens": 2}'
    good = GOOD.encode()
    data = (_one("/v1/completions", body, "pipe-0", good) + _one("/v1/completions", body, "pipe-1", b"Bearer bad")
            + _one("/v1/completions", body, "pipe-2", good, close=True))
    alone = [_one("/v1/completions", body, "one-0", good, close=True),
             _one("/v1/completions", body, "one-1", b"Bearer bad", close=True)]
    with cluster(str(tmp_path), 1, router_args=["--api-key", KEY]) as c:
        _talk(c.port, _one("/v1/completions", body, "warm", good, close=True))
        before = _direct(c)
        direct = [_talk(c.port, data), *(_talk(c.port, x) for x in alone)]
        after = _direct(c)
        c.start_router("--api-key", KEY, "--no-direct-relay")
        _talk(c.port, _one("/v1/completions", body, "warm", good, close=True))
        asgi = [_talk(c.port, data), *(_talk(c.port, x) for x in alone)]
    assert direct == asgi
    assert re.findall(rb"HTTP/1.1 (\d+)", direct[0])[:2] == [b"200", b"401"], direct[0]
    assert b"HTTP/1.1 401" in direct[2] and b'"code":"invalid_api_key"' in direct[2].replace(b" ", b""), direct[2]
    # The first of the pipelined requests and the lone good one taken; the lone bad one declined.
    assert after["direct"] - before["direct"] >= 2 and after["declined"] - before["declined"] >= 1, (before, after)


# ---- the key's parser, fuzzed on both paths --------------------------------------------------------------------
@pytest.fixture(scope="module")
def routers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Routers]:
    """One sim worker and a router with ``--api-key`` and the relay on; the same with ``--no-direct-relay``."""
    with both_paths(tmp_path_factory, ["--api-key", KEY]) as rs:
        yield rs


_SCHEMES = st.sampled_from(["Bearer", "bearer", "BEARER", "BeArEr", "Bearer:", "Basic", "Token", "Bear", ""])
_SEPS = st.sampled_from([" ", "  ", "\t", "", " \t ", ":"])
_KEYS = st.sampled_from([KEY, KEY.upper(), KEY[:-1], KEY + "x", "x" + KEY, "", KEY.replace("=", "")])
_PADS = st.sampled_from(["", " ", "  ", "\t"])
_AUTH = st.one_of(st.none(), st.builds(lambda a, b, c, d, e: a + b + c + d + e, _PADS, _SCHEMES, _SEPS, _KEYS, _PADS),
                  st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7e), max_size=40))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(auth=_AUTH, twice=st.booleans())
@example(auth=GOOD, twice=False)
@example(auth=f"bearer  {KEY}  ", twice=False)
@example(auth="Bearer wrong", twice=True)
def test_fuzzed_authorization_is_answered_alike(routers: Routers, auth: str | None, twice: bool) -> None:
    """Any ``Authorization`` value (scheme case and spacing, a key close to the right one, none, a header given
    twice with the right key first): the relay router gives the status, error code and body the ASGI path gives;
    a header given twice is a 400 ``duplicate_header`` on both."""
    body = b'{"model": "dplb-sim", "prompt": "f", "max_tokens": 1}'
    value = auth.encode() if auth is not None else None
    data = _one("/v1/completions", body, "fuzz", value, close=True)
    twice = twice and value is not None
    if twice:  # the right key first, then this one
        data = data.replace(b"authorization: ", b"authorization: %s\r\nauthorization: " % GOOD.encode(), 1)
    got = [_talk(c.port, data) for c in (routers.direct, routers.asgi)]
    assert got[0] == got[1], auth
    assert re.match(rb"HTTP/1.1 400 " if twice else rb"HTTP/1.1 (200|401|400) ", got[0]), got[0][:200]
    if twice:
        assert b'"code":"duplicate_header"' in got[0], got[0]


def _with(base: bytes, *lines: bytes) -> bytes:
    """``base`` (a request of :func:`_one`) with header ``lines`` added after its first line."""
    first, rest = base.split(b"\r\n", 1)
    return first + b"\r\n" + b"".join(line + b"\r\n" for line in lines) + rest


def test_a_repeated_authorization_or_content_type_is_a_400_on_both_paths(routers: Routers) -> None:
    """Two ``Authorization`` headers (the good key first or last, both good, with different case) or two
    ``Content-Type`` headers: the relay declines, the ASGI path answers 400 ``duplicate_header`` (OpenAI-shaped,
    naming the header), byte for byte alike on both routers; no worker sees the request. A keyed local route
    (``/v1/models``) answers the same 400. Two ``Content-Encoding`` headers are one list: a body gzipped twice is
    decoded twice and served."""
    body = b'{"model": "dplb-sim", "prompt": "d", "max_tokens": 1}'
    bare = _one("/v1/completions", body, "dup", None, close=True)
    good, bad = b"authorization: " + GOOD.encode(), b"Authorization: Bearer nope"
    cases = {
        "authorization": [_with(bare, bad, good), _with(bare, good, bad), _with(bare, good, good),
                          _with(bare, good, b"AUTHORIZATION: " + GOOD.encode())],
        "content-type": [_with(bare, good, b"content-type: text/plain"),
                         _with(bare, good, b"Content-Type: application/json")],
    }
    before = _direct(routers.direct)
    for name, datas in cases.items():
        for data in datas:
            got = [_talk(c.port, data) for c in (routers.direct, routers.asgi)]
            assert got[0] == got[1], data
            status, _, rest = got[0].partition(b"\r\n")
            assert status == b"HTTP/1.1 400 Bad Request", got[0]
            err = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
            assert err["code"] == "duplicate_header" and err["type"] == "invalid_request_error", err
            assert name.title() in err["message"] and err["param"] is None, err
    after = _direct(routers.direct)
    assert after["declined"] - before["declined"] == 6 and after["direct"] == before["direct"], (before, after)
    for c in (routers.direct, routers.asgi):
        r = httpx.get(c.url + "/v1/models", headers=[("authorization", GOOD), ("authorization", GOOD)], timeout=5)
        assert r.status_code == 400 and r.json()["error"]["code"] == "duplicate_header", r.text
        assert httpx.get(c.url + "/v1/models", headers={"authorization": GOOD}, timeout=5).status_code == 200
        twice = gzip.compress(gzip.compress(body))
        r = httpx.post(c.url + "/v1/completions", content=twice, timeout=30, headers=[
            ("authorization", GOOD), ("content-type", "application/json"), ("content-encoding", "gzip"),
            ("content-encoding", "gzip")])
        assert r.status_code == 200 and r.json()["choices"], r.text


def _failures(c: Cluster) -> dict[str, Any]:
    """A request answered whole, a stream its client leaves after 3 events and a stream whose worker is killed
    after 5: the default tenant's ledger once they and the warm-up request are accounted."""
    key = {"authorization": GOOD}
    with httpx.Client(timeout=30) as client:
        assert client.post(c.url + "/v1/chat/completions", json=CHAT, headers=key).status_code == 200
        with client.stream("POST", c.url + "/v1/chat/completions", headers=key,
                           json={**CHAT, "max_tokens": 300, "stream": True}) as r:
            got = b""
            for chunk in r.iter_raw():
                got += chunk
                if got.count(b"data:") >= 3:
                    break
    got = b""
    with pytest.raises(httpx.HTTPError), httpx.Client(timeout=30) as client, \
            client.stream("POST", c.url + "/v1/chat/completions", headers=key,
                          json={**CHAT, "max_tokens": 300, "stream": True}) as r:
        for chunk in r.iter_raw():
            got += chunk
            if got.count(b"data:") >= 5 and 0 in c.workers and c.workers[0].poll() is None:
                c.kill_worker(0, signal.SIGKILL)
    assert b"worker_failed" in got, got[-300:]
    led = wait_for(lambda: (x := read_ledger(c.url, KEY).get("default")) and sum(x["requests"].values()) == 4 and x,
                   10, "four requests in the ledger")
    return led


def test_a_stream_cut_or_left_on_the_keyed_direct_relay_is_accounted_as_on_the_asgi_path(tmp_path: Path) -> None:
    """The tenant ledger of a failed and a cancelled stream is the ASGI path's: the same outcomes (ok, cancelled,
    server_error) and prompt tokens (the engine's count, else the router's estimate); the relay took all three
    (one may continue on the ASGI path when the aborted stream left no idle pooled connection)."""
    slow = ["--sim-chunk-delay-s", "0.05"]
    with cluster(str(tmp_path), 1, worker_args={0: slow}, router_args=["--api-key", KEY]) as c:
        _talk(c.port, _one("/v1/completions", b'{"model": "dplb-sim", "prompt": "w", "max_tokens": 1}', "warm",
                           GOOD.encode(), close=True))
        before = _direct(c)
        direct = _failures(c)
        after = _direct(c)
        c.start_worker(0, *slow)
        c.start_router("--api-key", KEY, "--no-direct-relay")
        _talk(c.port, _one("/v1/completions", b'{"model": "dplb-sim", "prompt": "w", "max_tokens": 1}', "warm",
                           GOOD.encode(), close=True))
        asgi = _failures(c)
    taken = after["direct"] + after["continued"] - before["direct"] - before["continued"]  # (continued: no idle
    assert taken == 3 and after["declined"] == before["declined"], (before, after)  # pooled connection yet)
    for led in (direct, asgi):  # (the warm-up request is in the ledger too)
        assert dict(led["requests"]) == {"ok": 2, "cancelled": 1, "server_error": 1}, led
        assert led["completion_tokens"] >= 1 + 4 + 3 + 5, led  # the events relayed before the cut
    assert direct["prompt_tokens"] == asgi["prompt_tokens"], (direct, asgi)
