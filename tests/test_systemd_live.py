"""DPLB's systemd units under a REAL running systemd (tests/systemd_ns.py: PID 1 of a private PID + mount
namespace), installed the way the README's systemd section says (``dplb launch --emit-systemd /etc/dplb``, the
units and drop-ins copied to ``/etc/systemd/system``, ``systemctl enable --now …``) for a 2-worker sim stack:

- start order: the router starts only after every worker's start job ended, i.e. after its ``READY=1`` (``Type=notify``,
  sent after the warm-up);
- ``systemctl stop dplb.target`` under load: the router stops first (reports drain for ``--drain-notice``, drains)
  and a worker gets SIGTERM only once the router has exited: every request sent before the notice ended got 200;
- ``systemctl stop dplb.target`` returns while the router still drains; ``systemctl stop dplb.target
  'dplb-*.service'`` waits for the whole stack; a reboot (``shutdown.target``) stops in the same order;
- the stop timeouts ``--emit-systemd`` derived from the drain flags are what systemd applies; ``systemctl reload``
  makes every router process reload the ``--tenants`` file in ``/etc/dplb``;
- with one router process and with a group of two (``--router-processes 2``: READY=1, SIGHUP and drain go through
  the group's parent, ``KillMode=mixed``);
- a worker or the router SIGKILLed is restarted (``Restart=on-failure``); a worker frozen (SIGSTOP) stops pinging
  the watchdog and is killed and restarted.

systemd's monotonic unit timestamps and the test's ``time.monotonic()`` are the same clock (CLOCK_MONOTONIC), so
client-side times compare with them directly. Skipped, with the reason, where a private systemd cannot boot (not
root, no systemd, no overlayfs or writable cgroups); CI runs it as root."""

from __future__ import annotations

import os
import random
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from cluster import ROOT, wait_for
from systemd_ns import PrivateSystemd, cannot_boot

from dplb.ops.systemd_units import stop_timeouts
from dplb.tenants import hash_key

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240),
              pytest.mark.skipif(cannot_boot() is not None, reason=f"private systemd cannot boot: {cannot_boot()}")]

DRAIN_NOTICE_S = 2.0
DRAIN_TIMEOUT_S = 5.0
WARMUP_S = 1.5  # --sim-warmup-delay-s: a worker's READY=1 comes at least this long after its start
WORKERS = ("dplb-worker@0.service", "dplb-worker@1.service")
ROUTER = "dplb-router.service"
US = 1e-6  # systemd's timestamps are in microseconds


def _port() -> int:
    """A free TCP port on 127.0.0.1 in 32000..32699 (above the suite's pool, below the ephemeral range)."""
    for _ in range(200):
        p = random.randrange(32000, 32700)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                continue
            return p
    raise RuntimeError("no free port in 32000..32699")


@dataclass
class Stack:
    """The private systemd running the installed units, and the router's URL."""

    sd: PrivateSystemd
    url: str

    def mono(self, unit: str, prop: str) -> float:
        """A ``…TimestampMonotonic`` property of ``unit``, in seconds of CLOCK_MONOTONIC."""
        return int(self.sd.show(unit, prop)[prop]) * US


TENANTS = "/etc/dplb/tenants.toml"  # where the README says a --tenants file goes (the router unit sees /etc)


def _write_tenants(sd: PrivateSystemd, key: str) -> None:
    """Write the namespace's tenants file: one tenant, ``key`` its only API key."""
    sd.run(["sh", "-c", f"printf '[tenants.team]\\napi_key_sha256 = [\"{hash_key(key)}\"]\\n' > {TENANTS}"])


HOST_PATHS = ("/etc/dplb", "/etc/systemd/system/dplb.target", "/etc/systemd/system/dplb-router.service",
              "/etc/systemd/system/dplb-worker@.service", "/opt/dplb", "/run/dplb", "/dev/shm/dplb_state_systemd")


@pytest.fixture
def start_stack(tmp_path: Path) -> Iterator[Callable[..., Stack]]:
    """Start a 2-worker sim stack installed as the README says (``router_processes``: the router group's size),
    under a private systemd; at the end the namespace is killed, and nothing of it is left on the host."""
    before = {p: os.path.lexists(p) for p in HOST_PATHS}
    sd = PrivateSystemd(tmp_path, ROOT, keep=("dplb.target", "dplb-segment.service", ROUTER, *WORKERS))

    def start(router_processes: int = 1, tenant_key: str = "") -> Stack:
        sd.start()
        port = _port()
        env = {**os.environ, "PYTHONPATH": ROOT}
        tenants = []
        if tenant_key:
            sd.run(["mkdir", "-p", "/etc/dplb"])
            _write_tenants(sd, tenant_key)
            tenants = ["--tenants", TENANTS]
        sd.run([sys.executable, "-m", "dplb.cli", "launch", "--num-workers", "2", "--host", "127.0.0.1", "--port",
                str(port), "--metrics-port-base", "0", "--drain-notice", f"{DRAIN_NOTICE_S:g}", "--drain-timeout",
                f"{DRAIN_TIMEOUT_S:g}", "--router-processes", str(router_processes), *tenants, "--sim-warmup-delay-s",
                f"{WARMUP_S:g}", "--emit-systemd", "/etc/dplb"], env=env)
        units = os.path.join(ROOT, "deploy", "systemd")
        sd.run(["sh", "-c", f"cp {units}/*.service {units}/*.target /etc/systemd/system/ && "
                            "cp -r /etc/dplb/*.service.d /etc/systemd/system/"])
        sd.ctl("daemon-reload")
        sd.ctl("enable", "--now", "dplb.target", "dplb-segment.service", *WORKERS, ROUTER)
        # systemd logs what it does not understand in a unit or drop-in as "<path>:<line>: …".
        assert "/etc/systemd/system/dplb" not in sd.log(), sd.log()
        return Stack(sd, f"http://127.0.0.1:{port}")

    try:
        yield start
    finally:
        sd.stop()
    assert {p: os.path.lexists(p) for p in HOST_PATHS} == before
    assert not any(os.path.exists(cg) for cg in sd.cgroups), sd.cgroups


class Load:
    """``n`` client threads sending completions to the router in a loop; ``results``: (sent, done, status or the
    exception's class name), times on CLOCK_MONOTONIC."""

    def __init__(self, url: str, key: str, n: int = 4) -> None:
        self.url, self.key, self.stop = url, key, threading.Event()
        self.results: list[tuple[float, float, int | str]] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        """Client ``i``: one request after the other on a keep-alive connection until :attr:`stop`."""
        with httpx.Client(timeout=30, headers={"authorization": f"Bearer {self.key}"}) as c:
            while not self.stop.is_set():
                t0 = time.monotonic()
                try:
                    status: int | str = c.post(self.url + "/v1/completions", json={
                        "model": "dplb-sim", "prompt": f"client {i} at {t0}", "max_tokens": 16}).status_code
                except httpx.HTTPError as e:
                    status = type(e).__name__
                    time.sleep(0.05)
                self.results.append((t0, time.monotonic(), status))

    def finish(self) -> list[tuple[float, float, int | str]]:
        """Stop the clients (each after its request in flight) and return :attr:`results`."""
        self.stop.set()
        for t in self.threads:
            t.join(40)
        return self.results


@pytest.mark.parametrize("router_processes", [1, 2])
def test_router_starts_after_ready_workers_reloads_on_sighup_and_stops_first_under_load(
        start_stack: Callable[..., Stack], router_processes: int) -> None:
    """With one router process and with a group of two (its parent sends READY=1 once both listen, forwards
    SIGHUP to both, and drains both on SIGTERM: ``KillMode=mixed``)."""
    stack = start_stack(router_processes, tenant_key="old-key")
    sd = stack.sd
    # Start: each worker's READY=1 (its start job's end) came after its warm-up and before the router was started.
    router_start = stack.mono(ROUTER, "ExecMainStartTimestampMonotonic")
    for w in WORKERS:
        ready, started = stack.mono(w, "ActiveEnterTimestampMonotonic"), stack.mono(w, "ExecMainStartTimestampMonotonic")
        assert ready - started >= WARMUP_S, (w, ready - started)
        assert ready <= router_start, f"{ROUTER} started {ready - router_start:.3f} s before {w} was ready"
    # The stop timeouts systemd applies are the ones derived from the flags (the template's drop-in reaches both
    # instances).
    router_stop_s, worker_stop_s = stop_timeouts(DRAIN_NOTICE_S, DRAIN_TIMEOUT_S)
    assert sd.show(ROUTER, "TimeoutStopUSec")["TimeoutStopUSec"] == f"{router_stop_s}s"
    for w in WORKERS:
        assert sd.show(w, "TimeoutStopUSec")["TimeoutStopUSec"] == f"{worker_stop_s}s"
    assert [_status(stack, k) for k in ("old-key", "new-key")] == [200, 401]
    # systemctl reload: ExecReload sends SIGHUP, every router process reloads the tenants file (the group's parent
    # passes it on), and the new key is let in, the old one no longer.
    _write_tenants(sd, "new-key")
    sd.ctl("reload", ROUTER)
    wait_for(lambda: sd.unit_log(ROUTER).count(f"tenants file {TENANTS} reloaded") == router_processes, 10,
             "the reload log line of every router process")
    assert {(_status(stack, "old-key"), _status(stack, "new-key")) for _ in range(8)} == {(401, 200)}
    assert sd.show(ROUTER, "ActiveState", "NRestarts") == {"ActiveState": "active", "NRestarts": "0"}
    # The router (ProtectSystem=strict) wrote its last good copy of the file into its RuntimeDirectory.
    assert os.path.exists(sd.path("/run/dplb/tenants.last-good.toml"))
    # Stop under load: the router goes first and drains; the workers get SIGTERM only after it exited.
    load = Load(stack.url, "new-key")
    time.sleep(1.0)
    t_stop = time.monotonic()
    sd.ctl("stop", "dplb.target", timeout=120)
    # systemctl waits for the target's own stop job only: the target is ordered after its units (systemd adds
    # After= for what a target wants), so it stops before them and the command returns with the router still
    # draining. Naming the units too (the README's command) waits for their stop jobs.
    assert sd.show(ROUTER, "ActiveState")["ActiveState"] == "deactivating"
    sd.ctl("stop", "dplb.target", "dplb-*.service", timeout=120)
    assert sd.show(ROUTER, "ActiveState")["ActiveState"] == "inactive"
    results = load.finish()
    router_sigterm = _stopped_router_first(stack)
    assert t_stop <= router_sigterm
    # Clients: no answer but 200; every request sent before the drain notice ended was answered 200, also those
    # sent after the stop began (the workers were still serving); what failed was sent after the router closed.
    statuses = {s for _, _, s in results if isinstance(s, int)}
    assert statuses == {200}, statuses
    during = [s for t0, _, s in results if router_sigterm <= t0 < router_sigterm + DRAIN_NOTICE_S - 0.2]
    assert during and set(during) == {200}, during
    failed = [(t0 - router_sigterm, s) for t0, _, s in results if s != 200]
    assert all(dt >= DRAIN_NOTICE_S - 0.2 for dt, _ in failed), failed
    log = sd.unit_log(ROUTER)
    assert log.count("host draining (stopping): reporting drain") == router_processes, log[-3000:]


def _stopped_router_first(stack: Stack) -> float:
    """Assert how the stack stopped: the router first, after its drain notice, each worker only once the router had
    exited, the segment last, every unit cleanly. Returns when the router got SIGTERM (CLOCK_MONOTONIC, s)."""
    router_sigterm = stack.mono(ROUTER, "ActiveExitTimestampMonotonic")
    router_gone = stack.mono(ROUTER, "InactiveEnterTimestampMonotonic")
    assert router_gone - router_sigterm >= DRAIN_NOTICE_S  # it reported drain and kept serving for the notice
    for w in WORKERS:
        assert stack.mono(w, "ActiveExitTimestampMonotonic") >= router_gone, f"{w} got SIGTERM before the router exited"
    segment_gone = stack.mono("dplb-segment.service", "ActiveExitTimestampMonotonic")
    assert segment_gone >= max(stack.mono(w, "InactiveEnterTimestampMonotonic") for w in WORKERS)
    for u in (*WORKERS, ROUTER, "dplb-segment.service"):
        assert stack.sd.show(u, "ActiveState", "Result") == {"ActiveState": "inactive", "Result": "success"}, u
    return router_sigterm


def _status(stack: Stack, key: str = "") -> int:
    """The status of one small completion through the router, with ``key`` as the API key (none when empty); a new
    connection each time (in a router group, any process may take it)."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(stack.url + "/v1/completions", json={"model": "dplb-sim", "prompt": "hi", "max_tokens": 4},
                      headers=headers, timeout=30).status_code


def _restarted(stack: Stack, unit: str, old_pid: str, restarts: int) -> bool:
    """``unit`` is active again, with a main process other than ``old_pid``, after ``restarts`` automatic restarts."""
    s = stack.sd.show(unit, "ActiveState", "MainPID", "NRestarts")
    return s["ActiveState"] == "active" and s["MainPID"] not in ("0", old_pid) and s["NRestarts"] == str(restarts)


def test_sigkilled_worker_is_restarted_and_a_frozen_one_by_the_watchdog(start_stack: Callable[..., Stack]) -> None:
    """Also: the router group's parent SIGKILLed (its children go with the unit's cgroup before the restart: the new
    group binds the port again), and a reboot's stop order."""
    stack = start_stack(router_processes=2)
    sd, w0, w1 = stack.sd, *WORKERS
    pid = sd.show(w0, "MainPID")["MainPID"]
    t_kill = time.monotonic()
    sd.run(["kill", "-KILL", pid])
    wait_for(lambda: _restarted(stack, w0, pid, 1), 60, f"{w0} restarted after SIGKILL", step_s=0.2)
    assert stack.mono(w0, "ExecMainStartTimestampMonotonic") - t_kill >= 5.0 - 0.1  # RestartSec=5
    assert sd.show(w0, "Result")["Result"] == "success"  # the restart's own result; the kill was counted above
    wait_for(lambda: sd.unit_log(w0).count("registered. State") >= 2, 30, f"{w0} registered again")
    assert _status(stack) == 200
    pid = sd.show(ROUTER, "MainPID")["MainPID"]
    sd.run(["kill", "-KILL", pid])
    wait_for(lambda: _restarted(stack, ROUTER, pid, 1), 60, f"{ROUTER} restarted after SIGKILL", step_s=0.2)
    assert _status(stack) == 200
    # The watchdog: a shorter WatchdogSec (and abort timeout) than the shipped 30 s, same mechanism.
    sd.run(["sh", "-c", "mkdir -p /etc/systemd/system/dplb-worker@1.service.d && printf "
                        "'[Service]\\nWatchdogSec=4\\nTimeoutAbortSec=2\\n' > "
                        "/etc/systemd/system/dplb-worker@1.service.d/watchdog-test.conf"])
    sd.ctl("daemon-reload")
    sd.ctl("restart", w1)
    assert sd.show(w1, "WatchdogUSec")["WatchdogUSec"] == "4s"
    pid = sd.show(w1, "MainPID")["MainPID"]
    time.sleep(9)  # over two watchdog periods: the worker's WATCHDOG=1 pings (every 2 s) keep it alive
    assert sd.show(w1, "MainPID", "ActiveState", "NRestarts") == {"MainPID": pid, "ActiveState": "active",
                                                                   "NRestarts": "0"}
    t_stop = time.monotonic()
    sd.run(["kill", "-STOP", pid])
    wait_for(lambda: _restarted(stack, w1, pid, 1), 60, f"{w1} killed by the watchdog and restarted", step_s=0.2)
    assert stack.mono(w1, "ExecMainStartTimestampMonotonic") - t_stop >= 4.0
    assert "watchdog timeout" in sd.log().lower(), sd.log()[-3000:]
    # A reboot: every unit conflicts with shutdown.target (DefaultDependencies), whose start job waits for their
    # stop jobs; the order is the same as for `systemctl stop dplb.target`.
    sd.ctl("start", "shutdown.target", timeout=120)
    _stopped_router_first(stack)
