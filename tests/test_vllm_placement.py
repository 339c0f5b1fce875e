"""Two real vLLM CPU workers started by `dplb launch` never share a core (dplb/ops/placement.py).

Without placement vLLM's auto-binding put both engines' OpenMP threads on core 0, where one busy-waiting engine
starved the other for seconds. Every thread of every process of each worker (the worker with vLLM's API server,
the EngineCore, the model runner and its OpenMP threads) must stay inside that worker's CPUs, and the workers'
CPUs must be disjoint; on a 2-core host each worker has one core.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest
from cluster import launched
from vllm_support import STARTUP_TIMEOUT_S, TINY_MODEL, VLLM_CPU_ARGS, require_vllm, vllm_env

from dplb.runtime.cpus import format_cpu_list

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (from /proc/<pid>/task/<tid>/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def _thread_cpus(pid: int) -> dict[str, set[int]]:
    """``{"pid/tid name": affinity}`` for every thread of ``pid`` (OpenMP threads bind themselves one by one)."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            out[f"{pid}/{tid} {name}"] = set(os.sched_getaffinity(int(tid)))
        except OSError:
            continue
    return out


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e]
    return {k.decode(): v.decode() for k, v in pairs}


def test_two_vllm_cpu_workers_never_share_a_core(tmp_path: Path) -> None:
    require_vllm()
    allowed = set(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("two vLLM CPU workers need 2 CPUs")
    # vllm_env's nobind: the launcher replaces it
    with launched(tmp_path, "--model", TINY_MODEL, "--num-workers", "2", *VLLM_CPU_ARGS, env=vllm_env()) as ln:
        proc, log_path, url = ln.proc, ln.log, ln.url
        st = ln.wait_ready(STARTUP_TIMEOUT_S, workers=True, step_s=1)
        assert st is not None
        banner = log_path.read_text()
        per_worker: list[set[int]] = []
        for w in st["workers"]:
            mine = set(os.sched_getaffinity(w["pid"]))
            assert w["cpus"] == sorted(mine)  # dplb state shows the placement
            procs = _descendants(w["pid"])
            assert len(procs) >= 2, f"worker {w['worker']}: no engine process under it ({procs})"
            threads = {k: v for p in procs for k, v in _thread_cpus(p).items()}
            escaped = {k: sorted(v) for k, v in threads.items() if not v <= mine}
            assert not escaped, f"worker {w['worker']} owns CPUs {sorted(mine)}; threads outside: {escaped}"
            omp = _environ(w["pid"])["VLLM_CPU_OMP_THREADS_BIND"]
            assert omp != "nobind" and set(map(int, omp.replace("-", ",").split(","))) <= mine, omp
            per_worker.append(mine)
        assert per_worker[0] and per_worker[1] and not per_worker[0] & per_worker[1], per_worker
        assert per_worker[0] | per_worker[1] <= allowed
        if len(allowed) == 2:
            assert [len(s) for s in per_worker] == [1, 1]
        assert f"cpus:    worker 0: {format_cpu_list(per_worker[0])}" in banner, banner
        # both still serve (the pinned engines work)
        for _ in range(4):
            r = httpx.post(url + "/v1/completions", timeout=120,
                           json={"model": "tiny", "prompt": "hi", "max_tokens": 4, "ignore_eos": True})
            assert r.status_code == 200, r.text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
