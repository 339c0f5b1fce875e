"""pick() latency benchmark (issue 2): p50/p99 in µs for 2, 4, 8, 16 workers, every policy.

Usage: python benchmarks/bench_pick.py [--iterations 20000] [--json OUT]
Target (DESIGN / issue 2): dplb policy at 8 workers, p50 ≤ 10 µs and p99 ≤ 50 µs. Snapshots are fresh
(heartbeat "now"), ready, with varied load, so every term is computed; half the picks carry a prefix hash.
The shm read is *not* included (it is measured separately as read_all()).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

from dplb.config import POLICIES, PolicyConfig
from dplb.policy import make_policy
from dplb.shm import Lifecycle, Segment, WorkerState


def _snapshot(n: int, now: int) -> list[WorkerState]:
    return [
        WorkerState(
            k, pid=1000 + k, lifecycle=Lifecycle.READY, heartbeat_mono_ns=now, num_running=k % 5,
            num_waiting=k % 3, kv_cache_usage=0.1 * (k % 7), gpu_memory_total_bytes=80 << 30,
            gpu_memory_used_bytes=(70 + k) << 30, avg_latency_s=0.5 + 0.1 * k,
        )
        for k in range(n)
    ]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=20000)
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    results = []
    print(f"{'policy':<14}{'workers':>8}{'p50 µs':>10}{'p99 µs':>10}")
    for name in POLICIES:
        for n in (2, 4, 8, 16):
            pol = make_policy(PolicyConfig(name=name), n)
            for i in range(60):
                pol.observe_latency(0.5 + i * 0.01)
            now = time.monotonic_ns()
            snap = _snapshot(n, now)
            samples = []
            gc.disable()
            for i in range(args.iterations):
                t0 = time.perf_counter_ns()
                pol.pick(snap, now, prefix_hash=(i * 2654435761) if i & 1 else None)
                samples.append((time.perf_counter_ns() - t0) / 1000)
            gc.enable()
            p50, p99 = _pct(samples, 0.5), _pct(samples, 0.99)
            results.append({"policy": name, "workers": n, "p50_us": p50, "p99_us": p99})
            print(f"{name:<14}{n:>8}{p50:>10.2f}{p99:>10.2f}")
    with tempfile.TemporaryDirectory() as d:
        seg = Segment.create(os.path.join(d, "seg"), 8)
        for k in range(8):
            seg.writer(k).publish_now(_snapshot(8, 0)[k])
        samples = []
        for _ in range(args.iterations):
            t0 = time.perf_counter_ns()
            seg.read_all()
            samples.append((time.perf_counter_ns() - t0) / 1000)
        seg.close()
    print(f"shm read_all() 8 workers: p50 {_pct(samples, 0.5):.2f} µs, p99 {_pct(samples, 0.99):.2f} µs")
    d8 = next(r for r in results if r["policy"] == "dplb" and r["workers"] == 8)
    ok = d8["p50_us"] <= 10 and d8["p99_us"] <= 50
    print(f"target dplb@8 p50≤10µs p99≤50µs: {'PASS' if ok else 'FAIL'} ({d8['p50_us']:.2f} / {d8['p99_us']:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"pick": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
