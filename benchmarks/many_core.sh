#!/usr/bin/env bash
# The router's capacity on a host with many cores, in one run (benchmarks/README.md, "Router capacity" and
# "On a host with many cores"): the 2-core dev machine cannot show 2 router processes scaling, because the client
# and the workers take the cores a second router process would use.
#
#   benchmarks/many_core.sh [OUT_DIR]          # default OUT_DIR: ./out/many-core
#
# Runs, each writing JSON and a log into OUT_DIR:
#   1. bench_pick.py (pick() p50/p99 per policy and worker count);
#   2. bench_router.py (added latency vs direct at concurrency 1, requests/s and SSE ratios);
#   3. bench_capacity.py: DPLB 1 process, DPLB 2 processes and the SGLang router (when sglang-router is
#      installed) on the same fast sim workers, with enough clients and workers that the router is the limit.
# With COMPILED_FROM=DIR (a folder of mypyc .so files and the manifest built by scripts/build_native.sh for this
# Python and this source, laid out as under dplb/), steps 1 and 3 run again with those modules in place, then they
# are removed.
# PYTHON picks the interpreter (default python3); dplb runs from this checkout (PYTHONPATH), so only the
# dependencies must be installed. Sizes: CAP_CLIENTS (4), CAP_WORKERS (8), CAP_CONCURRENCY (256),
# CAP_REQUESTS (6000 one-token requests a round), CAP_STREAMS (1500 SSE streams a round), CAP_ROUNDS (3),
# CAP_REPEAT (1: runs of the three targets, alternated; medians printed when more).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT_DIR="${1:-out/many-core}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
CAP=(--clients "${CAP_CLIENTS:-4}" --workers "${CAP_WORKERS:-8}" --concurrency "${CAP_CONCURRENCY:-256}"
     --requests "${CAP_REQUESTS:-6000}" --streams "${CAP_STREAMS:-1500}" --rounds "${CAP_ROUNDS:-3}"
     --repeat "${CAP_REPEAT:-1}")

step() {  # step NAME CMD...: run CMD, its output to OUT_DIR/NAME.log and the terminal, its time and status after
    local name=$1; shift
    local t0; t0=$(date +%s)
    echo "=== $name: $*"
    "$@" 2>&1 | tee "$OUT_DIR/$name.log"
    echo "=== $name: rc ${PIPESTATUS[0]}, $(( $(date +%s) - t0 )) s"
}

echo "host: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $("$PY" --version)"
"$PY" -c "import dplb.native as n; print('compiled modules:', len(n.compiled_modules()))"
step pick "$PY" benchmarks/bench_pick.py --iterations 20000 --json "$OUT_DIR/pick.json"
step router "$PY" benchmarks/bench_router.py --json "$OUT_DIR/router.json"
step capacity "$PY" benchmarks/bench_capacity.py --targets dplb1,dplb2,sglang "${CAP[@]}" \
    --json "$OUT_DIR/capacity.json"

if [[ -n "${COMPILED_FROM:-}" ]]; then
    # The .so files and the build's manifest (dplb/_hot_build.json): without it every dplb command refuses them.
    (cd "$COMPILED_FROM" && find . \( -name '*.so' -o -name '_hot_build.json' \) -print0) \
        | while IFS= read -r -d '' f; do cp "$COMPILED_FROM/$f" "$ROOT/$f"; done
    "$PY" -c "import dplb.native as n; print('compiled modules:', len(n.compiled_modules()))"
    step pick-compiled "$PY" benchmarks/bench_pick.py --iterations 20000 --json "$OUT_DIR/pick-compiled.json"
    step capacity-compiled "$PY" benchmarks/bench_capacity.py --targets dplb1,dplb2,sglang "${CAP[@]}" \
        --json "$OUT_DIR/capacity-compiled.json"
    (cd "$COMPILED_FROM" && find . \( -name '*.so' -o -name '_hot_build.json' \) -print0) \
        | while IFS= read -r -d '' f; do rm -f "$ROOT/$f"; done
fi
echo "=== summary"
for f in pick router capacity pick-compiled capacity-compiled; do
    [[ -f "$OUT_DIR/$f.log" ]] || continue
    echo "--- $f"
    grep -hE '^(dplb|least_loaded) +8 |^(stepped_)?(added|router|direct)_p|^target added|2 processes / 1|DPLB / SGLang|^=== dplb|^=== sglang|^--- (dplb|sglang)' \
        "$OUT_DIR/$f.log"
done
