"""Test helpers for fleets: DPLB hosts on loopback addresses, a real front balancer, closed-loop load."""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx
from cluster import Cluster, cluster, dplb_cmd, free_port, router_ready
from proc_tags import kill_tagged, new_tag

from dplb.ops.fleet import FleetHost


def tool(name: str) -> str | None:
    """``name`` on PATH, else next to this interpreter (a virtualenv's bin: the test extra's envoy, kubectl)."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    return shutil.which(name) or (here if os.access(here, os.X_OK) else None)


ENVOY = tool("envoy")
HAPROXY = shutil.which("haproxy") or ("/usr/sbin/haproxy" if os.path.exists("/usr/sbin/haproxy") else None)
# A sim worker whose batch fills at a modest concurrency, so load differences between hosts show.
WORKER = ["--sim-max-num-seqs", "4", "--sim-chunk-delay-s", "0.01"]


@contextlib.contextmanager
def hosts(tmp_path: str, speeds: list[float], router_args: list[str] | None = None, workers: int = 2,
          worker_extra: dict[int, list[str]] | None = None) -> Iterator[list[tuple[Cluster, int]]]:
    """One DPLB host (``workers`` sim workers + router on 127.0.0.<2+i>) per entry of ``speeds`` (sim speed
    factor), each with an agent port; ``worker_extra[i]``: more arguments for host i's workers. Yields (cluster,
    agent port) pairs."""
    with contextlib.ExitStack() as stack:
        out = []
        for i, speed in enumerate(speeds):
            agent = free_port()
            args = ["--agent-port", str(agent), "--processes", "1", *(router_args or [])]
            wargs = {k: [*WORKER, "--sim-speed", str(speed), *(worker_extra or {}).get(i, [])] for k in range(workers)}
            c = stack.enter_context(cluster(os.path.join(tmp_path, f"host{i}"), workers, worker_args=wargs,
                                            router_args=args, host=f"127.0.0.{2 + i}"))
            out.append((c, agent))
        yield out


def haproxy_stat(sock_path: str) -> dict[str, dict[str, str]]:
    """HAProxy's ``show stat`` over its admin socket: one row per proxy/server, keyed ``"<proxy>/<server>"`` (the
    CSV columns: ``status``, ``agent_status``, ``last_agt``, ``wretr``, ``wredis``, …)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(sock_path)
        s.sendall(b"show stat\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    lines = data.decode().strip().splitlines()
    cols = lines[0].lstrip("# ").split(",")
    rows = [dict(zip(cols, ln.split(","), strict=False)) for ln in lines[1:] if ln]
    return {f"{r['pxname']}/{r['svname']}": r for r in rows}


def rejected(c: Cluster, reasons: tuple[str, ...]) -> int:
    """How many requests ``c``'s router answered itself with one of ``reasons`` (dplb_requests_rejected_total)."""
    return int(sum(c.metric("dplb_requests_rejected_total", {"reason": r}) or 0 for r in reasons))


def agent_answer(host: str, port: int) -> str:
    """One agent-check exchange, as HAProxy does it: connect, read the line, close."""
    with socket.create_connection((host, port), timeout=5) as s:
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(256)
            if not chunk:
                break
            data += chunk
    return data.decode()


@dataclass
class Launched:
    """One ``dplb launch`` host: its address (router and agent port) and the launcher process."""

    host: FleetHost
    proc: subprocess.Popen[bytes]
    log_path: str

    @property
    def url(self) -> str:
        return f"http://{self.host.host}:{self.host.port}"


@contextlib.contextmanager
def launched_hosts(tmp_path: str, n: int, launch_args: list[str], workers: int = 1) -> Iterator[list[Launched]]:
    """``n`` real ``dplb launch`` hosts (sim engine, ``workers`` each) on 127.0.0.<2+i> with an agent port, plus
    ``launch_args``; yields once every router is ready; stops what is left (the test's processes only)."""
    tag = new_tag()
    out: list[Launched] = []
    try:
        for i in range(n):
            h = FleetHost(f"127.0.0.{2 + i}", free_port(), free_port())
            log_path = os.path.join(tmp_path, f"launch{i}.log")
            with open(log_path, "wb") as log:
                p = subprocess.Popen(dplb_cmd(
                    "launch", "--num-workers", str(workers), "--host", h.host, "--port", str(h.port),
                    "--agent-port", str(h.agent_port), "--router-processes", "1", "--metrics-port-base", "0",
                    "--shm-path", f"/dev/shm/dplb_state_test_{tag}_{i}", "--run-dir",
                    os.path.join(tmp_path, f"run{i}"), *WORKER, *launch_args), stdout=log, stderr=subprocess.STDOUT)
            out.append(Launched(h, p, log_path))
        for lh in out:
            deadline = time.monotonic() + 90
            while not router_ready(lh.url):
                if lh.proc.poll() is not None or time.monotonic() > deadline:
                    with open(lh.log_path, errors="replace") as f:
                        raise RuntimeError(f"dplb launch on {lh.url} did not get ready:\n{f.read()[-3000:]}")
                time.sleep(0.2)
        yield out
    finally:
        for lh in out:
            if lh.proc.poll() is None:
                lh.proc.send_signal(signal.SIGINT)
        for lh in out:
            try:
                lh.proc.wait(30)
            except subprocess.TimeoutExpired:
                lh.proc.kill()
                lh.proc.wait(5)
        kill_tagged(tag)
        for i in range(n):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/dplb_state_test_{tag}_{i}")


@dataclass
class Load:
    """Closed-loop clients against ``url`` until stopped; counts answers by the ``by`` response header."""

    url: str
    clients: int
    by: str = "x-dplb-host"
    max_tokens: int = 16
    headers_of: object = None  # callable(client index, turn) -> extra headers, or None
    served: collections.Counter[str] = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)
    failed: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)  # (by, error code)
    latencies: list[float] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _run(self, i: int) -> None:
        turn = 0
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                extra = self.headers_of(i, turn) if callable(self.headers_of) else {}
                body = {"model": "dplb-sim", "max_tokens": self.max_tokens,
                        "messages": [{"role": "user", "content": f"client {i} turn {turn}"}]}
                t0 = time.perf_counter()
                key = ("?", "?")
                try:
                    r = client.post(self.url + "/v1/chat/completions", json=body, headers=extra)
                    ok = r.status_code == 200
                    why = f"HTTP {r.status_code}: {r.text[:200]}"
                    if not ok:
                        with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
                            key = (r.headers.get(self.by, "?"), str(r.json()["error"]["code"]))
                except httpx.HTTPError as e:
                    ok, why = False, f"{type(e).__name__}: {e}"
                with self._lock:
                    if ok:
                        self.served[r.headers.get(self.by, "?")] += 1
                        self.latencies.append(time.perf_counter() - t0)
                    else:
                        self.failures.append(why)
                        self.failed[key] += 1
                turn += 1

    def start(self) -> Load:
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(self.clients)]
        for t in self._threads:
            t.start()
        return self

    def snapshot(self) -> collections.Counter[str]:
        with self._lock:
            return collections.Counter(self.served)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)


@contextlib.contextmanager
def balancer(cmd: list[str], url: str, log_path: str, ready_path: str = "/health") -> Iterator[subprocess.Popen[bytes]]:
    """Run a front balancer ``cmd`` (foreground) until ``url + ready_path`` answers 200 through it."""
    f = open(log_path, "ab")  # noqa: SIM115 - the process owns it
    p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            if p.poll() is not None:
                with open(log_path, errors="replace") as log:
                    raise RuntimeError(f"{cmd[0]} exited {p.returncode}:\n{log.read()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + ready_path, timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{cmd[0]} did not route {ready_path} in 30 s")
            time.sleep(0.1)
        yield p
    finally:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
        f.close()


#: Host 0 of :func:`retry_fleet`: its engine stalls for good after this many completed requests.
STALL_AFTER_REQUESTS = 20
STALLED = "worker_stalled"
#: What a DPLB router answers 503 for (the request reached no engine: a balancer re-sends it to another host), and
#: what it answers 502/504 for (the request reached an engine: passed to the client).
RESENT = ("no_routable_worker", "no_workers_registered", "all_workers_over_queue_cap", "worker_unreachable")
PASSED = (STALLED, "worker_failed", "worker_timeout")


@contextlib.contextmanager
def retry_fleet(tmp_path: str) -> Iterator[list[tuple[Cluster, int]]]:
    """Three one-worker hosts for the retry rule (README, "Running a fleet"), every router with ``--stall-after 1``:
    host 0's engine stalls for good after :data:`STALL_AFTER_REQUESTS` completed requests (its requests in flight
    then fail ``504 worker_stalled``: they reached an engine; later ones get ``503 no_routable_worker``), host 1
    stays healthy, and :func:`retry_scenario` kills host 2's worker (the requests it had fail ``502 worker_failed``,
    later ones get ``no_routable_worker``) while load runs through the balancer."""
    stall = ["--sim-stall-after", str(STALL_AFTER_REQUESTS), "--sim-stall-for-s", "120"]
    with hosts(tmp_path, [1.0, 1.0, 1.0], router_args=["--stall-after", "1"], workers=1,
               worker_extra={0: stall}) as fleet:
        yield fleet


def _until(cond: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def retry_scenario(fleet: list[tuple[Cluster, int]], url: str) -> tuple[Load, list[collections.Counter[str]]]:
    """Closed-loop load through the balancer at ``url``: host 0 stalls, and once its ``/ready`` says so and the
    balancer's checks (2 × 1 s) took it out, host 2's worker is killed, and again; returns the load and, per host,
    what its router answered itself (reason → count). One failing host at a time: a retry always finds a healthy
    one (HAProxy's redispatch avoids only the last server tried)."""
    stalled, _, killed = (c for c, _ in fleet)

    def not_ready(c: Cluster) -> bool:
        return httpx.get(c.url + "/ready", timeout=5).status_code != 200

    load = Load(url, clients=6, max_tokens=8).start()
    try:
        _until(lambda: rejected(stalled, (STALLED,)) >= 1 and not_ready(stalled), "host 0 did not stall")
        time.sleep(3)
        killed.kill_worker(0)
        _until(lambda: not_ready(killed), "host 2 stayed ready")
        time.sleep(3)
    finally:
        load.stop()
    counts = [collections.Counter({r: rejected(c, (r,)) for r in (*PASSED, *RESENT)}) for c, _ in fleet]
    return load, [+c for c in counts]


def assert_retry_rule(load: Load, answered: list[collections.Counter[str]], names: list[str]) -> None:
    """The retry rule, seen through a balancer (``names``: the hosts as its ``x-dplb-host`` names them): both kinds
    of answer happened; no client saw a 503 (each was re-sent to another host), and the answers to requests that
    reached an engine reached the clients one for one (none re-sent)."""
    assert sum(a[r] for a in answered for r in RESENT) >= 1 and answered[0][STALLED] >= 1, answered
    passed = {(names[i], r): n for i, a in enumerate(answered) for r, n in a.items() if r in PASSED}
    assert dict(load.failed) == passed, (load.failed, passed, load.failures[:3])
