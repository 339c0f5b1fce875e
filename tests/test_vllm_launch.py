"""The main job on real input: `dplb launch --model <tiny model> --num-workers 2` with real vLLM CPU workers."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from collections import Counter

import httpx
import openai
import pytest
from cluster import dplb_cmd, launched
from proc_tags import kill_tagged, new_tag, ppid, tagged_env, tagged_procs
from vllm_support import STARTUP_TIMEOUT_S, TINY_MODEL, VLLM_CPU_ARGS, require_vllm, vllm_env

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _state(shm: str) -> dict:  # type: ignore[type-arg]
    return json.loads(subprocess.run(dplb_cmd("state", "--json", "--shm-path", shm), capture_output=True, text=True,
                                     timeout=30).stdout)


def test_launch_two_real_vllm_workers_end_to_end(tmp_path) -> None:  # type: ignore[no-untyped-def]
    require_vllm()
    tag = new_tag()
    with launched(tmp_path, "--model", TINY_MODEL, "--num-workers", "2", *VLLM_CPU_ARGS, tag=tag,
                  env=tagged_env(tag, vllm_env()), cleanup=lambda: kill_tagged(tag)) as ln:  # only what it started
        proc, log_path, shm, url, run_dir = ln.proc, ln.log, ln.shm, ln.url, ln.run_dir
        t0 = time.monotonic()
        ln.wait_ready(STARTUP_TIMEOUT_S, workers=True, step_s=1)
        print(f"2 real vLLM CPU workers ready in {time.monotonic() - t0:.1f} s")
        assert "SIM engine" not in log_path.read_text()
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8)
        assert raw.headers["x-sg-worker-id"] in ("0", "1") and raw.parse().choices[0].message is not None
        comp = client.completions.create(model="tiny", prompt="once", max_tokens=4, extra_body={"ignore_eos": True})
        assert comp.usage and comp.usage.completion_tokens == 4
        chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "s"}],
                                                     max_tokens=8, stream=True, extra_body={"ignore_eos": True}))
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2

        async def twenty() -> Counter[str]:
            async with httpx.AsyncClient(timeout=300) as cl:
                rs = await asyncio.gather(*[cl.post(url + "/v1/completions", json={
                    "model": "tiny", "prompt": f"p{i}", "max_tokens": 16, "ignore_eos": True}) for i in range(20)])
            assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200]
            return Counter(r.headers["x-sg-worker-id"] for r in rs)

        spread = asyncio.run(twenty())
        assert set(spread) == {"0", "1"}, spread
        # kill -9 of a worker leaves no engine behind: its EngineCore (a child process that would be re-parented and
        # keep running) dies with it, and the launcher starts a fresh worker.
        old = next(w["pid"] for w in _state(shm)["workers"] if w["worker"] == 0)
        engine = [pid for pid, _ in tagged_procs(tag) if ppid(pid) == old]
        assert engine, f"worker 0 (pid {old}) has no engine child: {tagged_procs(tag)}"
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while (left := [pid for pid, _ in tagged_procs(tag) if pid in engine]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert left == [], f"worker 0's engine outlived it: {left}"
        t0 = time.monotonic()
        while not (lambda w: w["pid"] not in (0, old) and w["lifecycle"] == "ready")(_state(shm)["workers"][0]):
            assert time.monotonic() - t0 < STARTUP_TIMEOUT_S, log_path.read_text()[-4000:]
            time.sleep(1)
        proc.send_signal(signal.SIGINT)
        t_stop = time.monotonic()
        assert proc.wait(60) == 0
        assert time.monotonic() - t_stop < 30
        assert not os.path.exists(shm)
        assert not any(n.endswith(".sock") for n in os.listdir(run_dir))
        # No process the launcher started (its whole tree, orphans included: they keep the test's tag in their
        # environment) may outlive it; an exited child waiting to be reaped holds nothing and is not counted.
        deadline = time.monotonic() + 10
        while (leftovers := tagged_procs(tag)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert leftovers == [], leftovers
