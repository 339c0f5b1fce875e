"""Router end to end: real router and sim worker processes on real Unix sockets around a real shm segment."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import os
import signal
import socket
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import openai
import pytest
from cluster import Cluster, assert_openai_error, cluster, free_port, worker_get
from cluster import post as cluster_post

from dplb.state.shm import Lifecycle, Segment, WorkerState

CHAT = {"model": "dplb-sim", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A router and two healthy sim workers, shared by the read-only tests of this module."""
    with cluster(str(tmp_path_factory.mktemp("two")), 2) as c:
        yield c


post = functools.partial(cluster_post, sim_debug=True)  # every response carries the hash of the body the worker got


# ---- the OpenAI SDK --------------------------------------------------------------------------------------------
def test_openai_sdk_chat_completion_stream_models_and_header(two: Cluster) -> None:
    client = openai.OpenAI(base_url=two.url + "/v1", api_key="unused", max_retries=0)
    seen = Counter()
    for i in range(12):
        raw = client.chat.completions.with_raw_response.create(
            model="dplb-sim", messages=[{"role": "user", "content": f"question {i}"}], max_tokens=3)
        seen[raw.headers["x-sg-worker-id"]] += 1
        chat = raw.parse()
        assert chat.choices[0].message.content and chat.usage and chat.usage.completion_tokens == 3
    assert set(seen) == {"0", "1"}, seen
    comp = client.completions.with_raw_response.create(model="dplb-sim", prompt="once upon", max_tokens=2)
    assert comp.headers["x-sg-worker-id"] in ("0", "1") and comp.parse().choices[0].text
    stream = client.chat.completions.create(model="dplb-sim", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=5, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    models = client.models.list()
    assert [m.id for m in models.data] == ["dplb-sim"]


def test_streaming_has_worker_header_and_done(two: Cluster) -> None:
    with httpx.stream("POST", two.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30) as r:
        assert r.status_code == 200 and r.headers["x-sg-worker-id"] in ("0", "1")
        assert r.headers["content-type"].startswith("text/event-stream")
        body = b"".join(r.iter_bytes())
    assert body.rstrip().endswith(b"data: [DONE]")


# ---- byte-exactness --------------------------------------------------------------------------------------------
BODIES = {
    "tools_and_vendor_fields": json.dumps({
        "model": "dplb-sim", "messages": [{"role": "user", "content": "weather?"}], "max_tokens": 2, "n": 1,
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
                   "properties": {"city": {"type": "string"}}}}}], "tool_choice": "auto",
        "response_format": {"type": "json_object"}, "chat_template_kwargs": {"enable_thinking": False},
        "vendor_x": {"nested": [1, 2.50, None, True]}, "top_k": 7, "guided_choice": ["a", "b"],
    }, indent=1).encode(),  # indentation and "2.50" would not survive a re-serialisation
    "cjk_and_emoji": '{"model":"dplb-sim","max_tokens":2,"messages":[{"role":"user","content":"你好，世界 🌍🚀 \\u00e9 é"}]}'
                     .encode(),
}


@pytest.mark.parametrize("name", sorted(BODIES))
def test_body_reaches_worker_byte_for_byte(two: Cluster, name: str) -> None:
    body = BODIES[name]
    r = post(two, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.headers["x-sim-body-sha256"] == hashlib.sha256(body).hexdigest()


def test_eight_megabyte_body_byte_for_byte(two: Cluster) -> None:
    filler = "lorem ipsum " * (8 * 1024 * 1024 // 12)
    body = json.dumps({"model": "dplb-sim", "prompt": filler[:4000], "max_tokens": 1,
                       "vendor_blob": filler}).encode()
    assert len(body) > 8_000_000
    r = post(two, "/v1/completions", body, timeout=60)
    assert r.status_code == 200, r.text[:300]
    assert r.headers["x-sim-body-sha256"] == hashlib.sha256(body).hexdigest()


# ---- headers ---------------------------------------------------------------------------------------------------
def test_request_id_honoured_or_generated_and_hop_by_hop_dropped(two: Cluster) -> None:
    r = post(two, "/v1/chat/completions", CHAT, {"x-request-id": "abc-123.X:y", "keep-alive": "timeout=5",
                                                 "connection": "keep-alive, x-secret-hop", "x-secret-hop": "1",
                                                 "te": "trailers"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123.X:y"
    recent = httpx.get(two.url + "/debug/decisions?limit=1").json()[0]
    assert recent["request_id"] == "abc-123.X:y"
    k = int(r.headers["x-sg-worker-id"])
    log = worker_get(two.sock(k), "/debug/requests").json()
    mine = [e for e in log if e.get("x_request_id") == "abc-123.X:y"]
    assert mine, log[-3:]
    for bad in ("has space", "x" * 200, "quote\"", "ünï"):
        r = post(two, "/v1/chat/completions", CHAT, {"x-request-id": bad.encode()})
        assert r.status_code == 200
        assert r.headers["x-request-id"] != bad and len(r.headers["x-request-id"]) == 32


def test_hop_by_hop_request_headers_never_reach_worker(two: Cluster) -> None:
    """The worker's /debug/requests records the header names it received."""
    r = post(two, "/v1/chat/completions", CHAT, {"x-request-id": "hop-check-1", "connection": "x-private",
                                                 "x-private": "secret", "proxy-authorization": "Basic Zm9v",
                                                 "x-custom-e2e": "kept"})
    assert r.status_code == 200
    entry = next(e for e in worker_get(two.sock(int(r.headers["x-sg-worker-id"])), "/debug/requests").json()
                 if e.get("x_request_id") == "hop-check-1")
    names = set(entry["header_names"])
    assert "x-custom-e2e" in names and "authorization" not in names
    assert not names & {"connection", "x-private", "proxy-authorization", "keep-alive", "transfer-encoding"}
    assert len(r.headers.get_list("date")) <= 1 and len(r.headers.get_list("server")) <= 1


# ---- router-made errors ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "ctype", "status", "code"),
    [
        (b"{not json", "application/json", 400, "invalid_json"),
        (b"\xff\xfe\x00garbage", "application/json", 400, "invalid_json"),
        (b"[1, 2, 3]", "application/json", 400, "body_not_object"),
        (b'"a string"', "application/json", 400, "body_not_object"),
        (b'{"model": "x"}', "text/plain", 415, "unsupported_media_type"),
        (b"model=x", "application/x-www-form-urlencoded", 415, "unsupported_media_type"),
    ],
)
def test_bad_requests_get_openai_errors(two: Cluster, body: bytes, ctype: str, status: int, code: str) -> None:
    r = httpx.post(two.url + "/v1/chat/completions", content=body, headers={"content-type": ctype}, timeout=10)
    assert_openai_error(r, status, code)
    assert "x-sg-worker-id" not in r.headers


def test_413_from_content_length_without_reading_the_body(two: Cluster) -> None:
    """Announce 100 MB, send only the head: the router must answer 413 at once instead of waiting for bytes."""
    with socket.create_connection(("127.0.0.1", two.port), timeout=5) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 104857600\r\n\r\n{\"model\":")
        s.settimeout(5)
        data = b""
        while b"body_too_large" not in data:  # head and body may arrive in separate segments
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    assert data.startswith(b"HTTP/1.1 413"), data[:200]
    assert b"body_too_large" in data


def test_413_for_chunked_body_over_limit(tmp_path: str) -> None:
    with cluster(str(tmp_path), 1, router_args=["--max-body-bytes", "1000"]) as c:
        def gen() -> Iterator[bytes]:
            yield b'{"model":"dplb-sim","prompt":"'
            for _ in range(100):
                yield b"x" * 100
            yield b'"}'
        r = httpx.post(c.url + "/v1/completions", content=gen(), headers={"content-type": "application/json"})
        assert_openai_error(r, 413, "body_too_large")


def test_wrong_method_on_proxied_path(two: Cluster) -> None:
    r = httpx.get(two.url + "/v1/chat/completions")
    assert_openai_error(r, 405, "method_not_allowed")


def test_no_worker_registered_is_503_with_retry_after(tmp_path: str) -> None:
    with cluster(str(tmp_path), 2, start_workers=False) as c:
        r = post(c, "/v1/chat/completions", CHAT)
        assert_openai_error(r, 503, "no_workers_registered")
        assert r.headers["retry-after"] == "1"
        assert httpx.get(c.url + "/ready").status_code == 503
        assert httpx.get(c.url + "/health").status_code == 200
        assert httpx.get(c.url + "/v1/models").status_code == 503
        # Now a worker comes up: the router starts routing to it without a restart.
        c.start_worker(1)
        t0 = time.monotonic()
        while httpx.get(c.url + "/ready").status_code != 200:
            assert time.monotonic() - t0 < 5
            time.sleep(0.05)
        r = post(c, "/v1/chat/completions", CHAT)
        assert r.status_code == 200 and r.headers["x-sg-worker-id"] == "1"
        t0 = time.monotonic()
        while "worker 1 registered" not in c.router_log():  # the monitor logs it within its 0.5 s period
            assert time.monotonic() - t0 < 3, c.router_log()
            time.sleep(0.05)


def test_none_routable_when_all_stale_and_all_over_cap(tmp_path: str) -> None:
    with cluster(str(tmp_path), 1, start_workers=False, router_args=["--hard-queue-cap", "2"]) as c:
        assert c.segment is not None
        w = c.segment.writer(0)
        # A worker that registered long ago and went silent: stale → not routable.
        w.publish(WorkerState(0, pid=os.getpid(), lifecycle=Lifecycle.READY, heartbeat_mono_ns=time.monotonic_ns()
                              - 10**10))
        r = post(c, "/v1/chat/completions", CHAT)
        assert_openai_error(r, 503, "no_routable_worker")
        assert "worker 0: stale" in r.json()["error"]["message"], r.text  # each worker's reason, named
        # Fresh but over the hard cap (the test publishes the state a busy worker would).
        w.publish_now(WorkerState(0, pid=os.getpid(), lifecycle=Lifecycle.READY, num_running=2))
        r = post(c, "/v1/chat/completions", CHAT)
        assert_openai_error(r, 503, "all_workers_over_queue_cap")
        assert r.headers["retry-after"] == "1"


# ---- failures --------------------------------------------------------------------------------------------------
def test_missing_socket_is_retried_on_the_next_worker(tmp_path: str) -> None:
    """Slot 0 says ready (published by the test, as a worker would) but nothing listens on its socket."""
    with cluster(str(tmp_path), 2, start_workers=False, wait_router_ready=False) as c:
        assert c.segment is not None
        c.start_worker(1)
        stop = False

        async def fake_heartbeat() -> None:
            w = c.segment.writer(0)  # type: ignore[union-attr]
            while not stop:
                w.publish_now(WorkerState(0, pid=os.getpid(), lifecycle=Lifecycle.READY))
                await asyncio.sleep(0.1)

        async def main() -> list[httpx.Response]:
            nonlocal stop
            hb = asyncio.create_task(fake_heartbeat())
            await asyncio.sleep(0.3)
            async with httpx.AsyncClient(timeout=30) as cl:
                # No "model": the model filter would keep the request off worker 0 (its /v1/models never
                # answered), and this test is about the connect-failure retry.
                body = {k: v for k, v in CHAT.items() if k != "model"}
                rs = [await cl.post(c.url + "/v1/chat/completions", json=body) for _ in range(6)]
            stop = True
            await hb
            return rs

        rs = asyncio.run(main())
        assert all(r.status_code == 200 and r.headers["x-sg-worker-id"] == "1" for r in rs), [r.text for r in rs]
        # The refused worker is skipped after the first failure (regression: each request used to waste its retry
        # on it, and got a 502 when the retry landed on another dead socket).
        assert c.metric("dplb_upstream_retries_total") == 1
        assert "skipping it" in c.router_log()


def test_no_worker_could_be_connected_to_is_a_503_a_balancer_re_sends(tmp_path: str) -> None:
    """The only worker says ready but nothing listens on its socket: the request reached no engine (no byte was
    sent), so it is answered like every such request, 503 with Retry-After, which the fleet's HAProxy and Envoy
    configs re-send to another host (regression: it was a 502, the status of worker_failed, which they pass on)."""
    with cluster(str(tmp_path), 1, start_workers=False, wait_router_ready=False) as c:
        assert c.segment is not None
        c.segment.writer(0).publish_now(WorkerState(0, pid=os.getpid(), lifecycle=Lifecycle.READY))
        r = post(c, "/v1/chat/completions", {k: v for k, v in CHAT.items() if k != "model"})
        assert_openai_error(r, 503, "worker_unreachable")
        assert r.json()["error"]["type"] == "service_unavailable" and r.headers["retry-after"] == "1", r.headers
        assert "skipping it" in c.router_log()


def test_worker_killed_mid_stream_ends_with_error_event_not_done(tmp_path: str) -> None:
    with cluster(str(tmp_path), 1, worker_args={0: ["--sim-chunk-delay-s", "0.05"]}) as c:
        got = b""
        with pytest.raises(httpx.HTTPError):  # abnormal close: incomplete chunked body
            with httpx.stream("POST", c.url + "/v1/chat/completions", timeout=30,
                              json={**CHAT, "max_tokens": 200, "stream": True}) as r:
                assert r.status_code == 200
                for chunk in r.iter_raw():
                    got += chunk
                    if got.count(b"data:") == 5:
                        c.kill_worker(0, signal.SIGKILL)
        assert b"[DONE]" not in got
        assert b'"error"' in got and b"worker_failed" in got
        _wait_inflight_zero(c, 1)


def _wait_inflight_zero(c: Cluster, n: int) -> None:
    t0 = time.monotonic()
    while True:
        vals = [c.metric("dplb_worker_requests_inflight", {"worker": str(k)}) for k in range(n)]
        if all(v == 0 for v in vals):
            return
        assert time.monotonic() - t0 < 5, vals
        time.sleep(0.05)


def test_hung_worker_hits_idle_and_first_byte_timeouts_and_releases_inflight(tmp_path: str) -> None:
    """The sim hangs after 2 completed requests (warm-up + one): a stream open at that moment stalls mid-way."""
    with cluster(str(tmp_path), 1, worker_args={0: ["--sim-hang-after", "2", "--sim-chunk-delay-s", "0.05"]},
                 router_args=["--idle-timeout", "1", "--first-byte-timeout", "2"]) as c:
        got = b""
        t_stall = 0.0
        with pytest.raises(httpx.HTTPError), httpx.stream("POST", c.url + "/v1/completions", timeout=30,
                          json={"model": "dplb-sim", "prompt": "y", "max_tokens": 200, "stream": True}) as s:
            for chunk in s.iter_raw():
                got += chunk
                if got.count(b"data:") == 3 and not t_stall:
                    r = post(c, "/v1/completions", {"model": "dplb-sim", "prompt": "z", "max_tokens": 1})
                    assert r.status_code == 200  # the 2nd completed request: the sim hangs from here on
                    t_stall = time.monotonic()
        stalled_for = time.monotonic() - t_stall
        assert b"worker_timeout" in got and b"[DONE]" not in got
        assert 0.8 <= stalled_for < 10, stalled_for
        t0 = time.monotonic()
        r = post(c, "/v1/completions", {"model": "dplb-sim", "prompt": "w", "max_tokens": 1})
        assert_openai_error(r, 504, "worker_timeout")
        assert 1.8 <= time.monotonic() - t0 < 10
        assert r.headers["x-sg-worker-id"] == "0"
        _wait_inflight_zero(c, 1)


def test_client_disconnect_aborts_the_engine_request(two: Cluster) -> None:
    with httpx.stream("POST", two.url + "/v1/chat/completions", timeout=30,
                      json={**CHAT, "max_tokens": 400, "stream": True},
                      headers={"x-request-id": "disconnect-me"}) as r:
        k = int(r.headers["x-sg-worker-id"])
        it = r.iter_raw()
        next(it)
    t_closed = time.monotonic()
    while True:
        entry = next((e for e in worker_get(two.sock(k), "/debug/requests").json()
                      if e.get("x_request_id") == "disconnect-me"), None)
        if entry and entry.get("aborted"):
            break
        assert time.monotonic() - t_closed < 1.0, entry
        time.sleep(0.02)
    _wait_inflight_zero(two, 2)


def test_worker_503_passes_through_and_worker_stays_routable(tmp_path: str) -> None:
    with cluster(str(tmp_path), 1, worker_args={0: ["--sim-max-inflight-503", "1", "--sim-chunk-delay-s", "0.05"]}
                 ) as c:
        async def main() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as cl:
                return await asyncio.gather(*[cl.post(c.url + "/v1/completions", json={
                    "model": "dplb-sim", "prompt": "p", "max_tokens": 20}) for _ in range(4)])
        rs = asyncio.run(main())
        codes = Counter(r.status_code for r in rs)
        assert codes[503] >= 1 and codes[200] >= 1, codes
        for r in rs:
            assert r.headers["x-sg-worker-id"] == "0"
            if r.status_code == 503:
                assert r.json()["error"]["code"] == "server_overloaded"
        assert post(c, "/v1/completions", {"model": "dplb-sim", "prompt": "p", "max_tokens": 2}).status_code == 200
        assert httpx.get(c.url + "/ready").status_code == 200


def test_inflight_returns_to_zero_after_a_mix(two: Cluster) -> None:
    async def main() -> None:
        async with httpx.AsyncClient(timeout=30) as cl:
            async def cancelled() -> None:
                async with cl.stream("POST", two.url + "/v1/chat/completions",
                                     json={**CHAT, "max_tokens": 100, "stream": True}) as r:
                    async for _ in r.aiter_raw():
                        return
            await asyncio.gather(
                *[cl.post(two.url + "/v1/chat/completions", json=CHAT) for _ in range(10)],
                *[cl.post(two.url + "/v1/chat/completions", content=b"{bad") for _ in range(5)],
                *[cl.post(two.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 0}) for _ in range(5)],
                *[cancelled() for _ in range(5)],
            )
    asyncio.run(main())
    _wait_inflight_zero(two, 2)


def test_worker_400_passes_through_unchanged(two: Cluster) -> None:
    r = post(two, "/v1/chat/completions", {**CHAT, "max_tokens": 0})
    assert r.status_code == 400 and r.headers["x-sg-worker-id"] in ("0", "1")
    assert "error" in r.json()


def test_unbuffered_streaming(tmp_path: str) -> None:
    with cluster(str(tmp_path), 1, worker_args={0: ["--sim-chunk-delay-s", "0.1"]}) as c:
        times = []
        with httpx.stream("POST", c.url + "/v1/completions", timeout=30,
                          json={"model": "dplb-sim", "prompt": "p", "max_tokens": 10, "stream": True}) as r:
            for chunk in r.iter_raw():
                if b"data:" in chunk:
                    times.append(time.monotonic())
        assert len(times) >= 3
        assert times[-1] - times[0] >= 0.5, [round(t - times[0], 3) for t in times]


def test_api_key(tmp_path: str) -> None:
    with cluster(str(tmp_path), 1, router_args=["--api-key", "s3cret"]) as c:
        assert_openai_error(post(c, "/v1/chat/completions", CHAT), 401, "invalid_api_key")
        assert_openai_error(post(c, "/v1/chat/completions", CHAT, {"authorization": "Bearer nope"}), 401,
                            "invalid_api_key")
        assert post(c, "/v1/chat/completions", CHAT, {"authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(c.url + "/v1/models").status_code == 401
        assert httpx.get(c.url + "/v1/models", headers={"authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(c.url + "/health").status_code == 200
        assert httpx.get(c.url + "/metrics").status_code == 200


def test_debug_decisions_show_every_candidate(two: Cluster) -> None:
    post(two, "/v1/chat/completions", CHAT, {"x-request-id": "dbg-1"})
    d = httpx.get(two.url + "/debug/decisions?limit=5").json()
    mine = next(x for x in d if x["request_id"] == "dbg-1")
    assert mine["policy"] == "dplb" and mine["worker"] in (0, 1)
    assert [c["worker"] for c in mine["candidates"]] == [0, 1]
    assert mine["weights"] == {"queue": 0.3, "memory": 0.2, "latency": 0.2, "prefix": 0.3}
    for cand in mine["candidates"]:
        assert {"score", "terms", "queue", "kv_cache_usage", "max_queue", "prefix_match", "latency_s"} <= set(cand)
        assert set(cand["terms"]) == {"queue", "memory", "latency", "prefix"}


def test_draining_worker_loses_no_request(tmp_path: str) -> None:
    """SIGTERM one of two workers under steady load: every request still succeeds (in-flight ones finish there,
    new ones go to the other; a request that races the drain gets the worker's 503 worker_draining, which the
    router retries elsewhere because nothing was started)."""
    with cluster(str(tmp_path), 2, worker_args={0: ["--sim-chunk-delay-s", "0.01"]}) as c:
        async def main() -> list[tuple[int, str]]:
            out: list[tuple[int, str]] = []
            async with httpx.AsyncClient(timeout=60) as cl:
                async def client(i: int) -> None:
                    for j in range(30):
                        r = await cl.post(c.url + "/v1/completions", json={
                            "model": "dplb-sim", "prompt": f"c{i} r{j}", "max_tokens": 8})
                        out.append((r.status_code, r.headers.get("x-sg-worker-id", "")))
                async def killer() -> None:
                    await asyncio.sleep(0.5)
                    os.kill(c.workers[0].pid, signal.SIGTERM)
                await asyncio.gather(*[client(i) for i in range(8)], killer())
            return out

        res = asyncio.run(main())
        assert Counter(code for code, _ in res) == {200: 240}, Counter(res)
        assert c.workers[0].wait(20) == 0
        assert {w for _, w in res} == {"0", "1"}


def test_router_own_errors_are_openai_shaped(two: Cluster) -> None:
    r = httpx.get(two.url + "/no/such/path")
    assert_openai_error(r, 404, "not_found")
    # The last three: more than the ring of 256 decisions holds (a 20-digit limit was taken as "everything").
    for bad in ("abc", "0", "-1", "1.5", "", "%EF%BC%91", "257", "99999999999999999999", "9" * 5000):
        r = httpx.get(two.url + f"/debug/decisions?limit={bad}")  # %EF%BC%91: a fullwidth one (isdigit says yes)
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "invalid_request" and err["type"] == "invalid_request_error"
        assert err["message"].startswith("query parameter 'limit' must be a positive integer up to 256"), (bad, err)
        assert "Validation failed" not in r.text and "Traceback" not in r.text and "/work" not in r.text
    for good in ("2", "007", "256", "0256"):
        r = httpx.get(two.url + f"/debug/decisions?limit={good}")
        assert r.status_code == 200 and isinstance(r.json(), list), (good[:10], r.text)


def test_ready_without_segment_or_sockets_is_503(tmp_path: str) -> None:
    """Regression: with no segment and no workers /ready said ready (and chat got 502s)."""
    with cluster(str(tmp_path), 2, start_workers=False, wait_router_ready=False) as c:
        os.unlink(c.shm_path)
        t0 = time.monotonic()
        while httpx.get(c.url + "/metrics").text.find("dplb_shm_segment_present 0.0") < 0:
            assert time.monotonic() - t0 < 5
            time.sleep(0.1)
        assert httpx.get(c.url + "/ready").status_code == 503
        assert_openai_error(post(c, "/v1/chat/completions", CHAT), 503, "no_workers_registered")


def test_failing_worker_is_ejected_instead_of_attracting_traffic(tmp_path: str) -> None:
    """Regression: a worker that answers every request with a fast 500 looked idle to the score
    (no latency sample, empty queue) and got most of the traffic. Three failures in a row now eject it for 2 s."""
    with cluster(str(tmp_path), 2, worker_args={1: ["--sim-oom-after", "2"]}) as c:
        codes = Counter()
        t0 = time.monotonic()
        for i in range(40):
            r = post(c, "/v1/completions", {"model": "dplb-sim", "prompt": f"{i}", "max_tokens": 2})
            codes[(r.status_code, r.headers["x-sg-worker-id"])] += 1
        elapsed = time.monotonic() - t0
        failed = sum(n for (code, _), n in codes.items() if code == 500)
        # Ejected after 3 failures in a row, back (and ejected again) every 2 s: at most 3 per started 2 s window.
        assert failed <= 3 * (1 + int(elapsed / 2.0)), (codes, elapsed)
        assert failed < 20 and codes[(200, "0")] == 40 - failed, codes
        assert (c.metric("dplb_worker_ejections_total", {"worker": "1"}) or 0) >= 1
        assert "ejecting it" in c.router_log()


def test_more_workers_than_the_segment_has_slots_is_a_start_up_error(tmp_path: str) -> None:
    """``dplb router --num-workers 100`` on a segment of 4 worker slots stops at once with one line naming the flag
    and the segment's slot count (it used to log, ignore the segment and serve on its fallback forever)."""
    import subprocess
    import sys

    path = os.path.join(str(tmp_path), "seg")
    Segment.create(path, 4).close()
    r = subprocess.run([sys.executable, "-m", "dplb.cli", "router", "--num-workers", "100", "--port", str(free_port()),
                        "--run-dir", str(tmp_path), "--shm-path", path], capture_output=True, text=True, timeout=60)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode != 0 and len(lines) == 1, r.stderr
    assert "--num-workers 100" in lines[0] and "has 4 worker slots" in lines[0], r.stderr


def test_segment_deleted_at_runtime_router_keeps_serving_on_its_own_counts(tmp_path: str) -> None:
    with cluster(str(tmp_path), 2) as c:
        assert post(c, "/v1/completions", {"model": "dplb-sim", "prompt": "a", "max_tokens": 1}).status_code == 200
        os.unlink(c.shm_path)
        t0 = time.monotonic()
        while c.metric("dplb_shm_segment_present") != 0:
            assert time.monotonic() - t0 < 5
            time.sleep(0.1)
        seen = Counter()
        for i in range(10):
            r = post(c, "/v1/completions", {"model": "dplb-sim", "prompt": f"{i}", "max_tokens": 1})
            assert r.status_code == 200
            seen[r.headers["x-sg-worker-id"]] += 1
        assert set(seen) == {"0", "1"}
        d = httpx.get(c.url + "/debug/decisions?limit=1").json()[0]
        assert d["reason"] == "fallback"
        assert c.router_log().count("was removed or replaced") == 1


def test_conversation_turns_follow_their_history_and_prefix_scoring_can_be_off(tmp_path: str) -> None:
    """Two conversations sharing a system prompt: each next turn goes to the worker that served its history
    (prefix_outcome hit, preferred = that worker); with --prefix-block-bytes 0 the seed's three terms decide."""
    system = {"role": "system", "content": "You are a careful assistant. " * 20}

    def turn(conv: int, n: int) -> dict:  # type: ignore[type-arg]
        msgs = [system]
        for t in range(n):
            msgs += [{"role": "user", "content": f"conversation {conv} question {t} " * 8},
                     {"role": "assistant", "content": f"answer {t} " * 8}]
        return {"model": "dplb-sim", "max_tokens": 1, "messages": msgs[:-1]}

    with cluster(str(tmp_path), 2) as c:
        home = {conv: post(c, "/v1/chat/completions", turn(conv, 1)).headers["x-sg-worker-id"] for conv in (1, 2)}
        for n in (2, 3):
            for conv in (1, 2):
                got = post(c, "/v1/chat/completions", turn(conv, n)).headers["x-sg-worker-id"]
                assert got == home[conv], json.dumps(httpx.get(c.url + "/debug/decisions?limit=1").json()[0])
                d = httpx.get(c.url + "/debug/decisions?limit=1").json()[0]
                assert d["prefix_outcome"] == "hit" and d["preferred"] == int(home[conv]), d
        text = httpx.get(c.url + "/metrics").text
        # conversation 1's first turn found nothing cached; conversation 2's found the system prompt (hit or not,
        # depending on load); every later turn was a hit
        assert 'dplb_prefix_routed_total{outcome="miss"} 1.0' in text
        assert 'dplb_prefix_routed_total{outcome="hit"} 4.0' in text or 'outcome="hit"} 5.0' in text
        assert "dplb_prefix_index_blocks " in text and "dplb_policy_weight{term=\"prefix\"} 0.3" in text
    with cluster(str(tmp_path) + "-off", 2, router_args=["--prefix-block-bytes", "0"]) as c:
        post(c, "/v1/chat/completions", turn(1, 2))
        d = httpx.get(c.url + "/debug/decisions?limit=1").json()[0]
        assert d["reason"] == "score" and d["preferred"] is None and d["prefix_outcome"] is None
        assert d["weights"] == {"queue": 0.4, "memory": 0.3, "latency": 0.3}
