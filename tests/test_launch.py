"""`dplb launch` end to end on the sim engine: real launcher, real workers, real signals, full cleanup."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter

import httpx
import pytest
from cluster import dplb_cmd, free_port, launched, router_ready
from proc_tags import kill_tagged, new_tag, tagged_procs

from dplb import native


def _wait(pred, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:  # type: ignore[no-untyped-def, type-arg]
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"launcher exited ({proc.returncode}) while waiting for {what}")
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _state(shm: str) -> dict:  # type: ignore[type-arg]
    out = subprocess.run(dplb_cmd("state", "--json", "--shm-path", shm), capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def _dplb_procs(tag: str) -> list[str]:
    """``"pid command line"`` of every live process this test started under ``tag`` (tests/proc_tags.py: by
    ancestry and start time, never another stack's processes with a similar command line)."""
    return [f"{pid} {cmd}" for pid, cmd in tagged_procs(tag)]


def test_launch_sim_four_workers_restart_and_clean_stop(tmp_path) -> None:  # type: ignore[no-untyped-def]
    tag = new_tag()
    shm = f"/dev/shm/dplb_state_test_{tag}"
    run_dir = str(tmp_path / f"r-{tag[:8]}")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "launch.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        dplb_cmd("launch", "--num-workers", "4", "--port", str(port), "--host", "127.0.0.1", "--shm-path", shm,
                 "--run-dir", run_dir, "--metrics-port-base", "0", "--drain-timeout", "5"),
        stdout=log, stderr=subprocess.STDOUT)
    try:
        t0 = time.monotonic()
        _wait(lambda: router_ready(url) and all(w["lifecycle"] == "ready" for w in _state(shm)["workers"]), 60,
              "4 ready workers", proc)
        took = time.monotonic() - t0
        st = _state(shm)
        assert len(st["workers"]) == 4 and st["header"]["model"] == "dplb-sim"
        banner = (tmp_path / "launch.log").read_text()
        assert "SIM engine" in banner and f"http://127.0.0.1:{port}" in banner and "curl" in banner
        assert f"  build:   {native.describe()}\n" in banner, banner  # pure Python, or compiled (44/44 …)
        # Traffic spreads over all four.
        seen = Counter()
        for i in range(24):
            r = httpx.post(url + "/v1/chat/completions", json={"model": "dplb-sim", "max_tokens": 2,
                           "messages": [{"role": "user", "content": f"q{i}"}]}, timeout=30)
            assert r.status_code == 200
            seen[r.headers["x-sg-worker-id"]] += 1
        assert set(seen) == {"0", "1", "2", "3"}, seen
        # Kill worker 2's process: the launcher restarts it and it serves again.
        old_pid = next(w["pid"] for w in st["workers"] if w["worker"] == 2)
        os.kill(old_pid, signal.SIGKILL)
        _wait(lambda: (lambda w: w["pid"] not in (0, old_pid) and w["lifecycle"] == "ready")(
            _state(shm)["workers"][2]), 30, "worker 2 restarted", proc)
        seen2 = Counter()
        for i in range(40):
            r = httpx.post(url + "/v1/chat/completions", json={"model": "dplb-sim", "max_tokens": 1,
                           "messages": [{"role": "user", "content": f"again {i}"}]}, timeout=30)
            assert r.status_code == 200
            seen2[r.headers["x-sg-worker-id"]] += 1
        assert seen2["2"] > 0, seen2
        # SIGINT: everything stops, nothing is left behind.
        proc.send_signal(signal.SIGINT)
        t_stop = time.monotonic()
        assert proc.wait(30) == 0
        assert time.monotonic() - t_stop < 30
        assert not os.path.exists(shm), "segment left in /dev/shm"
        assert not [n for n in os.listdir(run_dir) if n.endswith(".sock")], "sockets left behind"
        assert os.path.exists(os.path.join(run_dir, "router.log")), "logs must survive the stop"
        assert _dplb_procs(tag) == [], _dplb_procs(tag)
        print(f"4 sim workers ready in {took:.1f} s")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
        kill_tagged(tag)
        if os.path.exists(shm):
            os.unlink(shm)


def test_launch_refuses_bad_plan_and_bad_flags() -> None:
    r = subprocess.run(dplb_cmd("launch", "--num-workers", "0"), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--num-workers must be 1..64" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run(dplb_cmd("launch", "--num-workers", "65"), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--num-workers must be 1..64, got 65" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run(dplb_cmd("launch", "--weights", "0.5,0.5,0.5", "--port", str(free_port())),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "sum to 1" in r.stderr and "Traceback" not in r.stderr


def test_worker_without_segment_is_a_clear_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = {k: v for k, v in os.environ.items() if k != "DPLB_SHM_PATH"}
    r = subprocess.run(dplb_cmd("worker", "--worker-id", "0", "--uds", str(tmp_path / "w.sock")),
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode != 0 and "DPLB_SHM_PATH" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("args", [["--json"], []])
def test_state_without_segment(args: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DPLB_SHM_PATH"}
    r = subprocess.run(dplb_cmd("state", "--shm-path", "/dev/shm/dplb_state_nope", *args), capture_output=True,
                       text=True, timeout=60, env=env)
    assert r.returncode == 1 and "does not exist" in r.stderr and "Traceback" not in r.stderr


def test_second_launch_refuses_and_leaves_the_first_untouched(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Regression: a second `dplb launch` on the same port/run dir crash-looped, then deleted
    the first launch's sockets, leaving ready-looking workers that answered 502."""
    tag = new_tag()
    shm = f"/dev/shm/dplb_state_test_{tag}"
    run_dir = str(tmp_path / "run")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    common = ["--num-workers", "2", "--port", str(port), "--host", "127.0.0.1", "--run-dir", run_dir,
              "--metrics-port-base", "0"]
    with open(tmp_path / "first.log", "wb") as log:
        first = subprocess.Popen(dplb_cmd("launch", "--shm-path", shm, *common), stdout=log,
                                 stderr=subprocess.STDOUT)
    try:
        _wait(lambda: router_ready(url) and all(w["lifecycle"] == "ready" for w in _state(shm)["workers"]), 60,
              "first launch ready", first)
        second = subprocess.run(dplb_cmd("launch", "--shm-path", shm + "_2", *common), capture_output=True,
                                text=True, timeout=60)
        assert second.returncode == 2 and "Traceback" not in second.stderr
        assert f"127.0.0.1:{port}" in second.stderr and "--port" in second.stderr
        other_port = free_port()
        third = subprocess.run(dplb_cmd("launch", "--shm-path", shm + "_3", *common[:3], str(other_port),
                                        *common[4:]), capture_output=True, text=True, timeout=60)
        # the first served socket of its run dir: a worker's, or its engine's KV-events socket (kv-events-0.sock)
        assert third.returncode == 2 and re.search(r"(worker|kv-events)-0\.sock is served by a running process",
                                                   third.stderr), third.stderr
        assert not os.path.exists(shm + "_2") and not os.path.exists(shm + "_3")
        for k in range(2):
            assert os.path.exists(os.path.join(run_dir, f"worker-{k}.sock"))
        for i in range(10):
            r = httpx.post(url + "/v1/completions", json={"model": "dplb-sim", "prompt": f"{i}", "max_tokens": 1},
                           timeout=30)
            assert r.status_code == 200
    finally:
        first.send_signal(signal.SIGINT)
        first.wait(30)
        if os.path.exists(shm):
            os.unlink(shm)


def test_launcher_killed_takes_its_children_along(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Regression: `kill -9` on the launcher orphaned the router and workers (they kept serving, holding GPUs)."""
    tag = new_tag()
    shm = f"/dev/shm/dplb_state_test_{tag}"
    port = free_port()
    with open(tmp_path / "l.log", "wb") as log:
        proc = subprocess.Popen(dplb_cmd("launch", "--num-workers", "2", "--port", str(port), "--host", "127.0.0.1",
                                         "--shm-path", shm, "--run-dir", str(tmp_path / f"r-{tag[:8]}"),
                                         "--metrics-port-base", "0"), stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait(lambda: router_ready(f"http://127.0.0.1:{port}"), 60, "ready", proc)
        assert len(_dplb_procs(tag)) >= 3
        proc.kill()
        proc.wait(10)
        _wait(lambda: _dplb_procs(tag) == [], 30, "children to exit after the launcher died")
    finally:
        kill_tagged(tag)
        if os.path.exists(shm):
            os.unlink(shm)


def test_launch_flag_errors_are_one_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cases = [
        (["--num-workers", "65"], "--num-workers must be 1..64"),
        (["--run-dir", "/proc/nope/run"], "cannot create the run directory"),
        (["--drain-timeout", "-1"], "--drain-timeout"),
        (["--metrics-port-base", "70000"], "--metrics-port-base"),
        (["--tensor-parallel-size", "2"], "needs GPUs"),
    ]
    for args, needle in cases:
        r = subprocess.run(dplb_cmd("launch", "--port", str(free_port()), "--shm-path",
                                    f"/dev/shm/dplb_state_test_{uuid.uuid4().hex[:8]}", *args),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)


def test_launch_passes_router_flags_through(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Regression: `dplb launch --api-key-exempt` was accepted but never reached the router. Also checks that
    `--worker-args` reaches only its worker (the heterogeneous benchmark's half-speed worker), and that
    `--router-processes 2` reaches the router (the config is handed over whole, not as flags)."""
    tag = new_tag()
    shm = f"/dev/shm/dplb_state_test_{tag}"
    port = free_port()
    env = {**os.environ, "DPLB_API_KEY": "k3y"}
    with open(tmp_path / "l.log", "wb") as log:
        proc = subprocess.Popen(dplb_cmd("launch", "--num-workers", "2", "--port", str(port), "--host", "127.0.0.1",
                                         "--shm-path", shm, "--run-dir", str(tmp_path / f"r-{tag[:8]}"),
                                         "--metrics-port-base", "0", "--api-key-exempt", "/metrics",
                                         "--worker-args", "1=--sim-speed 0.5", "--router-processes", "2"),
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"

    def ready_with_key() -> bool:
        try:
            return httpx.get(url + "/ready", headers={"Authorization": "Bearer k3y"}, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        _wait(ready_with_key, 60, "ready", proc)
        assert httpx.get(url + "/health").status_code == 401  # not exempt any more
        assert httpx.get(url + "/metrics").status_code == 200
        procs = _dplb_procs(tag)
        w1 = [p for p in procs if "--worker-id 1" in p]
        w0 = [p for p in procs if "--worker-id 0" in p]
        assert len(w1) == 1 and w1[0].rstrip().endswith("--sim-speed 0.5")
        assert len(w0) == 1 and "--sim-speed" not in w0[0]
        # The router got its config whole (no flags on its command line) and runs as a group of 2.
        kids = subprocess.run(["pgrep", "-P", str(proc.pid), "-a"], capture_output=True, text=True).stdout
        router = [ln for ln in kids.splitlines() if " router --config-env" in ln]
        assert len(router) == 1 and "--api-key" not in router[0], kids
        _wait(lambda: len(_state(shm).get("routers", [])) == 2, 30, "two router slots", proc)
        assert sorted(r["process_index"] for r in _state(shm)["routers"]) == [0, 1]
        assert "k3y" not in " ".join(r for r in router)  # the key travels in the environment only
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
        if os.path.exists(shm):
            os.unlink(shm)


def test_log_tail_shows_only_this_launchers_lines(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Regression: logs are kept across runs in one --run-dir, and a worker's "last log lines"
    mixed in an earlier run's error."""
    from dplb.ops.children import Child

    log = tmp_path / "worker-0.log"
    log.write_text("old run: argument --sim-speed: expected one argument\n")
    c = Child("worker 0", [sys.executable, "-c", "print('this run')"], dict(os.environ), str(log))
    c.start()
    assert c.proc is not None and c.proc.wait(10) == 0
    assert c.log_tail() == "this run\n"
    assert "old run" in log.read_text()  # kept, just not shown


def test_launch_restarts_a_worker_frozen_past_stall_restart_after(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A worker whose process lives but publishes nothing (SIGSTOP: its collector cannot run, so it cannot exit by
    itself as a stalled worker does) is killed by the launcher once its heartbeat is --stall-restart-after stale,
    and restarted: a new pid in its slot, ready again; the other worker is untouched."""
    with launched(tmp_path, "--num-workers", "2", "--stall-after", "1", "--stall-restart-after", "3",
                  process_group=0) as ln:
        before = {w["worker"]: w["pid"] for w in (ln.wait_ready(120, workers=True) or {})["workers"]}
        os.kill(before[1], signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            while True:
                assert time.monotonic() - t0 < 60, ln.log.read_text()[-3000:]
                st = ln.state()
                w1 = next(w for w in st["workers"] if w["worker"] == 1)
                if w1["pid"] not in (0, before[1]) and w1["lifecycle"] == "ready":
                    break
                time.sleep(0.3)
            took = time.monotonic() - t0
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(before[1], signal.SIGCONT)
        w0 = next(w for w in st["workers"] if w["worker"] == 0)
        assert w0["pid"] == before[0]
        assert "published nothing for" in ln.log.read_text()
        print(f"frozen worker replaced and ready {took:.1f} s after SIGSTOP (--stall-restart-after 3)")
