"""Worker process on the sim engine: lifecycle in shm, heartbeat, metrics port, OOM reporting, stats published."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
from cluster import cluster, free_port

from dplb.state.shm import Lifecycle


def test_lifecycle_starting_warming_ready_with_slow_warmup(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with cluster(str(tmp_path), 1, start_workers=False, wait_router_ready=False) as c:
        assert c.segment is not None
        c.start_worker(0, "--sim-warmup-delay-s", "1.5", wait=False)
        seen: list[Lifecycle] = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < 20:
            s = c.segment.read(0)
            if s.pid and (not seen or seen[-1] != s.lifecycle):
                seen.append(s.lifecycle)
                # A worker that is not ready is never routed to: the router says so.
                if s.lifecycle != Lifecycle.READY:
                    r = httpx.post(c.url + "/v1/completions", json={"model": "dplb-sim", "prompt": "x"})
                    assert r.status_code == 503 and r.json()["error"]["code"] == "no_routable_worker"
            if s.lifecycle == Lifecycle.READY:
                break
            time.sleep(0.02)
        assert seen[0] == Lifecycle.STARTING and seen[-1] == Lifecycle.READY, seen
        s = c.segment.read(0)
        assert s.warmup_seconds > 0 and s.started_unix_ns > 0 and s.requests_total == 1
        log = Path(c.logs[-1]).read_text()
        for line in ("Worker 0 starting", "Worker 0 warming up", "Worker 0 registered. State: {"):
            assert line in log, log
        # Heartbeat is written every tick even when nothing changes.
        hb1, seq1 = s.heartbeat_mono_ns, s.seq
        time.sleep(0.5)
        s2 = c.segment.read(0)
        assert s2.heartbeat_mono_ns > hb1 and s2.seq > seq1 and s2.age_s() < 0.4
        # SIGTERM: draining, then stopped, written to the slot.
        c.kill_worker(0, signal.SIGTERM)
        assert c.segment.read(0).lifecycle == Lifecycle.STOPPED
        log = Path(c.logs[-1]).read_text()
        assert "Worker 0 draining" in log and "Worker 0 stopped" in log


def test_oom_is_published_counted_and_logged_with_remedy(tmp_path) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    with cluster(str(tmp_path), 1, start_workers=False, wait_router_ready=False) as c:
        assert c.segment is not None
        c.start_worker(0, "--sim-oom-after", "2", metrics_port=port)  # the warm-up is request 1
        r = httpx.post(c.url + "/v1/completions", json={"model": "dplb-sim", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 500 and "CUDA out of memory" in r.text and r.headers["x-sg-worker-id"] == "0"
        t0 = time.monotonic()
        while c.segment.read(0).cuda_oom_total != 1:
            assert time.monotonic() - t0 < 3
            time.sleep(0.05)
        s = c.segment.read(0)
        assert s.errors_total == 1
        log = Path(c.logs[-1]).read_text()
        assert "CUDA out of memory" in log and "--gpu-memory-utilization" in log
        m = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'dplb_worker_errors_total{worker="0"} 1.0' in m and "# TYPE dplb_worker_errors_total counter" in m
        assert "vllm:num_requests_running" in m and 'dplb_worker_info{engine="sim",worker="0"} 1.0' in m
        # the slot's figures (OOMs, lifecycle, warm-up) have one owner: the router
        assert "dplb_worker_cuda_oom_total" not in m and "dplb_worker_lifecycle" not in m
        assert c.metric("dplb_worker_cuda_oom_total", {"worker": "0"}) == 1


def test_published_queue_and_latency_follow_load(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    with cluster(str(tmp_path), 1, worker_args={0: ["--sim-chunk-delay-s", "0.02"]}) as c:
        assert c.segment is not None
        peak = 0

        async def main() -> None:
            nonlocal peak
            async with httpx.AsyncClient(timeout=60) as cl:
                task = asyncio.gather(*[cl.post(c.url + "/v1/completions", json={
                    "model": "dplb-sim", "prompt": "load " * 20, "max_tokens": 30}) for _ in range(24)])
                while not task.done():
                    s = c.segment.read(0)  # type: ignore[union-attr]
                    peak = max(peak, s.num_running + s.num_waiting)
                    await asyncio.sleep(0.02)
                assert all(r.status_code == 200 for r in await task)

        asyncio.run(main())
        assert peak >= 8, peak
        time.sleep(0.5)
        s = c.segment.read(0)
        assert s.num_running == s.num_waiting == 0
        assert s.avg_latency_s > 0 and s.last_prompt_tokens >= 20 and s.requests_total >= 25
        assert s.max_num_seqs == 16 and s.first_request_seconds > 0


def test_warmup_request_is_not_a_latency_sample() -> None:
    """Regression: the tiny warm-up request made a fresh worker look fast (avg latency 0.024 s) next to loaded
    peers, so the score herded traffic onto it."""
    from dplb.worker.engines.base import RequestStats

    rs = RequestStats()
    rs.begin()
    rs.end(0.02, 0.02, False)  # warm-up, before ready
    assert rs.averages() == (0.0, 0.0) and rs.requests_total == 1
    rs.counting_first = True
    rs.begin()
    rs.end(3.0, 0.5, False)
    assert rs.averages() == (3.0, 0.5) and rs.first_request_seconds == 3.0


def test_sigterm_during_a_slow_engine_load_stops_promptly(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Regression: SIGTERM was ignored until the engine finished loading (a real model load can
    outlast systemd's TimeoutStopSec). The metrics port also answers during the load now."""
    port = free_port()
    with cluster(str(tmp_path), 1, start_workers=False, wait_router_ready=False) as c:
        assert c.segment is not None
        c.start_worker(0, "--sim-warmup-delay-s", "30", wait=False, metrics_port=port)
        t0 = time.monotonic()
        while c.segment.read(0).lifecycle != Lifecycle.STARTING:
            assert time.monotonic() - t0 < 10
            time.sleep(0.05)
        t0 = time.monotonic()
        while True:
            try:
                m = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=1).text
                break
            except httpx.HTTPError:
                assert time.monotonic() - t0 < 10
                time.sleep(0.1)
        assert 'dplb_worker_info{engine="sim",worker="0"} 1.0' in m
        t_term = time.monotonic()
        c.kill_worker(0, signal.SIGTERM)
        assert time.monotonic() - t_term < 5
        assert c.workers[0].returncode == 0
        assert c.segment.read(0).lifecycle == Lifecycle.STOPPED
