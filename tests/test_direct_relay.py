"""The direct relay (dplb/router/direct.py) against the ASGI path, with real router and sim worker processes: the
same answers, and the failures the relay handles itself (mid-body) or hands on (before the head)."""

from __future__ import annotations

import re
import signal
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from cluster import Cluster, assert_openai_error, cluster, worker_get

CHAT = {"model": "dplb-sim", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}
_VOLATILE = re.compile(rb'"(id|created|system_fingerprint)":\s*("[^"]*"|\d+)')
# (path, JSON body, extra headers): each asked the same of both paths.
REQUESTS: list[tuple[str, Any, dict[str, str]]] = [
    ("/v1/chat/completions", CHAT, {}),
    ("/v1/chat/completions", {**CHAT, "stream": True, "max_tokens": 6}, {}),
    ("/v1/completions", {"model": "dplb-sim", "prompt": "abc", "max_tokens": 3}, {}),
    ("/v1/completions", {"model": "dplb-sim", "prompt": "abc", "max_tokens": 5, "stream": True}, {}),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, {}),  # the worker's 400
    ("/v1/chat/completions", {**CHAT, "model": "no-such-model"}, {}),  # the router's 404 (declined)
    ("/v1/completions", "not json", {"content-type": "text/plain"}),  # the router's 415 (declined)
    ("/v1/embeddings", {"model": "dplb-sim", "input": "hello"}, {}),
    ("/v1/chat/completions", CHAT, {"connection": "close"}),
]


def _direct(c: Cluster) -> dict[str, float]:
    return {p: c.metric("dplb_direct_relay_requests_total", {"path": p}) or 0.0
            for p in ("direct", "continued", "declined")}


def _ask(c: Cluster) -> list[tuple[int, list[tuple[str, str]], bytes]]:
    """Each of :data:`REQUESTS` on one keep-alive client: (status, headers without the volatile ones, body with its
    ids and timestamps masked)."""
    out = []
    with httpx.Client(timeout=30) as client:
        client.post(c.url + "/v1/completions", json={"model": "dplb-sim", "prompt": "w", "max_tokens": 1})  # pool
        for i, (path, body, extra) in enumerate(REQUESTS):
            headers = {"content-type": "application/json", "x-request-id": f"same-{i}", **extra}
            data = body.encode() if isinstance(body, str) else httpx.Request("POST", "/", json=body).content
            r = client.post(c.url + path, content=data, headers=headers)
            kept = sorted((k, v) for k, v in r.headers.multi_items() if k not in ("date", "content-length"))
            out.append((r.status_code, kept, _VOLATILE.sub(rb'"\1":X', r.content)))
    return out


def test_direct_relay_answers_as_the_asgi_path_does(tmp_path: Path) -> None:
    """One worker (the same routing both times): every request of the table gets the same status, headers and body
    (ids and timestamps masked) from the direct relay as from the ASGI path; only the relay's counter differs."""
    with cluster(str(tmp_path), 1) as c:
        direct = _ask(c)
        counts = _direct(c)
        c.start_router("--no-direct-relay")
        asgi = _ask(c)
        assert _direct(c) == {"direct": 0, "continued": 0, "declined": 0}
    for (path, body, _), d, a in zip(REQUESTS, direct, asgi, strict=True):
        assert d == a, (path, body)
    # The 404 and the 415 declined; the rest (with the pool's warm-up request) taken, and answered directly but for
    # at most the first (no pooled connection yet unless the models refresh left one).
    assert counts["declined"] == 2 and counts["direct"] + counts["continued"] == len(REQUESTS) - 1, counts
    assert counts["continued"] <= 1, counts


def _warm(c: Cluster) -> None:
    r = httpx.post(c.url + "/v1/completions", json={"model": "dplb-sim", "prompt": "w", "max_tokens": 1}, timeout=30)
    assert r.status_code == 200


def test_worker_killed_mid_stream_on_the_direct_relay(tmp_path: Path) -> None:
    """A stream relayed from the callbacks whose worker dies: the error event, no [DONE], the connection cut, and
    the worker's in-flight count back to 0."""
    with cluster(str(tmp_path), 1, worker_args={0: ["--sim-chunk-delay-s", "0.05"]}) as c:
        _warm(c)
        before = _direct(c)
        got = b""
        with pytest.raises(httpx.HTTPError), httpx.Client(timeout=30) as client:
            client.post(c.url + "/v1/completions", json={"model": "dplb-sim", "prompt": "w", "max_tokens": 1})
            with client.stream("POST", c.url + "/v1/chat/completions",
                               json={**CHAT, "max_tokens": 200, "stream": True}) as r:
                for chunk in r.iter_raw():
                    got += chunk
                    if got.count(b"data:") == 5:
                        c.kill_worker(0, signal.SIGKILL)
        assert b"[DONE]" not in got and b"worker_failed" in got, got[-300:]
        after = _direct(c)
        assert after["direct"] - before["direct"] == 2 and after["continued"] == before["continued"], (before, after)
        _wait_inflight_zero(c)


def test_idle_timeout_mid_stream_and_first_byte_timeout_on_the_direct_relay(tmp_path: Path) -> None:
    """The sim hangs after its 3rd completed request: a stream relayed directly then stalls and gets the
    ``worker_timeout`` event after ``--idle-timeout``; the next request is taken by the relay, times out before its
    head and is continued on the ASGI path, which answers 504."""
    with cluster(str(tmp_path), 1, worker_args={0: ["--sim-hang-after", "3", "--sim-chunk-delay-s", "0.05"]},
                 router_args=["--idle-timeout", "1", "--first-byte-timeout", "2"]) as c:
        with httpx.Client(timeout=30) as client:
            assert client.post(c.url + "/v1/completions", json={"model": "dplb-sim", "prompt": "w",
                                                                 "max_tokens": 1}).status_code == 200
            got, t_stall = b"", 0.0
            with pytest.raises(httpx.HTTPError), client.stream("POST", c.url + "/v1/completions", json={
                    "model": "dplb-sim", "prompt": "y", "max_tokens": 200, "stream": True}) as s:
                for chunk in s.iter_raw():
                    got += chunk
                    if got.count(b"data:") == 3 and not t_stall:
                        r = httpx.post(c.url + "/v1/completions", json={"model": "dplb-sim", "prompt": "z",
                                                                          "max_tokens": 1}, timeout=30)
                        assert r.status_code == 200  # the sim hangs from here on
                        t_stall = time.monotonic()
            assert b"worker_timeout" in got and b"[DONE]" not in got
            assert 0.8 <= time.monotonic() - t_stall < 10
        before = _direct(c)
        with httpx.Client(timeout=30) as client:
            t0 = time.monotonic()
            r = client.post(c.url + "/v1/completions", json={"model": "dplb-sim", "prompt": "w", "max_tokens": 1})
            assert_openai_error(r, 504, "worker_timeout")
            assert 1.8 <= time.monotonic() - t0 < 10
        after = _direct(c)
        _wait_inflight_zero(c)
    assert after["continued"] - before["continued"] >= 1, (before, after)


def test_client_leaving_a_direct_stream_aborts_the_engine_request(tmp_path: Path) -> None:
    with cluster(str(tmp_path), 1, worker_args={0: ["--sim-chunk-delay-s", "0.02"]}) as c:
        _warm(c)
        before = _direct(c)
        with httpx.stream("POST", c.url + "/v1/chat/completions", timeout=30,
                          json={**CHAT, "max_tokens": 400, "stream": True},
                          headers={"x-request-id": "leave-me"}) as r:
            next(r.iter_raw())
        t_closed = time.monotonic()
        while True:
            entry = next((e for e in worker_get(c.sock(0), "/debug/requests").json()
                          if e.get("x_request_id") == "leave-me"), None)
            if entry and entry.get("aborted"):
                break
            assert time.monotonic() - t_closed < 1.0, entry
            time.sleep(0.02)
        _wait_inflight_zero(c)
        assert _direct(c)["direct"] - before["direct"] == 1


def test_pipelined_requests_on_one_connection_answer_in_order(tmp_path: Path) -> None:
    """Three requests written back to back on one connection: three answers, in order, each with its own id."""
    with cluster(str(tmp_path), 1) as c:
        _warm(c)
        body = b'{"model": "dplb-sim", "prompt": "p", "max_tokens": 2}'
        one = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\nx-request-id: pipe-%%d\r\n\r\n%s" % (len(body), body))
        with socket.create_connection(("127.0.0.1", c.port), timeout=10) as s:
            s.sendall(b"".join(one % i for i in range(3)))
            data = b""
            while data.count(b"HTTP/1.1 200") < 3 or not data.endswith(b"}"):
                chunk = s.recv(65536)
                assert chunk, data
                data += chunk
        assert [int(m) for m in re.findall(rb"x-request-id: pipe-(\d)", data)] == [0, 1, 2]


def test_a_body_over_a_small_max_body_bytes_is_413_on_the_direct_relay(tmp_path: Path) -> None:
    """Regression: with ``--max-body-bytes`` under the relay's 64 KiB offer, the relay forwarded a body between the
    two (200 from the worker) where the ASGI path answers 413; it now declines it and the ASGI path answers."""
    with cluster(str(tmp_path), 1, router_args=["--max-body-bytes", "1000"]) as c:
        _warm(c)
        before = _direct(c)
        body = b'{"model": "dplb-sim", "prompt": "%s", "max_tokens": 1}' % (b"x" * 2000)
        with httpx.Client(timeout=30) as client:
            for _ in range(2):
                r = client.post(c.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
                assert_openai_error(r, 413, "body_too_large")
            small = client.post(c.url + "/v1/completions", json={"model": "dplb-sim", "prompt": "y", "max_tokens": 1})
            assert small.status_code == 200, small.text
        after = _direct(c)
        assert after["declined"] - before["declined"] == 2 and after["direct"] - before["direct"] == 1, after


def _wait_inflight_zero(c: Cluster) -> None:
    t0 = time.monotonic()
    while (v := c.metric("dplb_worker_requests_inflight", {"worker": "0"})) != 0:
        assert time.monotonic() - t0 < 5, v
        time.sleep(0.05)


@pytest.mark.parametrize(("feature", "on"), [({}, True), ({"direct_relay": False}, False), ({"api_key": "k"}, True),
                                         ({"access_log": True}, True), ({"api_key": "k", "access_log": True}, True),
                                         ({"tenants_file": "TENANTS"}, True),
                                         ({"cors_allowed_origins": ("https://a.example",)}, False),
                                         ({"resume_streams": True}, False), ({"sse_keepalive_s": 5.0}, False)])
def test_the_direct_relay_is_on_only_while_no_feature_needs_the_asgi_path(tmp_path: Path, feature: dict[str, Any],
                                                                         on: bool) -> None:
    """In-process (the router's own objects, no segment): each feature that needs the ASGI path turns the direct
    relay off (the tenant gate does not: a tenants file, the API key, the access log); tracing, enabled after
    start, too."""
    from dplb.config import PolicyConfig, RouterConfig
    from dplb.router.app import RouterApp

    if "tenants_file" in feature:
        tf = tmp_path / "tenants.toml"
        tf.write_text(f'[tenants.a]\napi_key_sha256 = ["{"0" * 64}"]\n')
        feature = {"tenants_file": str(tf)}
    app = RouterApp(RouterConfig(PolicyConfig(), run_dir=str(tmp_path), num_workers=1,
                                 shm_path=str(tmp_path / "absent"), **feature))
    assert app.proxy.direct_enabled() is on
    app.proxy.enable_tracing(object())
    assert app.proxy.direct_enabled() is False
    app.state.close()
    app.pool.close()
