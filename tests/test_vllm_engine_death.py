"""A real vLLM EngineCore killed under its live API server (what a CUDA error, an Xid or the OOM killer does on a GPU
host): `dplb launch --model <tiny model> --num-workers 1`, a long stream, SIGKILL of the worker's ``VLLM::EngineCore``
a few tokens in. vLLM ends the stream itself — its 5xx error event, ``data: [DONE]``, a clean close — and the router
must relay those bytes unchanged and count the request as an upstream error; the worker exits and is restarted, and
the launcher removes the ``/dev/shm/psm_*`` files the killed engine left (which nothing else maps)."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest
from cluster import launched, wait_for
from proc_tags import kill_tagged, new_tag, ppid, tagged_env, tagged_procs
from vllm_support import STARTUP_TIMEOUT_S, TINY_MODEL, VLLM_CPU_ARGS, require_vllm, vllm_env

from dplb.errors import stream_failure
from dplb.ops.shm_leftovers import descendants, mapped_semaphores, mapped_shm

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
DONE = b"data: [DONE]\n\n"


def test_engine_core_killed_mid_stream_is_an_upstream_error_and_leaves_no_shared_memory(tmp_path: Path) -> None:
    require_vllm()
    tag = new_tag()
    with launched(tmp_path, "--model", TINY_MODEL, "--num-workers", "1", *VLLM_CPU_ARGS, tag=tag,
                  env=tagged_env(tag, vllm_env()), cleanup=lambda: kill_tagged(tag)) as ln:
        ln.wait_ready(STARTUP_TIMEOUT_S, workers=True, step_s=1)
        worker = ln.state()["workers"][0]["pid"]
        cores = [pid for pid, cmd in tagged_procs(tag) if ppid(pid) == worker and "EngineCore" in cmd]
        assert len(cores) == 1, (worker, tagged_procs(tag))
        wait_for(lambda: mapped_shm(descendants(worker)), 30, "the engine's shared memory to be mapped", step_s=0.5)
        time.sleep(6)  # the launcher records the worker's mappings every 5 s
        engine_shm = mapped_shm(descendants(worker))
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 400, "stream": True, "ignore_eos": True}
        got: list[bytes] = []
        with httpx.Client(timeout=60) as client, client.stream("POST", ln.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for chunk in r.iter_raw():  # raises on an abnormal close: vLLM's own end is a clean one
                got.append(chunk)
                if len(got) == 5:
                    os.kill(cores[0], signal.SIGKILL)
        text = b"".join(got)
        assert text.endswith(DONE) and text.count(DONE) == 1, text[-600:]
        failure = stream_failure(text[-2000:])
        assert failure is not None and "EngineCore" in failure, text[-600:]
        assert b"worker_failed" not in text  # vLLM's bytes, not the router's
        metrics = httpx.get(ln.url + "/metrics").text
        m = re.search(r'dplb_upstream_request_duration_seconds_count\{outcome="upstream_error",worker="0"\} (\S+)',
                      metrics)
        assert m and float(m.group(1)) == 1.0, metrics[-3000:]
        router_log = Path(ln.run_dir, "router.log").read_text(errors="replace")
        assert "failed stream" in router_log, router_log[-3000:]
        # The worker exits (vLLM engine died), the launcher reaps its group, removes what the engine left, restarts.
        wait_for(lambda: "exited unexpectedly" in ln.log.read_text(), 60, "the worker's exit", step_s=0.5)
        wait_for(lambda: not any(os.path.exists(p) for p in engine_shm), 40, "the engine's psm_ files removed",
                 step_s=0.5)
        removed = [p for p in engine_shm if f"removed {p}" in ln.log.read_text()]
        print(f"engine death: stream ended with vLLM's event + [DONE] after {len(got)} chunks; counted "
              f"upstream_error; {len(engine_shm)} psm_ file(s) the engine mapped, {len(removed)} removed by the "
              f"launcher (the rest unlinked by vLLM itself)")
        # The restarted worker SIGKILLed whole (the tester's kill -9 of the worker pid): its process group's
        # multiprocessing semaphores (sem.mp-*, which its killed resource tracker cannot unlink) are removed too.
        state = ln.wait_ready(STARTUP_TIMEOUT_S, workers=True, step_s=1)
        assert state is not None
        worker = state["workers"][0]["pid"]
        sems = wait_for(lambda: mapped_semaphores(descendants(worker))[0], 30, "the worker's semaphores",
                        step_s=0.5)
        time.sleep(6)  # the launcher records the worker's mappings every 5 s
        sems = mapped_semaphores(descendants(worker))[0]
        os.kill(worker, signal.SIGKILL)
        wait_for(lambda: not any(os.path.exists(p) for p in sems), 40, "the killed worker's semaphores removed",
                 step_s=0.5)
        log = ln.log.read_text()
        assert all(f"removed {p}" in log for p in sems), (sems, log[-3000:])
        print(f"worker SIGKILL: {len(sems)} sem.mp-* file(s) its group mapped, all removed by the launcher")
