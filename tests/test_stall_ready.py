"""A stalled engine's worker is not ready, and the stall lifts by itself when the engine recovers (dplb.policy.stall,
dplb.worker.stall_probe, docs/DESIGN.md §6): real router and sim workers whose engine stalls while their process,
HTTP and collector live on. Every readiness surface (``/ready``, the HAProxy agent, the host report's Model Server
Protocol figures) says not ready while a one-worker host's engine is stalled and idle, and everything comes back,
the stall flag too, without any client request once the engine resumes."""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import httpx
from cluster import cluster, free_port, wait_for
from fleet_support import agent_answer

from dplb.router.agent import MAX_REASON
from dplb.router.host_report import stalled_list
from dplb.state.shm import FLAG_STALLED, Segment

STALL_AFTER = 2.0  # the router's and the workers' --stall-after here
BODY = {"model": "dplb-sim", "prompt": "a", "max_tokens": 4}
STALLED_AGENT = "down #no routable worker (engine stalled: worker 0)\n"  # HAProxy shows the reason


def test_the_stalled_workers_in_a_reason_fit_the_agent_line_without_a_comma() -> None:
    """The agent's reason is cut at 64 characters and HAProxy splits its words at commas."""
    assert stalled_list([0]) == "worker 0" and stalled_list([1, 3]) == "workers 1 3"
    for n in range(1, 257):
        reason = f"no routable worker (engine stalled: {stalled_list(list(range(n)))})"
        assert len(reason) <= MAX_REASON and "," not in reason, reason


def _host_figures(url: str) -> dict[str, float]:
    """``/metrics/host``'s samples by name (with labels) → value."""
    out = {}
    for line in httpx.get(url + "/metrics/host", timeout=5).text.splitlines():
        if line and not line.startswith("#"):
            head, _, value = line.rpartition(" ")
            out[head] = float(value)
    return out


def _surfaces(url: str, agent: int) -> dict[str, Any]:
    """What every readiness surface says now."""
    m = _host_figures(url)
    r = httpx.get(url + "/ready", timeout=5)
    return {"ready": r.status_code, "why": r.text, "agent": agent_answer("127.0.0.1", agent),
            "down": m.get('dplb_host_state{state="down"}'), "kv": m.get("vllm:kv_cache_usage_perc"),
            "waiting": m.get("vllm:num_requests_waiting")}


def _flag(seg: Segment, k: int) -> bool:
    return bool(seg.read(k).flags & FLAG_STALLED)


def test_a_host_whose_only_worker_is_stalled_is_not_ready_and_comes_back_without_requests(tmp_path: str) -> None:
    """Regression: a one-worker host whose engine stalled answered /ready 200 and the agent ``up ready 100%`` once
    the failed requests were gone (the stalled worker counted as routable for the router's probe), so a front
    balancer kept sending it requests that all ended 504 worker_stalled. Now, for the whole stall while idle:
    /ready 503, agent ``down #…``, host state down and the MSP figures saturated (KV usage 1, waiting at the
    picker's threshold); after the engine resumes, with no client request: all back, the stall flag and
    ``dplb_worker_stalled`` 0, and the logged stall duration close to the real one."""
    stall_for = 12.0
    agent = free_port()
    stall = ["--stall-after", str(STALL_AFTER), "--sim-stall-after", "2", "--sim-stall-for-s", str(stall_for)]
    with cluster(str(tmp_path), 1, worker_args={0: stall},
                 router_args=["--stall-after", str(STALL_AFTER), "--agent-port", str(agent)]) as c:
        assert c.segment is not None
        assert httpx.post(c.url + "/v1/completions", json=BODY, timeout=20).status_code == 200  # then it stalls
        t_stall = time.monotonic()
        r = httpx.post(c.url + "/v1/completions", json=BODY, timeout=20)
        assert r.status_code == 504 and r.json()["error"]["code"] == "worker_stalled", r.text
        time.sleep(0.5)  # the host report is recomputed every state interval (0.2 s here)
        seen = []
        while time.monotonic() < t_stall + stall_for - 1.0:  # stalled, idle: well past the router's probe window
            seen.append((round(time.monotonic() - t_stall, 1), _surfaces(c.url, agent)))
            time.sleep(0.3)
        bad = [(t, s) for t, s in seen if not (s["ready"] == 503 and s["agent"] == STALLED_AGENT
                                               and s["down"] == 1 and s["kv"] == 1 and s["waiting"] >= 5)]
        assert not bad, bad[:3]
        assert all("engine stalled: worker 0" in s["why"] for _, s in seen), seen[0]
        assert c.metric("dplb_worker_stalled", {"worker": "0"}) == 1
        # The engine resumes at t_stall + stall_for; nobody sends a request.
        t_back = wait_for(lambda: httpx.get(c.url + "/ready", timeout=5).status_code == 200 and time.monotonic(),
                          stall_for + 4 * STALL_AFTER, "/ready 200 again", step_s=0.1) - t_stall
        assert t_back <= stall_for + 2 * STALL_AFTER, t_back
        wait_for(lambda: c.metric("dplb_worker_stalled", {"worker": "0"}) == 0 and not _flag(c.segment, 0),
                 2.0, "the stall flag and gauge at 0")
        wait_for(lambda: _surfaces(c.url, agent)["agent"].startswith("up "), 2.0, "the agent up again")
        now = _surfaces(c.url, agent)
        assert now["down"] == 0 and now["kv"] < 1 and now["waiting"] == 0, now
        assert httpx.post(c.url + "/v1/completions", json=BODY, timeout=20).status_code == 200
        log = c.router_log()
    m = re.search(r"worker 0: engine progress resumed after ([0-9.]+) s", log)
    assert m, log[-2000:]
    logged = float(m.group(1))
    print(f"stalled {stall_for:g} s: /ready 200 again {t_back:.1f} s after the stall began; logged {logged:.1f} s")
    assert stall_for - 0.5 <= logged <= stall_for + 1.5, logged


def test_the_stall_flag_clears_on_an_idle_worker_and_traffic_stays_on_the_healthy_one(tmp_path: str) -> None:
    """Regression: the stall flag (``FLAG_STALLED``: ``dplb state`` ``stalled``; ``dplb_worker_stalled`` 1, alert
    DPLBWorkerStalled) stayed set on an idle worker whose engine had recovered until the next request came. Two
    workers, worker 1's engine stalls for 8 s under 4 req/s for 4 s, then no traffic: the flag and the gauge go to 0 within
    2 × --stall-after of the engine's recovery. While worker 0 is routable, the router sends worker 1 no probe: no
    request fails after the ones the stall caught, and /ready stays 200 (worker 0)."""
    stall_for = 8.0
    stall = ["--stall-after", str(STALL_AFTER), "--sim-stall-after", "2", "--sim-stall-for-s", str(stall_for)]
    with cluster(str(tmp_path), 2, worker_args={1: stall}, router_args=["--stall-after", str(STALL_AFTER)]) as c:
        seg = c.segment
        assert seg is not None
        flags: list[tuple[float, bool, int]] = []  # (t, FLAG_STALLED of worker 1, progress_total of worker 1)
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(0.05):
                w = seg.read(1)
                flags.append((time.monotonic(), bool(w.flags & FLAG_STALLED), w.progress_total))

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        recs: list[tuple[float, int, str | None]] = []
        lock = threading.Lock()

        def one() -> None:
            r = httpx.post(c.url + "/v1/completions", json=BODY, timeout=20)
            with lock:
                recs.append((time.monotonic(), r.status_code, r.headers.get("x-sg-worker-id")))

        t0 = time.monotonic()
        threads = []
        readies = []
        while time.monotonic() - t0 < 4.0:  # traffic while worker 1 is stalled, then none
            threads.append(threading.Thread(target=one))
            threads[-1].start()
            readies.append(httpx.get(c.url + "/ready", timeout=5).status_code)
            time.sleep(0.25)
        for t in threads:
            t.join()
        t_quiet = time.monotonic()

        def resumed() -> bool:
            # The flag cleared with the engine's progress moving: an unflagged read after the quiet began whose
            # progress differs from the flagged reads'. (An unflagged read alone is not enough: when the router cuts
            # the stalled requests before the worker's own check judges them, the worker forgives its debt and its
            # flag is down until its probe finds the engine still stalled, while the router's verdict stands until
            # progress.)
            marked = [p for _, f, p in flags if f]
            t, f, p = flags[-1] if flags else (0.0, True, 0)
            return bool(marked) and not f and p != marked[-1] and t > t_quiet

        wait_for(resumed, 3 * stall_for, "the flag cleared with the engine's progress")
        stop.set()
        watcher.join()
        # The router's own check clears at its next monitor step (0.5 s) after the progress.
        wait_for(lambda: c.metric("dplb_worker_stalled", {"worker": "1"}) == 0, 4.0, "dplb_worker_stalled 0")
    assert all(s == 200 for s in readies), readies
    failed = sorted(t for t, s, _ in recs if s != 200)
    assert failed and all(s in (200, 504) for _, s, _ in recs), recs
    # The requests the stall caught all end within one --stall-after (+ margin) of the first; none after (no probe).
    assert failed[-1] - failed[0] <= STALL_AFTER + 1.0, [round(t - failed[0], 2) for t in failed]
    marked = [t for t, f, _ in flags if f]
    assert marked, "worker 1 never flagged itself stalled"
    # The engine resumed stall_for after its last progress before the stall; the flag cleared soon after.
    p_stall = next(p for t, f, p in flags if f)
    t_last_progress = min(t for t, _, p in flags if p == p_stall)
    t_clear = next(t for t, f, _ in flags if t > marked[0] and not f)
    print(f"worker 1: flag set {marked[0] - t_last_progress:.1f} s after its last progress, cleared "
          f"{t_clear - t_last_progress - stall_for:.1f} s after its engine resumed")
    assert t_clear - (t_last_progress + stall_for) <= 2 * STALL_AFTER, (t_clear, t_last_progress)
