"""A persistently slow worker at light load, with real sim workers and a real router (dplb/policy/scorers.py,
``latency``): sequential requests find every worker idle at each pick, so the latency term decides between them.
A worker 10× slower than its peers must lose its share once its latency is known (it kept 1/3 when an idle worker
got its peers' mean term), and one whose slow figure has aged must get traffic again (never starved)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from tests.cluster import Cluster, cluster, completion, post

TOKENS = 4  # sim: 4 decode steps of ~22 ms at speed 1 (~0.1 s), ~1 s at speed 0.1


def sequential(c: Cluster, start: int, n: int, tokens: int = TOKENS) -> Counter[int]:
    """Send ``n`` requests of ``tokens`` one after another (distinct prompts: no prefix term); requests per
    worker."""
    got: Counter[int] = Counter()
    for i in range(start, start + n):
        r = post(c, "/v1/completions", completion(i, tokens, stream=False, prompt=f"distinct question number {i}"))
        assert r.status_code == 200, r.text
        got[int(r.headers["x-sg-worker-id"])] += 1
    return got


def test_persistently_slow_worker_loses_its_share_of_light_traffic(tmp_path: Path) -> None:
    with cluster(str(tmp_path), 3, worker_args={0: ["--sim-speed", "0.1"]},
                 router_args=["--baseline-window", "6"]) as c:
        warm = sequential(c, 0, 12)  # the baseline (6 samples) and a figure on every worker
        assert warm[0] >= 1, warm  # before the baseline every latency term is 1: ties rotate
        got = sequential(c, 100, 30)
        # Before the fix: 10 of 30 (an idle worker got its peers' mean term, every worker is idle at each pick).
        assert got[0] < 0.15 * 30, got
        assert got[1] + got[2] == 30 - got[0]


def burst_on(c: Cluster, k: int, n: int, max_tokens: int) -> None:
    """``n`` concurrent requests of ``max_tokens`` sent straight to worker ``k``'s socket (not through the router):
    a burst that makes its recent latency figure slow while its engine is as fast as its peers'."""
    def one(i: int) -> None:
        with httpx.Client(transport=httpx.HTTPTransport(uds=c.sock(k)), base_url="http://worker", timeout=60) as h:
            r = h.post("/v1/completions", json=completion(1000 + i, max_tokens, stream=False, prompt=f"burst {i}"))
            assert r.status_code == 200, r.text
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_once_slow_worker_gets_traffic_back_as_its_figure_ages(tmp_path: Path) -> None:
    with cluster(str(tmp_path), 3, router_args=["--baseline-window", "6", "--scorer-param",
                                               "latency.half_life_s=1"]) as c:
        # The baseline (P95, frozen after 6): ~0.6 s, so a ~0.1 s worker's term is ~0.8 (a worker at or above the
        # baseline is clamped to 0, whatever its figure).
        sequential(c, 0, 6, tokens=24)
        sequential(c, 10, 30)  # every worker's figure ~0.1 s
        burst_on(c, 0, 10, 24)  # worker 0's last 10 requests: ~1 s each (10 at once), 10× its peers
        time.sleep(0.5)  # two state intervals: the router sees its new figure
        # Its slow figure is fresh: left alone. (Two requests, not more: with a 1 s half-life its figure is below
        # the baseline ~0.85 s after the burst, and on a loaded box 4 sequential requests once took longer.)
        first = sequential(c, 100, 2)
        assert first[0] == 0, first
        later: Counter[int] = Counter()
        t0 = time.monotonic()
        i = 200
        while time.monotonic() - t0 < 20:
            later += sequential(c, i, 5)
            i += 5
        # Its figure ages (half-life 1 s): it is probed about every 5 half-lives (measured: 3 probes in 15 s), each
        # fast probe lowering its 10-request mean; never starved.
        assert later[0] >= 2, later
