#!/usr/bin/env bash
# Opt-in: compile the router's hot modules with mypyc, in place (README, "Optional: compile the hot path").
#
#   scripts/build_native.sh           # build: one extension module (.so) next to each hot module's .py
#   scripts/build_native.sh --clean   # remove them (and build/): the pure-Python modules are used again
#
# The modules are dplb.native.HOT_MODULES. Python's import system loads dplb/x/y.*.so instead of dplb/x/y.py when
# both are there. Besides them mypyc writes one shared library, built as dplb/_hot__mypyc.*.so (group name
# dplb._hot) so that it is importable wherever dplb is (an editable install maps the package, not the repository
# root: a shared library at the root made every dplb command fail to import), and this script writes the build's
# manifest, dplb/_hot_build.json: the sha256 of every .so it installed and of every source the compiled code
# depends on (dplb.native). A build only works whole and current: every dplb command refuses to start, in one line,
# on a partial build (a .so or the manifest missing, a .so not the build's) or a stale one (a source changed since:
# the .so would run old code; DPLB_ACCEPT_STALE_BUILD=1 runs it anyway). So rebuild (or --clean) after changing
# the sources, and restart the router to run the new build.
# The build runs in a copy of dplb/ under build/native/; the tree's build is replaced only once every module
# compiled (each .so renamed into place, the manifest last): a failed build leaves the previous one working.
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

STAGE=build/native   # the build happens in a copy of dplb/ here; the tree's own build is replaced only at the end
MANIFEST="dplb/$(PYTHONPATH="$ROOT" "$PYTHON" -c "from dplb.native import MANIFEST; print(MANIFEST)")"

clean() {
    # Only extension modules inside dplb/, the manifest and mypyc's shared library at the root; nothing else.
    find dplb \( -name '*.so' -o -name '*.installing' \) -type f -print -delete
    if [[ -f "$MANIFEST" ]]; then rm -f "$MANIFEST" && echo "$MANIFEST"; fi
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
# The stage: the sources as they are now, without any build (setuptools and mypy read pyproject.toml).
rm -rf "$STAGE"
mkdir -p "$STAGE"
cp -R dplb "$STAGE/dplb"
find "$STAGE/dplb" \( -name '*.so' -o -name '__pycache__' -o -name "$(basename "$MANIFEST")" \) -prune -exec rm -rf {} +
cp pyproject.toml "$STAGE/"
# mypyc type-checks the modules first (as mypy does: errors stop the build), then builds with setuptools.
(cd "$STAGE" && OPT_LEVEL="$OPT_LEVEL" "$PYTHON" - "${FILES[@]}" <<'PY') 2>&1 \
    | grep -v -E '^(gcc|building|copying|creating|running) |Treating generator' || true
import os
import sys

from mypyc.build import mypycify
from setuptools import setup

files = sys.argv[1:]
sys.argv = [sys.argv[0], "build_ext", "--inplace"]
setup(name="dplb-hot-path", ext_modules=mypycify(files, group_name="dplb._hot", opt_level=os.environ["OPT_LEVEL"]))
PY
# Whole or nothing: the manifest is written only for a build that compiled every hot module and the shared library.
if ! PYTHONPATH="$ROOT" "$PYTHON" -m dplb.native manifest "$STAGE/dplb" >"$STAGE/manifest.json"; then
    echo "nothing was installed: dplb/ keeps what it had (a compiled build: $0 --clean removes it)" >&2
    exit 1
fi
# Install: the old manifest goes first (a dplb command started meanwhile refuses the half-swapped build), then each
# extension file is copied next to its place and renamed over it (a running process keeps the file it mapped), the
# old build's files the new one lacks are removed, and the new manifest comes last.
"$PYTHON" - "$STAGE/dplb" dplb "$STAGE/manifest.json" "$MANIFEST" <<'PY'
import importlib.machinery
import json
import os
import shutil
import sys

stage, pkg, manifest, target = sys.argv[1:]
with open(manifest) as f:
    files = json.load(f)["extensions"]
if os.path.exists(target):
    os.unlink(target)
for rel in files:
    dst = os.path.join(pkg, rel)
    shutil.copy2(os.path.join(stage, rel), dst + ".installing")
    os.replace(dst + ".installing", dst)
suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
for d, _, names in os.walk(pkg):
    for name in names:
        path = os.path.join(d, name)
        if name.endswith(suffixes) and os.path.relpath(path, pkg) not in files:
            os.unlink(path)
shutil.copy2(manifest, target + ".installing")
os.replace(target + ".installing", target)
PY
find . -maxdepth 1 -name '*__mypyc*.so' -type f -delete   # (a shared library an older version built at the root)
verdict=$(PYTHONPATH="$ROOT" "$PYTHON" -m dplb.native check 2>&1) || { echo "$verdict" >&2; exit 1; }
echo "compiled ${#FILES[@]} of ${#FILES[@]} hot modules ($verdict); restart the router (dplb launch) to run it:" \
     "the router logs 'hot path compiled' and exports dplb_build_info{compiled=\"true\"}"
