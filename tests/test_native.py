"""dplb.native: the hot-module list scripts/build_native.sh compiles, and what the router says about it.

Run with or without the build's .so files in place: the checks compare what the module reports with where each
module was really imported from.
"""

from __future__ import annotations

import importlib
import importlib.machinery
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from dplb import native
from dplb.obs.metrics_router import RouterMetrics

ROOT = Path(__file__).resolve().parent.parent


def test_every_hot_module_exists_and_is_reported_as_what_was_imported() -> None:
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    compiled = set(native.compiled_modules())
    assert len(set(native.HOT_MODULES)) == len(native.HOT_MODULES) == 35
    for name in native.HOT_MODULES:
        assert (ROOT / (name.replace(".", "/") + ".py")).is_file(), name  # the script builds from this file
        mod = importlib.import_module(name)
        assert (name in compiled) == str(mod.__file__).endswith(suffixes), (name, mod.__file__)
    label = native.build_label()
    assert label == ("true" if len(compiled) == 35 else "false" if not compiled else "partial")
    assert native.describe().startswith("pure Python" if not compiled else f"compiled ({len(compiled)}/35 hot modules")


def test_build_info_carries_the_compiled_label() -> None:
    text = generate_latest(RouterMetrics("9.9").registry).decode()
    line = next(ln for ln in text.splitlines() if ln.startswith("dplb_build_info{"))
    assert f'compiled="{native.build_label()}"' in line and 'component="router"' in line, line


def test_mypyc_attr_is_a_no_op_in_pure_python() -> None:
    class C:
        pass

    assert native.mypyc_attr(allow_interpreted_subclasses=True)(C) is C


def test_a_build_older_than_its_source_is_named(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A compiled module whose .py changed after the build runs the old code: the start-up line names it."""
    so = tmp_path / ("core" + importlib.machinery.EXTENSION_SUFFIXES[0])
    py = tmp_path / "core.py"
    so.write_bytes(b"")
    py.write_text("")
    import os

    os.utime(so, (1_000_000, 1_000_000))
    os.utime(py, (2_000_000, 2_000_000))  # edited after the build
    monkeypatch.setattr(native, "compiled_modules", lambda: ["dplb.policy.core"])
    monkeypatch.setattr(native, "_origin", lambda name: str(so))
    assert native.stale_modules() == ["dplb.policy.core"]
    assert "1 older than their .py: dplb.policy.core; rebuild with scripts/build_native.sh" in native.describe()
    os.utime(so, (3_000_000, 3_000_000))  # rebuilt
    assert native.stale_modules() == [] and native.describe() == "compiled (1/35 hot modules)"


#: Behaviour tests run again against the compiled copy: the direct relay byte for byte against the ASGI path, its
#: timeouts, kills and limits, pipelining with disconnects, the exact request and response heads, keep-alive, panic
#: routing, the worker health's state machine and the HTTP request count (unit tests, seconds). A compiled-only bug
#: (mypyc's typed locals, native classes that cannot be patched) shows up here in CI, where the README's test
#: command otherwise runs pure Python only.
COMPILED_CHECKS = ("test_direct_relay.py", "test_pipelined_disconnect.py", "test_head_bytes.py",
                   "test_serving_keepalive.py", "test_panic.py", "test_health.py", "test_http_count.py")


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_build_imports_wherever_the_package_does_and_passes_the_relay_tests(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """scripts/build_native.sh on a copy of the tree, then (1) the compiled package imported the way an editable
    install maps it: the package directory alone on the path, not the tree's root (mypyc's shared library must sit
    inside the package, or every dplb command fails to import); (2) :data:`COMPILED_CHECKS` run against that copy,
    its routers and workers compiled (the copy first on ``PYTHONPATH``, ahead of the editable install)."""
    import os
    import shutil
    import subprocess
    import sys

    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: scripts/build_native.sh needs one")
    tree = tmp_path / "tree"
    junk = shutil.ignore_patterns("*.so", "__pycache__", ".pytest_cache")
    for part in ("dplb", "scripts", "tests", "benchmarks"):
        shutil.copytree(ROOT / part, tree / part, ignore=junk)
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    env = {**os.environ, "PYTHON": sys.executable, "OPT_LEVEL": "0"}  # what is tested is where the build lands
    env.pop("PYTHONPATH", None)
    r = subprocess.run(["bash", str(tree / "scripts" / "build_native.sh")], cwd=tree, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert not list(tree.glob("*.so")), "a shared library at the tree's root is importable only with the root on the path"
    site = tmp_path / "site"  # what an editable install puts on the path: the package, not the root
    site.mkdir()
    (site / "dplb").symlink_to(tree / "dplb")
    probe = "from dplb import native; import dplb.router.app; print(native.build_label())"
    r = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env={**env, "PYTHONPATH": str(site)},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "true", r.stdout + r.stderr[-2000:]
    compiled_env = {**env, "PYTHONPATH": str(tree)}
    r = subprocess.run([sys.executable, "-c", probe], cwd=tree, env=compiled_env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "true", r.stdout + r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider",
                        *(f"tests/{name}" for name in COMPILED_CHECKS)],
                       cwd=tree, env=compiled_env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " skipped" not in r.stdout, r.stdout[-2000:]


def test_no_hot_function_binds_one_except_name_to_two_dplb_classes() -> None:
    """Compiled, a local name is one typed variable, typed by its first binding: ``except UpstreamTimeout as e``
    and then ``except UpstreamClosed as e`` in one function made the second handler raise ``TypeError:
    UpstreamTimeout object expected; got UpstreamClosed`` in the compiled router only (builtin exception classes
    are plain objects to mypyc, so only classes of compiled modules are at stake)."""
    import ast
    import builtins

    found = []
    for name in native.HOT_MODULES:
        tree = ast.parse((ROOT / (name.replace(".", "/") + ".py")).read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            bound: dict[str, set[str]] = {}
            for node in ast.walk(fn):
                if isinstance(node, ast.ExceptHandler) and node.name and node.type is not None:
                    bound.setdefault(node.name, set()).add(ast.unparse(node.type))
            for var, types in bound.items():
                if len(types) > 1 and not all(hasattr(builtins, t.strip("()").split(",")[0]) for t in types):
                    found.append(f"{name}.{fn.name}: {var} = {sorted(types)}")
    assert not found, found
