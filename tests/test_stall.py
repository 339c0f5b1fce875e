"""Stalled engines (dplb.policy.stall, docs/DESIGN.md §6): the detector's state machine table-driven with made-up
snapshots, then the hang scenario on a real router and 4 real sim workers, one of whose engine stalls (its process,
HTTP and collector live on) and later resumes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import threading
import time
from typing import Any

import httpx
import pytest
from cluster import cluster, progress_gaps

from dplb.errors import worker_stalled_message
from dplb.ops.state_cli import snapshot
from dplb.policy.stall import StallDetector
from dplb.state.shm import FLAG_STALLED, Lifecycle, Segment, WorkerState

S = 1_000_000_000  # ns per second
T0 = 10**12


def _w(progress: int, moved_at_s: float, pid: int = 7, life: Lifecycle = Lifecycle.READY,
       flagged: bool = False) -> WorkerState:
    return WorkerState(0, pid=pid, lifecycle=life, progress_total=progress,
                       progress_mono_ns=T0 + int(moved_at_s * S) if moved_at_s >= 0 else 0,
                       flags=FLAG_STALLED if flagged else 0)


# (case, observations (t s, worker state, outstanding), {t: (stalled, excluded, cut)} checked at those times)
_IDLE = _w(5, 0.0)
CASES: list[tuple[str, list[tuple[float, WorkerState, int]], dict[float, tuple[bool, bool, bool]]]] = [
    ("idle for long is not a stall", [(t, _IDLE, 0) for t in range(0, 30, 5)], {25: (False, False, False)}),
    ("busy and progressing is not a stall",
     [(t / 2, _w(t, t / 2), 3) for t in range(0, 20)], {9.5: (False, False, False)}),
    ("a request after a long idle: the debt starts when it arrives",
     [(100.0, _IDLE, 1), (101.5, _IDLE, 1), (102.5, _IDLE, 1)], {101.5: (False, False, False),
                                                               102.5: (True, True, True)}),
    ("busy, no progress past stall_after: stalled and cut",
     [(0.0, _w(5, 0.0), 2), (1.9, _w(5, 0.0), 2), (2.1, _w(5, 0.0), 2)],
     {1.9: (False, False, False), 2.1: (True, True, True)}),
    ("requests gone before stall_after: the debt is forgiven",
     [(0.0, _w(5, 0.0), 2), (1.5, _w(5, 0.0), 0), (2.5, _w(5, 0.0), 0), (3.0, _w(5, 0.0), 1), (4.5, _w(5, 0.0), 1)],
     {2.5: (False, False, False), 4.5: (False, False, False)}),
    ("stalled stays out after its requests were cut, then takes one probe, whose progress brings it back",
     [(0.0, _w(5, 0.0), 2), (2.1, _w(5, 0.0), 2), (2.2, _w(5, 0.0), 0), (3.0, _w(5, 0.0), 0),
      (4.3, _w(5, 0.0), 0), (4.4, _w(5, 0.0), 1), (5.0, _w(9, 4.9), 1)],
     {3.0: (True, True, False), 4.3: (True, False, False), 4.4: (True, True, False), 5.0: (False, False, False)}),
    ("a probe without progress is cut after stall_after",
     [(0.0, _w(5, 0.0), 2), (2.1, _w(5, 0.0), 2), (2.2, _w(5, 0.0), 0), (4.3, _w(5, 0.0), 0),
      (4.4, _w(5, 0.0), 1), (6.3, _w(5, 0.0), 1), (6.5, _w(5, 0.0), 1)],
     {6.3: (True, True, False), 6.5: (True, True, True)}),
    ("a restart (new pid) lifts the stall", [(0.0, _w(5, 0.0), 2), (2.1, _w(5, 0.0), 2), (3.0, _w(0, 3.0, pid=8), 0)],
     {2.1: (True, True, True), 3.0: (False, False, False)}),
    ("an engine that cannot tell its progress is never stalled",
     [(0.0, _w(0, -1), 2), (10.0, _w(0, -1), 2)], {10.0: (False, False, False)}),
    ("a worker that is not ready is never stalled",
     [(0.0, _w(5, 0.0, life=Lifecycle.DRAINING), 2), (10.0, _w(5, 0.0, life=Lifecycle.DRAINING), 2)],
     {10.0: (False, False, False)}),
]


@pytest.mark.parametrize(("case", "obs", "want"), CASES, ids=[c[0] for c in CASES])
def test_stall_state_machine(case: str, obs: list[tuple[float, WorkerState, int]],
                             want: dict[float, tuple[bool, bool, bool]]) -> None:
    d = StallDetector(1, stall_after_s=2.0)
    seen = {}
    for t, w, outstanding in obs:
        now = T0 + int(t * S)
        d.observe([w], [outstanding], now)
        seen[t] = (0 in d.stalled(), 0 in d.excluded(now), 0 in d.cut)
    for t, v in want.items():
        assert seen[t] == v, (case, t, seen)


def test_transitions_are_reported_once() -> None:
    d = StallDetector(1, stall_after_s=2.0)
    events = []
    for t, w, n in [(0.0, _w(5, 0.0), 1), (2.1, _w(5, 0.0), 1), (2.6, _w(5, 0.0), 1), (3.0, _w(6, 3.0), 1),
                    (3.5, _w(7, 3.5), 1)]:
        d.observe([w], [n], T0 + int(t * S))
        events.append((t, set(d.newly_stalled), set(d.recovered)))
    assert [e for e in events if e[1] or e[2]] == [(2.1, {0}, set()), (3.0, set(), {0})]
    assert d.no_progress_s(0, T0 + 3 * S) == 0.0


def test_requests_gone_without_progress_make_a_worker_suspect_until_its_progress_moves() -> None:
    """A debt forgiven without progress (another process's stall check cut the requests first, or their clients
    left before any engine step) makes the worker suspect, which the worker's own probe acts on; progress, or a
    debt that ends with progress, does not."""
    d = StallDetector(1, stall_after_s=2.0)
    seen = []
    for t, w, n in [(0.0, _w(5, 0.0), 1), (0.5, _w(6, 0.5), 0),  # served: progress, no suspicion
                    (1.0, _w(6, 0.5), 1), (2.0, _w(6, 0.5), 0), (3.0, _w(6, 0.5), 0),  # left without progress
                    (4.0, _w(7, 4.0), 0)]:  # progress (the probe's)
        d.observe([w], [n], T0 + int(t * S))
        seen.append((t, d.suspect(0), 0 in d.stalled()))
    assert seen == [(0.0, False, False), (0.5, False, False), (1.0, False, False), (2.0, True, False),
                    (3.0, True, False), (4.0, False, False)], seen


def _run(d: StallDetector, obs: list[tuple[float, WorkerState, int]]) -> list[tuple[float, bool, bool, bool, str]]:
    """(t, stalled, excluded, cut, "new"/"back"/"") after each observation."""
    out = []
    for t, w, n in obs:
        now = T0 + int(t * S)
        d.observe([w], [n], now)
        ev = "new" if d.newly_stalled else "back" if d.recovered else ""
        out.append((t, 0 in d.stalled(), 0 in d.excluded(now), 0 in d.cut, ev))
    return out


def test_the_workers_own_verdict_makes_it_stalled_for_a_router_until_its_flag_clears() -> None:
    """Regression: the router forgave a debt whose requests left before stall_after (a client timeout shorter than
    it) and ignored the worker's own ``FLAG_STALLED`` (its probe found the stall), so it kept the stuck worker
    ready and routable. With ``heed_flag`` the flag makes it stalled (counted once), excluded but for the detector's
    probe timing, never cut without a debt of its own, and back when the flag clears with progress, or alone."""
    obs = [(0.0, _w(5, 0.0), 1), (0.8, _w(5, 0.0), 0),  # the client left: forgiven
           (3.0, _w(5, 0.0, flagged=True), 0), (3.5, _w(5, 0.0, flagged=True), 0),  # the worker's probe found it
           (5.1, _w(5, 0.0, flagged=True), 0),  # free for stall_after: due for one probe (the caller's choice)
           (6.0, _w(9, 6.0), 0), (6.5, _w(9, 6.0), 0)]  # the worker's probe moved the progress, flag cleared
    assert _run(StallDetector(1, stall_after_s=2.0, heed_flag=True), obs) == [
        (0.0, False, False, False, ""), (0.8, False, False, False, ""), (3.0, True, True, False, "new"),
        (3.5, True, True, False, ""), (5.1, True, False, False, ""), (6.0, False, False, False, "back"),
        (6.5, False, False, False, "")]
    # Without heed_flag (the worker's check on its own slot, whose flag is its own output): not stalled.
    assert not any(r[1] for r in _run(StallDetector(1, stall_after_s=2.0), obs))
    # The flag cleared with no progress seen (the worker's check lifted it): lifted too.
    lifted = _run(StallDetector(1, stall_after_s=2.0, heed_flag=True),
                  [(0.0, _w(5, 0.0, flagged=True), 0), (1.0, _w(5, 0.0), 0)])
    assert lifted == [(0.0, True, True, False, "new"), (1.0, False, False, False, "back")]


def test_a_stall_the_router_found_itself_lifts_only_with_progress_not_with_the_flag() -> None:
    """A stall of the router's own (its debt overdue) is not lifted by the worker's flag clearing; requests open
    on a flagged worker are cut by the router's own rule (their debt past stall_after), not at once."""
    d = StallDetector(1, stall_after_s=2.0, heed_flag=True)
    got = _run(d, [(0.0, _w(5, 0.0), 1), (1.0, _w(5, 0.0, flagged=True), 1), (1.5, _w(5, 0.0, flagged=True), 1),
                   (2.1, _w(5, 0.0, flagged=True), 1), (3.0, _w(5, 0.0), 1), (4.0, _w(6, 4.0), 1)])
    assert got == [(0.0, False, False, False, ""), (1.0, True, True, False, "new"), (1.5, True, True, False, ""),
                   (2.1, True, True, True, ""), (3.0, True, True, True, ""), (4.0, False, False, False, "back")]


# ---- the hang scenario, real processes ---------------------------------------------------------------------------
STALL_AFTER = 2.0  # the router's --stall-after here (the default is 5 s; the mechanism is the same)
STALL_FOR = 10.0  # worker 2's engine makes no progress this long


async def _load(url: str, seconds: float, rate: float) -> list[dict[str, Any]]:
    """``rate`` requests/s for ``seconds`` (every other one streamed); one record per request."""
    out: list[dict[str, Any]] = []

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": "dplb-sim", "prompt": f"req {i}", "max_tokens": 12, "stream": i % 2 == 0}
        t0 = time.monotonic()
        rec: dict[str, Any] = {"i": i, "t0": t0, "stream": body["stream"]}
        try:
            if body["stream"]:
                async with client.stream("POST", url + "/v1/completions", json=body) as r:
                    rec.update(status=r.status_code, worker=r.headers.get("x-sg-worker-id"),
                               retry_after=r.headers.get("retry-after"))
                    rec["body"] = ""
                    async for chunk in r.aiter_raw():
                        rec["body"] += chunk.decode()
            else:
                r = await client.post(url + "/v1/completions", json=body)
                rec.update(status=r.status_code, worker=r.headers.get("x-sg-worker-id"),
                           retry_after=r.headers.get("retry-after"), body=r.text)
        except httpx.HTTPError as e:  # a cut stream ends abnormally after its error event
            rec.update(status=rec.get("status", 0), error=type(e).__name__)
        rec["took"] = time.monotonic() - t0
        out.append(rec)

    async with httpx.AsyncClient(timeout=20) as client:
        tasks = []
        for i in range(int(seconds * rate)):
            tasks.append(asyncio.create_task(one(client, i)))
            await asyncio.sleep(1 / rate)
        await asyncio.gather(*tasks)
    return out


def _state_of(seg: Segment, k: int, stop: threading.Event, out: list[tuple[float, str]]) -> None:
    """Worker ``k``'s ``why`` in ``dplb state --json`` (:func:`dplb.ops.state_cli.snapshot`) every 0.2 s."""
    while not stop.wait(0.2):
        out.append((time.monotonic(), snapshot(seg)["workers"][k]["why"]))  # type: ignore[index]


def test_a_stalled_sim_engine_leaves_rotation_fails_fast_and_comes_back(tmp_path: str) -> None:
    """Worker 2's engine stalls after 10 completed requests for STALL_FOR s while its process, HTTP and collector
    live on; 20 req/s with a 20 s client timeout. No request waits past --stall-after + one router check (+ 2.5 s of
    margin for a loaded 2-core box); those on worker 2 fail with the retryable 504 worker_stalled (an SSE error
    event once streaming); worker 2 leaves rotation and takes requests again after its engine resumes."""
    stall = ["--stall-after", str(STALL_AFTER), "--sim-stall-after", "10", "--sim-stall-for-s", str(STALL_FOR)]
    with cluster(str(tmp_path), 4, worker_args={2: stall}, router_args=["--stall-after", str(STALL_AFTER)]) as c:
        assert c.segment is not None
        stop, gaps = threading.Event(), []  # type: ignore[var-annotated]
        watcher = threading.Thread(target=progress_gaps, args=(c.segment, [0, 1, 3], stop, gaps), daemon=True)
        watcher.start()
        shown: list[tuple[float, str]] = []  # (t, why) of worker 2 in `dplb state --json`, every 0.2 s
        seen = threading.Thread(target=_state_of, args=(c.segment, 2, stop, shown), daemon=True)
        seen.start()
        recs = asyncio.run(_load(c.url, 26, 20))
        stop.set()
        watcher.join()
        seen.join()
        log = c.router_log()
        stalls = c.metric("dplb_worker_stalls_total", {"worker": "2"})
        failed = c.metric("dplb_stalled_requests_failed_total", {"worker": "2"})
    recs.sort(key=lambda r: r["t0"])
    limit = STALL_AFTER + 0.5 + 2.5
    slow = [r for r in recs if r["took"] > limit]
    assert not slow, slow[:3]
    ok = [r for r in recs if r["status"] == 200 and "worker_stalled" not in r.get("body", "") and not r.get("error")]
    stalled = [r for r in recs if r not in ok]
    assert stalled and all(r["worker"] == "2" for r in stalled), [r for r in stalled if r["worker"] != "2"][:3]
    for r in stalled:
        if r["status"] == 504:
            assert '"code":"worker_stalled"' in r["body"].replace(" ", "") and r["retry_after"] == "1", r
            assert "retry (another worker will take it)" in r["body"], r  # three other workers are routable
        else:  # a stream cut after its head: the error event, no [DONE]
            assert r["stream"] and "worker_stalled" in r["body"] and "[DONE]" not in r["body"], r
    assert stalls is not None and stalls >= 1 and failed is not None and failed >= len(stalled) - 2
    # Out of rotation: while stalled, worker 2 takes no request but the probes (one at a time, every STALL_AFTER s).
    t_out = min(r["t0"] + r["took"] for r in stalled)  # the first fast failure: the router found the stall
    t_last = stalled[-1]["t0"]
    on2 = [r for r in recs if r["worker"] == "2" and t_out < r["t0"] <= t_last]
    assert len(on2) <= (t_last - t_out) / STALL_AFTER + 2, [(round(r["t0"] - t_out, 2), r["status"]) for r in on2]
    # And back: worker 2 served requests after its engine resumed.
    assert any(r["worker"] == "2" and r in ok and r["t0"] > t_last for r in recs), "worker 2 never came back"
    m = re.search(r"worker 2: engine made no progress for ([0-9.]+) s", log)
    assert m, log[-2000:]
    detect_s = float(m.group(1))
    print(f"sim detection: last progress -> stalled in {detect_s:.1f} s (--stall-after {STALL_AFTER:g}); "
          f"{len(stalled)} of {len(recs)} requests failed fast; slowest {max(r['took'] for r in recs):.2f} s; "
          f"healthy workers' largest gap between progress moves {max(gaps):.2f} s over {len(gaps)} moves")
    assert STALL_AFTER <= detect_s <= STALL_AFTER + 1.5
    assert "progress resumed" in log
    # The router log: no "registered" line for worker 2 while it is stalled (a probe window is not a registration).
    during = log[m.start():log.index("progress resumed", m.start())]
    assert "worker 2 registered" not in during, during
    # `dplb state` says stalled for the whole stall, not only while a request happens to be in flight: from the
    # first sample that shows it to the last, every sample does (its requests are failed, so the routers'
    # in-flight count to worker 2 is mostly 0 meanwhile).
    marks = [i for i, (_, why) in enumerate(shown) if why == "stalled"]
    assert marks, shown
    span = shown[marks[0]:marks[-1] + 1]
    assert all(why == "stalled" for _, why in span), span
    assert span[-1][0] - span[0][0] >= STALL_FOR - STALL_AFTER - 2.5, (span[0], span[-1])


def test_the_stalled_504_says_another_worker_takes_the_retry_only_when_one_is_routable(tmp_path: str) -> None:
    """Regression: a one-worker stack's stalled 503 (now 504) said "retry (another worker will take it)" with no other worker.
    The advice follows how many other workers are routable (the wording itself: dplb.errors)."""
    assert "another worker will take it" in worker_stalled_message(0, 2, 1)
    stall = ["--stall-after", "2", "--sim-stall-after", "2", "--sim-stall-for-s", "8"]  # the warm-up request is 1
    with cluster(str(tmp_path), 1, worker_args={0: stall}, router_args=["--stall-after", "2"]) as c:
        body = {"model": "dplb-sim", "prompt": "a", "max_tokens": 4}
        assert httpx.post(c.url + "/v1/completions", json=body, timeout=20).status_code == 200  # then it stalls
        r = httpx.post(c.url + "/v1/completions", json=body, timeout=20)
    assert r.status_code == 504 and r.json()["error"]["code"] == "worker_stalled", r.text
    msg = r.json()["error"]["message"]
    assert msg == worker_stalled_message(0, 2, 0) and "another worker" not in msg, msg
    assert msg.endswith("no other worker is routable now; retry later"), msg


def test_a_worker_stalled_past_stall_restart_after_stops_its_watchdog_and_exits(tmp_path: str) -> None:
    """systemd's protocol for real: the worker pings WATCHDOG=1 on a datagram socket the test binds as
    NOTIFY_SOCKET; once its engine has been stalled --stall-restart-after (3 s) since its last progress with the
    router's requests on it, the pings stop and the worker exits 1 (its supervisor restarts it)."""
    sock_path = os.path.join(str(tmp_path), "notify.sock")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(sock_path)
    notify.settimeout(0.2)
    pings: list[float] = []

    def listen(stop: threading.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                if b"WATCHDOG=1" in notify.recv(4096):
                    pings.append(time.monotonic())

    stop = threading.Event()
    listener = threading.Thread(target=listen, args=(stop,), daemon=True)
    listener.start()
    try:
        with cluster(str(tmp_path), 1, start_workers=False, wait_router_ready=False,
                     router_args=["--stall-after", "1"]) as c:
            c.start_worker(0, "--stall-after", "1", "--stall-restart-after", "3", "--sim-stall-after", "2",
                           env={"NOTIFY_SOCKET": sock_path, "WATCHDOG_USEC": "400000"})
            body = {"model": "dplb-sim", "prompt": "x", "max_tokens": 4}
            assert httpx.post(c.url + "/v1/completions", json=body, timeout=30).status_code == 200  # → stalled
            t_stall = time.monotonic()
            codes = []
            while c.workers[0].poll() is None and time.monotonic() - t_stall < 40:
                with contextlib.suppress(httpx.HTTPError):
                    codes.append(httpx.post(c.url + "/v1/completions", json=body, timeout=10).status_code)
                time.sleep(0.2)
            assert c.workers[0].poll() == 1, c.tail()
            log = c.tail(200)
    finally:
        stop.set()
        listener.join()
        notify.close()
    assert 504 in codes, codes  # the stalled worker's worker_stalled (later ones: 503 no_routable_worker)
    assert "withholding the systemd watchdog and exiting for a restart" in log, log
    assert pings and min(pings) < t_stall, "the worker never pinged the watchdog"
    last = max(pings)
    assert last - t_stall < 1 + 3 + 2.5, (last - t_stall)  # pings stopped once stalled 3 s (+ margin)
