"""A client that leaves with requests pipelined behind the one being answered: every open request of the connection
hears the disconnect (the engine aborts, the router's in-flight count returns to 0, the outcome is the client's),
on the direct relay and on the ASGI path. Real router and sim workers, raw sockets."""

from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Iterator

import httpx
import pytest
from cluster import Cluster, cluster, worker_get

CHAT = {"model": "dplb-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "stream": True}


def _post(rid: str, body: dict) -> bytes:
    raw = json.dumps(body).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"X-Request-Id: %s\r\nContent-Length: %d\r\n\r\n" % (rid.encode(), len(raw))) + raw


#: What is pipelined behind the stream: a local route, another proxied stream, both.
FOLLOWERS = {
    "health": lambda rid: b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
    "stream": lambda rid: _post(rid + "-next", CHAT),
    "both": lambda rid: _post(rid + "-next", CHAT) + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
}


@pytest.fixture(scope="module", params=["direct", "asgi"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One slow-streaming sim worker (50 ms a token) behind a router, on the direct relay or the ASGI path."""
    flags = [] if request.param == "direct" else ["--no-direct-relay"]
    with cluster(str(tmp_path_factory.mktemp("pipe")), 1, worker_args={0: ["--sim-chunk-delay-s", "0.05"]},
                 router_args=flags) as c:
        yield c


def _open_then_leave(c: Cluster, rid: str, follower: bytes, reset: bool, stream: bool) -> None:
    """Send a request and ``follower`` in one write; once the engine runs it (a stream: its first event read), close
    (``reset``: with an RST)."""
    s = socket.create_connection(("127.0.0.1", c.port), timeout=10)
    try:
        s.sendall(_post(rid, {**CHAT, "stream": stream}) + follower)
        got = b""
        while stream and b"data:" not in got:
            chunk = s.recv(65536)
            assert chunk, got
            got += chunk
        assert not stream or got.startswith(b"HTTP/1.1 200"), got[:200]
        t0 = time.monotonic()
        while not stream and not any(e.get("x_request_id") == rid
                                     for e in worker_get(c.sock(0), "/debug/requests").json()):
            assert time.monotonic() - t0 < 5
            time.sleep(0.02)
        if reset:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    finally:
        s.close()


def _outcomes(c: Cluster) -> dict[str, float]:
    text = httpx.get(c.url + "/metrics", timeout=5).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("dplb_upstream_request_duration_seconds_count{"):
            head, _, value = line.rpartition(" ")
            outcome = head.split('outcome="', 1)[1].split('"', 1)[0]
            out[outcome] = out.get(outcome, 0.0) + float(value)
    return out


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("reset", [False, True], ids=["close", "reset"])
@pytest.mark.parametrize("follower", sorted(FOLLOWERS))
def test_a_client_gone_with_requests_pipelined_behind_aborts_and_releases(stack: Cluster, follower: str,
                                                                         reset: bool, stream: bool) -> None:
    before = _outcomes(stack)
    rids = [f"pipe-{follower}-{int(reset)}-{int(stream)}-{i}" for i in range(4)]
    for rid in rids:
        _open_then_leave(stack, rid, FOLLOWERS[follower](rid), reset, stream)
    t0 = time.monotonic()
    while True:  # the engine was told at once, and the router holds nothing
        entries = {e.get("x_request_id"): e for e in worker_get(stack.sock(0), "/debug/requests").json()}
        aborted = [rid for rid in rids if entries.get(rid, {}).get("aborted")]
        inflight = stack.metric("dplb_worker_requests_inflight", {"worker": "0"})
        if len(aborted) == len(rids) and inflight == 0:
            break
        assert time.monotonic() - t0 < 2.0, (aborted, inflight)
        time.sleep(0.05)
    # A pipelined stream behind the one answered never reached the engine.
    assert not any(rid + "-next" in entries for rid in rids)
    after = _outcomes(stack)
    grew = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
    assert grew == {"client_disconnect": len(rids)}, grew
    assert stack.metric("dplb_worker_ejections_total", {"worker": "0"}) == 0
    r = httpx.post(stack.url + "/v1/chat/completions", json={**CHAT, "stream": False, "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and httpx.get(stack.url + "/ready").status_code == 200
    with open(stack.logs[-1], encoding="utf-8", errors="replace") as f:
        log = f.read()
    assert "Traceback" not in log and "broke off a response" not in log, log[-3000:]
