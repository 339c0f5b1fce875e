"""Test harness: real worker and router processes on real Unix sockets around a real shm segment.

Everything here starts real ``dplb`` processes (``python -m dplb.cli …``) and cleans them up; nothing is mocked.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx

from dplb.state.shm import Lifecycle, Segment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dplb_cmd(*args: str) -> list[str]:
    """The command line of ``dplb ARGS`` with this interpreter."""
    return [sys.executable, "-m", "dplb.cli", *args]


@dataclass
class Cluster:
    """A running set of workers + a router. ``url`` is the router's base URL."""

    run_dir: str
    shm_path: str
    num_workers: int
    port: int = 0
    workers: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    router: subprocess.Popen[bytes] | None = None
    logs: list[str] = field(default_factory=list)
    segment: Segment | None = None
    host: str = "127.0.0.1"  # the router's address (fleet tests give each host its own loopback address)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def sock(self, k: int) -> str:
        return os.path.join(self.run_dir, f"worker-{k}.sock")

    def env(self) -> dict[str, str]:
        e = dict(os.environ)
        e["DPLB_SHM_PATH"] = self.shm_path
        e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
        return e

    def start_worker(self, k: int, *sim_args: str, wait: bool = True, metrics_port: int = 0) -> None:
        log = os.path.join(self.run_dir, f"worker-{k}.log")
        self.logs.append(log)
        f = open(log, "ab")  # noqa: SIM115 - the process owns it
        self.workers[k] = subprocess.Popen(
            dplb_cmd("worker", "--worker-id", str(k), "--uds", self.sock(k), "--metrics-port", str(metrics_port),
                     "--drain-timeout", "10", *sim_args),
            env=self.env(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
        )
        if wait:
            self.wait_ready(k)

    def wait_ready(self, k: int, timeout: float = 30) -> None:
        assert self.segment is not None
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            s = self.segment.read(k)
            if s.lifecycle == Lifecycle.READY and not s.is_stale(self.segment.state_interval_ms):
                return
            p = self.workers.get(k)
            if p is not None and p.poll() is not None:
                raise RuntimeError(f"worker {k} exited with {p.returncode}:\n{self.tail()}")
            time.sleep(0.05)
        raise TimeoutError(f"worker {k} not ready after {timeout}s:\n{self.tail()}")

    def start_router(self, *args: str, wait_ready: bool = True) -> None:
        self.port = free_port()
        log = os.path.join(self.run_dir, "router.log")
        self.logs.append(log)
        f = open(log, "ab")  # noqa: SIM115
        self.router = subprocess.Popen(
            dplb_cmd("router", "--host", self.host, "--port", str(self.port), "--run-dir", self.run_dir, *args),
            env=self.env(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
        )
        t0 = time.monotonic()
        path = "/ready" if wait_ready else "/health"
        while time.monotonic() - t0 < 30:
            if self.router.poll() is not None:
                raise RuntimeError(f"router exited with {self.router.returncode}:\n{self.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + path, timeout=1).status_code == 200:
                    return
            time.sleep(0.05)
        raise TimeoutError(f"router not {path} after 30 s:\n{self.tail()}")

    def router_log(self) -> str:
        with open(os.path.join(self.run_dir, "router.log"), errors="replace") as f:
            return f.read()

    def tail(self, n: int = 40) -> str:
        out = []
        for log in dict.fromkeys(self.logs):
            with contextlib.suppress(OSError), open(log, errors="replace") as f:
                out.append(f"--- {log}\n" + "".join(f.readlines()[-n:]))
        return "\n".join(out)

    def kill_worker(self, k: int, sig: int = signal.SIGKILL) -> None:
        p = self.workers[k]
        os.kill(p.pid, sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            p.wait(30)

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """One sample's value from the router's /metrics (None if absent)."""
        text = httpx.get(self.url + "/metrics", timeout=5).text
        want = ",".join(f'{k}="{v}"' for k, v in (labels or {}).items())
        for line in text.splitlines():
            if line.startswith("#"):
                continue
            head, _, value = line.rpartition(" ")
            if head == name or head == f"{name}{{{want}}}":
                return float(value)
        return None

    def stop(self) -> None:
        procs = [p for p in [self.router, *self.workers.values()] if p is not None]
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
                    os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        if self.segment is not None:
            self.segment.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.shm_path)


@contextlib.contextmanager
def cluster(tmp_path: str, num_workers: int, worker_args: dict[int, list[str]] | None = None,
            router_args: list[str] | None = None, start_workers: bool = True,
            wait_router_ready: bool = True, state_interval_ms: int = 200,
            host: str = "127.0.0.1") -> Iterator[Cluster]:
    """Segment + ``num_workers`` sim workers (``worker_args[k]`` extra args) + router; all stopped afterwards.
    ``state_interval_ms``: the segment's publish interval (workers and router take it from the segment)."""
    shm = f"/dev/shm/dplb_state_test_{uuid.uuid4().hex[:10]}"
    run_dir = os.path.join(tmp_path, "run")
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    c = Cluster(run_dir=run_dir, shm_path=shm, num_workers=num_workers, host=host)
    c.segment = Segment.create(shm, num_workers, state_interval_ms=state_interval_ms, model="dplb-sim")
    try:
        if start_workers:
            for k in range(num_workers):
                c.start_worker(k, *(worker_args or {}).get(k, []), wait=False)
            for k in range(num_workers):
                c.wait_ready(k)
        c.start_router(*(router_args or []), wait_ready=wait_router_ready and start_workers)
        yield c
    finally:
        c.stop()
