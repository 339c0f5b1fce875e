"""benchmarks/bench_instructions.py: a short run of each mode (the figures are the benchmark's; here, that it runs and
counts something plausible)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from cluster import ROOT

BENCH = f"{ROOT}/benchmarks/bench_instructions.py"


def _run(*args: str) -> dict[str, object]:
    r = subprocess.run([sys.executable, BENCH, "--requests", "100", "--warmup", "50", "--json", *args],
                       capture_output=True, text=True, cwd=ROOT, timeout=600, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stdout + r.stderr
    return dict(json.loads(r.stdout.strip().splitlines()[-1]))


def test_instructions_per_request_under_callgrind() -> None:
    """100 counted requests after 50 warm-up ones, the idle window taken out: a few hundred thousand instructions
    per request of the router (386 k on the reference box), and the idle window smaller than the load's."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        pytest.skip("valgrind with callgrind_control is not installed (apt-get install valgrind)")
    fig = _run()
    assert 100e3 < float(fig["ir_per_request"]) < 2e6, fig  # type: ignore[arg-type]
    assert 0 < float(fig["ir_idle"]) < float(fig["ir_load"]), fig  # type: ignore[arg-type]


def test_calls_per_request_under_cprofile() -> None:
    """``--profile``: Python calls per request of the router (load window minus idle), and the functions listed."""
    fig = _run("--profile", "--top", "5")
    assert 50 < float(fig["calls_per_request"]) < 5000, fig  # type: ignore[arg-type]
    top = fig["top"]
    assert isinstance(top, list) and len(top) == 5 and all(n > 0 for _, n in top), top


def test_kv_events_workload_counts_ring_entries() -> None:
    """``--kv events``: bench_capacity's KV-target workload (8 workers, a small prefix cache, long prompts from a pool)
    with the router following the engines' events: the workers published KV-ring entries in the counted window."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        pytest.skip("valgrind with callgrind_control is not installed (apt-get install valgrind)")
    fig = _run("--kv", "events")
    assert fig["workers"] == 8 and fig["kv"] == "events", fig
    assert float(fig["kv_entries_per_request"]) > 0, fig  # type: ignore[arg-type]
    assert 100e3 < float(fig["ir_per_request"]) < 3e6, fig  # type: ignore[arg-type]
