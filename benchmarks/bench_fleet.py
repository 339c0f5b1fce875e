"""Fleet benchmark: `dplb bench run` against a front balancer over N sim hosts (one at half speed), the same seeded
workload for every balancer configuration; prints P99 E2E per configuration and the ratio to its round robin.

    python benchmarks/bench_fleet.py                       # 3 hosts x 2 workers, 600 prompts per configuration
    python benchmarks/bench_fleet.py --num-prompts 120     # a smoke run

Hosts are `dplb launch` processes on 127.0.0.2, 127.0.0.3, … (sim engine, --agent-port, --orca asked); the
balancers are the real haproxy and envoy binaries with the configs `dplb fleet … -config` writes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dplb.ops.fleet import FleetHost, envoy_config, haproxy_config  # noqa: E402

PY = sys.executable
SIM = ["--sim-max-num-seqs", "4", "--sim-chunk-delay-s", "0.01"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as r:
            if r.status == 200:
                return
        time.sleep(0.2)
    raise TimeoutError(url)


@contextlib.contextmanager
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    out: list[subprocess.Popen[bytes]] = []
    try:
        yield out
    finally:
        for p in reversed(out):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in out:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def start_hosts(tmp: str, speeds: list[float], workers: int, run: list[subprocess.Popen[bytes]]) -> list[FleetHost]:
    hosts = []
    env = {**os.environ, "PYTHONPATH": ROOT}
    for i, speed in enumerate(speeds):
        h = FleetHost(f"127.0.0.{2 + i}", free_port(), free_port())
        d = os.path.join(tmp, f"host{i}")
        os.makedirs(d)
        cmd = [PY, "-m", "dplb.cli", "launch", "--host", h.host, "--port", str(h.port), "--num-workers",
               str(workers), "--run-dir", d, "--shm-path", f"/dev/shm/dplb_state_fleetbench_{os.getpid()}_{i}",
               "--metrics-port-base", "0", "--agent-port", str(h.agent_port), "--router-processes", "1",
               *SIM, "--sim-speed", str(speed)]
        log = open(os.path.join(d, "launch.log"), "ab")  # noqa: SIM115 - the process owns it
        run.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        hosts.append(h)
    for h in hosts:
        wait_http(f"http://{h.host}:{h.port}/ready", 120)
    return hosts


def bench(url: str, args: argparse.Namespace, out: str) -> dict[str, object]:
    cmd = [PY, "-m", "dplb.cli", "bench", "run", "--base-url", url, "--num-prompts", str(args.num_prompts),
           "--request-rate", str(args.request_rate), "--seed", "7", "--output-len", "24", "--range-ratio", "0.5",
           "--no-progress", "--output", out]
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.DEVNULL)
    with open(out) as f:
        summary: dict[str, object] = json.load(f)["summary"]
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=600)
    p.add_argument("--request-rate", type=float, default=30.0)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    haproxy = shutil.which("haproxy") or "/usr/sbin/haproxy"
    envoy = shutil.which("envoy") or os.path.join(os.path.dirname(PY), "envoy")
    rows = []
    with tempfile.TemporaryDirectory() as tmp, procs() as run:
        hosts = start_hosts(tmp, [1.0, 1.0, 0.5], args.workers, run)
        configs = [("haproxy round robin", "haproxy", {"agent": False}), ("haproxy + DPLB agent", "haproxy", {}),
                   ("envoy round robin", "envoy", {"orca": False}), ("envoy + DPLB ORCA", "envoy", {"orca": True})]
        for label, kind, kw in configs:
            port = free_port()
            path = os.path.join(tmp, f"{kind}-{port}." + ("cfg" if kind == "haproxy" else "yaml"))
            with open(path, "w") as f:
                if kind == "haproxy":
                    text = haproxy_config(hosts, f"127.0.0.1:{port}")
                    if kw.get("agent") is False:
                        text = text.replace(" agent-check", "")
                    f.write(text)
                    cmd = [haproxy, "-db", "-f", path]
                else:
                    f.write(envoy_config(hosts, f"127.0.0.1:{port}", orca=bool(kw["orca"]), admin_port=free_port()))
                    cmd = [envoy, "-c", path, "--concurrency", "1", "--base-id", str(port), "-l", "error"]
            with procs() as lb:
                log = open(path + ".log", "ab")  # noqa: SIM115 - the process owns it
                lb.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
                try:
                    wait_http(f"http://127.0.0.1:{port}/ready", 30)
                except TimeoutError:
                    with open(path + ".log", errors="replace") as f:
                        sys.exit(f"{label}: the balancer does not route /ready:\n{f.read()[-2000:]}")
                time.sleep(3)  # health checks, agent/ORCA weights settle
                s = bench(f"http://127.0.0.1:{port}", args, os.path.join(tmp, f"{port}.json"))
            e2e = s["e2e_ms"]
            assert isinstance(e2e, dict)
            rows.append((label, float(e2e["p99"]), int(s["failed"])))  # type: ignore[call-overload]
            print(f"{label:24s} P99 E2E {e2e['p99']:8.1f} ms  failed {s['failed']}", flush=True)
    base = {"haproxy": rows[0][1], "envoy": rows[2][1]}
    print("\n| configuration | P99 E2E ms | x its round robin | failed |\n|---|---|---|---|")
    for label, p99, failed in rows:
        print(f"| {label} | {p99:.0f} | {p99 / base[label.split()[0]]:.2f} | {failed} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
