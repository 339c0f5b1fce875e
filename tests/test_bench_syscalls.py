"""benchmarks/bench_syscalls.py: a short run (the figures are the benchmark's; here, that it runs and reads
something plausible: CPU split into user and system time, and the syscalls of a direct-relay request)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from cluster import ROOT

BENCH = f"{ROOT}/benchmarks/bench_syscalls.py"


def test_user_system_cpu_and_syscalls_per_request(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "sys.json"
    r = subprocess.run([sys.executable, BENCH, "--targets", "dplb1", "--rounds", "1", "--requests", "400",
                        "--json", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stdout + r.stderr
    fig = json.loads(out.read_text())["dplb1"]
    assert fig["requests"] == 400 and fig["user_us"] > 0 and fig["cpu_us"] >= fig["user_us"], fig
    if fig["syscall_tool"]:  # perf with tracepoints, or strace: the direct relay's read + write on each side
        calls = fig["syscalls_per_request"]
        assert calls.get("read", 0) + calls.get("recvfrom", 0) >= 1.5, calls
        assert fig["syscalls_total_per_request"] < 20, calls
    else:
        assert shutil.which("strace") is None  # (and perf missing, or without the syscall tracepoints)
