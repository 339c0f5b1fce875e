"""`dplb launch` end to end on the sim engine: real launcher, real workers, real signals, full cleanup."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from collections import Counter

import httpx
import pytest
from cluster import dplb_cmd, free_port


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


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _dplb_procs(tag: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if tag in line and "ps -eo" not in line]


def test_launch_sim_four_workers_restart_and_clean_stop(tmp_path) -> None:  # type: ignore[no-untyped-def]
    tag = uuid.uuid4().hex[:10]
    shm = f"/dev/shm/dplb_state_test_{tag}"
    run_dir = str(tmp_path / f"run-{tag}")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "launch.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        dplb_cmd("launch", "--num-workers", "4", "--port", str(port), "--host", "127.0.0.1", "--shm-path", shm,
                 "--run-dir", run_dir, "--metrics-port-base", "0", "--drain-timeout", "5"),
        stdout=log, stderr=subprocess.STDOUT)
    try:
        t0 = time.monotonic()
        _wait(lambda: _ready(url) and all(w["lifecycle"] == "ready" for w in _state(shm)["workers"]), 60,
              "4 ready workers", proc)
        took = time.monotonic() - t0
        st = _state(shm)
        assert len(st["workers"]) == 4 and st["header"]["model"] == "dplb-sim"
        banner = (tmp_path / "launch.log").read_text()
        assert "SIM engine" in banner and f"http://127.0.0.1:{port}" in banner and "curl" in banner
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
        assert not os.path.exists(run_dir), "run dir (sockets) left behind"
        assert _dplb_procs(tag) == [], _dplb_procs(tag)
        print(f"4 sim workers ready in {took:.1f} s")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
        for line in _dplb_procs(tag):
            os.kill(int(line.split()[0]), signal.SIGKILL)
        if os.path.exists(shm):
            os.unlink(shm)


def test_launch_refuses_bad_plan_and_bad_flags() -> None:
    r = subprocess.run(dplb_cmd("launch", "--num-workers", "0"), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--num-workers must be ≥ 1" in r.stderr and "Traceback" not in r.stderr
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
