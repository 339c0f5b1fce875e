"""Instructions per 1-token request of the router process, under cachegrind (deterministic, unlike CPU time).

Method
- 2 fast sim workers (``bench_capacity.FAST_SIM``) around a real shm segment, the router under
  ``valgrind --tool=cachegrind --cache-sim=no``, driven by ``bench_capacity``'s client (one process, ``--conns``
  keep-alive connections, 1-token completions).
- The router is started twice: ``--warmup`` requests then SIGTERM, and ``--warmup`` + ``--requests`` then SIGTERM.
  Instructions per request = (Ir of the second − Ir of the first) ÷ ``--requests``: start-up, warm-up and shutdown
  cancel out.
- The tree measured is whatever is importable: pure Python, or with ``scripts/build_native.sh``'s ``.so`` files in
  place (the router's start-up log line says which; printed).

Usage: PYTHONPATH=. python benchmarks/bench_instructions.py [--requests 1000] [--warmup 200] [--conns 16]
Prints one JSON line: {"compiled": ..., "ir_warmup": ..., "ir_total": ..., "ir_per_request": ...}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, HERE)

import httpx  # noqa: E402
from bench_capacity import FAST_SIM, Clients  # noqa: E402
from cluster import Cluster, dplb_cmd, free_port  # noqa: E402

from dplb.state.shm import Segment  # noqa: E402


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def router_ir(c: Cluster, n_requests: int, conns: int, out_file: str) -> tuple[int, str]:
    """Start the router under cachegrind, send ``n_requests`` 1-token requests, stop it; (Ir, its start-up line)."""
    port = free_port()
    log_path = os.path.join(c.run_dir, f"router-{n_requests}.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            ["valgrind", "--tool=cachegrind", "--cache-sim=no", f"--cachegrind-out-file={out_file}",
             *dplb_cmd("router", "--host", "127.0.0.1", "--port", str(port), "--run-dir", c.run_dir)],
            env=c.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None or time.monotonic() - t0 > 300:
                raise RuntimeError(f"router not ready: {_read(log_path)[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code == 200:
                    break
            time.sleep(0.5)
        if n_requests:
            clients = Clients(port, 1, conns)
            got = clients.phase(n_requests, 1)
            clients.close()
            if got["requests"] != n_requests:
                raise RuntimeError(f"{got} of {n_requests} requests answered")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    with open(out_file) as f:
        ir = int(re.search(r"^summary:\s+(\d+)", f.read(), re.M).group(1))  # type: ignore[union-attr]
    line = next((ln for ln in _read(log_path).splitlines() if "listening on" in ln), "")
    return ir, line.strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--conns", type=int, default=16)
    args = ap.parse_args()
    if shutil.which("valgrind") is None:
        print("valgrind is not installed", file=sys.stderr)
        return 1
    tmp = tempfile.mkdtemp(prefix="dplb-ir-")
    run_dir = os.path.join(tmp, "run")
    os.makedirs(run_dir, mode=0o700)
    c = Cluster(run_dir=run_dir, shm_path=f"/dev/shm/dplb_state_bench_{uuid.uuid4().hex[:10]}", num_workers=2)
    c.segment = Segment.create(c.shm_path, 2, state_interval_ms=200, model="dplb-sim")
    try:
        for k in range(2):
            c.start_worker(k, *FAST_SIM, wait=False)
        for k in range(2):
            c.wait_ready(k)
        ir0, line = router_ir(c, args.warmup, args.conns, os.path.join(tmp, "cg.0"))
        ir1, _ = router_ir(c, args.warmup + args.requests, args.conns, os.path.join(tmp, "cg.1"))
    finally:
        c.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    hot = line.rsplit("hot path ", 1)[-1].removesuffix(")") if "hot path " in line else "?"
    print(json.dumps({"hot_path": hot, "ir_warmup": ir0, "ir_total": ir1,
                      "ir_per_request": round((ir1 - ir0) / args.requests)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
