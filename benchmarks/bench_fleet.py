"""Fleet benchmark: `dplb bench run` against a front balancer over N sim hosts (one at half speed), the same seeded
workload for every balancer configuration; prints P99 E2E per configuration and the ratio to its round robin, and
the multi-turn prefix-cache hit rate with and without HAProxy's conversation hash.

    python benchmarks/bench_fleet.py                       # 3 hosts x 2 workers, 600 prompts per configuration
    python benchmarks/bench_fleet.py --num-prompts 120     # a smoke run
    python benchmarks/bench_fleet.py --repeat 2            # every configuration twice; the table shows medians

Hosts are `dplb launch` processes on 127.0.0.2, 127.0.0.3, … (sim engine, --agent-port, ORCA when asked), started
afresh for every configuration (so no run inherits another's prefix caches); the balancers are the real haproxy
and envoy binaries with the configs `dplb fleet … -config` writes.

- Single-turn rows: Poisson arrivals, 128 ± 64 prompt words, 24 ± 12 output tokens, seed 7.
- Multi-turn rows: conversations of 5 turns (each turn sends the whole history; ``dplb bench run --conversations``)
  with ``x-session-id: conversation-<n>``; HAProxy with agent weights, without and with ``balance
  hdr(x-session-id)`` + ``hash-balance-factor``. The hit rate is the engines' own: prefix-cache hit tokens ÷
  prompt tokens, summed over every sim worker of every host (``vllm:prefix_cache_hits/queries`` read over each
  worker's Unix socket before and after the run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dplb.bench.compare import _uds_get  # noqa: E402
from dplb.ops.fleet import FleetHost, envoy_config, haproxy_config  # noqa: E402

PY = sys.executable
SIM = ["--sim-max-num-seqs", "4", "--sim-chunk-delay-s", "0.01"]
SESSION = "x-session-id"
SINGLE = ["--input-len", "128", "--output-len", "24", "--range-ratio", "0.5"]
MULTI = ["--turns", "5", "--think-time", "0.5", "--input-len", "60", "--output-len", "24", "--range-ratio", "0.5",
         "--prefix-len", "20", "--session-header", SESSION]


@dataclass(frozen=True)
class Config:
    """One row: the balancer, its options, the workload kind."""

    label: str
    kind: str  # haproxy | envoy
    agent: bool = True  # haproxy: agent-check weights
    orca: bool = False  # envoy: ORCA client-side weighted round robin
    affinity: bool = False  # haproxy: conversation hash
    algorithm: str = "roundrobin"  # haproxy without the hash: roundrobin | leastconn
    multi_turn: bool = False
    base: str = ""  # the label this row's ratio is to


CONFIGS = [
    Config("HAProxy round robin", "haproxy", agent=False),
    Config("HAProxy + DPLB agent-check weights", "haproxy", base="HAProxy round robin"),
    Config("HAProxy leastconn", "haproxy", agent=False, algorithm="leastconn", base="HAProxy round robin"),
    Config("HAProxy leastconn + DPLB agent-check weights", "haproxy", algorithm="leastconn",
           base="HAProxy round robin"),
    Config("Envoy round robin", "envoy"),
    Config("Envoy CSWRR + DPLB ORCA", "envoy", orca=True, base="Envoy round robin"),
    Config("multi-turn: HAProxy + agent, no hash", "haproxy", multi_turn=True),
    Config("multi-turn: HAProxy + agent + hdr(x-session-id) hash", "haproxy", affinity=True, multi_turn=True,
           base="multi-turn: HAProxy + agent, no hash"),
]


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
                p.wait(5)


def start_hosts(tmp: str, speeds: list[float], workers: int, run: list[subprocess.Popen[bytes]]
                ) -> list[tuple[FleetHost, str]]:
    """``dplb launch`` per speed on 127.0.0.<2+i>; returns (host, run dir) once every host is ready."""
    hosts = []
    env = {**os.environ, "PYTHONPATH": ROOT}
    for i, speed in enumerate(speeds):
        h = FleetHost(f"127.0.0.{2 + i}", free_port(), free_port())
        d = tempfile.mkdtemp(prefix=f"host{i}-", dir=tmp)
        cmd = [PY, "-m", "dplb.cli", "launch", "--host", h.host, "--port", str(h.port), "--num-workers",
               str(workers), "--run-dir", d, "--shm-path", f"/dev/shm/dplb_state_fleetbench_{os.getpid()}_{i}",
               "--metrics-port-base", "0", "--agent-port", str(h.agent_port), "--router-processes", "1",
               *SIM, "--sim-speed", str(speed)]
        log = open(os.path.join(d, "launch.log"), "ab")  # noqa: SIM115 - the process owns it
        run.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        hosts.append((h, d))
    for h, _ in hosts:
        wait_http(f"http://{h.host}:{h.port}/ready", 120)
    return hosts


def cache_tokens(hosts: list[tuple[FleetHost, str]], workers: int) -> tuple[float, float]:
    """(hit, query) prompt tokens summed over every worker's ``vllm:prefix_cache_*`` counters."""
    hits = queries = 0.0
    for _, d in hosts:
        for k in range(workers):
            for line in _uds_get(os.path.join(d, f"worker-{k}.sock"), "/metrics").splitlines():
                if line.startswith("vllm:prefix_cache_hits_total"):
                    hits += float(line.rsplit(" ", 1)[1])
                elif line.startswith("vllm:prefix_cache_queries_total"):
                    queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def bench(url: str, args: argparse.Namespace, out: str, multi_turn: bool) -> dict[str, object]:
    shape = ["--conversations", str(max(1, args.num_prompts // 5)), *MULTI] if multi_turn else \
        ["--num-prompts", str(args.num_prompts), *SINGLE]
    cmd = [PY, "-m", "dplb.cli", "bench", "run", "--base-url", url, "--request-rate", str(args.request_rate),
           "--seed", "7", *shape, "--no-progress", "--output", out]
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.DEVNULL)
    with open(out) as f:
        summary: dict[str, object] = json.load(f)["summary"]
    return summary


def balancer_cmd(c: Config, hosts: list[FleetHost], port: int, path: str) -> list[str]:
    """Write ``c``'s balancer config to ``path``; the command that runs it in the foreground."""
    with open(path, "w") as f:
        if c.kind == "haproxy":
            text = haproxy_config(hosts, f"127.0.0.1:{port}", affinity_header=SESSION if c.affinity else None,
                                  algorithm=c.algorithm)
            f.write(text if c.agent else text.replace(" agent-check", ""))
            return [shutil.which("haproxy") or "/usr/sbin/haproxy", "-db", "-f", path]
        f.write(envoy_config(hosts, f"127.0.0.1:{port}", orca=c.orca, admin_port=free_port()))
    envoy = shutil.which("envoy") or os.path.join(os.path.dirname(PY), "envoy")
    return [envoy, "-c", path, "--concurrency", "1", "--base-id", str(port), "-l", "error"]


def run_one(c: Config, args: argparse.Namespace, tmp: str) -> dict[str, float]:
    """Fresh hosts, the balancer, one benchmark run: P99 E2E ms, failed requests, prefix-cache hit rate."""
    with procs() as run:
        fleet = start_hosts(tmp, [1.0] * (args.hosts - 1) + [0.5], args.workers, run)
        hosts = [h for h, _ in fleet]
        port = free_port()
        path = os.path.join(tmp, f"{c.kind}-{port}." + ("cfg" if c.kind == "haproxy" else "yaml"))
        cmd = balancer_cmd(c, hosts, port, path)
        with procs() as lb:
            log = open(path + ".log", "ab")  # noqa: SIM115 - the process owns it
            lb.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            try:
                wait_http(f"http://127.0.0.1:{port}/ready", 30)
            except TimeoutError:
                with open(path + ".log", errors="replace") as f:
                    sys.exit(f"{c.label}: the balancer does not route /ready:\n{f.read()[-2000:]}")
            time.sleep(3)  # health checks, agent/ORCA weights settle
            h0, q0 = cache_tokens(fleet, args.workers)
            s = bench(f"http://127.0.0.1:{port}", args, os.path.join(tmp, f"{port}.json"), c.multi_turn)
            h1, q1 = cache_tokens(fleet, args.workers)
    e2e = s["e2e_ms"]
    assert isinstance(e2e, dict)
    return {"p99": float(e2e["p99"]), "failed": float(s["failed"]),  # type: ignore[arg-type]
            "hit": (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=600, help="requests per configuration (multi-turn: /5 chats)")
    p.add_argument("--request-rate", type=float, default=16.0, help="Poisson requests/s")
    p.add_argument("--workers", type=int, default=2, help="sim workers per host")
    p.add_argument("--hosts", type=int, default=3, help="hosts (the last at half speed)")
    p.add_argument("--repeat", type=int, default=1, help="runs per configuration; the table shows medians")
    p.add_argument("--only", default="", help="comma-separated substrings: run only the matching configurations")
    p.add_argument("--json", metavar="FILE", help="write every run's figures here")
    args = p.parse_args()
    wanted = [c for c in CONFIGS if not args.only or any(s.strip() in c.label for s in args.only.split(","))]
    runs: dict[str, list[dict[str, float]]] = {c.label: [] for c in wanted}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeat):
            for c in wanted:
                fig = run_one(c, args, tmp)
                runs[c.label].append(fig)
                print(f"[run {r + 1}] {c.label:52s} P99 E2E {fig['p99']:8.1f} ms  failed {fig['failed']:.0f}  "
                      f"prefix hit {fig['hit']:.3f}", flush=True)
    med = {k: {f: statistics.median(x[f] for x in v) for f in ("p99", "failed", "hit")} for k, v in runs.items()}
    print(f"\nmedians over {args.repeat} run(s), {args.num_prompts} prompts per configuration, "
          f"{args.request_rate:g} req/s, {args.hosts} hosts x {args.workers} workers (the last host at half speed)")
    print("\n| configuration | P99 E2E ms | runs | x its baseline | prefix-cache hit rate | x its baseline | failed |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for c in wanted:
        m, b = med[c.label], med.get(c.base)
        each = " / ".join(f"{x['p99']:.0f}" for x in runs[c.label])
        ratio = f"{m['p99'] / b['p99']:.2f}" if b else "1.00"
        hit = f"{m['hit']:.3f}" if c.multi_turn else "–"
        hit_ratio = (f"{m['hit'] / b['hit']:.2f}" if b and b["hit"] else "1.00") if c.multi_turn else "–"
        print(f"| {c.label} | {m['p99']:.0f} | {each} | {ratio} | {hit} | {hit_ratio} | {m['failed']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs, "medians": med}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
