"""A compiled build that goes stale under a running stack (the checkout edited or pulled while it serves): the
running router notices and says so (``dplb_build_info{compiled="stale"}``, one WARNING), a restart of it is refused
with its own exit status, and ``dplb launch`` keeps the workers and retries the router until the build is fixed.

The build is faked as tests/test_native.py does (extension files of any content and a manifest written by
:func:`dplb.native.manifest_for`): the refusal happens before any hot module is imported, so the fake is never loaded.
The launcher test starts the stack from a pure-Python copy of the package and plants the (stale) fake build in it
while the stack runs, which is what a ``git pull`` does to a compiled checkout.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from cluster import launched, router_ready
from prometheus_client import generate_latest
from test_native import _fake_build, _so

from dplb import native
from dplb.config import PolicyConfig, RouterConfig
from dplb.errors import StaleBuildError
from dplb.router.app import RouterApp

ROOT = Path(__file__).resolve().parent.parent


def test_stale_watch_notices_an_edit_by_content_at_most_every_interval(tmp_path: Path) -> None:
    pkg = _fake_build(tmp_path)
    watch = native.StaleWatch(native.inspect_build(str(pkg)), every_s=5.0)
    assert watch.label == "true" and watch.poll(100.0) is None
    scorers = pkg / "policy" / "scorers.py"
    original = scorers.read_text()
    scorers.write_text(original + "# pulled\n")
    assert watch.poll(101.0) is None  # within the interval: not even a stat
    assert watch.poll(105.0) == "stale" and watch.stale == ("policy/scorers.py",)
    assert watch.poll(111.0) is None  # reported once
    scorers.write_text(original)  # `git checkout` of the file: new mtime, the build's content
    os.utime(scorers, (2_000_000_000, 2_000_000_000))
    assert watch.poll(117.0) == "true" and watch.stale == ()


def test_stale_watch_watches_nothing_for_pure_python(tmp_path: Path) -> None:
    pkg = tmp_path / "dplb"
    shutil.copytree(ROOT / "dplb", pkg, ignore=shutil.ignore_patterns("*.so", "__pycache__", native.MANIFEST))
    watch = native.StaleWatch(native.inspect_build(str(pkg)), every_s=0.0)
    (pkg / "config.py").write_text("# edited\n")
    assert watch.poll(1.0) is None and watch.label == "false"


def test_the_router_reports_its_build_going_stale_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """In-process router: its monitor step runs the build check; the edit turns ``dplb_build_info``'s label to
    ``stale`` with one WARNING naming the file and the fix; reverting turns it back."""
    pkg = _fake_build(tmp_path / "tree")
    app = RouterApp(RouterConfig(PolicyConfig(), run_dir=str(tmp_path), num_workers=1,
                                 shm_path=str(tmp_path / "absent")))
    app._build_watch = native.StaleWatch(native.inspect_build(str(pkg)), every_s=0.0)
    config = pkg / "config.py"
    original = config.read_text()
    config.write_text(original + "X = 1\n")
    with caplog.at_level(logging.INFO, logger="dplb.router"):
        app.state.check_once()
        app.state.check_once()
    text = generate_latest(app.metrics.registry).decode()
    assert 'dplb_build_info{compiled="stale",component="router"' in text, text
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "build went stale" in r.getMessage()]
    assert len(warnings) == 1 and "dplb/config.py" in warnings[0] and "scripts/build_native.sh" in warnings[0]
    config.write_text(original)
    os.utime(config, (2_000_000_000, 2_000_000_000))
    app.state.check_once()
    assert 'dplb_build_info{compiled="true",component="router"' in generate_latest(app.metrics.registry).decode()


def test_a_stale_refusal_has_its_own_exit_status_and_a_partial_one_does_not(tmp_path: Path) -> None:
    pkg = _fake_build(tmp_path)
    (pkg / "policy" / "scorers.py").write_text("# edited\n")
    env = {k: v for k, v in os.environ.items() if k != native.ACCEPT_STALE_ENV}
    env["PYTHONPATH"] = str(tmp_path)
    r = subprocess.run([sys.executable, "-P", "-m", "dplb.cli", "state"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == StaleBuildError.exit_code == 75 and "is stale" in r.stderr, r.stderr
    (pkg / native.MANIFEST).unlink()
    r = subprocess.run([sys.executable, "-P", "-m", "dplb.cli", "state"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and "is partial" in r.stderr, r.stderr


def _router_pid(launcher_pid: int) -> int:
    out = subprocess.run(["ps", "ww", "-o", "pid=,args=", "--ppid", str(launcher_pid)], capture_output=True, text=True)
    pids = [int(ln.split()[0]) for ln in out.stdout.splitlines() if " router --config-env" in ln]
    return pids[0] if len(pids) == 1 else 0


def _wait(pred, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def test_launch_keeps_the_workers_while_the_router_restart_is_refused_as_stale(tmp_path: Path) -> None:
    """Real launcher, sim worker: the build goes stale under the running stack, the router is SIGKILLed. Each
    restart is refused (exit 75); the launcher does not give up after --max-start-failures, keeps the worker (same
    pid), logs one ERROR naming the fix, and the router is back once the build is removed (``--clean``)."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "dplb", tree / "dplb", ignore=shutil.ignore_patterns("*.so", "__pycache__",
                                                                                native.MANIFEST, "*.installing"))
    env = {k: v for k, v in os.environ.items() if k != native.ACCEPT_STALE_ENV}
    env["PYTHONPATH"] = str(tree)
    with launched(tmp_path, "--num-workers", "1", "--max-start-failures", "2", env=env, cwd=str(tree)) as s:
        _wait(lambda: router_ready(s.url) and s.state()["workers"][0]["lifecycle"] == "ready", 60, "ready")
        worker_pid = s.state()["workers"][0]["pid"]
        pkg = tree / "dplb"
        _plant_stale_build(pkg)
        router = _router_pid(s.proc.pid)
        assert router > 0, subprocess.run(["ps", "ww", "-o", "pid=,args=", "--ppid", str(s.proc.pid)],
                                          capture_output=True, text=True).stdout
        os.kill(router, signal.SIGKILL)
        router_log = Path(s.run_dir) / "router.log"
        _wait(lambda: router_log.read_text().count("is stale") >= 3, 60, "three refused restarts")
        log = s.log.read_text()
        assert s.proc.poll() is None, log  # not "giving up"
        errors = [ln for ln in log.splitlines() if "ERROR" in ln and "router restart refused" in ln]
        assert len(errors) == 1 and "dplb/policy/scorers.py" in errors[0], log
        # One "router restarted" line for the refused retries (one every <= 5 s; the next line a minute later at
        # most), after the one of the restart that found the build stale
        retried = [ln for ln in log.splitlines() if "router restarted" in ln]
        assert len(retried) == 2 and "refused for the stale build" in retried[1], log
        assert "scripts/build_native.sh" in errors[0] and "--clean" in errors[0], errors
        assert "giving up" not in log and s.state()["workers"][0]["pid"] == worker_pid
        for p in pkg.rglob("*" + native._SUFFIXES[0]):  # scripts/build_native.sh --clean
            p.unlink()
        (pkg / native.MANIFEST).unlink()
        _wait(lambda: router_ready(s.url), 30, "the router back after the build was removed")
        r = httpx.post(s.url + "/v1/chat/completions", json={"model": "dplb-sim", "max_tokens": 2,
                       "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
        assert r.status_code == 200 and s.state()["workers"][0]["pid"] == worker_pid
        assert "router started: the build is current again" in s.log.read_text()
        s.proc.send_signal(signal.SIGINT)
        assert s.proc.wait(30) == 0


def _plant_stale_build(pkg: Path) -> None:
    """A whole fake build in the running tree, then a source changed under it (a ``git pull``)."""
    for name in (*native.HOT_MODULES, native.GROUP_LIBRARY):
        _so(pkg, name).write_text(name)
    (pkg / native.MANIFEST).write_text(json.dumps(native.manifest_for(str(pkg))))
    (pkg / "policy" / "scorers.py").write_text((pkg / "policy" / "scorers.py").read_text() + "# pulled\n")


def test_a_router_group_whose_children_refuse_a_stale_build_exits_75_and_launch_keeps_retrying(
        tmp_path: Path) -> None:
    """``--router-processes 2``: the build goes stale under the running group and both children are SIGKILLed.
    Their restarts are refused (exit 75); the group's parent gives up with 75 too (it exited 1, which the launcher
    took for a crash: "router exit 1; restarting"), so the launcher logs the one refusal ERROR, no crash WARNING,
    keeps the worker and brings the group back once the build is removed."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "dplb", tree / "dplb", ignore=shutil.ignore_patterns("*.so", "__pycache__",
                                                                                native.MANIFEST, "*.installing"))
    env = {k: v for k, v in os.environ.items() if k != native.ACCEPT_STALE_ENV}
    env["PYTHONPATH"] = str(tree)
    with launched(tmp_path, "--num-workers", "1", "--router-processes", "2", "--max-start-failures", "2", env=env,
                  cwd=str(tree)) as s:
        _wait(lambda: router_ready(s.url) and s.state()["workers"][0]["lifecycle"] == "ready", 60, "ready")
        worker_pid = s.state()["workers"][0]["pid"]
        parent = _router_pid(s.proc.pid)
        children = [int(p) for p in subprocess.run(["ps", "-o", "pid=", "--ppid", str(parent)], capture_output=True,
                                                   text=True).stdout.split()]
        assert parent > 0 and len(children) == 2, children
        _plant_stale_build(tree / "dplb")
        for pid in children:
            os.kill(pid, signal.SIGKILL)
        router_log = Path(s.run_dir) / "router.log"
        _wait(lambda: "failed to start 5 times in a row (exit 75)" in router_log.read_text(), 90,
              "the group's parent to give up")
        _wait(lambda: "router restart refused" in s.log.read_text(), 30, "the launcher's refusal line")
        log = s.log.read_text()
        assert s.proc.poll() is None and "router exit" not in log and "giving up" not in log, log
        errors = [ln for ln in log.splitlines() if "ERROR" in ln and "router restart refused" in ln]
        assert len(errors) == 1 and "dplb/policy/scorers.py" in errors[0], log
        assert s.state()["workers"][0]["pid"] == worker_pid
        for p in (tree / "dplb").rglob("*" + native._SUFFIXES[0]):  # scripts/build_native.sh --clean
            p.unlink()
        (tree / "dplb" / native.MANIFEST).unlink()
        _wait(lambda: "router started: the build is current again" in s.log.read_text(), 30,
              "the group back after the build was removed")
        assert router_ready(s.url)
        assert s.state()["workers"][0]["pid"] == worker_pid


def test_a_group_child_refused_for_a_stale_build_beside_a_serving_sibling_is_logged_once(tmp_path: Path) -> None:
    """``--router-processes 2``: the build goes stale under the running group and one child is SIGKILLed. Its
    sibling keeps serving, so the parent keeps retrying it; the parent checks the build itself before each retry
    and starts no child that would only refuse, so the refusal is logged once (the child's line and the parent's),
    not twice per retry (every 10 s, indefinitely), and the retries go on (one line a minute at most)."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "dplb", tree / "dplb", ignore=shutil.ignore_patterns("*.so", "__pycache__",
                                                                                native.MANIFEST, "*.installing"))
    env = {k: v for k, v in os.environ.items() if k != native.ACCEPT_STALE_ENV}
    env["PYTHONPATH"] = str(tree)
    with launched(tmp_path, "--num-workers", "1", "--router-processes", "2", env=env, cwd=str(tree)) as s:
        _wait(lambda: router_ready(s.url) and s.state()["workers"][0]["lifecycle"] == "ready", 60, "ready")
        parent = _router_pid(s.proc.pid)
        children = [int(p) for p in subprocess.run(["ps", "-o", "pid=", "--ppid", str(parent)], capture_output=True,
                                                   text=True).stdout.split()]
        assert parent > 0 and len(children) == 2, children
        _plant_stale_build(tree / "dplb")
        os.kill(children[0], signal.SIGKILL)
        router_log = Path(s.run_dir) / "router.log"
        # Five refused starts take 0.5 + 1 + 2 + 4 + 8 s of backoff; then one every 10 s
        _wait(lambda: "failed to start 5 times in a row (exit 75)" in router_log.read_text(), 60, "5 refused starts")
        time.sleep(11)  # one more retry at the longest backoff
        lines = router_log.read_text().splitlines()
        child = [ln for ln in lines if "error: the compiled build" in ln and "is stale" in ln]
        ours = [ln for ln in lines if "(exit 75: the compiled build went stale" in ln]
        assert len(child) == 1 and len(ours) == 1, "\n".join(lines[-30:])
        assert "processes 1 still serve" in router_log.read_text()
        assert router_ready(s.url) and s.proc.poll() is None
        r = httpx.post(s.url + "/v1/chat/completions", json={"model": "dplb-sim", "max_tokens": 2,
                       "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
        assert r.status_code == 200


@pytest.mark.skipif(len(native.compiled_modules()) != len(native.HOT_MODULES),
                    reason="needs the compiled build in place (scripts/build_native.sh; test_native's slow test runs "
                           "this file against its build)")
def test_a_compiled_stack_goes_stale_under_its_router_and_heals_when_the_source_is_back(tmp_path: Path) -> None:
    """The real compiled build, copied whole (it runs wherever the package is): a source edited under the running
    stack turns the router's ``dplb_build_info`` to ``stale`` with one WARNING; the router SIGKILLed is refused
    (exit 75) and retried, the worker kept; the source put back (`git checkout FILE`), the router starts compiled."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "dplb", tree / "dplb", ignore=shutil.ignore_patterns("__pycache__", "*.installing"))
    env = {k: v for k, v in os.environ.items() if k != native.ACCEPT_STALE_ENV}
    env["PYTHONPATH"] = str(tree)
    with launched(tmp_path, "--num-workers", "1", env=env, cwd=str(tree)) as s:
        _wait(lambda: router_ready(s.url) and s.state()["workers"][0]["lifecycle"] == "ready", 90, "ready")
        assert "build:   compiled (44/44 hot modules)" in s.log.read_text()
        worker_pid = s.state()["workers"][0]["pid"]
        source = tree / "dplb" / "policy" / "scorers.py"
        original = source.read_text()
        source.write_text(original + "# pulled\n")

        def info() -> str:
            text = httpx.get(s.url + "/metrics", timeout=5).text
            return next(ln for ln in text.splitlines() if ln.startswith("dplb_build_info{"))

        _wait(lambda: 'compiled="stale"' in info(), native.STALE_CHECK_S + 5, "the router to notice")
        router_log = Path(s.run_dir) / "router.log"
        assert router_log.read_text().count("the compiled build went stale under this router") == 1
        os.kill(_router_pid(s.proc.pid), signal.SIGKILL)
        _wait(lambda: "router restart refused" in s.log.read_text(), 30, "the refused restart")
        assert s.proc.poll() is None and s.state()["workers"][0]["pid"] == worker_pid
        source.write_text(original)
        _wait(lambda: router_ready(s.url), 30, "the router back once the source is the build's again")
        assert 'compiled="true"' in info() and s.state()["workers"][0]["pid"] == worker_pid
        s.proc.send_signal(signal.SIGINT)
        assert s.proc.wait(30) == 0
