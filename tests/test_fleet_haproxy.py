"""A real HAProxy (Debian's package) in front of real DPLB hosts on loopback addresses, fed by DPLB's agent-check:
weights follow load, a drained host (SIGTERM) loses its traffic with zero failed requests, a killed host leaves
rotation. Skips when haproxy is not installed (CI installs it: .ci/run)."""

from __future__ import annotations

import collections
import concurrent.futures
import os
import signal
import time

import pytest
from cluster import free_port
from fleet_support import HAPROXY, Load, balancer, hosts

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
        import httpx

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
