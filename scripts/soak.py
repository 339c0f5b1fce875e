#!/usr/bin/env python3
"""Soak test: a 4-worker sim cluster under ``dplb launch``, a steady request rate for a long time, and the router's
memory, file descriptors, errors and in-flight gauges checked at the end.

Usage::

    python scripts/soak.py                    # 10 minutes at 20 req/s against 4 sim workers
    python scripts/soak.py --duration-s 20    # a short smoke run

Requests are completions (half of them streamed) over ``--prompts`` distinct prompt prefixes (200; 0 makes every
prompt unique, which also fills the router's bounded prefix-affinity table). Every ``--sample-s`` seconds the
router's RSS (``VmRSS``) and open descriptors (``/proc/<pid>/fd``) are printed. The figures compare two quiet
points: after the warm-up (``--warmup-s``, default 10 % of the run, 5..60 s; load stopped, in-flight 0) and after
the run. Descriptors are split into Unix sockets (the router's pool of worker connections, bounded by design) and
everything else (client sockets, files, pipes), whose growth is what a leak looks like. Exit status 1 when RSS grew
≥ ``--max-rss-growth-pct`` (5 %), any request failed, non-pool descriptors grew (beyond ``--fd-slack``, 0), or a
router in-flight gauge or a worker's published queue is not 0 after the run; 0 otherwise.

The helpers here (:class:`LaunchedCluster`, :class:`SteadyLoad`, :func:`proc_stats`) are also used by the test
suite's hardening tests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from dplb.state.shm import Lifecycle, Segment  # noqa: E402


def proc_stats(pid: int) -> tuple[int, int]:
    """(resident set size in bytes, open file descriptors) of process ``pid`` from ``/proc``.
    Raises ``OSError`` when the process is gone."""
    with open(f"/proc/{pid}/status") as f:
        rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return rss_kb * 1024, len(os.listdir(f"/proc/{pid}/fd"))


def fd_kinds(pid: int) -> dict[str, int]:
    """Open descriptors of ``pid`` by kind: ``unix`` (Unix sockets: the router's pooled worker connections, bounded
    by the pool), ``other`` (TCP sockets, files, pipes, event fds: a leak shows here). Raises ``OSError``."""
    unix: set[str] = set()
    with open(f"/proc/{pid}/net/unix") as f:
        next(f)
        for line in f:
            parts = line.split()
            if len(parts) >= 7:
                unix.add(parts[6])
    out = {"unix": 0, "other": 0}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            out["unix" if target.startswith("socket:[") and target[8:-1] in unix else "other"] += 1
    return out


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        with contextlib.suppress(OSError), open(f"/proc/{d}/stat") as f:
            # Field 4 is the parent pid; the command name (field 2) may contain spaces, so split after ")".
            if int(f.read().rpartition(")")[2].split()[1]) == pid:
                out.append(int(d))
    return out


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


@dataclass
class LaunchedCluster:
    """``dplb launch`` of ``num_workers`` sim workers on a private port, run dir and segment.

    ``launch_args``: extra ``dplb launch`` flags (router flags, ``--sim-*`` engine knobs). Use as a context manager
    or call :meth:`start` / :meth:`stop`. Times are seconds."""

    num_workers: int = 4
    launch_args: list[str] = field(default_factory=list)
    state_interval_ms: int = 200
    workdir: str = ""
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    segment: Segment | None = None

    def __post_init__(self) -> None:
        tag = uuid.uuid4().hex[:10]
        self.workdir = self.workdir or tempfile.mkdtemp(prefix="dplb-soak-")
        self.run_dir = os.path.join(self.workdir, f"run-{tag}")
        self.shm_path = f"/dev/shm/dplb_state_soak_{tag}"
        self.port = self.port or free_port()
        self.log_path = os.path.join(self.workdir, f"launch-{tag}.log")

    @property
    def url(self) -> str:
        """The router's base URL."""
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 90.0) -> None:
        """Start the launcher and wait until the router is ready and every worker is ready.
        Raises ``RuntimeError`` (with the log tail) if the launcher exits or ``TimeoutError``."""
        cmd = [sys.executable, "-m", "dplb.cli", "launch", "--num-workers", str(self.num_workers), "--host",
               "127.0.0.1", "--port", str(self.port), "--shm-path", self.shm_path, "--run-dir", self.run_dir,
               "--metrics-port-base", "0", "--state-interval-ms", str(self.state_interval_ms), *self.launch_args]
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.wait(lambda: self.ready() and self.all_workers_ready(), timeout_s, "the router and every worker ready")

    def wait(self, pred: Any, timeout_s: float, what: str) -> None:
        """Poll ``pred()`` every 20 ms until true; raise with the log tail on timeout or launcher exit."""
        t0 = time.monotonic()
        while not pred():
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"dplb launch exited ({self.proc.returncode}) waiting for {what}:\n{self.tail()}")
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"{what}: not after {timeout_s:g} s\n{self.tail()}")
            time.sleep(0.02)

    def ready(self) -> bool:
        """True when the router's ``/ready`` answers 200."""
        try:
            return httpx.get(self.url + "/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def seg(self) -> Segment | None:
        """The segment, attached read-only on first use (None until the launcher created it)."""
        if self.segment is None and os.path.exists(self.shm_path):
            with contextlib.suppress(Exception):
                self.segment = Segment.attach(self.shm_path, writable=False)
        return self.segment

    def all_workers_ready(self) -> bool:
        """True when every slot says ready with a fresh heartbeat."""
        seg = self.seg()
        if seg is None:
            return False
        return all(w.lifecycle == Lifecycle.READY and not w.is_stale(seg.state_interval_ms) for w in seg.read_all())

    def worker_pid(self, k: int) -> int:
        """The pid worker ``k`` published (0 when none)."""
        seg = self.seg()
        return seg.read(k).pid if seg is not None else 0

    def router_pid(self) -> int:
        """The router child's pid (0 when it is not running)."""
        if self.proc is None:
            return 0
        for pid in _children(self.proc.pid):
            if "router" in _cmdline(pid):
                return pid
        return 0

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """One sample from the router's ``/metrics`` (None when absent)."""
        text = httpx.get(self.url + "/metrics", timeout=5).text
        want = ",".join(f'{k}="{v}"' for k, v in (labels or {}).items())
        for line in text.splitlines():
            head, _, value = line.rpartition(" ")
            if not line.startswith("#") and head in (name, f"{name}{{{want}}}"):
                return float(value)
        return None

    def inflight(self) -> list[float]:
        """``dplb_worker_requests_inflight`` per worker (the router's own counts)."""
        return [self.metric("dplb_worker_requests_inflight", {"worker": str(k)}) or 0.0
                for k in range(self.num_workers)]

    def published_queues(self) -> list[int]:
        """num_running + num_waiting each worker published in shm."""
        seg = self.seg()
        return [w.num_running + w.num_waiting for w in seg.read_all()] if seg is not None else []

    def tail(self, n: int = 40) -> str:
        """The last ``n`` lines of the launcher's and the router's logs."""
        out = []
        for p in (self.log_path, os.path.join(self.run_dir, "router.log")):
            with contextlib.suppress(OSError), open(p, errors="replace") as f:
                out.append(f"--- {p}\n" + "".join(f.readlines()[-n:]))
        return "\n".join(out)

    def router_log(self) -> str:
        """The router's whole log."""
        with open(os.path.join(self.run_dir, "router.log"), errors="replace") as f:
            return f.read()

    def stop(self) -> int | None:
        """SIGINT the launcher (it drains and cleans up); SIGKILL after 60 s. Returns its exit code."""
        rc = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                rc = self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                rc = self.proc.wait(10)
        elif self.proc is not None:
            rc = self.proc.returncode
        if self.segment is not None:
            self.segment.close()
            self.segment = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.shm_path)
        return rc

    def __enter__(self) -> LaunchedCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class Result:
    """One request of a :class:`SteadyLoad`: monotonic start/end (s), HTTP status (0 = none), the serving worker
    (``X-SG-Worker-ID``, None when absent), ``outcome`` (``ok``, ``http_error``, ``stream_error`` (error event or
    no ``[DONE]``), ``short`` (fewer tokens than asked), ``conn_error``), completion tokens, detail (error body or
    exception), whether a stream ended with ``[DONE]`` and the code of its SSE error event ("" if none)."""

    t0: float
    t1: float = 0.0
    status: int = 0
    worker: int | None = None
    outcome: str = ""
    tokens: int = 0
    detail: str = ""
    done: bool = False
    error_event: str = ""


async def one_request(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Result:
    """Send one completion request (streamed when ``body["stream"]``) and classify it (see :class:`Result`)."""
    res = Result(time.monotonic())
    want = int(body.get("max_tokens", 0))
    try:
        if body.get("stream"):
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                res.status = r.status_code
                res.worker = int(r.headers["x-sg-worker-id"]) if "x-sg-worker-id" in r.headers else None
                if r.status_code != 200:  # an error answer (the router's 504 before any byte): keep its body
                    res.detail = (await r.aread()).decode("utf-8", "replace")[:300]
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        res.done = True
                        continue
                    obj = json.loads(data)
                    if "error" in obj:
                        res.error_event = str(obj["error"].get("code"))
                    elif obj.get("usage"):
                        res.tokens = int(obj["usage"]["completion_tokens"])
                res.outcome = ("http_error" if r.status_code != 200 else
                               "stream_error" if res.error_event or not res.done else
                               "short" if want and res.tokens != want else "ok")
        else:
            r = await client.post(url + "/v1/completions", json=body)
            res.status = r.status_code
            res.worker = int(r.headers["x-sg-worker-id"]) if "x-sg-worker-id" in r.headers else None
            if r.status_code == 200:
                res.tokens = int(r.json()["usage"]["completion_tokens"])
                res.outcome = "short" if want and res.tokens != want else "ok"
            else:
                res.outcome = "http_error"
                res.detail = r.text[:300]
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, ValueError) as e:
        # A stream that started (200) and then broke off is a stream error; anything else never got an answer.
        res.outcome = "stream_error" if body.get("stream") and res.status == 200 else "conn_error"
        res.detail = f"{type(e).__name__}: {e}"[:300]
    res.t1 = time.monotonic()
    return res


class SteadyLoad:
    """Open-loop load: ``rate`` requests per second (fixed spacing) against ``url`` from a background thread, until
    :meth:`stop`. ``body(i)`` builds request ``i``'s JSON body. Results are in :attr:`results`."""

    def __init__(self, url: str, rate: float, body: Any, timeout_s: float = 60.0) -> None:
        self.url, self.rate, self.body, self.timeout_s = url, rate, body, timeout_s
        self.results: list[Result] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="steady-load", daemon=True)

    def start(self) -> SteadyLoad:
        """Begin sending."""
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 120.0) -> list[Result]:
        """Stop sending, wait for the requests in flight (up to ``timeout_s``), return every result."""
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"requests still in flight {timeout_s:g} s after the load stopped")
        return self.results

    async def _main(self) -> None:
        limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
        async with httpx.AsyncClient(timeout=self.timeout_s, limits=limits) as client:
            tasks: set[asyncio.Task[None]] = set()

            async def run(i: int) -> None:
                self.results.append(await one_request(client, self.url, self.body(i)))

            t0 = time.monotonic()
            i = 0
            while not self._stop.is_set():
                t = asyncio.create_task(run(i))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
                i += 1
                await asyncio.sleep(max(0.0, t0 + i / self.rate - time.monotonic()))
            if tasks:
                await asyncio.gather(*tasks)


def _pct(a: float, b: float) -> float:
    return 100.0 * (b - a) / a if a else 0.0


def _quiesce(lc: LaunchedCluster, timeout_s: float = 15.0) -> list[float]:
    """Wait until the router's in-flight gauges are all 0 (or ``timeout_s``); return them."""
    deadline = time.monotonic() + timeout_s
    while any(lc.inflight()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return lc.inflight()


def settled_fds(pid: int, timeout_s: float = 5.0, every_s: float = 0.25) -> dict[str, int]:
    """:func:`fd_kinds` once it has stopped changing: three equal counts ``every_s`` apart (or ``timeout_s``).

    The client's closed connections (the load's and the last ``/metrics`` read's) leave the router's table only when
    its loop has handled the close, which a loaded box can delay past any fixed sleep; a leak does not settle back.
    """
    deadline = time.monotonic() + timeout_s
    seen = [fd_kinds(pid)]
    while time.monotonic() < deadline and not (len(seen) >= 3 and seen[-1] == seen[-2] == seen[-3]):
        time.sleep(every_s)
        seen.append(fd_kinds(pid))
    return seen[-1]


def _drive(lc: LaunchedCluster, rpid: int, rate: float, seconds: float, sample_s: float, body: Any, t0: float,
           samples: list[tuple[float, int, int]]) -> list[Result]:
    load = SteadyLoad(lc.url, rate, body).start()
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        rss, fds = proc_stats(rpid)
        now = time.monotonic() - t0
        samples.append((now, rss, fds))
        print(f"  t={now:6.1f}s rss={rss / 2**20:7.2f} MiB fds={fds:4d} requests={len(load.results)}", flush=True)
        time.sleep(min(sample_s, left))
    return load.stop()


def main(argv: list[str] | None = None) -> int:
    """Run the soak (see the module docstring). Returns the exit status."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--duration-s", type=float, default=600.0, help="how long to drive load after the warm-up (600)")
    ap.add_argument("--rate", type=float, default=20.0, help="requests per second (default 20)")
    ap.add_argument("--workers", type=int, default=4, help="sim workers (default 4)")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens per request (default 16)")
    ap.add_argument("--stream-share", type=float, default=0.5, help="fraction of streamed requests (default 0.5)")
    ap.add_argument("--sample-s", type=float, default=5.0, help="seconds between RSS/fd samples (default 5)")
    ap.add_argument("--warmup-s", type=float, default=None,
                    help="load before the baseline is taken (default 10%% of the duration, 5..60 s)")
    ap.add_argument("--max-rss-growth-pct", type=float, default=5.0, help="allowed RSS growth after warm-up (5)")
    ap.add_argument("--fd-slack", type=int, default=0, help="allowed non-pool descriptor growth (default 0)")
    ap.add_argument("--prompts", type=int, default=200,
                    help="distinct prompt prefixes (default 200; 0 = every prompt unique, which also fills the "
                    "router's bounded prefix-affinity table: 16384 entries, about 2.8 MiB)")
    ap.add_argument("--launch-arg", action="append", default=[], help="extra `dplb launch` argument (repeatable)")
    ap.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    a = ap.parse_args(argv)
    if a.duration_s <= 0 or a.rate <= 0 or a.workers < 1 or a.sample_s <= 0 or not 0 <= a.stream_share <= 1 \
            or a.prompts < 0:
        ap.error("--duration-s, --rate, --sample-s must be > 0, --workers ≥ 1, --stream-share within 0..1, "
                 "--prompts ≥ 0")
    warmup = a.warmup_s if a.warmup_s is not None else min(60.0, max(5.0, 0.1 * a.duration_s))
    every = max(1, round(1 / a.stream_share)) if a.stream_share > 0 else 0

    def body(i: int) -> dict[str, Any]:
        key = i % a.prompts if a.prompts > 0 else i
        b: dict[str, Any] = {"model": "dplb-sim", "prompt": f"soak prompt {key} " + "lorem ipsum " * (i % 7),
                             "max_tokens": a.max_tokens}
        if every and i % every == 0:
            b.update(stream=True, stream_options={"include_usage": True})
        return b

    samples: list[tuple[float, int, int]] = []
    with LaunchedCluster(a.workers, list(a.launch_arg)) as lc:
        rpid = lc.router_pid()
        print(f"soak: {a.workers} sim workers, router pid {rpid} on {lc.url}; warm-up {warmup:g} s, then "
              f"{a.rate:g} req/s for {a.duration_s:g} s", flush=True)
        t0 = time.monotonic()
        results = _drive(lc, rpid, a.rate, warmup, a.sample_s, body, t0, samples)
        _quiesce(lc)
        rss0, _ = proc_stats(rpid)
        kinds0 = settled_fds(rpid)
        print(f"soak: baseline after warm-up: rss={rss0 / 2**20:.2f} MiB fds={kinds0}", flush=True)
        results += _drive(lc, rpid, a.rate, a.duration_s, a.sample_s, body, t0, samples)
        inflight = _quiesce(lc)
        queues = lc.published_queues()
        rss1, _ = proc_stats(rpid)
        kinds1 = settled_fds(rpid)
    errors = [r for r in results if r.outcome != "ok"]
    lat = sorted(r.t1 - r.t0 for r in results if r.outcome == "ok")
    fig = {
        "requests": len(results), "errors": len(errors), "duration_s": a.duration_s, "rate": a.rate,
        "rss_warm_mib": round(rss0 / 2**20, 2), "rss_end_mib": round(rss1 / 2**20, 2),
        "rss_max_mib": round(max(s[1] for s in samples) / 2**20, 2), "rss_growth_pct": round(_pct(rss0, rss1), 2),
        "fds_warm": kinds0, "fds_end": kinds1, "fd_growth": kinds1["other"] - kinds0["other"],
        "inflight_after": inflight, "published_queues_after": queues,
        "p50_s": round(lat[len(lat) // 2], 4) if lat else None,
        "p99_s": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 4) if lat else None,
    }
    print(f"soak: {fig['requests']} requests, {fig['errors']} errors; router RSS {fig['rss_warm_mib']} MiB after "
          f"warm-up -> {fig['rss_end_mib']} MiB at the end ({fig['rss_growth_pct']:+.2f} %, peak "
          f"{fig['rss_max_mib']} MiB); descriptors {kinds0} -> {kinds1} (growth {fig['fd_growth']:+d} outside the "
          f"worker connection pool); in-flight after the run {inflight}; published queues {queues}; latency p50 "
          f"{fig['p50_s']} s p99 {fig['p99_s']} s")
    for r in errors[:10]:
        print(f"  error: {r.outcome} status={r.status} worker={r.worker} {r.detail}")
    if a.json:
        print(json.dumps(fig))
    failed = []
    if fig["rss_growth_pct"] >= a.max_rss_growth_pct:
        failed.append(f"RSS grew {fig['rss_growth_pct']} % (limit {a.max_rss_growth_pct} %)")
    if errors:
        failed.append(f"{len(errors)} request(s) failed")
    if fig["fd_growth"] > a.fd_slack:
        failed.append(f"descriptors grew by {fig['fd_growth']}")
    if any(inflight) or any(queues):
        failed.append(f"in-flight not back to 0: router {inflight}, workers {queues}")
    print("soak: FAIL: " + "; ".join(failed) if failed else "soak: PASS")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
