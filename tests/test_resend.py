"""A request written on a pooled worker connection that ends before any response byte reached no engine: the router
sends it again on a new connection (both paths: the direct relay and the ASGI path), counts it in
``dplb_upstream_resends_total{reason}`` and notes it on the decision (``/debug/decisions``: ``resent``); a
connection that ends after the response began is never re-sent. Real router and sim worker processes; the sim's
``close_after_response_s`` fault closes each connection shortly after its response without reading what came
meanwhile, as a worker whose short keep-alive timeout fires as the next request arrives."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cluster import Cluster, Routers, both_paths, cluster, completion, wait_for

from dplb.errors import RESEND_REASONS

N = 12


def _resends(c: Cluster) -> float:
    return sum(c.metric("dplb_upstream_resends_total", {"reason": r}) or 0.0 for r in RESEND_REASONS)


def _resent_decisions(c: Cluster) -> list[str]:
    ds = httpx.get(c.url + "/debug/decisions?limit=100", timeout=5).json()
    return [d["resent"] for d in ds if d["resent"] is not None]


@pytest.fixture
def dropping(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Routers]:
    """Each path's router in front of one sim worker that closes each connection 0.3 s after its response, what
    came meanwhile unread."""
    with both_paths(tmp_path_factory, [], worker_args={0: ["--sim-close-after-response-s", "0.3"]}) as rs:
        yield rs


@pytest.mark.parametrize("path", ["direct", "asgi"])
def test_a_request_on_a_pooled_connection_closed_before_answering_is_resent(dropping: Routers, path: str) -> None:
    """Sequential requests over one keep-alive client connection: the router reuses its pooled worker connection
    at once, the worker closes it with the next request unread; every request is answered 200 all the same, and
    each resend is counted and noted on its decision (without the resend, each was a 502 worker_failed)."""
    c: Cluster = getattr(dropping, path)
    with httpx.Client(base_url=c.url, timeout=30) as client:
        rs = [client.post("/v1/completions", json=completion(i, max_tokens=3)) for i in range(N)]
    assert [r.status_code for r in rs] == [200] * N, [r.text for r in rs if r.status_code != 200]
    assert all(r.text.rstrip().endswith(("}", "data: [DONE]")) for r in rs)
    resent = _resends(c)
    assert resent >= N // 2, c.tail()  # every request after the first, unless the box stalls the router 0.3 s
    assert len(_resent_decisions(c)) == resent
    assert set(_resent_decisions(c)) == {"reset"}
    assert c.metric("dplb_upstream_resends_total", {"reason": "reset"}) == resent
    assert c.metric("dplb_upstream_retries_total") == 0  # the same worker, on a new connection
    if path == "direct":
        assert (c.metric("dplb_direct_relay_requests_total", {"path": "direct"}) or 0) > 0


@pytest.mark.parametrize("path", ["direct", "asgi"])
def test_a_connection_that_ends_after_the_response_head_is_not_resent(
        tmp_path_factory: pytest.TempPathFactory, path: str) -> None:
    """A stream on a reused connection whose worker is SIGKILLed mid-answer: the client gets the error event and
    the cut (the request reached the engine), and nothing is sent again."""
    with both_paths(tmp_path_factory, [], worker_args={0: ["--sim-chunk-delay-s", "0.05"]}) as rs:
        c: Cluster = getattr(rs, path)
        other = rs.asgi if path == "direct" else rs.direct
        other.stop()
        with httpx.Client(base_url=c.url, timeout=30) as client:
            assert client.post("/v1/completions", json=completion(0, max_tokens=2, stream=False)).status_code == 200
            got = b""
            with client.stream("POST", "/v1/completions", json=completion(1, max_tokens=60, stream=True)) as r:
                assert r.status_code == 200
                try:
                    for chunk in r.iter_raw():
                        got += chunk
                        if got.count(b"data: ") == 2:
                            os.kill(c.workers[0].pid, signal.SIGKILL)
                except httpx.HTTPError:  # the abnormal close after the error event
                    pass
        assert b"worker_failed" in got and b"[DONE]" not in got, got
        wait_for(lambda: c.workers[0].poll() is not None, 10, "the worker to exit")
        assert _resends(c) == 0 and not _resent_decisions(c)


async def _burst(url: str, first: int, n: int) -> list[httpx.Response]:
    """``n`` completions at once, each on its own client connection."""
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=httpx.Limits(max_connections=n)) as client:
        return await asyncio.gather(*(client.post("/v1/completions", json=completion(first + i, max_tokens=2,
                                                                                      stream=False))
                                      for i in range(n)))


@pytest.mark.parametrize("path", ["direct", "asgi"])
def test_requests_written_to_a_worker_as_it_is_killed_are_resent(tmp_path: Path, path: str) -> None:
    """Worker 0 of 2 is stopped (its heartbeat still fresh, so it is still picked), requests are written on its
    pooled connections and sit unread, then it is SIGKILLed: those connections reset (the requests never reached
    its engine), each request is sent again, its worker refuses the new connection, and it is retried on worker 1:
    every request is answered 200 (without the resend: a 502 worker_failed each, as a request written in the ms
    after a worker's death on a pooled connection the kernel had not closed yet)."""
    args = ["--policy", "round_robin"] + ([] if path == "direct" else ["--no-direct-relay"])  # 2 of 4 to worker 0
    with cluster(str(tmp_path), 2, router_args=args, state_interval_ms=1000) as c:
        for round_ in range(3):  # pooled connections to both workers (a few each)
            rs = asyncio.run(_burst(c.url, 100 * round_, 12))
            assert [r.status_code for r in rs] == [200] * 12
        assert {r.headers["x-sg-worker-id"] for r in rs} == {"0", "1"}
        os.kill(c.workers[0].pid, signal.SIGSTOP)

        async def burst_then_kill() -> list[httpx.Response]:
            going = asyncio.ensure_future(_burst(c.url, 1000, 4))
            await asyncio.sleep(0.5)  # written, unread: worker 0 is stopped
            os.kill(c.workers[0].pid, signal.SIGKILL)
            return await going

        rs = asyncio.run(burst_then_kill())
        assert [r.status_code for r in rs] == [200] * 4, [r.text for r in rs]
        assert {r.headers["x-sg-worker-id"] for r in rs} == {"1"}
        resent = c.metric("dplb_upstream_resends_total", {"reason": "reset"}) or 0
        assert resent == 2, c.tail()
        assert c.metric("dplb_upstream_retries_total") == resent  # each then retried on worker 1
        assert _resent_decisions(c) == ["reset"] * int(resent)
