"""The tests' one fixture module: the builders every test file shares (pytest fixtures proper are in conftest.py).

- Clusters: real worker and router processes on real Unix sockets around a real shm segment (:func:`cluster`),
  the soak script's launcher and load (``scripts/soak.py``: :data:`LaunchedCluster`, :data:`SteadyLoad`, …).
  Everything starts real ``dplb`` processes (``python -m dplb.cli …``) and cleans them up; nothing is mocked.
- Requests: :func:`post` (JSON to the router), :func:`completion` (a request body), :func:`worker_get` (a worker's
  own endpoints over its socket), :func:`router_ready`, :func:`cut_stream` (a client that leaves mid-stream).
- Engine progress: :func:`progress_gaps` (the largest silence of a healthy busy engine).
- Router groups: :func:`group_children` (the pids of a ``--processes N`` group's children).
- Checks and polling: :func:`assert_openai_error`, :func:`assert_no_internals`, :func:`wait_for`, :func:`read`,
  :func:`log_count`.
- A real Prometheus scraping the stack (:class:`Prometheus`).
- System tools: :func:`need` (skip locally without systemd-analyze/prometheus/promtool, fail in CI).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from dplb.state.shm import Lifecycle, Segment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import soak  # noqa: E402

LaunchedCluster = soak.LaunchedCluster
SteadyLoad = soak.SteadyLoad
Result = soak.Result
proc_stats = soak.proc_stats
fd_kinds = soak.fd_kinds
settled_fds = soak.settled_fds
one_request = soak.one_request
IN_CI = os.environ.get("CI") == "true"
#: Debian package that provides each tool (.ci/run installs them).
PACKAGES = {"systemd-analyze": "systemd", "prometheus": "prometheus", "promtool": "prometheus"}
INTERNALS = re.compile(r"Traceback|File \"|/root|/tmp/|/work/|/dev/shm|site-packages|\.py\b")


def _port_pool() -> range:
    """Ports tests may listen on: below the kernel's ephemeral range (``ip_local_port_range``, where every outbound
    connection takes its source port, so a port found free there can be taken by any client before the test's server
    binds it) and below DPLB's own defaults (30000 and up); a slice of it per pytest-xdist worker."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    pool = range(10000, min(low, 30000))
    # Under pytest-xdist each worker process takes its own slice, so two workers never probe the same port.
    count, me = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    if count > 1 and me[2:].isdigit() and len(pool) // count > 1000:
        step = len(pool) // count
        start = pool.start + int(me[2:]) % count * step
        pool = range(start, start + step)
    return pool


_PORTS = _port_pool()
_RNG = random.Random()  # seeded from os.urandom: two test processes do not walk the pool in step


def free_block(n: int = 1) -> int:
    """A port P with P..P+n-1 free on 127.0.0.1 a moment ago, from :func:`_port_pool` (the ephemeral range only when
    that pool is too small). Raises RuntimeError when 500 tries found none."""
    for _ in range(500):
        if len(_PORTS) > 1000:
            p = _RNG.randrange(_PORTS.start, _PORTS.stop - n)
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                p = int(s.getsockname()[1])
            if p + n >= 65535:
                continue
        try:
            for q in range(p, p + n):
                with socket.socket() as t:
                    t.bind(("127.0.0.1", q))
            return p
        except OSError:
            continue
    raise RuntimeError(f"no block of {n} free ports on 127.0.0.1")


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1 (:func:`free_block` of one)."""
    return free_block(1)


def dplb_cmd(*args: str) -> list[str]:
    """The command line of ``dplb ARGS`` with this interpreter."""
    return [sys.executable, "-m", "dplb.cli", *args]


def router_cmd(*args: str) -> list[str]:
    """The command line of ``dplb router ARGS``, with ``--processes 1`` unless ARGS set the count: the router's
    default depends on the host (one process per 8 cores, :func:`dplb.config.default_router_processes`), so a test
    or benchmark that meant one process would run two on a 16-core host."""
    if not any(a in ("--processes", "--router-processes") or a.startswith(("--processes=", "--router-processes="))
               for a in args):
        args = (*args, "--processes", "1")
    return dplb_cmd("router", *args)


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

    def start_worker(self, k: int, *sim_args: str, wait: bool = True, metrics_port: int = 0,
                     env: dict[str, str] | None = None) -> None:
        log = os.path.join(self.run_dir, f"worker-{k}.log")
        self.logs.append(log)
        f = open(log, "ab")  # noqa: SIM115 - the process owns it
        self.workers[k] = subprocess.Popen(
            dplb_cmd("worker", "--worker-id", str(k), "--uds", self.sock(k), "--metrics-port", str(metrics_port),
                     "--drain-timeout", "10", *sim_args),
            env={**self.env(), **(env or {})}, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
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
        """Start the router (stopping the one running first: a test that restarts it with other flags must not
        leave the first behind); wait for ``/ready`` (``/health`` without ``wait_ready``)."""
        self.stop_router()
        self.port = free_port()
        log = os.path.join(self.run_dir, "router.log")
        self.logs.append(log)
        f = open(log, "ab")  # noqa: SIM115
        self.router = subprocess.Popen(
            router_cmd("--host", self.host, "--port", str(self.port), "--run-dir", self.run_dir, *args),
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

    def stop_router(self) -> None:
        """SIGTERM the router if it runs (it drains), SIGKILL after 10 s."""
        r = self.router
        if r is None or r.poll() is not None:
            return
        r.terminate()
        try:
            r.wait(10)
        except subprocess.TimeoutExpired:
            r.kill()
            r.wait(5)

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


@dataclass
class Routers:
    """The same stack twice: a router with the direct relay on, and one with ``--no-direct-relay`` (the ASGI path)."""

    direct: Cluster
    asgi: Cluster


@contextlib.contextmanager
def both_paths(tmp: pytest.TempPathFactory, router_args: list[str],
               worker_args: dict[int, list[str]] | None = None) -> Iterator[Routers]:
    """One sim worker behind a router with ``router_args`` and the relay on, and the same with
    ``--no-direct-relay``: what a test comparing the two paths answer by answer starts."""
    with cluster(str(tmp.mktemp("direct")), 1, worker_args=worker_args, router_args=router_args) as d, \
            cluster(str(tmp.mktemp("asgi")), 1, worker_args=worker_args,
                    router_args=[*router_args, "--no-direct-relay"]) as a:
        yield Routers(d, a)


# ---- requests ----------------------------------------------------------------------------------------------------
@dataclass
class Launch:
    """A ``dplb launch`` a test started with :func:`launched`: its process, base URL, segment path, log file and run
    directory."""

    proc: subprocess.Popen[bytes]
    url: str
    shm: str
    log: Path
    run_dir: str

    def state(self) -> dict[str, Any]:
        """``dplb state --json`` of this stack's segment. Raises json.JSONDecodeError while it has none."""
        out = subprocess.run(dplb_cmd("state", "--json", "--shm-path", self.shm), capture_output=True, text=True,
                             timeout=30).stdout
        return json.loads(out)  # type: ignore[no-any-return]

    def wait_ready(self, timeout_s: float, workers: bool = False, step_s: float = 0.2) -> dict[str, Any] | None:
        """Wait until the router's ``/ready`` is 200 (with ``workers``: and every worker's lifecycle is ready; the
        state is returned then). Fails with the log's tail when the launcher exits or ``timeout_s`` passes."""
        t0 = time.monotonic()
        while True:
            assert self.proc.poll() is None, self.log.read_text()[-4000:]
            assert time.monotonic() - t0 < timeout_s, self.log.read_text()[-4000:]
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    if not workers:
                        return None
                    st = self.state()
                    if all(w["lifecycle"] == "ready" for w in st["workers"]):
                        return st
            except (json.JSONDecodeError, httpx.HTTPError):
                pass
            time.sleep(step_s)


def stop_gracefully(proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """Stop a ``dplb launch`` (or router) still running with SIGTERM and wait for it, SIGKILL after ``timeout_s``.
    SIGTERM, not SIGKILL: a killed launcher's workers get SIGTERM from the kernel (``PDEATHSIG``) and drain on their
    own, still holding their metrics ports while the next test (or the same test's next launch) binds them."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@contextlib.contextmanager
def launched(tmp_path: Path, *args: str, tag: str | None = None, env: dict[str, str] | None = None,
             cleanup: Callable[[], None] | None = None, **popen: Any) -> Iterator[Launch]:
    """Start ``dplb launch ARGS`` on a free port of 127.0.0.1 with its own segment and run directory (named by
    ``tag``), no per-worker metrics ports, and its output in ``tmp_path/launch.log``; on exit stop it if it still
    runs (:func:`stop_gracefully`: its workers gone too), call ``cleanup`` and remove its segment. ``popen``: more ``subprocess.Popen`` arguments."""
    tag = tag or uuid.uuid4().hex[:10]
    shm = f"/dev/shm/dplb_state_test_{tag}"
    port = free_port()
    run_dir = str(tmp_path / f"r-{tag[:8]}")
    log = tmp_path / "launch.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            dplb_cmd("launch", "--port", str(port), "--host", "127.0.0.1", "--shm-path", shm, "--run-dir", run_dir,
                     "--metrics-port-base", "0", *args), env=env, stdout=f, stderr=subprocess.STDOUT, **popen)
    try:
        yield Launch(proc, f"http://127.0.0.1:{port}", shm, log, run_dir)
    finally:
        stop_gracefully(proc)
        if cleanup is not None:
            cleanup()
        if os.path.exists(shm):
            os.unlink(shm)


def post(c: Cluster, path: str, body: bytes | dict[str, Any], headers: dict[str, str | bytes] | None = None,
         timeout: float = 30, sim_debug: bool = False) -> httpx.Response:
    """``POST`` ``body`` (bytes as given, a dict as JSON) to the router of ``c`` with Content-Type JSON;
    ``sim_debug`` asks the sim worker for ``x-sim-body-sha256`` (the hash of the body it received)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    h: dict[str, str | bytes] = {"content-type": "application/json"}
    if sim_debug:
        h["x-sim-debug"] = "body-sha256"
    return httpx.post(c.url + path, content=data, headers={**h, **(headers or {})}, timeout=timeout)


def completion(i: int, max_tokens: int = 8, stream: bool | None = None, prompt: str = "") -> dict[str, Any]:
    """Request ``i``'s completion body: streamed every other request unless ``stream`` says, usage included."""
    s = (i % 2 == 0) if stream is None else stream
    b: dict[str, Any] = {"model": "dplb-sim", "prompt": prompt or f"request {i}", "max_tokens": max_tokens}
    if s:
        b.update(stream=True, stream_options={"include_usage": True})
    return b


def worker_get(sock: str, path: str) -> httpx.Response:
    """``GET path`` on a worker's Unix socket (the sim engine's own endpoints: ``/debug/requests``, ``/metrics``)."""
    with httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://worker", timeout=10) as c:
        return c.get(path)


def cut_stream(c: Cluster, max_tokens: int, prompt: str = "cut") -> None:
    """Start a streamed completion of ``max_tokens`` through the router of ``c``, read its first bytes, then close
    the connection (the client leaves mid-stream)."""
    with httpx.Client(timeout=30) as client, client.stream(
            "POST", c.url + "/v1/completions",
            json={"model": "dplb-sim", "prompt": prompt, "max_tokens": max_tokens, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        next(r.iter_bytes())


def sim_aborts(sock: str) -> float:
    """``vllm:request_success_total{finished_reason="abort"}`` of the sim engine on ``sock``."""
    for line in worker_get(sock, "/metrics").text.splitlines():
        if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line:
            return float(line.rpartition(" ")[2])
    return 0.0


def router_ready(url: str) -> bool:
    """True when the router at ``url`` answers ``/ready`` with 200 (False when it does not answer)."""
    try:
        return httpx.get(url + "/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def progress_gaps(seg: Segment, workers: list[int], stop: threading.Event, gaps: list[float]) -> None:
    """Until ``stop`` is set, append to ``gaps`` the seconds between two moves of each of ``workers``' engine
    progress (``progress_mono_ns`` of its slot) after this call started: how long a healthy busy engine goes without
    publishing progress (what ``--stall-after`` must stay well above). Run it on a thread."""
    last = {k: seg.read(k).progress_mono_ns for k in workers}
    counting = dict.fromkeys(workers, False)  # the first move after the start ends an idle stretch: not counted
    while not stop.wait(0.02):
        for k in workers:
            w = seg.read(k)
            t = w.progress_mono_ns
            if not w.torn and t != last[k]:
                if counting[k]:
                    gaps.append((t - last[k]) / 1e9)
                counting[k], last[k] = True, t


# ---- checks and polling ------------------------------------------------------------------------------------------
def assert_openai_error(r: httpx.Response, status: int, code: str) -> None:
    """``r`` is an OpenAI-shaped error with ``status`` and reason ``code`` (and a message and a type)."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and err["type"]


def assert_no_internals(text: str) -> None:
    """No stack trace, source file or internal path in a response body (AssertionError naming what leaked)."""
    m = INTERNALS.search(text)
    assert m is None, f"internal detail {m.group(0)!r} in {text[:300]!r}"


def group_children(c: Cluster) -> dict[int, int]:
    """Router process index → pid of the children of ``c``'s router group (``--processes N``)."""
    assert c.router is not None
    out = subprocess.run(["pgrep", "-P", str(c.router.pid), "-a"], capture_output=True, text=True).stdout
    kids = {}
    for line in out.splitlines():
        pid, _, cmd = line.partition(" ")
        if "--process-index" in cmd:
            kids[int(cmd.rsplit(" ", 1)[1])] = int(pid)
    return kids


def interrupt(proc: subprocess.Popen[Any], wait_s: float) -> None:
    """Stop ``proc`` as an operator's Ctrl-C does (SIGINT), waiting up to ``wait_s`` seconds for it to exit, then
    SIGKILL (a test's teardown: what it left behind is the leak check's to find)."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def wait_for(pred: Callable[[], Any], timeout_s: float, what: str, step_s: float = 0.02) -> Any:
    """Poll ``pred()`` until it returns something truthy (returned); AssertionError naming ``what`` on timeout."""
    t0 = time.monotonic()
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(step_s)


def read(path: str) -> str:
    """The text of ``path`` (undecodable bytes replaced)."""
    with open(path, errors="replace") as f:
        return f.read()


def log_count(text: str, needle: str) -> int:
    """Lines of ``text`` containing ``needle``."""
    return sum(1 for line in text.splitlines() if needle in line)


# ---- Prometheus -------------------------------------------------------------------------------------------------
class Prometheus:
    """A real Prometheus on loopback scraping ``targets`` ({job: [host:port]}, each target labelled ``labels``,
    then relabelled by ``relabel_configs``) every second; with ``file_sd`` (a glob of file_sd JSON files, e.g. what
    ``dplb launch`` writes) also the shipped deploy/prometheus/dplb-scrape.yml scrape config, its files pointed
    there. ``port``: where it listens (default: a free one)."""

    def __init__(self, binary: str, tmp: Path, targets: dict[str, list[str]], rule_file: Path | None = None,
                 labels: dict[str, str] | None = None, file_sd: str | None = None,
                 relabel_configs: list[dict[str, Any]] | None = None, port: int = 0) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg: dict[str, Any] = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": t, "labels": labels or {}}],
                                "relabel_configs": relabel_configs or []} for job, t in targets.items()],
        }
        if file_sd is not None:
            shipped = yaml.safe_load((Path(ROOT) / "deploy" / "prometheus" / "dplb-scrape.yml").read_text())
            for sc in shipped["scrape_configs"]:
                sc["scrape_interval"] = "1s"
                for fsd in sc["file_sd_configs"]:
                    fsd["files"] = [file_sd]
                cfg["scrape_configs"].append(sc)
        if rule_file is not None:
            cfg["rule_files"] = [str(rule_file)]
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "prometheus.yml").write_text(json.dumps(cfg))  # JSON is YAML
        self.log_path = tmp / "prometheus.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - the process owns it
        self.proc = subprocess.Popen([binary, f"--config.file={tmp / 'prometheus.yml'}",
                                      f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{self.port}"],
                                     stdout=self._log, stderr=subprocess.STDOUT)

    def api(self, path: str, **params: str) -> Any:
        r = httpx.get(self.url + path, params=params, timeout=10).json()
        assert r["status"] == "success", r
        return r["data"]

    def query(self, q: str) -> list[dict[str, Any]]:
        return self.api("/api/v1/query", query=q)["result"]  # type: ignore[no-any-return]

    def alerts(self) -> list[dict[str, Any]]:
        return self.api("/api/v1/alerts")["alerts"]  # type: ignore[no-any-return]

    def firing(self) -> dict[str, list[dict[str, str]]]:
        """alertname -> label sets of its firing alerts."""
        out: dict[str, list[dict[str, str]]] = {}
        for a in self.alerts():
            if a["state"] == "firing":
                out.setdefault(a["labels"]["alertname"], []).append(a["labels"])
        return out

    def wait_up(self, n: int, timeout: float = 60) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError, AssertionError, ValueError):
                res = self.query("up")
                if len(res) == n and all(r["value"][1] == "1" for r in res):
                    return
            time.sleep(0.3)
        raise AssertionError(f"targets not up after {timeout}s: {self.query('up')}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self._log.close()


# ---- system tools ------------------------------------------------------------------------------------------------
def need(tool: str) -> str:
    """Path of ``tool``; skip the test locally without it, fail it in CI (CI=true), where .ci/run installs it."""
    path = shutil.which(tool)
    if path is None:
        pkg = PACKAGES.get(tool, tool)
        if IN_CI:
            pytest.fail(f"{tool} must be installed in CI (.ci/run: apt-get install {pkg})")
        pytest.skip(f"{tool} not installed (apt-get install {pkg}); CI runs this")
    return path
