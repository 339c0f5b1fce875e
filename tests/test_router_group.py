"""``dplb router --processes N`` (docs/DESIGN.md §7): N real router processes on one port and one segment, real signals.

What must hold: the group answers as one router (merged /metrics with nothing counted twice or lost, decisions of
every process), a SIGKILLed process is replaced while the other's requests finish, and SIGTERM drains every
process without dropping a request.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import subprocess
import threading
import time

import httpx
import pytest
from cluster import Cluster, cluster, group_children

from dplb.state.segments import process_gone

pytestmark = pytest.mark.timeout(120)
BODY = {"model": "dplb-sim", "prompt": "hello", "max_tokens": 2}
SLOW = ["--sim-decode-step-s", "0.05"]  # 30 tokens ≈ 1.5 s: long enough to kill or drain mid-stream


def _wait_group(c: Cluster, n: int, timeout: float = 30) -> dict[int, int]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        kids = group_children(c)
        if len(kids) == n and c.metric("dplb_router_processes", {"state": "answered"}) == n:
            return kids
        time.sleep(0.1)
    raise TimeoutError(f"group of {n} not up:\n{c.tail()}")


async def _streams(url: str, n: int, tokens: int, started: asyncio.Event | None = None) -> list[tuple[str, int, bool]]:
    """``n`` concurrent SSE completions, each on its own connection. Returns (request id, status, saw [DONE])."""

    async def one() -> tuple[str, int, bool]:
        async with httpx.AsyncClient(base_url=url, timeout=30) as cl:
            try:
                async with cl.stream("POST", "/v1/completions",
                                     json={**BODY, "max_tokens": tokens, "stream": True}) as r:
                    done = False
                    async for line in r.aiter_lines():
                        done |= line == "data: [DONE]"
                    return r.headers.get("x-request-id", ""), r.status_code, done
            except httpx.HTTPError:
                return "", 0, False

    return list(await asyncio.gather(*(one() for _ in range(n))))


def _served_by(c: Cluster) -> dict[str, int]:
    """Request id → router process index, from the group's merged decisions."""
    return {d["request_id"]: d["process"] for d in httpx.get(c.url + "/debug/decisions?limit=256").json()}


def _samples(text: str) -> dict[str, float]:
    return {ln.rpartition(" ")[0]: float(ln.rpartition(" ")[2]) for ln in text.splitlines()
            if ln and not ln.startswith("#")}


def _total(samples: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in samples.items() if k.startswith(prefix))


def test_group_answers_as_one_router(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse

    with cluster(str(tmp_path), 2, router_args=["--processes", "2"]) as c:
        _wait_group(c, 2)
        for _ in range(60):  # a new connection each: the kernel spreads them over both processes
            assert httpx.post(c.url + "/v1/completions", json=BODY, timeout=10).status_code == 200
        procs = set(_served_by(c).values())
        assert procs == {0, 1}, procs
        samples = _samples(httpx.get(c.url + "/metrics").text)
        # A process's own counters: one series per process (label `process`); their sum is the group's.
        ok = 'dplb_http_requests_total{method="POST",process="%s",route="/v1/completions",status="200"}'
        assert samples[ok % "0"] + samples[ok % "1"] == 60 and samples[ok % "0"] > 0 and samples[ok % "1"] > 0
        assert _total(samples, "dplb_routing_decisions_total") == 60
        assert 'process_cpu_seconds_total{process="0"}' in samples and 'process_cpu_seconds_total{process="1"}' in samples
        # Per-worker figures from shm are shown once (each process sees the whole group), not per process.
        assert samples['dplb_worker_up{worker="0"}'] == 1 and samples['dplb_worker_up{worker="1"}'] == 1
        assert samples['dplb_worker_requests_inflight{worker="0"}'] == 0
        assert samples['dplb_router_processes{state="answered"}'] == 2
        one = httpx.get(c.url + "/metrics?scope=process").text
        assert "dplb_router_processes" not in one and 'process="' not in one  # one process alone, unmerged
        # The merged OpenMetrics answer is valid (each labelled child's samples kept together).
        om = httpx.get(c.url + "/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"})
        assert {f.name for f in om_parse(om.text)} >= {"dplb_http_requests", "dplb_upstream_request_duration_seconds"}
        assert all("process" in d for d in httpx.get(c.url + "/debug/decisions?scope=process").json())
        # A restarted process resets only its own series: the survivor's count never goes down.
        before = samples[ok % "1"]
        os.kill(group_children(c)[0], signal.SIGKILL)
        _wait_group(c, 2)
        after = _samples(httpx.get(c.url + "/metrics").text)
        assert after[ok % "1"] == before and after.get(ok % "0", 0) == 0


def test_sigkilled_process_is_replaced_and_the_other_finishes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with cluster(str(tmp_path), 2, worker_args={0: SLOW, 1: SLOW}, router_args=["--processes", "2"]) as c:
        kids = _wait_group(c, 2)

        async def scenario() -> list[tuple[str, int, bool]]:
            task = asyncio.ensure_future(_streams(c.url, 8, 30))
            await asyncio.sleep(0.6)  # every stream is under way
            os.kill(kids[0], signal.SIGKILL)
            return await task

        results = asyncio.run(scenario())
        served = _served_by(c)  # the survivor's ring (the killed process's ring died with it)
        on_survivor = [r for r in results if served.get(r[0]) == 1]
        assert on_survivor, (results, served)
        assert all(status == 200 and done for _, status, done in on_survivor), results
        new = _wait_group(c, 2)
        assert new[0] != kids[0] and new[1] == kids[1]
        assert "router process 0 exited (killed by SIGKILL); restarting" in c.router_log()
        for _ in range(20):
            assert httpx.post(c.url + "/v1/completions", json=BODY, timeout=10).status_code == 200


def test_sigterm_drains_every_process(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with cluster(str(tmp_path), 2, worker_args={0: SLOW, 1: SLOW}, router_args=["--processes", "2"]) as c:
        _wait_group(c, 2)
        assert c.router is not None

        async def scenario() -> list[tuple[str, int, bool]]:
            task = asyncio.ensure_future(_streams(c.url, 8, 30))
            await asyncio.sleep(0.6)
            c.router.send_signal(signal.SIGTERM)
            return await task

        results = asyncio.run(scenario())
        assert all(status == 200 and done for _, status, done in results), results
        assert c.router.wait(30) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(c.url + "/health", timeout=2)
        assert not os.path.exists(os.path.join(c.run_dir, f"router-{c.port}.0.sock"))


def test_group_refuses_a_taken_port_and_a_missing_run_dir(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A group never joins another program's SO_REUSEPORT group on its port, and says what to fix."""
    import socket
    import sys

    from cluster import free_port

    port = free_port()
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # even one that allows port sharing
    holder.bind(("127.0.0.1", port))
    holder.listen()
    try:
        for argv, needle in ((["--port", str(port), "--run-dir", str(tmp_path)], f"cannot bind 127.0.0.1:{port}"),
                             (["--port", str(free_port()), "--run-dir", str(tmp_path / "nope")],
                              "is not a writable directory"),
                             (["--port", str(port), "--run-dir", str(tmp_path), "--processes", "1"],
                              f"cannot bind 127.0.0.1:{port}")):  # one line, never a traceback
            r = subprocess.run([sys.executable, "-m", "dplb.cli", "router", "--host", "127.0.0.1", "--processes", "2",
                                "--num-workers", "1", *argv], capture_output=True, text=True, timeout=30)
            assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    finally:
        holder.close()


def test_a_bad_host_is_one_line_naming_host_not_a_port_holder(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A --host that does not resolve or is not this machine's is a one-line error naming --host, with one router
    process or a group (the group's port reservation resolves the host first: once a traceback), and never blames
    another process for holding the port."""
    import errno
    import sys

    from cluster import free_port

    from dplb.errors import PortInUseError, bind_error

    for host in ("999.1.1.1", "192.0.2.1"):  # no such name; TEST-NET-1, not an address of this machine
        for processes in ("1", "2"):
            r = subprocess.run([sys.executable, "-m", "dplb.cli", "router", "--host", host, "--port", str(free_port()),
                                "--processes", processes, "--num-workers", "1", "--run-dir", str(tmp_path)],
                               capture_output=True, text=True, timeout=30)
            lines = r.stderr.strip().splitlines()
            assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
            assert f"cannot bind {host}:" in lines[0] and "--host must be" in lines[0], lines[0]
            assert "another process holds it" not in lines[0], lines[0]
    assert isinstance(bind_error("h", 1, OSError(errno.EADDRINUSE, "Address already in use")), PortInUseError)
    assert "pass another --port" in str(bind_error("h", 1, OSError(errno.EACCES, "Permission denied")))


def test_a_conversation_finds_its_worker_whichever_process_gets_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The prefix index is shared through the segment's prefix rings: each turn of a conversation arrives on a new
    connection (so on either process) and still goes to the worker that holds its history."""
    with cluster(str(tmp_path), 2, router_args=["--processes", "2"]) as c:
        _wait_group(c, 2)
        crossed = 0
        for conv in range(6):
            system = {"role": "system", "content": f"conversation {conv}: " + "a long shared history " * 120}
            msgs = [system, {"role": "user", "content": "turn 0"}]
            first = httpx.post(c.url + "/v1/chat/completions", timeout=10,
                               json={"model": "dplb-sim", "messages": msgs, "max_tokens": 2})
            home = first.headers["x-sg-worker-id"]
            ids = [first.headers["x-request-id"]]
            for turn in range(1, 5):
                msgs = [*msgs, {"role": "assistant", "content": "ok"}, {"role": "user", "content": f"turn {turn}"}]
                r = httpx.post(c.url + "/v1/chat/completions", timeout=10,
                               json={"model": "dplb-sim", "messages": msgs, "max_tokens": 2})
                assert r.status_code == 200 and r.headers["x-sg-worker-id"] == home, (conv, turn)
                ids.append(r.headers["x-request-id"])
            served = _served_by(c)
            crossed += len({served[i] for i in ids}) > 1
        assert crossed >= 2, "the turns never crossed between processes: the test proved nothing"


def _load(url: str, stop: threading.Event, out: list[tuple[float, int]]) -> None:
    """Requests one after the other, each on a new connection (the kernel spreads them over the group's processes),
    until ``stop``: (monotonic time at the answer, status; 0 for a transport error or a 1 s timeout: one that the
    frozen process accepted comes back soon and tries again)."""
    while not stop.is_set():
        try:
            status = httpx.post(url + "/v1/completions", json=BODY, timeout=1).status_code
        except httpx.HTTPError:
            status = 0
        out.append((time.monotonic(), status))


def test_a_frozen_process_is_killed_by_its_heartbeat_and_replaced(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A stopped child still gets new connections from the kernel: the parent reads its router slot in the segment
    and SIGKILLs it once the heartbeat is --restart-after old (3 s here: killed ~3 s after the SIGSTOP, where the
    /health probes take ~10 s), then starts another; the sibling serves throughout and the group serves after."""
    with cluster(str(tmp_path), 1, router_args=["--processes", "2", "--restart-after", "3"]) as c:
        kids = _wait_group(c, 2)
        stop, answers = threading.Event(), []  # type: ignore[var-annotated]
        loads = [threading.Thread(target=_load, args=(c.url, stop, answers), daemon=True) for _ in range(4)]
        for load in loads:  # four clients: one waiting on the frozen process does not stop the others
            load.start()
        os.kill(kids[1], signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < 30 and not process_gone(kids[1]):
                time.sleep(0.05)
            killed_s = time.monotonic() - t0
            new = _wait_group(c, 2)
            replaced_s = time.monotonic() - t0
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(kids[1], signal.SIGCONT)
            stop.set()
            for load in loads:
                load.join(10)
        log = c.router_log()
        assert new[1] != kids[1] and new[0] == kids[0], (kids, new)
        assert f"router process 1 (pid {kids[1]}) published no heartbeat for" in log, log[-3000:]
        assert "(--restart-after 3)" in log and "gave no /health answer" not in log, log[-3000:]
        # the last heartbeat is up to 0.5 s before the SIGSTOP; the parent reads the slots every 0.25 s, but a /health
        # probe of the frozen child holds its loop up to 1 s (its timeout): ~10 s before the heartbeat was judged
        assert 2.4 <= killed_s <= 3 + 2, killed_s
        served = [t for t, status in answers if status == 200 and t0 < t < t0 + killed_s]
        assert served, [(round(t - t0, 2), status) for t, status in answers]  # the sibling served meanwhile
        for _ in range(10):
            assert httpx.post(c.url + "/v1/completions", json=BODY, timeout=10).status_code == 200
        print(f"frozen group child killed {killed_s:.1f} s and replaced {replaced_s:.1f} s after SIGSTOP "
              f"(--restart-after 3); {len(served)} requests served meanwhile")


def test_restart_after_0_leaves_a_hung_process_to_the_health_probes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """--restart-after 0: the heartbeat is not judged, and the parent's liveness probe (GET /health on the child's
    private socket every 2 s, 5 misses) kills the stopped child and starts another."""
    with cluster(str(tmp_path), 1, router_args=["--processes", "2", "--restart-after", "0"]) as c:
        kids = _wait_group(c, 2)
        os.kill(kids[1], signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < 40 and group_children(c).get(1) == kids[1]:
                time.sleep(0.25)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(kids[1], signal.SIGCONT)
        assert group_children(c).get(1) != kids[1], "the stopped process was never replaced"
        assert 8 <= time.monotonic() - t0 <= 25, time.monotonic() - t0
        log = c.router_log()
        assert f"router process 1 (pid {kids[1]}) gave no /health answer 5 times in a row" in log
        assert "published no heartbeat" not in log, log[-3000:]
        assert _wait_group(c, 2)[0] == kids[0]


def test_heartbeats_of_a_removed_segment_are_not_judged_and_a_recreated_one_is(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The parent reads the segment now at the path: once it is removed the children stop writing heartbeats into it
    and none is judged (they live on); once one is recreated there the children claim slots in it and a frozen one
    is killed by its heartbeat again."""
    from dplb.state.shm import Segment

    with cluster(str(tmp_path), 1, router_args=["--processes", "2", "--restart-after", "1"]) as c:
        kids = _wait_group(c, 2)
        assert c.segment is not None
        c.segment.close()
        c.segment = None
        os.unlink(c.shm_path)
        time.sleep(4)  # four limits
        assert group_children(c) == kids, c.router_log()[-3000:]
        log = c.router_log()
        assert "router group: state segment" in log and "published no heartbeat" not in log, log[-3000:]
        c.segment = Segment.create(c.shm_path, 1, state_interval_ms=200, model="dplb-sim")
        t0 = time.monotonic()
        while time.monotonic() - t0 < 20 and len({s["pid"] for s in c.segment.router_slots()} & set(kids.values())) < 2:
            time.sleep(0.1)
        os.kill(kids[0], signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < 20 and not process_gone(kids[0]):
                time.sleep(0.05)
            killed_s = time.monotonic() - t0
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(kids[0], signal.SIGCONT)
        assert killed_s <= 1 + 2, (killed_s, c.router_log()[-3000:])
        assert f"router process 0 (pid {kids[0]}) published no heartbeat for" in c.router_log()
        assert _wait_group(c, 2)[1] == kids[1]



def test_every_scrape_time_family_has_a_group_rule() -> None:
    """A family the per-worker collector yields is either shared (derived from shm: shown once) or a process's own
    (labelled per process); a new one must be put in one of the two sets in dplb/obs/metrics.py."""
    from dplb.config import PolicyConfig
    from dplb.obs import metrics as M
    from dplb.obs.metrics_scrape import WorkerStateCollector
    from dplb.policy import make_policy
    from dplb.state.shm import Lifecycle, WorkerState

    p = make_policy(PolicyConfig(), 1)
    now = time.monotonic_ns()
    d = p.pick([WorkerState(0, pid=1, lifecycle=Lifecycle.READY, heartbeat_mono_ns=now)], now, dry_run=True)
    names = {f.name for f in WorkerStateCollector(lambda: (d, [0], 1, 0.5, p)).collect()}
    assert not M.GROUP_SHARED & M.GROUP_PER_PROCESS_SCRAPE
    assert names <= M.GROUP_SHARED | M.GROUP_PER_PROCESS_SCRAPE, names - M.GROUP_SHARED - M.GROUP_PER_PROCESS_SCRAPE


def test_a_worker_connection_lost_before_use_logs_no_asyncio_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Regression: after SIGSTOP/SIGCONT a router logged "Future exception was never retrieved …
    UpstreamClosed": a worker connection opened for a client that had gone meanwhile, then closed before any
    request was sent on it, failed a response future nobody would await. Real Unix socket, real close."""
    import gc
    import socket

    from dplb.errors import UpstreamTimeout
    from dplb.router.upstream_pool import UpstreamPool

    path = str(tmp_path / "w.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen()
    errors: list[dict[str, object]] = []

    async def scenario() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
        pool = UpstreamPool([path], 1.0)
        conn = await pool.open(0)
        peer, _ = srv.accept()
        peer.close()  # the worker side goes away before the router sent anything
        await asyncio.sleep(0.1)
        assert conn.closed
        conn2 = await pool.open(0)  # and a request whose head never comes: its timeout is still raised
        conn2.send_request(b"GET / HTTP/1.1\r\nhost: w\r\n\r\n", b"")
        with pytest.raises(UpstreamTimeout):
            await conn2.response_head(0.05)
        del conn, conn2
        pool.close()
        gc.collect()
        await asyncio.sleep(0.05)

    asyncio.run(scenario())
    srv.close()
    assert not [e for e in errors if "never retrieved" in str(e.get("message"))], errors


def test_a_failing_worker_is_ejected_by_the_group_after_max_fails_in_all(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Worker 1 of 4 answers every request with a fast 500 (its engine gone, its heartbeat fresh), round robin in a
    group of 2 processes. Each process used to count its own failures: 3 in each, 6 failed requests before the
    worker was out of both; now the processes share their streaks and ejections (dplb.state.health_board): 3 in
    all, then it is out of both for the ejection's 2 s, counted once."""
    from dplb.router.health import MAX_FAILS, UNREACHABLE_S

    fast = ["--sim-decode-step-s", "0.001"]
    with cluster(str(tmp_path), 4, worker_args={k: [*fast, *(["--sim-oom-after", "2"] if k == 1 else [])]
                                                for k in range(4)},
                 router_args=["--processes", "2", "--policy", "round_robin"]) as c:
        _wait_group(c, 2)
        results: list[tuple[float, int, str]] = []  # (time sent, status, worker)
        first_fail = None
        t0 = time.monotonic()
        # One request at a time, each on a new connection (the kernel spreads them over both processes; one client:
        # not an SSL context per request), until the first ejection window after the first failure is nearly over.
        client = httpx.Client(base_url=c.url, timeout=10, limits=httpx.Limits(max_keepalive_connections=0))
        while time.monotonic() - t0 < 30:
            sent = time.monotonic()
            r = client.post("/v1/completions", json={**BODY, "max_tokens": 1})
            results.append((sent, r.status_code, r.headers.get("x-sg-worker-id", "")))
            if r.status_code == 500 and first_fail is None:
                first_fail = sent
            if first_fail is not None and time.monotonic() - first_fail > UNREACHABLE_S * 0.95:
                break
        client.close()
        assert first_fail is not None, results
        window = [x for x in results if x[0] >= first_fail]
        failed = [x for x in window if x[1] != 200]
        assert all(x[2] == "1" and x[1] == 500 for x in failed), failed
        assert len(window) >= 8 * MAX_FAILS, f"too few requests to see both processes' streaks: {len(window)}"
        served = collections.Counter(_served_by(c).values())
        assert len(served) == 2, served  # both processes routed (each would have failed MAX_FAILS times alone)
        assert len(failed) <= MAX_FAILS, f"{len(failed)} failed requests before worker 1 was out of both: {failed}"
        samples = _samples(httpx.get(c.url + "/metrics").text)
        assert _total(samples, "dplb_worker_ejections_total") == 1, {k: v for k, v in samples.items() if "eject" in k}
