"""In-flight reconciliation (docs/DESIGN.md §8.1) with real parts: a real router, real sim workers, real client
connections cut at random points, the worker's reconciler and its metrics.

- 1,000 client aborts at random points (before the request is whole, before the response head, in prefill,
  mid-stream; streamed and not; chat, completions, responses streamed and not, background responses): afterwards
  the routers' in-flight counts (router slots and ``dplb_worker_requests_inflight``) and the engines' (slot
  ``num_running + num_waiting``) are 0 within 2 s, no abort was lost (the reconciler aborted nothing) and no client
  abort was counted as an engine error (half the clients close with RST, half with FIN). The same storm against
  engines that lose every disconnect's abort: the reconciler cleans up, still within 2 s.
- A lost abort (``--sim-lose-aborts``): the reconciler finds the orphan and aborts it within a few intervals.
- An engine that ignores every abort (``--sim-ignore-aborts``): the orphan stays, counted.
- Which engine requests are orphans, table-driven (the pure rule of :func:`dplb.worker.reconcile.find_orphans`).
- A leaked router counter (a router slot that claims requests the worker does not have): counted after ≥ 2
  intervals, and back to 0 when the router's count is.
- A client disconnect is not an engine error (``errors_total``).
Timing: the segment's state interval is 200 ms; every wait allows ≥ 10 intervals on a loaded 2-core box.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from pathlib import Path

import httpx
from cluster import Cluster, cluster, cut_stream, free_port, wait_for, worker_get

from dplb.state.router_slots import RouterSlots
from dplb.worker.engines.base import EngineRequest, OpenRequest
from dplb.worker.reconcile import find_orphans

N_ABORTS = 1000
CONCURRENCY = 48
# Prefill long enough to be cut inside it: 200 prompt words x 1 ms = 0.2 s; then ~0.02-0.05 s per token (8 tokens):
# a background response, which by design runs on after its creating request is cut (as in vLLM), ends well within
# the 2 s.
SIM = ["--sim-prefill-s-per-token", "0.001", "--sim-decode-step-s", "0.02", "--sim-decode-step-s-per-seq", "0.0005",
       "--sim-max-num-seqs", "64"]


def _worker_metric(port: int, name: str) -> float:
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rpartition(" ")[2])
    raise AssertionError(f"{name} not exported on :{port}")


def _request(i: int, rng: random.Random) -> tuple[str, bytes]:
    """Request ``i``: (kind, path and JSON body), over every proxied route that can be long."""
    words = " ".join(f"w{i}-{j}" for j in range(rng.choice((5, 50, 200))))
    kind = ("chat", "chat-stream", "completions", "completions-stream", "responses", "responses-stream",
            "background")[i % 7]
    stream = kind.endswith("-stream")
    if kind.startswith("chat"):
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": words}], "max_tokens": 8}
    elif kind.startswith("completions"):
        path, body = "/v1/completions", {"prompt": words, "max_tokens": 8}
    else:
        path, body = "/v1/responses", {"input": words, "max_output_tokens": 8}
        if kind == "background":
            body["background"] = True
    body.update(model="dplb-sim", stream=stream)
    return kind, path.encode() + b" " + json.dumps(body).encode()


async def _abort_one(port: int, i: int, rng: random.Random, counts: dict[str, int]) -> None:
    """Send request ``i`` over a raw connection and cut it at a random point."""
    kind, spec = _request(i, rng)
    path, body = spec.split(b" ", 1)
    head = (b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
            % (path, len(body)))
    point = rng.choice(("body", "head", "prefill", "first-byte", "mid"))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if point == "body":  # the request is never whole
            writer.write(head + body[: len(body) // 2])
            await writer.drain()
            await asyncio.sleep(rng.uniform(0, 0.05))
        else:
            writer.write(head + body)
            await writer.drain()
            if point == "head":  # before anything could come back
                await asyncio.sleep(rng.uniform(0, 0.01))
            elif point == "prefill":
                await asyncio.sleep(rng.uniform(0.01, 0.2))
            else:
                await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)  # the response head
                if point == "mid":
                    await asyncio.wait_for(reader.read(rng.randint(1, 400)), 30)
                    await asyncio.sleep(rng.uniform(0, 0.1))
    finally:
        if i % 2:
            writer.transport.abort()  # RST: the client is gone at once
        else:
            writer.close()  # FIN
    counts[f"{kind}/{point}"] = counts.get(f"{kind}/{point}", 0) + 1


async def _abort_many(port: int, n: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    counts: dict[str, int] = {}
    sem = asyncio.Semaphore(CONCURRENCY)

    async def one(i: int) -> None:
        async with sem:
            await _abort_one(port, i, rng, counts)

    await asyncio.gather(*(one(i) for i in range(n)))
    return counts


def _inflight(c: Cluster, since_ns: int = 0) -> tuple[list[int], list[int]]:
    """(routers' in-flight per worker from the router slots, engine running + waiting per worker). The engine's
    figure is taken from the slot only once it was published after ``since_ns`` (CLOCK_MONOTONIC; -1 until then)
    and must agree with the engine's own ``/load`` now."""
    assert c.segment is not None
    routers = [0] * c.num_workers
    for slot in c.segment.router_slots():
        for k, n in enumerate(slot["inflight"]):
            routers[k] += n
    engine = []
    for s in c.segment.read_all():
        load = worker_get(c.sock(s.worker_id), "/load").json()
        fresh = s.heartbeat_mono_ns > since_ns
        engine.append(s.num_running + s.num_waiting + load["num_running"] + load["num_waiting"] if fresh else -1)
    return routers, engine


def _abort_storm(tmp_path: Path, n: int, sim_args: list[str]) -> tuple[list[float], str]:
    """``n`` client aborts against 2 workers; asserts both in-flight counts are 0 within 2 s, the gauges agree, no
    abort was an engine error and the cluster still answers. Returns the orphan aborts per worker and a summary."""
    ports = [free_port(), free_port()]
    with cluster(str(tmp_path), 2, start_workers=False, wait_router_ready=False) as c:
        for k in range(2):
            c.start_worker(k, *SIM, *sim_args, metrics_port=ports[k])
        c.start_router()
        assert c.segment is not None
        errors0 = [c.segment.read(k).errors_total for k in range(2)]
        t0 = time.monotonic()
        counts = asyncio.run(_abort_many(c.port, n, seed=22))
        took = time.monotonic() - t0
        assert sum(counts.values()) == n
        t_end, since = time.monotonic(), time.monotonic_ns()
        wait_for(lambda: _inflight(c, since) == ([0, 0], [0, 0]), 2.0,
                 f"router and engine in-flight 0: {_inflight(c, since)}")
        settle = time.monotonic() - t_end
        gauge = [c.metric("dplb_worker_requests_inflight", {"worker": str(k)}) for k in range(2)]
        assert gauge == [0.0, 0.0], gauge
        for k in range(2):
            assert _worker_metric(ports[k], "dplb_worker_leaked_inflight") == 0
            assert c.segment.read(k).errors_total == errors0[k], c.tail()  # a client abort is no engine error
        orphans = [_worker_metric(p, "dplb_worker_orphan_aborts_total") for p in ports]
        r = httpx.post(c.url + "/v1/completions", json={"model": "dplb-sim", "prompt": "after", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 200, r.text
        return orphans, (f"{n} aborts in {took:.1f} s, in-flight 0 after {settle:.2f} s, reconciler aborts "
                         f"{orphans}; by kind/point: {dict(sorted(counts.items()))}")


def test_1000_client_aborts_leave_nothing_in_flight(tmp_path: Path) -> None:
    orphans, summary = _abort_storm(tmp_path, N_ABORTS, [])
    print(summary)
    assert orphans == [0, 0], summary  # every abort reached the engine: the reconciler had nothing to do


def test_client_aborts_whose_aborts_are_lost_are_cleaned_up_by_the_reconciler(tmp_path: Path) -> None:
    """The same storm, smaller, against engines that lose every disconnect's abort: the reconciler aborts the
    orphans, and both in-flight counts are still 0 within 2 s."""
    orphans, summary = _abort_storm(tmp_path, 140, ["--sim-lose-aborts", "true"])
    print(summary)
    assert sum(orphans) > 0, summary


def test_a_lost_abort_is_found_and_aborted_by_the_reconciler(tmp_path: Path) -> None:
    port = free_port()
    with cluster(str(tmp_path), 1, start_workers=False, wait_router_ready=False) as c:
        c.start_worker(0, "--sim-lose-aborts", "true", metrics_port=port)
        c.start_router()
        cut_stream(c, 5000)  # 100 s of decode if nobody aborts it
        t0 = time.monotonic()
        assert c.segment is not None
        wait_for(lambda: _worker_metric(port, "dplb_worker_orphan_aborts_total") == 1, 10, "the reconciler's abort")
        wait_for(lambda: c.segment.read(0).num_running == 0, 5, "the orphan gone from the engine")  # type: ignore
        took = time.monotonic() - t0
        # the reconciler's next tick sees it gone (the slot may be published first)
        wait_for(lambda: _worker_metric(port, "dplb_worker_orphan_requests") == 0, 5, "the orphan no longer counted")
        assert _inflight(c) == ([0], [0])
        assert "aborted 1 orphan request(s)" in c.tail()
        print(f"orphan aborted {took:.2f} s after the client left")


def test_an_engine_that_ignores_aborts_keeps_a_counted_orphan(tmp_path: Path) -> None:
    port = free_port()
    with cluster(str(tmp_path), 1, start_workers=False, wait_router_ready=False) as c:
        c.start_worker(0, "--sim-ignore-aborts", "true", metrics_port=port)
        c.start_router()
        cut_stream(c, 5000)
        wait_for(lambda: _worker_metric(port, "dplb_worker_orphan_requests") == 1, 10, "the orphan counted")
        time.sleep(1.0)  # five more ticks: still there, still counted, aborted once
        assert _worker_metric(port, "dplb_worker_orphan_requests") == 1
        assert _worker_metric(port, "dplb_worker_orphan_aborts_total") == 1
        assert c.segment is not None and c.segment.read(0).num_running == 1
        assert _inflight(c)[0] == [0]  # the router released it: only the engine holds it


def test_a_leaked_router_counter_is_reported_and_clears(tmp_path: Path) -> None:
    """A router slot that counts 3 requests to worker 0 that the worker does not have (what a router counter that
    never got released looks like) is reported after ≥ 2 intervals, and not before; 0 again once it is gone."""
    port = free_port()
    with cluster(str(tmp_path), 1, start_workers=False, wait_router_ready=False) as c:
        c.start_worker(0, metrics_port=port)
        c.start_router()
        slots = RouterSlots.claim(c.shm_path, 1, free_port(), process_index=1, pid=os.getpid())
        assert slots is not None
        try:
            slots.publish(0, 0, 3, time.monotonic_ns())
            t0 = time.monotonic()
            deadline = t0 + 10
            while time.monotonic() < deadline:
                slots.heartbeat()
                if _worker_metric(port, "dplb_worker_leaked_inflight") == 3:
                    break
                time.sleep(0.05)
            took = time.monotonic() - t0
            assert _worker_metric(port, "dplb_worker_leaked_inflight") == 3
            assert took >= 0.35, took  # seen at 3 ticks (2 intervals of 200 ms) before it counts
            r = httpx.post(c.url + "/v1/completions", json={"model": "dplb-sim", "prompt": "x", "max_tokens": 2})
            assert r.status_code == 200  # the real router's own requests are not leaks
            slots.publish(0, 0, 0)
            wait_for(lambda: (slots.heartbeat(), _worker_metric(port, "dplb_worker_leaked_inflight"))[1] == 0,
                     5, "leak cleared")
        finally:
            slots.close()
        assert "routers count 3 request(s) in flight here" in c.tail()


def test_a_client_disconnect_is_not_an_engine_error(tmp_path: Path) -> None:
    """Cutting a stream mid-way is the client's doing: requests_total counts it, errors_total does not."""
    with cluster(str(tmp_path), 1) as c:
        assert c.segment is not None
        before = c.segment.read(0)
        for _ in range(3):
            cut_stream(c, 200)
        wait_for(lambda: c.segment.read(0).requests_total == before.requests_total + 3, 5,  # type: ignore
                 "the three requests ended")
        assert c.segment.read(0).errors_total == before.errors_total


def _open(xrid: str | None, state: str = "live") -> OpenRequest:
    r = OpenRequest({"headers": [(b"x-request-id", xrid.encode())] if xrid else []})
    r.closed, r.disconnected = state == "closed", state == "gone"
    return r


def test_find_orphans_table() -> None:
    """Which engine requests no client waits for, given the requests open on the socket (pure)."""
    a, b_gone, c_closed, d = _open("a"), _open("b", "gone"), _open("c", "closed"), _open("d")
    anon, d2 = _open(None), _open("d")
    cases: list[tuple[str, list[EngineRequest], list[OpenRequest], list[str]]] = [
        ("sim: owner live / gone / closed", [EngineRequest("1", a), EngineRequest("2", b_gone),
                                            EngineRequest("3", c_closed)], [a, b_gone, c_closed], ["2", "3"]),
        ("background: never an orphan", [EngineRequest("1", None)], [], []),
        ("vllm ids: chatcmpl-<xrid>, cmpl-<xrid>-<n>, the id itself",
         [EngineRequest("i1", "chatcmpl-a"), EngineRequest("i2", "cmpl-b-0"), EngineRequest("i3", "c")],
         [a, b_gone, c_closed], ["i2", "i3"]),
        ("vllm: no open request at all", [EngineRequest("i1", "chatcmpl-zz")], [], ["i1"]),
        ("vllm: an unmatched id is spared while a live request has no engine request (a responses id)",
         [EngineRequest("i1", "chatcmpl-a"), EngineRequest("i2", "resp_x_0")], [a, d], []),
        ("vllm: an unmatched id when every live request has its engine request",
         [EngineRequest("i1", "chatcmpl-a"), EngineRequest("i2", "resp_x_0")], [a], ["i2"]),
        ("vllm: an anonymous live request (no X-Request-Id) spares unmatched ids",
         [EngineRequest("i1", "cmpl-5f2e")], [anon], []),
        ("vllm: two requests sharing an X-Request-Id claim one each", [EngineRequest("i1", "chatcmpl-d"),
                                                                      EngineRequest("i2", "resp_y_0")],
         [d, d2], []),
        ("vllm: several prompts of one request", [EngineRequest("i1", "cmpl-a-0"), EngineRequest("i2", "cmpl-a-1")],
         [a], []),
    ]
    for name, held, opened, want in cases:
        assert sorted(find_orphans(held, opened)) == want, name
