"""benchmarks/bench_placement.py's load generator is not what it measures: it runs in its own session (its own
kernel autogroup) at nice -10, and the servers it starts go back to nice 0 in sessions of their own. Without it,
the client was runnable but not running for 0.9-2.1 s inside measured windows on a shared 2-core box, and every
request in flight carried the stall as TTFT (benchmarks/README.md, "Worker placement")."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from cluster import ROOT

SCRIPT = f"""
import json, os, subprocess, sys
sys.path.insert(0, {os.path.join(ROOT, "benchmarks")!r})
import bench_placement as b
applied = b.client_priority()
child = subprocess.run([sys.executable, "-c",
                        "import os; print(os.getsid(0), os.nice(0), open('/proc/self/autogroup').read())"],
                       capture_output=True, text=True, start_new_session=True, preexec_fn=b._server_priority).stdout.split()
print(json.dumps({{"applied": applied, "sid": os.getsid(0), "pid": os.getpid(), "nice": os.nice(0),
                  "autogroup": open("/proc/self/autogroup").read(), "child": child}}))
"""


def test_client_runs_in_its_own_session_above_the_servers() -> None:
    if os.geteuid() != 0 or not os.path.exists("/proc/self/autogroup"):
        pytest.skip("raising a priority needs root; the autogroup file needs CONFIG_SCHED_AUTOGROUP")
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["sid"] == d["pid"] and d["nice"] == -10, d  # own session, raised
    assert "nice -10" in d["autogroup"], d
    sid, nice, group = int(d["child"][0]), int(d["child"][1]), d["child"][2]
    assert sid != d["sid"] and nice == 0, d  # a server: its own session, back to nice 0
    assert group != d["autogroup"].split()[0] and d["child"][-1] == "0", d
