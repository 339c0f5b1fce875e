"""A second stack on one host is one flag: ``--port`` (run dir, metrics ports follow; the segment name is unique
per process), two launches in the same second both come up, and ``dplb doctor`` and ``dplb launch`` agree that a
run directory a live stack uses is taken."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx

from dplb.stack import stack_metrics_port_base, stack_run_dir
from dplb.state.layout import default_segment_path
from tests.cluster import dplb_cmd, free_block, free_port


def test_segment_names_are_unique_per_process_within_a_second() -> None:
    assert default_segment_path(1000, 1) != default_segment_path(1000, 2)
    assert default_segment_path(1000, 7).endswith("dplb_state_1000_7")


def test_stack_defaults_follow_the_port(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("DPLB_RUN_DIR", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/5")
    assert stack_run_dir(30000) == "/run/user/5/dplb" and stack_run_dir(31000) == "/run/user/5/dplb-31000"
    assert stack_metrics_port_base(30000, None) == 30001 and stack_metrics_port_base(31000, None) == 31001
    assert stack_metrics_port_base(31000, 0) == 0 and stack_metrics_port_base(31000, 40000) == 40000
    monkeypatch.setenv("DPLB_RUN_DIR", "/srv/dplb")  # named explicitly: used as is
    assert stack_run_dir(31000) == "/srv/dplb"


def _wait_ready(p: subprocess.Popen[str], log: Path, timeout: float = 60) -> str:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        text = log.read_text()
        if "worker(s) ready; serving" in text:
            return text
        assert p.poll() is None, text
        time.sleep(0.1)
    raise TimeoutError(log.read_text())


def test_two_stacks_started_in_the_same_second_both_serve(tmp_path: Path) -> None:
    """Regression: two `dplb launch` in one second picked the same /dev/shm/dplb_state_<seconds> and the second
    failed; a second stack also needed --metrics-port-base and --run-dir besides --port."""
    env = {k: v for k, v in os.environ.items() if k not in ("DPLB_SHM_PATH", "DPLB_RUN_DIR")}
    env["XDG_RUNTIME_DIR"] = str(tmp_path)  # the default run dirs land here, away from other stacks on the host
    ports = [free_block(4), 0]
    ports[1] = free_block(4)
    while abs(ports[1] - ports[0]) < 4:
        ports[1] = free_block(4)
    procs, logs = [], []
    for port in ports:
        log = tmp_path / f"launch-{port}.log"
        logs.append(log)
        procs.append(subprocess.Popen(dplb_cmd("launch", "--num-workers", "2", "--port", str(port), "--host",
                                               "127.0.0.1", "--drain-timeout", "2"),
                                      env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"), text=True))  # noqa: SIM115
    try:
        texts = [_wait_ready(p, log) for p, log in zip(procs, logs, strict=True)]
        segs = [re.search(r"segment: (\S+)", t).group(1) for t in texts]  # type: ignore[union-attr]
        assert segs[0] != segs[1] and all(os.path.exists(s) for s in segs), segs
        for port, text in zip(ports, texts, strict=True):
            assert f"{tmp_path}/dplb-{port}/router.log" in text, text  # its own run dir
            r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=30, json={
                "model": "dplb-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert r.status_code == 200, r.text
            for k in range(2):  # worker metrics on --port + 1 + K
                assert httpx.get(f"http://127.0.0.1:{port + 1 + k}/metrics", timeout=5).status_code == 200
        # doctor and launch agree: the first stack's run dir is taken
        run_dir = f"{tmp_path}/dplb-{ports[0]}"
        other = free_block(3)
        d = subprocess.run(dplb_cmd("doctor", "--num-workers", "2", "--port", str(other), "--run-dir", run_dir,
                                    "--json"), capture_output=True, text=True, env=env, timeout=60)
        check = next(c for c in __import__("json").loads(d.stdout) if c["name"] == "run_dir")
        assert check["status"] == "fail" and "in use" in check["detail"], check
        r = subprocess.run(dplb_cmd("launch", "--num-workers", "2", "--port", str(other), "--metrics-port-base",
                                    "0", "--run-dir", run_dir), capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode == 2 and "served by a running process" in r.stderr, r.stderr
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)
        for p in procs:
            p.wait(60)
    assert [p.returncode for p in procs] == [0, 0]
    assert not any(os.path.exists(s) for s in segs)


def test_launch_refuses_a_run_dir_whose_socket_paths_cannot_be_bound(tmp_path: Path) -> None:
    """Regression: a run dir too long for a Unix socket failed only in the worker (no root cause), and a directory
    where a worker socket goes crashed the launcher's cleanup with an IsADirectoryError traceback."""
    long_dir = tmp_path / ("r" * 110)
    r = subprocess.run(dplb_cmd("launch", "--num-workers", "1", "--port", str(free_port()), "--metrics-port-base", "0",
                                "--run-dir", str(long_dir)), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "shorter --run-dir" in r.stderr, r.stderr
    assert not long_dir.exists()
    run = tmp_path / "run"
    (run / "worker-0.sock").mkdir(parents=True)
    r = subprocess.run(dplb_cmd("launch", "--num-workers", "1", "--port", str(free_port()), "--metrics-port-base", "0",
                                "--run-dir", str(run)), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "is not a socket" in r.stderr and "Traceback" not in r.stderr, r.stderr
