"""`dplb launch` when its segment is removed and recreated the runbook's way (runbooks/DPLBShmSegmentMissing.md):
real launcher, sim workers, real signals. The launcher's frozen-worker watchdog must follow the file at the path."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable

import httpx
from cluster import Launch, dplb_cmd, launched

LIMIT_S = 3.0  # --stall-restart-after of these stacks
FLAGS = ("--num-workers", "2", "--stall-after", "1", "--stall-restart-after", f"{LIMIT_S:g}")


def _wait(ln: Launch, pred: Callable[[], bool], timeout: float, what: str) -> None:
    t0 = time.monotonic()
    while not pred():
        assert ln.proc.poll() is None, f"launcher exited while waiting for {what}:\n{ln.log.read_text()[-3000:]}"
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}:\n{ln.log.read_text()[-3000:]}"
        time.sleep(0.1)


def _workers(ln: Launch) -> dict[int, tuple[int, str]]:
    """``{worker: (pid, lifecycle)}`` from ``dplb state`` (empty while there is no segment)."""
    try:
        return {w["worker"]: (w["pid"], w["lifecycle"]) for w in ln.state()["workers"]}
    except json.JSONDecodeError:
        return {}


def _recreate(ln: Launch) -> None:
    """The runbook's mitigation: `dplb segment create` at the launch banner's path, N from the banner."""
    r = subprocess.run(dplb_cmd("segment", "create", "--shm-path", ln.shm, "--num-workers", "2"),
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


def _serves(ln: Launch) -> None:
    r = httpx.post(ln.url + "/v1/completions", json={"model": "dplb-sim", "prompt": "hi", "max_tokens": 4},
                   timeout=30)
    assert r.status_code == 200, r.text


def _ready_again(ln: Launch, pids: dict[int, int]) -> Callable[[], bool]:
    """True once every worker is ready in the segment now at the path, worker k with pid ``pids[k]`` when given."""
    def check() -> bool:
        ws = _workers(ln)
        return len(ws) == 2 and all(lc == "ready" and (k not in pids or pid == pids[k]) for k, (pid, lc) in ws.items())
    return check


def test_runbook_recreate_keeps_the_workers_past_the_stall_window(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Regression: after `rm` of the segment and the runbook's `dplb segment create`, the launcher kept judging the
    removed file's heartbeats (stopped at the rm) and SIGKILLed every worker --stall-restart-after later although
    they had re-attached and served. Now: same pids well past the window, the stack serves, one WARNING and one
    INFO line from the launcher, and the recreated header carries the model and run dir again."""
    with launched(tmp_path, *FLAGS, process_group=0) as ln:
        pids = {w["worker"]: w["pid"] for w in (ln.wait_ready(120, workers=True) or {})["workers"]}
        os.unlink(ln.shm)
        t_rm = time.monotonic()
        _wait(ln, lambda: "launcher: state segment" in ln.log.read_text(), 5, "the launcher's removal warning")
        time.sleep(1)
        _recreate(ln)
        _wait(ln, _ready_again(ln, pids), 10, "both workers re-published")
        time.sleep(max(0.0, t_rm + 2 * LIMIT_S + 1 - time.monotonic()))  # well past the window since the rm
        assert {k: pid for k, (pid, _) in _workers(ln).items()} == pids, ln.log.read_text()[-3000:]
        _serves(ln)
        st = ln.state()
        log = ln.log.read_text()
    assert "published nothing" not in log, log[-3000:]
    assert log.count(f"launcher: state segment {ln.shm} was removed or replaced") == 1, log[-3000:]
    assert log.count(f"launcher: attached the state segment {ln.shm}") == 1, log[-3000:]
    assert "restored its model, run dir" in log, log[-3000:]
    assert st["header"]["model"] == "dplb-sim" and st["header"]["run_dir"] == ln.run_dir, st["header"]


def test_watchdog_judges_the_recreated_segment(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """While the segment is missing nothing is judged (a worker stopped then is not killed); once it is recreated
    the watchdog reads the new file: the worker stopped meanwhile never re-publishes and is restarted
    --stall-restart-after after the re-attach, and a worker stopped after the recreate is restarted too."""
    with launched(tmp_path, *FLAGS, process_group=0) as ln:
        pids = {w["worker"]: w["pid"] for w in (ln.wait_ready(120, workers=True) or {})["workers"]}
        stopped = []
        try:
            os.unlink(ln.shm)
            _wait(ln, lambda: "launcher: state segment" in ln.log.read_text(), 5, "the launcher's removal warning")
            os.kill(pids[1], signal.SIGSTOP)
            stopped.append(pids[1])
            time.sleep(LIMIT_S + 1.5)
            assert "published nothing" not in ln.log.read_text()  # no judgement without a segment
            os.kill(pids[1], 0)  # still there
            _recreate(ln)
            _wait(ln, lambda: _workers(ln).get(0) == (pids[0], "ready"), 10, "worker 0 re-published")
            _wait(ln, lambda: _workers(ln).get(1, (0, ""))[0] not in (0, pids[1])
                  and _workers(ln)[1][1] == "ready", 60, "worker 1 (stopped before the recreate) replaced")
            assert "worker 1 published nothing for" in ln.log.read_text()
            new1 = _workers(ln)[1][0]
            os.kill(pids[0], signal.SIGSTOP)  # frozen after the recreate: judged on the new file's heartbeats
            stopped.append(pids[0])
            _wait(ln, lambda: _workers(ln).get(0, (0, ""))[0] not in (0, pids[0])
                  and _workers(ln)[0][1] == "ready", 60, "worker 0 (stopped after the recreate) replaced")
            assert "worker 0 published nothing for" in ln.log.read_text()
            assert _workers(ln)[1][0] == new1
            _serves(ln)
        finally:
            for pid in stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
