"""Instructions per pick: bench_pick.py's dplb@8 workload under valgrind's callgrind, collected only inside the timed
loop (``functools.reduce``), so ``(Ir(N picks) − Ir(0 picks)) / N`` is the cost of one ``Policy.pick`` — deterministic,
unlike wall-clock time on a shared box.

Usage: ``python benchmarks/pick_ir.py [--mode p|n|m] [--picks N] [--measure]``. ``--mode p``: every pick carries one
of bench_pick's 64 prepared 2 KB chat prompts; ``n``: none does; ``m``: every other one does (bench_pick's mix). The
requests are made before the loop (not counted); 2,000 picks warm the policy and its prefix index first. Without
``--measure`` it only runs the workload (what callgrind runs); with it, it runs itself under callgrind for 0 and N
picks (``PYTHONHASHSEED=0``) and prints thousands of instructions per pick.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_pick import _fresh, _snapshot

from dplb.config import PolicyConfig
from dplb.policy import RouteRequest, make_policy


def workload(mode: str, picks: int) -> None:
    """Warm a dplb policy for 8 workers with 2,000 picks, then make ``picks`` more inside ``functools.reduce``."""
    system = ("You are a careful assistant. " * 40).encode()[:1024]
    prompts = [b'[{"role":"system","content":"' + system + b'"},{"role":"user","content":"'
               + (f"question {p} " * 80).encode()[:1000] + b'"}]' for p in range(64)]
    pol = make_policy(PolicyConfig(name="dplb"), 8)
    for i in range(60):
        pol.observe_latency(0.5 + i * 0.01)
    now = 10**12
    snap = _snapshot(8, now)
    prepared = []
    for p in prompts:
        pol.prepare(r := RouteRequest(p))
        prepared.append(r)

    def requests(k: int, off: int) -> list[RouteRequest | None]:
        return [_fresh(prepared[i % 64]) if mode == "p" or (mode == "m" and i & 1) else None
                for i in range(off, off + k)]

    for warm in requests(2000, 0):
        pol.pick(snap, now, warm)

    def step(acc: None, r: RouteRequest | None) -> None:
        pol.pick(snap, now, r)
        return acc

    functools.reduce(step, requests(picks, 2000), None)


def measure(mode: str, picks: int) -> float:
    """Thousands of instructions per pick (callgrind, 0 and ``picks`` picks)."""
    totals = []
    with tempfile.TemporaryDirectory() as d:
        for n in (0, picks):
            out = os.path.join(d, f"cg.{n}")
            subprocess.run(["valgrind", "--tool=callgrind", "--toggle-collect=functools_reduce",
                            f"--callgrind-out-file={out}", sys.executable, os.path.abspath(__file__), "--mode", mode,
                            "--picks", str(n)], check=True, capture_output=True, env={**os.environ,
                                                                                     "PYTHONHASHSEED": "0"})
            with open(out) as f:
                totals.append(int(re.search(r"^totals: (\d+)", f.read(), re.M).group(1)))  # type: ignore[union-attr]
    return (totals[1] - totals[0]) / picks / 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("p", "n", "m"), default="p")
    ap.add_argument("--picks", type=int, default=2000)
    ap.add_argument("--measure", action="store_true")
    args = ap.parse_args()
    if args.measure:
        print(f"{measure(args.mode, args.picks):.1f} k instructions per pick (mode {args.mode})")
    else:
        workload(args.mode, args.picks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
