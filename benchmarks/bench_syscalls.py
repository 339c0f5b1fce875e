"""Where a router's CPU per request goes in the kernel: user vs system CPU and syscalls per request, for DPLB and the
SGLang router on the same workload (``bench_capacity.py``'s targets, client and fast sim workers).

Method
- Targets: ``dplb1`` (one ``dplb router`` process, defaults), ``dplb1asgi`` (``--no-direct-relay``) and
  ``sglang`` (``python -m sglang_router.launch_router`` on the same sim engine over TCP), each started as
  ``bench_capacity.py`` starts it; ``--workers`` sim workers (2).
- Load: ``bench_capacity.Clients`` (``--clients`` processes, ``--concurrency`` keep-alive connections), a warm-up,
  then ``--rounds`` measured windows of ``--requests`` one-token completions (``--tokens`` > 1: SSE streams of that
  many tokens, and the figures are also given per streamed token).
- CPU: utime and stime from ``/proc/<pid>/stat`` of the router process and its descendants (each process's figure
  covers all its threads), before and after each window, summed over the windows (10 ms ticks), ÷ requests.
- Syscalls: ``perf stat -e 'syscalls:sys_enter_*'`` (kernel tracepoints) attached to the router's processes (all
  their threads) for one more window of ``--requests`` after those; each syscall's count ÷ requests. The counter
  slows the router (~1.3× here; more for a many-threaded one), so that window's CPU is not counted, and a slower
  router batches fewer events per ``epoll_wait``: those counts read a little high. Without ``perf`` (or
  tracepoints), ``strace -c -f`` is used (much slower still). ``--no-syscalls``: CPU only.

Output per target: user, system and total µs per request, syscalls per request (total and the ``--top`` by count),
and the same per streamed token with ``--tokens`` > 1; ``--json FILE`` writes every figure. Read the ratios of
targets measured in one run: the box is shared, and absolute µs move with its load.

Usage: ``python benchmarks/bench_syscalls.py [--targets dplb1,sglang] [--rounds 3] [--requests 2000] [--tokens 1]
[--json OUT]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_capacity as bc  # noqa: E402

_TCK = os.sysconf("SC_CLK_TCK")


def tree_pids(root: int) -> list[int]:
    """``root`` and every live descendant of it."""
    parent: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            s = bc._stat(int(name))
            if s is not None:
                parent[int(name)] = s[0]
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += [p for p, pp in parent.items() if pp == pid]
    return out


def user_sys_s(pids: list[int]) -> tuple[float, float]:
    """(utime, stime) seconds summed over ``pids`` (gone ones count 0)."""
    u = s = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                rest = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        u += int(rest[11])
        s += int(rest[12])
    return u / _TCK, s / _TCK


class Syscalls:
    """Counts syscalls of ``pids`` between :meth:`start` and :meth:`stop` (perf tracepoints, else strace)."""

    def __init__(self, pids: list[int], tmp: str) -> None:
        self.pids = pids
        self.out = os.path.join(tmp, "sys.txt")
        self.proc: subprocess.Popen[bytes] | None = None
        self.tool = "perf" if shutil.which("perf") and os.path.isdir("/sys/kernel/tracing/events/syscalls") \
            else "strace" if shutil.which("strace") else ""

    def start(self) -> None:
        ids = ",".join(map(str, self.pids))
        if self.tool == "perf":
            cmd = ["perf", "stat", "-x,", "-o", self.out, "-e", "syscalls:sys_enter_*", "-p", ids]
        elif self.tool == "strace":
            cmd = ["strace", "-c", "-f", "-o", self.out, *(x for p in self.pids for x in ("-p", str(p)))]
        else:
            return
        self.proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # attached before the window starts (perf opens ~350 events per thread)

    def stop(self) -> dict[str, int]:
        """Counts by syscall name (without the ``sys_enter_`` prefix)."""
        if self.proc is None:
            return {}
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(30)
        counts: dict[str, int] = {}
        with open(self.out) as f:
            for line in f:
                if self.tool == "perf":
                    parts = line.strip().split(",")
                    if len(parts) > 2 and parts[0].isdigit() and "sys_enter_" in parts[2]:
                        counts[parts[2].split("sys_enter_", 1)[1]] = int(parts[0])
                else:
                    parts = line.split()
                    if len(parts) >= 5 and parts[0][0].isdigit() and parts[-1] != "total":
                        counts[parts[-1]] = int(parts[3])
        return {k: v for k, v in counts.items() if v}


def measure(port: int, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    """Warm-up, the CPU windows, then one more window with the syscall counter attached (it slows the router, so
    its CPU is not counted); the figures per request (and per token)."""
    clients = bc.Clients(port, args.clients, args.concurrency)
    pids = tree_pids(pid)
    tok = args.tokens
    n = tokens = 0
    user = sys_ = wall = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        try:
            clients.phase(max(200, args.requests // 4), tok)
            for _ in range(args.rounds):
                u0, s0 = user_sys_s(pids)
                t0 = time.perf_counter()
                got = clients.phase(args.requests, tok)
                wall += time.perf_counter() - t0
                u1, s1 = user_sys_s(pids)
                if got["errors"]:
                    raise RuntimeError(f"{got['errors']:.0f} requests failed")
                n += int(got["requests"])
                tokens += int(got["tokens"])
                user += u1 - u0
                sys_ += s1 - s0
            sc = Syscalls(pids, tmp) if args.syscalls else None
            counts, traced = {}, 1
            if sc is not None:
                sc.start()
                traced = int(clients.phase(args.requests, tok)["requests"]) or 1
                counts = sc.stop()
        finally:
            clients.close()
    return {"requests": n, "tokens": tokens, "wall_s": wall, "user_us": user / n * 1e6, "sys_us": sys_ / n * 1e6,
            "cpu_us": (user + sys_) / n * 1e6, "sys_share": sys_ / max(1e-9, user + sys_), "req_s": n / wall,
            "router_cores": (user + sys_) / wall, "syscalls_per_request": {k: v / traced for k, v in counts.items()},
            "syscalls_total_per_request": sum(counts.values()) / traced,
            "syscall_tool": sc.tool if sc is not None else "", "processes": len(pids)}


def run(t: str, args: argparse.Namespace) -> dict[str, Any] | None:
    """One target's figures (None when it cannot run here)."""
    if t == "sglang":
        try:
            import sglang_router  # noqa: F401
        except ImportError:
            print("sglang: skipped (pip install sglang-router)")
            return None
        ctx = bc.sglang_target(args.workers)
    else:
        ctx = bc.dplb_target(args.workers, 1, ("--no-direct-relay",) if t == "dplb1asgi" else ())
    with ctx as (port, pid, _wpids, _shm):
        r = measure(port, pid, args)
    show(t, r, args)
    return r


def show(t: str, r: dict[str, Any], args: argparse.Namespace) -> None:
    """The lines of one target."""
    print(f"--- {t}: {r['requests']} requests, {r['req_s']:.0f}/s, router {r['router_cores']:.2f} cores; CPU µs per "
          f"request: user {r['user_us']:.1f}, system {r['sys_us']:.1f}, total {r['cpu_us']:.1f} (system "
          f"{r['sys_share']:.0%})")
    if args.tokens > 1 and r["tokens"]:
        per = r["requests"] / r["tokens"]
        print(f"    per streamed token: user {r['user_us'] * per:.2f}, system {r['sys_us'] * per:.2f} µs, syscalls "
              f"{r['syscalls_total_per_request'] * per:.2f}")
    calls = sorted(r["syscalls_per_request"].items(), key=lambda kv: -kv[1])
    if calls:
        top = ", ".join(f"{k} {v:.2f}" for k, v in calls[: args.top])
        print(f"    syscalls per request ({r['syscall_tool']}): {r['syscalls_total_per_request']:.2f} — {top}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", default="dplb1,sglang", help="comma list of dplb1, dplb1asgi, sglang")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--clients", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=2000, help="requests per window (2000)")
    ap.add_argument("--rounds", type=int, default=3, help="measured windows (3)")
    ap.add_argument("--tokens", type=int, default=1, help="max_tokens; > 1 streams (1)")
    ap.add_argument("--top", type=int, default=12, help="syscalls listed (12)")
    ap.add_argument("--no-syscalls", dest="syscalls", action="store_false", help="CPU only (no perf/strace)")
    ap.add_argument("--json", help="write every figure here")
    args = ap.parse_args()
    results = {t: r for t in args.targets.split(",") if (r := run(t, args)) is not None}
    if "dplb1" in results and "sglang" in results:
        a, b = results["dplb1"], results["sglang"]
        print(f"DPLB / SGLang per request: user {a['user_us'] / b['user_us']:.2f}x, system "
              f"{a['sys_us'] / b['sys_us']:.2f}x, total {a['cpu_us'] / b['cpu_us']:.2f}x, syscalls "
              f"{a['syscalls_total_per_request'] / max(1e-9, b['syscalls_total_per_request']):.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
