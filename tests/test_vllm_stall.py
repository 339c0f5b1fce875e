"""A stopped vLLM EngineCore on real vLLM CPU workers: `dplb launch --model <tiny model> --num-workers 2`, SIGSTOP
of worker 0's ``VLLM::EngineCore`` child (its API server and DPLB's collector keep running, its gauges freeze), then
requests at concurrency 4 with a client timeout. The router must stop sending to worker 0 within the detection time,
fail its in-flight requests fast with the retryable 504 ``worker_stalled``, and route to it again after SIGCONT."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from cluster import dplb_cmd, free_port, interrupt, progress_gaps
from proc_tags import kill_tagged, new_tag, ppid, tagged_env, tagged_procs
from vllm_support import STARTUP_TIMEOUT_S, TINY_MODEL, VLLM_CPU_ARGS, require_vllm, vllm_env

from dplb.config import STALL_AFTER_S
from dplb.state.shm import Lifecycle, Segment

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]
CHECK_S = 0.5  # the router's monitor step
MARGIN_S = 4.0  # a loaded 2-core box running two vLLM engines


async def _requests(url: str, n: int, concurrency: int, timeout: float, max_tokens: int = 16) -> list[dict[str, Any]]:
    sem = asyncio.Semaphore(concurrency)
    out: list[dict[str, Any]] = []

    async def one(cl: httpx.AsyncClient, i: int) -> None:
        async with sem:
            t0 = time.monotonic()
            rec: dict[str, Any] = {"i": i, "t0": t0}
            try:
                r = await cl.post(url + "/v1/completions", json={"model": "tiny", "prompt": f"p{i} " * (i % 7 * 20 + 1),
                                                                 "max_tokens": max_tokens, "ignore_eos": True})
                rec.update(status=r.status_code, worker=r.headers.get("x-sg-worker-id"), body=r.text,
                           retry_after=r.headers.get("retry-after"))
            except httpx.HTTPError as e:
                rec.update(status=0, worker=None, body=type(e).__name__)
            rec["took"] = time.monotonic() - t0
            out.append(rec)

    async with httpx.AsyncClient(timeout=timeout) as cl:
        await asyncio.gather(*[one(cl, i) for i in range(n)])
    return sorted(out, key=lambda r: r["t0"])


def test_sigstop_of_engine_core_fails_fast_and_recovers_on_sigcont(tmp_path) -> None:  # type: ignore[no-untyped-def]
    require_vllm()
    tag = new_tag()
    shm = f"/dev/shm/dplb_state_test_{tag}"
    run_dir = str(tmp_path / f"r-{tag[:8]}")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "launch.log"
    with open(log_path, "wb") as log:  # the default --stall-after; no restart while the test runs
        proc = subprocess.Popen(
            dplb_cmd("launch", "--model", TINY_MODEL, "--num-workers", "2", "--port", str(port), "--host",
                     "127.0.0.1", "--shm-path", shm, "--run-dir", run_dir, "--metrics-port-base", "0",
                     "--stall-restart-after", "0", *VLLM_CPU_ARGS),
            env=tagged_env(tag, vllm_env()), stdout=log, stderr=subprocess.STDOUT)
    core = 0
    seg = None
    try:
        t0 = time.monotonic()
        while True:
            assert proc.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() - t0 < STARTUP_TIMEOUT_S, log_path.read_text()[-4000:]
            with contextlib.suppress(Exception):
                seg = seg or Segment.attach(shm, writable=False)
                if all(seg.read(k).lifecycle == Lifecycle.READY for k in range(2)) and \
                        httpx.get(url + "/ready").status_code == 200:
                    break
            time.sleep(1)
        assert seg is not None
        # A healthy stack under the same load: the largest gap between two progress moves of a busy worker.
        stop, gaps = threading.Event(), []  # type: ignore[var-annotated]
        watcher = threading.Thread(target=progress_gaps, args=(seg, [0, 1], stop, gaps), daemon=True)
        watcher.start()
        warm = asyncio.run(_requests(url, 24, 4, 120, max_tokens=48))
        stop.set()
        watcher.join()
        assert all(r["status"] == 200 for r in warm), warm
        assert {r["worker"] for r in warm} == {"0", "1"}, warm
        print(f"healthy: largest gap between progress moves {max(gaps):.2f} s over {len(gaps)} moves")
        worker0 = seg.read(0).pid
        cores = [pid for pid, cmd in tagged_procs(tag) if ppid(pid) == worker0 and "EngineCore" in cmd]
        assert len(cores) == 1, (worker0, tagged_procs(tag))
        core = cores[0]
        os.kill(core, signal.SIGSTOP)
        t_stop = time.monotonic()
        recs = asyncio.run(_requests(url, 24, 4, 40))
        stalled_metric = httpx.get(url + "/metrics").text
        decisions = httpx.get(url + "/debug/decisions").text
        limit = STALL_AFTER_S + CHECK_S + MARGIN_S
        assert max(r["took"] for r in recs) < limit, [(r["worker"], r["status"], round(r["took"], 1)) for r in recs]
        failed = [r for r in recs if r["status"] != 200]
        assert failed and all(r["worker"] == "0" and r["status"] == 504 and "worker_stalled" in r["body"]
                              and r["retry_after"] for r in failed), failed
        assert all(r["worker"] == "1" for r in recs if r["status"] == 200), recs
        # Out of rotation: after the first fast failure, worker 0 gets at most one probe per --stall-after.
        t_out = min(r["t0"] + r["took"] for r in failed)
        late0 = [r for r in recs if r["worker"] == "0" and r["t0"] > t_out + 0.1]
        span = max(r["t0"] for r in recs) - t_out
        assert len(late0) <= span / STALL_AFTER_S + 1, late0
        assert re.search(r'dplb_worker_stalled\{worker="0"\} 1\.0', stalled_metric), stalled_metric[-3000:]
        assert '"stalled"' in decisions
        router_log = Path(run_dir, "router.log").read_text(errors="replace")
        m = re.search(r"worker 0: engine made no progress for ([0-9.]+) s", router_log)
        assert m, router_log[-3000:]
        print(f"vLLM detection: last progress -> stalled in {float(m.group(1)):.1f} s (--stall-after "
              f"{STALL_AFTER_S:g}); first fast failure {t_out - t_stop:.1f} s after SIGSTOP; {len(failed)} of "
              f"{len(recs)} failed fast, slowest {max(r['took'] for r in recs):.1f} s")
        os.kill(core, signal.SIGCONT)
        t_cont = time.monotonic()
        back = None
        while back is None and time.monotonic() - t_cont < 60:
            for r in asyncio.run(_requests(url, 4, 4, 40)):
                if r["worker"] == "0" and r["status"] == 200:
                    back = time.monotonic() - t_cont
            time.sleep(0.5)
        assert back is not None, "worker 0 never came back after SIGCONT"
        print(f"worker 0 served again {back:.1f} s after SIGCONT")
        assert "progress resumed" in Path(run_dir, "router.log").read_text(errors="replace")
    finally:
        if core:
            with contextlib.suppress(ProcessLookupError):
                os.kill(core, signal.SIGCONT)
        if seg is not None:
            seg.close()
        interrupt(proc, 60)
        kill_tagged(tag)  # only what this test started
        if os.path.exists(shm):
            os.unlink(shm)
