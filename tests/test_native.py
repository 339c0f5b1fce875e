"""dplb.native: the hot-module list scripts/build_native.sh compiles, whether a build is whole and current, and what
every dplb command, the router, ``dplb launch`` and ``dplb doctor`` say and do about it.

Run with or without the build's .so files in place: the checks compare what the module reports with where each
module was really imported from. The fast tests fake a build in a copy of the package's sources (an extension file
of any content is what the import system would load; the manifest is written by :func:`dplb.native.manifest_for`,
as the build script does); the slow test builds the real one.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from dplb import native
from dplb.obs.metrics_router import RouterMetrics
from dplb.ops import doctor

ROOT = Path(__file__).resolve().parent.parent
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def test_every_hot_module_exists_and_is_reported_as_what_was_imported() -> None:
    compiled = set(native.compiled_modules())
    assert len(set(native.HOT_MODULES)) == len(native.HOT_MODULES) == 44
    for name in native.HOT_MODULES:
        assert (ROOT / (name.replace(".", "/") + ".py")).is_file(), name  # the script builds from this file
        mod = importlib.import_module(name)
        loaded = isinstance(mod.__loader__, importlib.machinery.ExtensionFileLoader)
        assert (name in compiled) == loaded, (name, mod.__spec__)
    label = native.build_label()
    assert label in (("true", "stale") if len(compiled) == 44 else ("false",)), label
    assert native.describe().startswith("pure Python" if not compiled else "compiled (44/44 hot modules")


def test_build_info_carries_the_compiled_label(monkeypatch: pytest.MonkeyPatch) -> None:
    text = generate_latest(RouterMetrics("9.9").registry).decode()
    line = next(ln for ln in text.splitlines() if ln.startswith("dplb_build_info{"))
    assert f'compiled="{native.build_label()}"' in line and 'component="router"' in line, line
    monkeypatch.setattr(native, "_BUILD", [native.Build("/x", native.HOT_MODULES, stale=("config.py",))])
    text = generate_latest(RouterMetrics("9.9").registry).decode()
    assert 'dplb_build_info{compiled="stale",component="router"' in text  # never "true" for old code


def test_mypyc_attr_is_a_no_op_in_pure_python() -> None:
    class C:
        pass

    assert native.mypyc_attr(allow_interpreted_subclasses=True)(C) is C


# ---- a faked build in a copy of the sources -----------------------------------------------------------------------
def _fake_build(tmp_path: Path) -> Path:
    """``tmp_path/dplb``: the package's sources and a whole, current build of fake extension files (their content
    is their module's name: an import of one would fail, so a command that imports a hot module before it checks
    the build fails loudly)."""
    pkg = tmp_path / "dplb"
    shutil.copytree(ROOT / "dplb", pkg, ignore=shutil.ignore_patterns("*.so", "__pycache__", native.MANIFEST,
                                                                      "*.installing"))
    for name in (*native.HOT_MODULES, native.GROUP_LIBRARY):
        (pkg / ("/".join(name.split(".")[1:]) + SUFFIX)).write_text(name)
    (pkg / native.MANIFEST).write_text(json.dumps(native.manifest_for(str(pkg))))
    importlib.invalidate_caches()
    return pkg


def _so(pkg: Path, name: str) -> Path:
    return pkg / ("/".join(name.split(".")[1:]) + SUFFIX)


def test_a_whole_current_build_runs(tmp_path: Path) -> None:
    b = native.inspect_build(str(_fake_build(tmp_path)))
    assert (b.label, b.refusal(), b.compiled, b.missing, b.foreign, b.stale) == ("true", "", native.HOT_MODULES,
                                                                                (), (), ())


def test_no_extension_module_is_pure_python(tmp_path: Path) -> None:
    pkg = tmp_path / "dplb"
    shutil.copytree(ROOT / "dplb", pkg, ignore=shutil.ignore_patterns("*.so", "__pycache__", native.MANIFEST))
    b = native.inspect_build(str(pkg))
    assert b.pure and b.label == "false" and b.refusal() == "" and b.compiled == ()


@pytest.mark.parametrize(("remove", "says"), [
    ("dplb.policy.core", "dplb.policy.core has no extension module"),  # segfaulted the router
    ("dplb.obs.metrics_router", "dplb.obs.metrics_router has no extension module"),  # TypeError crash loop
    ("dplb.router.routes", "dplb.router.routes has no extension module"),  # ran, said "32/32" and "true"
    (native.GROUP_LIBRARY, "mypyc's shared library dplb/_hot__mypyc.*.so is missing"),  # every import failed
    (native.MANIFEST, f"dplb/{native.MANIFEST} is missing"),
], ids=["core", "metrics_router", "routes", "group-library", "manifest"])
def test_every_missing_part_makes_a_partial_build_that_is_refused(tmp_path: Path, remove: str, says: str) -> None:
    pkg = _fake_build(tmp_path)
    (pkg / remove if remove == native.MANIFEST else _so(pkg, remove)).unlink()
    importlib.invalidate_caches()
    b = native.inspect_build(str(pkg))
    assert b.label == "partial" and b.partial
    assert b.refusal() == (f"the compiled build in {pkg}/ is partial ({says}), and a compiled build only works "
                           f"whole; {native.FIXES}") == b.refusal(accept_stale=True)


def test_an_extension_file_not_of_the_build_makes_it_partial(tmp_path: Path) -> None:
    """A stray .so (of a module the build does not compile: the import system prefers it to the .py) and a .so
    copied in from another build (same name, other content) are not this build's."""
    pkg = _fake_build(tmp_path)
    (pkg / "router" / ("app" + SUFFIX)).write_text("stray")
    _so(pkg, "dplb.policy.fused").write_text("another build's")
    importlib.invalidate_caches()
    b = native.inspect_build(str(pkg))
    assert b.label == "partial" and b.foreign == (f"dplb/policy/fused{SUFFIX}", f"dplb/router/app{SUFFIX}")
    assert f"dplb/policy/fused{SUFFIX} is not this build's, dplb/router/app{SUFFIX} is not this build's" in b.refusal()


def test_a_changed_source_makes_the_build_stale_by_content_not_mtime(tmp_path: Path) -> None:
    """A hot module's source and a module the compiled code imports (mypyc inlined its Final constants) are
    compared by content: an edit is stale (refused unless accepted, labelled "stale"); the same content written
    back (``git checkout FILE``: a new mtime) is not; a module the hot path does not import is not covered."""
    pkg = _fake_build(tmp_path)
    proxy, config = pkg / "router" / "proxy.py", pkg / "config.py"
    original = proxy.read_text()
    proxy.write_text(original + "# edited\n")
    config.write_text(config.read_text() + "# edited\n")
    (pkg / "bench" / "plots.py").write_text("# not on the hot path\n")
    b = native.inspect_build(str(pkg))
    assert b.stale == ("config.py", "router/proxy.py") and b.label == "stale" and not b.partial
    assert b.refusal() == (f"the compiled build in {pkg}/ is stale: dplb/config.py, dplb/router/proxy.py changed "
                           f"since it was built, and it would run the old code; {native.FIXES}; "
                           f"{native.ACCEPT_STALE_ENV}=1 runs it anyway")
    assert b.refusal(accept_stale=True) == ""
    proxy.write_text(original)
    os.utime(proxy, (2_000_000_000, 2_000_000_000))
    assert native.inspect_build(str(pkg)).stale == ("config.py",)


def test_the_sources_of_the_build_are_what_the_hot_path_imports() -> None:
    sources = native.build_sources()
    assert {"config.py", "errors.py", "native.py", "__init__.py", "policy/__init__.py", "router/peek.py"} \
        <= set(sources)
    assert {m.replace(".", "/")[5:] + ".py" for m in native.HOT_MODULES} <= set(sources)
    assert not [p for p in sources if p.startswith(("bench/", "worker/"))] and "cli.py" not in sources


@pytest.mark.parametrize("argv", [["state"], ["doctor"], ["router", "--help"], ["worker", "--help"], ["--version"]],
                         ids=lambda a: a[0])
def test_every_command_refuses_a_partial_build_before_importing_it(tmp_path: Path, argv: list[str]) -> None:
    """The fake extension files cannot be imported: a command that imported any hot module before checking would
    fail with a traceback (or, on a real partial build, a segfault). It prints one line and exits 1."""
    pkg = _fake_build(tmp_path)
    _so(pkg, "dplb.policy.core").unlink()
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "DPLB_ACCEPT_STALE_BUILD": "1"}
    r = subprocess.run([sys.executable, "-P", "-m", "dplb.cli", *argv], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr == (f"dplb: error: the compiled build in {pkg}/ is partial (dplb.policy.core has no extension "
                        f"module), and a compiled build only works whole; {native.FIXES}\n"), r.stderr


def test_a_stale_build_is_refused_unless_accepted(tmp_path: Path) -> None:
    pkg = _fake_build(tmp_path)
    (pkg / "policy" / "scorers.py").write_text("# edited\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    env.pop(native.ACCEPT_STALE_ENV, None)
    r = subprocess.run([sys.executable, "-P", "-m", "dplb.cli", "state"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 75 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"dplb: error: the compiled build in {pkg}/ is stale: dplb/policy/scorers.py"), r.stderr
    probe = "from dplb import cli, native; print(native.refusal() or 'runs', native.build_label())"
    r = subprocess.run([sys.executable, "-P", "-c", probe], env={**env, native.ACCEPT_STALE_ENV: "1"},
                       capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["runs", "stale"], r.stdout + r.stderr


@pytest.mark.parametrize("broken", ["partial", "stale"])
def test_importing_the_package_directly_refuses_the_build_too(tmp_path: Path, broken: str) -> None:
    """A test, benchmark or script that imports ``dplb`` (not through the ``dplb`` command) gets the same refusal as
    an ImportError at its first hot module, before the extension loads (the fake one would fail otherwise);
    modules off the hot path still import."""
    pkg = _fake_build(tmp_path)
    if broken == "partial":
        _so(pkg, "dplb.policy.core").unlink()
    else:
        (pkg / "policy" / "scorers.py").write_text("# edited\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    env.pop(native.ACCEPT_STALE_ENV, None)
    probe = ("import dplb.errors\n"
             "for name in ('dplb.router.proxy', 'dplb.state.shm'):\n"
             "    try:\n        __import__(name)\n    except ImportError as e:\n        print(name, e.name, e)\n")
    r = subprocess.run([sys.executable, "-P", "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 2, r.stdout + r.stderr
    assert lines[0].startswith(f"dplb.router.proxy dplb.router.proxy the compiled build in {pkg}/ is {broken}")
    assert lines[1].startswith(f"dplb.state.shm dplb.state.shm the compiled build in {pkg}/ is {broken}")


def test_describe_and_doctor_say_which_build_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    whole = native.Build("/x", native.HOT_MODULES)
    stale = native.Build("/x", native.HOT_MODULES, stale=("router/proxy.py",))
    partial = native.Build("/x", native.HOT_MODULES[1:], missing=(native.HOT_MODULES[0],))
    pure = native.Build("/x", (), missing=(*native.HOT_MODULES, native.GROUP_LIBRARY))
    expect = {
        "pure Python": (pure, "pass"),
        "compiled (44/44 hot modules)": (whole, "pass"),
        "compiled (44/44 hot modules; STALE: dplb/router/proxy.py changed since the build, run because "
        "DPLB_ACCEPT_STALE_BUILD=1)": (stale, "fail"),
        f"compiled (43/44 hot modules; PARTIAL: {partial.refusal()})": (partial, "fail"),
    }
    for line, (b, status) in expect.items():
        monkeypatch.setattr(native, "_BUILD", [b])
        assert native.describe() == line
        check = doctor.check_build()
        assert (check.name, check.status) == ("build", status), check
        assert check.fix == ("" if status == "pass" else native.FIXES), check


#: Behaviour tests run again against the compiled copy: the direct relay byte for byte against the ASGI path, its
#: timeouts, kills and limits, pipelining with disconnects, the exact request and response heads, keep-alive, the
#: lingering close's bounds, panic routing, the worker health's state machine and the HTTP request count (unit
#: tests, seconds). A compiled-only bug (mypyc's typed locals, native classes that cannot be patched) shows up here
#: in CI, where the README's test command otherwise runs pure Python only.
COMPILED_CHECKS = ("test_native_stale.py", "test_direct_relay.py", "test_pipelined_disconnect.py", "test_head_bytes.py",
                   "test_serving_keepalive.py", "test_serving_linger.py", "test_panic.py", "test_health.py",
                   "test_http_count.py", "test_policy_plugins.py")


def _run(argv: list[str], env: dict[str, str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _check_refusals(tree: Path, env: dict[str, str]) -> None:
    """On the whole compiled copy: a partial build (a module's .so, or the shared library, moved away) and a stale
    one (a comment added to a hot module, which compiled code imports first: mypyc gives it a wrong ``__file__``)
    are refused by a dplb command in one line, before anything crashes; accepted, the stale build runs and says so
    (``dplb_build_info{compiled="stale"}``, the start-up line); the source written back, it is whole again."""
    pkg = tree / "dplb"
    cmd = [sys.executable, "-P", "-m", "dplb.cli", "state", "--shm-path", "/dev/shm/dplb_no_such_segment"]
    for name, says in (("dplb.policy.core", "dplb.policy.core has no extension module"),
                       (native.GROUP_LIBRARY, "mypyc's shared library dplb/_hot__mypyc.*.so is missing")):
        so = _so(pkg, name)
        so.rename(tree / "moved.so")
        try:
            r = _run(cmd, env, tree)
        finally:
            (tree / "moved.so").rename(so)
        assert r.returncode == 1 and r.stderr.count("\n") == 1 and f"is partial ({says})" in r.stderr, r.stderr
    proxy = pkg / "router" / "proxy.py"
    original = proxy.read_text()
    proxy.write_text(original + "# changed after the build\n")
    r = _run(cmd, env, tree)
    assert r.returncode == 75 and "is stale: dplb/router/proxy.py changed since it was built" in r.stderr, r.stderr
    probe = ("import dplb.router.app, dplb.router.proxy; from dplb import native; from prometheus_client import "
             "generate_latest; from dplb.obs.metrics_router import RouterMetrics; print(native.describe()); "
             "print(generate_latest(RouterMetrics('x').registry).decode())")
    r = _run([sys.executable, "-P", "-c", probe], {**env, native.ACCEPT_STALE_ENV: "1"}, tree)
    assert r.returncode == 0 and "STALE: dplb/router/proxy.py changed since the build" in r.stdout, r.stdout + r.stderr
    assert 'dplb_build_info{compiled="stale"' in r.stdout, r.stdout
    proxy.write_text(original)
    r = _run([sys.executable, "-P", "-m", "dplb.native", "check"], env, tree)
    assert r.returncode == 0 and r.stdout.startswith("true: 44/44"), r.stdout + r.stderr


def _check_failed_rebuild_keeps_the_build(tree: Path, env: dict[str, str]) -> None:
    """A rebuild that fails (a type error) installs nothing: every .so and the manifest are the same files as
    before, and the build is whole again once the source is back."""
    pkg = tree / "dplb"
    before = {p: p.stat().st_ino for p in [*pkg.rglob("*.so"), pkg / native.MANIFEST]}
    stall = pkg / "policy" / "stall.py"
    original = stall.read_text()
    stall.write_text(original + '\nBROKEN: int = "not an int"\n')
    try:
        r = _run(["bash", str(tree / "scripts" / "build_native.sh")], env, tree, timeout=600)
    finally:
        stall.write_text(original)
    assert r.returncode == 1 and "nothing was installed: dplb/ keeps what it had" in r.stderr, r.stdout + r.stderr
    assert {p: p.stat().st_ino for p in [*pkg.rglob("*.so"), pkg / native.MANIFEST]} == before
    assert _run([sys.executable, "-P", "-m", "dplb.native", "check"], env, tree).returncode == 0


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_build_imports_wherever_the_package_does_and_passes_the_relay_tests(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """scripts/build_native.sh on a copy of the tree, then (1) the compiled package imported the way an editable
    install maps it: the package directory alone on the path, not the tree's root (mypyc's shared library must sit
    inside the package, or every dplb command fails to import); (2) partial and stale builds refused
    (:func:`_check_refusals`) and a failed rebuild that keeps the build (:func:`_check_failed_rebuild_keeps_the_build`);
    (3) :data:`COMPILED_CHECKS` run against that copy, its routers and workers compiled (the copy first on
    ``PYTHONPATH``, ahead of the editable install)."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: scripts/build_native.sh needs one")
    tree = tmp_path / "tree"
    junk = shutil.ignore_patterns("*.so", "__pycache__", ".pytest_cache", native.MANIFEST, "*.installing")
    for part in ("dplb", "scripts", "tests", "benchmarks"):
        shutil.copytree(ROOT / part, tree / part, ignore=junk)
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    env = {**os.environ, "PYTHON": sys.executable, "OPT_LEVEL": "0"}  # what is tested is where the build lands
    env.pop("PYTHONPATH", None)
    env.pop(native.ACCEPT_STALE_ENV, None)
    r = _run(["bash", str(tree / "scripts" / "build_native.sh")], env, tree, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "warning" not in r.stdout + r.stderr, r.stdout + r.stderr  # mypyc's "Unsupported default attribute value"
    assert not list(tree.glob("*.so")), "a shared library at the tree's root is importable only with the root on the path"
    site = tmp_path / "site"  # what an editable install puts on the path: the package, not the root
    site.mkdir()
    (site / "dplb").symlink_to(tree / "dplb")
    probe = "from dplb import native; import dplb.router.app; print(native.build_label())"
    r = _run([sys.executable, "-c", probe], {**env, "PYTHONPATH": str(site)}, tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "true", r.stdout + r.stderr[-2000:]
    compiled_env = {**env, "PYTHONPATH": str(tree)}
    r = _run([sys.executable, "-c", probe], compiled_env, tree)
    assert r.returncode == 0 and r.stdout.strip() == "true", r.stdout + r.stderr[-2000:]
    _check_refusals(tree, compiled_env)
    _check_failed_rebuild_keeps_the_build(tree, env)
    r = _run([sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider",
              *(f"tests/{name}" for name in COMPILED_CHECKS)], compiled_env, tree, timeout=900)
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
