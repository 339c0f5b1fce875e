#!/usr/bin/env bash
# Opt-in: compile the router's hot modules with mypyc, in place (README, "Optional: compile the hot path").
#
#   scripts/build_native.sh           # build: one extension module (.so) next to each hot module's .py
#   scripts/build_native.sh --clean   # remove them (and build/): the pure-Python modules are used again
#
# The modules are dplb.native.HOT_MODULES. Python's import system loads dplb/x/y.*.so instead of dplb/x/y.py when
# both are there, so the .so files must be rebuilt (or removed) after any change to those .py files: a stale .so
# runs old code. Besides them mypyc writes one shared library, built as dplb/_hot__mypyc.*.so (group name
# dplb._hot) so that it is importable wherever dplb is (an editable install maps the package, not the repository
# root: a shared library at the root made every dplb command fail to import).
# Needs mypy (which ships mypyc; `pip install mypy`, or the `native` extra) and a C compiler. PYTHON picks the
# interpreter (default: .venv/bin/python if present, else python3); the .so files only load in that Python version.
# OPT_LEVEL is the C compiler's optimisation level (default 3, what the measured figures used; 0 builds in ~0.6×
# the time, for tests of the build itself: 69 s against 115 s on the 2-core dev machine).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
OPT_LEVEL="${OPT_LEVEL:-3}"
[[ "$OPT_LEVEL" =~ ^[0-3]$ ]] || { echo "OPT_LEVEL must be 0, 1, 2 or 3, got '$OPT_LEVEL'" >&2; exit 2; }

clean() {
    # Only extension modules inside dplb/ and mypyc's shared library at the root; nothing else is touched.
    find dplb -name '*.so' -type f -print -delete
    find . -maxdepth 1 -name '*__mypyc*.so' -type f -print -delete
    rm -rf build/
}

case "${1:-}" in
    --clean) clean; echo "removed the compiled modules: the router runs pure Python"; exit 0 ;;
    "") ;;
    *) echo "usage: $0 [--clean]" >&2; exit 2 ;;
esac

if ! "$PYTHON" -c "import mypyc" 2>/dev/null; then
    echo "mypyc is not installed for $PYTHON: pip install mypy (it ships mypyc)" >&2
    exit 1
fi
mapfile -t FILES < <(PYTHONPATH="$ROOT" "$PYTHON" -c \
    "from dplb.native import HOT_MODULES; print('\n'.join(m.replace('.', '/') + '.py' for m in HOT_MODULES))")
clean >/dev/null   # no stale .so of a module that is no longer in the list
# mypyc type-checks the modules first (as mypy does: errors stop the build), then builds with setuptools.
OPT_LEVEL="$OPT_LEVEL" "$PYTHON" - "${FILES[@]}" <<'PY' 2>&1 | grep -v -E '^(gcc|building|copying|creating|running) |Treating generator' || true
import os
import sys

from mypyc.build import mypycify
from setuptools import setup

files = sys.argv[1:]
sys.argv = [sys.argv[0], "build_ext", "--inplace"]
setup(name="dplb-hot-path", ext_modules=mypycify(files, group_name="dplb._hot", opt_level=os.environ["OPT_LEVEL"]))
PY
n=$(PYTHONPATH="$ROOT" "$PYTHON" -c "from dplb import native; print(len(native.compiled_modules()))")
total=${#FILES[@]}
if [[ "$n" != "$total" ]]; then
    echo "build failed: $n of $total hot modules compiled (see above); run $0 --clean for pure Python" >&2
    exit 1
fi
echo "compiled $n of $total hot modules; the router logs 'hot path compiled' and exports dplb_build_info{compiled=\"true\"}"
