"""A real HAProxy (Debian's package) in front of real DPLB hosts on loopback addresses, fed by DPLB's agent-check:
weights follow load, a drained host (SIGTERM) loses its traffic with zero failed requests, a killed host leaves
rotation. Skips when haproxy is not installed (CI installs it: .ci/run)."""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import os
import signal
import subprocess
import time

import httpx
import pytest
from cluster import cluster, free_port
from fleet_support import (
    HAPROXY,
    WORKER,
    Launched,
    Load,
    agent_answer,
    assert_retry_rule,
    balancer,
    haproxy_stat,
    hosts,
    launched_hosts,
    retry_fleet,
    retry_scenario,
)

from dplb.ops.fleet import FleetHost, haproxy_config

pytestmark = pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed (apt-get install haproxy)")


def _haproxy(tmp_path: str, fleet: list, listen_port: int, **kw: object):  # type: ignore[no-untyped-def]
    cfg = haproxy_config([FleetHost(c.host, c.port, agent) for c, agent in fleet], f"127.0.0.1:{listen_port}",
                         **kw)  # type: ignore[arg-type]
    path = os.path.join(tmp_path, "haproxy.cfg")
    with open(path, "w") as f:
        f.write(cfg)
    assert HAPROXY is not None
    return balancer([HAPROXY, "-db", "-f", path], f"http://127.0.0.1:{listen_port}",
                    os.path.join(tmp_path, "haproxy.log"), ready_path="/ready")


def test_agent_weights_follow_load_and_drain_loses_nothing(tmp_path: pytest.TempPathFactory) -> None:
    port = free_port()
    with hosts(str(tmp_path), [1.0, 0.5], router_args=["--drain-notice", "3"]) as fleet, \
            _haproxy(str(tmp_path), fleet, port):
        fast, slow = (f"h-{c.host.replace('.', '-')}-{c.port}" for c, _ in fleet)
        load = Load(f"http://127.0.0.1:{port}", clients=16).start()
        try:
            time.sleep(3)  # agent weights settle (agent-inter 500 ms)
            before = load.snapshot()
            time.sleep(8)
            window = load.snapshot() - before
            share_slow = window[slow] / max(1, window[slow] + window[fast])
            print(f"haproxy agent weights: fast {window[fast]}, half-speed {window[slow]} (share {share_slow:.2f})")
            # Round robin would give each host half; the half-speed host reports more load and gets less.
            assert window[fast] > 0 and share_slow < 0.45, window
            c_slow = fleet[1][0]
            assert c_slow.router is not None
            c_slow.router.send_signal(signal.SIGTERM)  # drain: report drain, serve 3 s more, then stop
            t0 = time.monotonic()
            time.sleep(2)
            mid = load.snapshot()
            time.sleep(2)
            late = load.snapshot() - mid
            assert late[slow] == 0, late  # no new request reached the draining host
            c_slow.router.wait(20)
            time.sleep(1)
        finally:
            load.stop()
        assert not load.failures, load.failures[:5]
        assert time.monotonic() - t0 > 2.5
        assert sum(load.served.values()) > 50


def test_conversation_hash_keeps_turns_together_and_a_killed_host_leaves_rotation(
        tmp_path: pytest.TempPathFactory) -> None:
    """hdr(x-session-id) with bounded-load consistent hashing: every turn of a conversation lands on one host and
    conversations use both hosts; a hot conversation (many turns in flight at once) spills onto the other host
    once its own holds more than hash-balance-factor (150 %) of the average load; then a SIGKILLed host loses at
    most its in-flight requests and is out of rotation within the check interval (inter 1 s x fall 2, retries
    redispatch the rest)."""
    port = free_port()
    with hosts(str(tmp_path), [1.0, 1.0]) as fleet, \
            _haproxy(str(tmp_path), fleet, port, affinity_header="x-session-id"):
        placement: dict[int, set[str]] = {}
        with httpx.Client(timeout=30) as client:
            for turn in range(4):
                for conv in range(12):
                    r = client.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                    headers={"x-session-id": f"conversation-{conv}"},
                                    json={"model": "dplb-sim", "max_tokens": 2,
                                          "messages": [{"role": "user", "content": f"turn {turn}"}]})
                    assert r.status_code == 200, r.text
                    placement.setdefault(conv, set()).add(r.headers["x-dplb-host"])
        assert all(len(h) == 1 for h in placement.values()), placement
        assert len(set().union(*placement.values())) == 2, placement
        home = next(iter(placement[0]))

        def hot_turn(_: int) -> str:
            r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                           headers={"x-session-id": "conversation-0"},
                           json={"model": "dplb-sim", "max_tokens": 60,
                                 "messages": [{"role": "user", "content": "a hot conversation"}]})
            assert r.status_code == 200, r.text
            return str(r.headers["x-dplb-host"])

        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            hot = collections.Counter(pool.map(hot_turn, range(12)))
        print(f"12 turns of one conversation at once: {dict(hot)} (home {home})")
        # Bounded load: the home host takes at most 1.5 x the average of what is in flight, the rest spills.
        assert len(hot) == 2 and hot[home] >= 4, hot
        load = Load(f"http://127.0.0.1:{port}", clients=8, max_tokens=4).start()
        try:
            time.sleep(2)
            victim = fleet[1][0]
            assert victim.router is not None
            t_kill = time.monotonic()
            victim.router.kill()
            victim.router.wait(10)
            time.sleep(4)
            fails_at = len(load.failures)
            before = load.snapshot()
            time.sleep(3)
            after = load.snapshot() - before
        finally:
            load.stop()
        dead = f"h-{victim.host.replace('.', '-')}-{victim.port}"
        print(f"killed host: {len(load.failures)} failed requests (8 clients in flight), then {dict(after)}")
        assert after[dead] == 0 and sum(after.values()) > 0, after
        assert len(load.failures) <= 8 and len(load.failures) == fails_at, load.failures  # only in-flight ones
        assert time.monotonic() - t_kill < 30


def _direct(lh: Launched) -> httpx.Response:
    """A request straight to the host's router, asking for an ORCA report."""
    return httpx.post(lh.url + "/v1/chat/completions", timeout=30, headers={"endpoint-load-metrics-format": "TEXT"},
                      json={"model": "dplb-sim", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})


def _drained_but_serving(lh: Launched) -> None:
    """Agent ``drain``, /ready 503 and ORCA utilization 1 within 1.5 s, while the router still answers."""
    deadline = time.monotonic() + 1.5
    while agent_answer(lh.host.host, lh.host.agent_port) != "drain\n":
        assert time.monotonic() < deadline, "the agent did not turn to drain"
        time.sleep(0.05)
    assert httpx.get(lh.url + "/ready", timeout=5).status_code == 503
    r = _direct(lh)
    assert r.status_code == 200, r.text  # still accepting: the balancer moves traffic first
    orca = dict(kv.split("=") for kv in r.headers["endpoint-load-metrics"][5:].split(", "))
    assert float(orca["application_utilization"]) >= 1, orca


def test_launched_hosts_drain_behind_haproxy_with_zero_failures(tmp_path: pytest.TempPathFactory) -> None:
    """Real `dplb launch` hosts: SIGUSR1 to a launcher (Kubernetes' preStop) and SIGTERM with --drain-notice (systemd
    stop) each turn the host's agent to drain, /ready to 503 and its ORCA utilization to 1 before it stops
    accepting; HAProxy moves new requests away and the clients see no failed request."""
    port = free_port()
    with launched_hosts(str(tmp_path), 3, ["--drain-notice", "3", "--drain-timeout", "10", "--orca", "asked"]) as lhs:
        fleet = [(lh.host, lh.host.agent_port) for lh in lhs]
        cfg = haproxy_config([h for h, _ in fleet], f"127.0.0.1:{port}")
        path = os.path.join(str(tmp_path), "haproxy.cfg")
        with open(path, "w") as f:
            f.write(cfg)
        assert HAPROXY is not None
        with balancer([HAPROXY, "-db", "-f", path], f"http://127.0.0.1:{port}", os.path.join(str(tmp_path), "hp.log"),
                      ready_path="/ready"):
            load = Load(f"http://127.0.0.1:{port}", clients=9, max_tokens=8).start()
            keep, usr1, term = lhs
            try:
                time.sleep(3)
                assert all(load.snapshot()[lh.host.name] > 0 for lh in lhs), load.snapshot()
                usr1.proc.send_signal(signal.SIGUSR1)  # drain without stopping
                _drained_but_serving(usr1)
                t0 = time.monotonic()
                term.proc.send_signal(signal.SIGTERM)  # drain, serve --drain-notice more, then stop
                _drained_but_serving(term)
                time.sleep(max(0.0, 2 - (time.monotonic() - t0)))
                mid = load.snapshot()
                time.sleep(1)
                late = load.snapshot() - mid
                assert late[usr1.host.name] == 0 and late[term.host.name] == 0 and late[keep.host.name] > 0, late
                assert term.proc.wait(30) == 0
                assert time.monotonic() - t0 > 2.5  # it served through the notice
                assert usr1.proc.poll() is None and agent_answer(usr1.host.host, usr1.host.agent_port) == "drain\n"
                time.sleep(1)
            finally:
                load.stop()
            print(f"launched hosts drained: {dict(load.served)}, failures {len(load.failures)}")
            assert not load.failures, load.failures[:5]
            assert load.served[keep.host.name] > 20
        with open(term.log_path, errors="replace") as f:
            log = f.read()
        assert "reporting drain to the front balancer for 3 s before stopping" in log, log[-2000:]


def _stream_gaps(url: str, max_tokens: int = 30) -> tuple[float, list[float]]:
    """One streamed chat through ``url``: seconds to the first token event and the gaps between token events."""
    body = {"model": "dplb-sim", "max_tokens": max_tokens, "stream": True,
            "messages": [{"role": "user", "content": "count slowly"}]}
    t0 = time.perf_counter()
    stamps: list[float] = []
    with httpx.Client(timeout=30) as client, client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content"' in line:
                stamps.append(time.perf_counter() - t0)
    assert len(stamps) >= max_tokens - 1, stamps
    return stamps[0], [b - a for a, b in itertools.pairwise(stamps)]


def test_streamed_tokens_pass_haproxy_one_by_one(tmp_path: pytest.TempPathFactory) -> None:
    """Regression: without `option http-no-delay` HAProxy held SSE chunks back and sent them in bursts (tokens 10 at a
    time every ~220 ms, TTFT ~210 ms against ~25 ms direct). The sim engine steps every ~20 ms; through HAProxy the
    first token and the median gap between tokens stay close to that."""
    port = free_port()
    with hosts(str(tmp_path), [1.0], workers=1) as fleet, _haproxy(str(tmp_path), fleet, port):
        c = fleet[0][0]
        _stream_gaps(f"http://127.0.0.1:{port}", 4)  # warm: connections, the worker's first request
        direct_ttft, direct = _stream_gaps(f"http://{c.host}:{c.port}")
        ttft, gaps = _stream_gaps(f"http://127.0.0.1:{port}")
    p50, direct_p50 = sorted(gaps)[len(gaps) // 2], sorted(direct)[len(direct) // 2]
    print(f"through haproxy: TTFT {ttft * 1000:.0f} ms, ITL P50 {p50 * 1000:.1f} ms, max {max(gaps) * 1000:.0f} ms; "
          f"direct: TTFT {direct_ttft * 1000:.0f} ms, ITL P50 {direct_p50 * 1000:.1f} ms")
    # Coalesced tokens arrive in bursts: a near-zero median gap and long silences between the bursts.
    assert 0.005 < p50 < 0.06 and max(gaps) < 0.15 and ttft < 0.15, (ttft, [round(g, 4) for g in gaps])


def _wait_stat(sock: str, key: str, ok: object, timeout_s: float = 15) -> dict[str, str]:
    """HAProxy's ``show stat`` row ``key`` once ``ok(row)`` holds (the last row seen in the failure)."""
    deadline, row = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        if os.path.exists(sock):
            row = haproxy_stat(sock).get(key, {})
            if row and ok(row):  # type: ignore[operator]
                return row
        time.sleep(0.1)
    raise AssertionError(f"{key}: {row}")


def test_the_agent_alone_takes_a_host_out_and_haproxy_shows_why(tmp_path: pytest.TempPathFactory) -> None:
    """Regression: the agent answered ``down#no routable worker``, which HAProxy 2.6 reads as one unknown word
    (``last_agt`` "agent reports an error : down#no", the server left in rotation): only the HTTP check of the
    generated config took such a host out, and a backend that keeps only the agent-check never did. A server checked
    by the agent alone (no ``check``) in front of a host with no routable worker: HAProxy marks it DOWN via the
    agent with the reason in its stats; once a worker is ready the agent's ``up`` brings it back into rotation."""
    tmp = str(tmp_path)
    agent, port, sock = free_port(), free_port(), os.path.join(tmp, "admin.sock")
    with cluster(os.path.join(tmp, "host"), 1, start_workers=False, wait_router_ready=False, host="127.0.0.2",
                 router_args=["--agent-port", str(agent)]) as c:
        assert agent_answer(c.host, agent) == "down #no routable worker\n"
        path = os.path.join(tmp, "agent-only.cfg")
        with open(path, "w") as f:
            f.write(f"global\n    stats socket {sock} mode 600 level admin\ndefaults\n    mode http\n"
                    "    timeout connect 2s\n    timeout client 30s\n    timeout server 30s\n"
                    f"frontend in\n    bind 127.0.0.1:{port}\n    default_backend hosts\nbackend hosts\n"
                    f"    server h1 {c.host}:{c.port} agent-check agent-port {agent} agent-inter 200ms\n")
        assert HAPROXY is not None
        with open(os.path.join(tmp, "haproxy.log"), "wb") as log:
            hp = subprocess.Popen([HAPROXY, "-db", "-f", path], stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        try:
            down = _wait_stat(sock, "hosts/h1", lambda r: r["status"].startswith("DOWN"))
            print(f"agent-only server, no routable worker: {down['status']}, {down['last_agt']!r}")
            assert down["status"] == "DOWN (agent)" and down["last_agt"] == "via agent : down (no routable worker)", down
            assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 503  # HAProxy: no server
            c.start_worker(0, *WORKER)
            # Back in rotation ("no check": no HTTP check runs, only the agent's up).
            _wait_stat(sock, "hosts/h1", lambda r: r["last_agt"].startswith("via agent : up") and r["status"] in (
                "UP", "no check"))
            r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=30, json={
                "model": "dplb-sim", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text
        finally:
            hp.terminate()
            hp.wait(10)


def test_haproxy_re_sends_a_503_and_nothing_that_reached_an_engine(tmp_path: pytest.TempPathFactory) -> None:
    """Regression: the HAProxy config re-sent every 503, empty response and response timeout (``retry-on
    conn-failure empty-response response-timeout 503``), so a stalled host's 503 worker_stalled (the request reached
    its engine, which may have started it) went to another host, which the Envoy config never did. The one rule
    (README, "Running a fleet"), the same test as Envoy's: every 503 re-sent to another host (no client sees one;
    HAProxy counts the retries); worker_stalled (now 504) and the killed worker's 502 worker_failed reach the clients
    one for one."""
    tmp = str(tmp_path)
    sock = os.path.join(tmp, "admin.sock")
    with retry_fleet(tmp) as fleet:
        port = free_port()
        with _haproxy(tmp, fleet, port, stats_socket=sock):
            load, answered = retry_scenario(fleet, f"http://127.0.0.1:{port}")
            backend = haproxy_stat(sock)["dplb_hosts/BACKEND"]
    print(f"haproxy retry rule: routers answered {[dict(a) for a in answered]}; clients: {dict(load.served)} "
          f"served, failed {dict(load.failed)}; retries {backend['wretr']}, redispatches {backend['wredis']}")
    assert_retry_rule(load, answered, [FleetHost(c.host, c.port).name for c, _ in fleet])
    assert int(backend["wretr"]) >= 1, backend
