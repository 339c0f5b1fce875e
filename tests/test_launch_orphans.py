"""`dplb launch` SIGKILLed (the OOM killer, a careless `kill -9`): the stack it leaves behind stops the way a SIGTERM
stops it — the router reports drain for its ``--drain-notice`` and keeps serving, the workers serve until the router
has stopped, then drain — and the last process removes the segment. Real launcher, sim workers, real signals."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from cluster import cluster, dplb_cmd, launched, wait_for
from proc_tags import kill_tagged, new_tag, tagged_env, tagged_procs

from dplb.config import ROUTER_RESTART_AFTER_S
from dplb.ops.watchdog import group_grace_s
from dplb.state.layout import register_router, unregister_router
from dplb.state.segments import process_gone, remove_abandoned
from dplb.state.shm import Lifecycle, Segment
from dplb.state.worker_state import WorkerState

NOTICE_S = 3.0


def _load(url: str, stop: threading.Event, out: list[tuple[float, int, str]]) -> None:
    """Requests one after the other on new connections until ``stop`` or the router refuses connections:
    (monotonic time at the answer, status, error code or ""); a transport error is status 0."""
    while not stop.is_set():
        try:
            r = httpx.post(url + "/v1/completions", json={"model": "dplb-sim", "prompt": "p", "max_tokens": 2},
                           timeout=10)
            code = r.json().get("error", {}).get("code", "") if r.status_code != 200 else ""
            out.append((time.monotonic(), r.status_code, str(code)))
        except httpx.ConnectError:
            return  # the router closed its port: the notice and the router's stop are over
        except httpx.HTTPError as e:
            out.append((time.monotonic(), 0, type(e).__name__))


def test_a_killed_launcher_stops_its_stack_like_a_sigterm_and_leaves_no_segment(tmp_path: Path) -> None:
    tag = new_tag()
    with launched(tmp_path, "--num-workers", "2", "--drain-notice", f"{NOTICE_S:g}", "--drain-timeout", "5",
                  tag=tag, env=tagged_env(tag), cleanup=lambda: kill_tagged(tag)) as ln:
        ln.wait_ready(90, workers=True)
        stop = threading.Event()
        answers: list[list[tuple[float, int, str]]] = [[] for _ in range(4)]
        clients = [threading.Thread(target=_load, args=(ln.url, stop, a)) for a in answers]
        for t in clients:
            t.start()
        try:
            time.sleep(1.0)
            t_kill = time.monotonic()
            ln.proc.kill()
            ln.proc.wait(10)
            wait_for(lambda: not tagged_procs(tag), 40, "every process of the stack to exit")
        finally:
            stop.set()
            for t in clients:
                t.join(30)
        after = [a for per in answers for a in per if a[0] > t_kill]
        failed = [a for a in after if a[1] != 200]
        served = [a for a in after if a[1] == 200 and a[0] < t_kill + NOTICE_S - 0.5]
        log = ln.log.read_text()
        router_log = Path(ln.run_dir, "router.log").read_text()
        worker_log = Path(ln.run_dir, "worker-0.log").read_text()
        # Served through the notice, by workers that did not drain under it: no 503 no_routable_worker.
        assert served, (len(after), log[-2000:])
        assert not [a for a in failed if a[1] != 0], failed[:10]
        assert "the process that started it" in worker_log and "no router serves any more" in worker_log, worker_log
        assert "draining" in router_log.lower()
        # The last process of the stack removed the segment its dead launcher made.
        assert not os.path.exists(ln.shm), "the segment was left in /dev/shm"
        print(f"after the launcher's SIGKILL: {len(served)} requests served during the {NOTICE_S:g} s notice, "
              f"{len(after)} answered in all, {len([a for a in failed if a[1] == 0])} transport errors at the end")


def test_remove_abandoned_only_when_the_creator_and_every_user_are_gone() -> None:
    """The removal rule on a real segment made by a process that exited: the creator named must be its creator and
    gone; a live router in the registry or a live worker whose slot is not ``stopped`` keeps it; a zombie counts as
    gone; then it is removed."""
    shm = f"/dev/shm/dplb_state_test_{new_tag()}"
    maker = subprocess.run([sys.executable, "-c", f"import os; from dplb.state.shm import Segment; "
                            f"Segment.create({shm!r}, 2).close(); print(os.getpid())"],
                           capture_output=True, text=True, timeout=60, check=True)
    creator = int(maker.stdout)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert process_gone(creator) and not process_gone(live.pid)
        assert not remove_abandoned(shm, live.pid)  # not the creator it names
        register_router(shm, 1234, pid=live.pid)  # a live router in the registry keeps it
        assert not remove_abandoned(shm, creator)
        unregister_router(shm, live.pid)
        with Segment.attach(shm) as seg:
            w = seg.writer(1)
            w.publish(WorkerState(1, pid=live.pid, lifecycle=Lifecycle.READY))
            assert not remove_abandoned(shm, creator)  # a live worker still serving keeps it
            w.publish(WorkerState(1, pid=live.pid, lifecycle=Lifecycle.STOPPED))
            seg.writer(0).publish(WorkerState(0, pid=live.pid, lifecycle=Lifecycle.DRAINING))
            live.kill()
            time.sleep(0.3)
            assert process_gone(live.pid)  # a zombie (not reaped yet) counts as gone
            assert remove_abandoned(shm, creator)
        assert not os.path.exists(shm)
        assert not remove_abandoned(shm, creator)  # nothing there any more: nothing done
    finally:
        live.kill()
        live.wait()
        if os.path.exists(shm):
            os.unlink(shm)


def test_launch_restarts_a_router_frozen_past_router_restart_after(tmp_path: Path) -> None:
    """A router whose process lives but whose event loop does not run (SIGSTOP) publishes no heartbeat in its router
    slot; the launcher kills it once the heartbeat is --router-restart-after old, logs it, counts the restart and
    starts a new one, which serves; the workers are untouched."""
    with launched(tmp_path, "--num-workers", "2", "--router-restart-after", "3") as ln:
        st = ln.wait_ready(90, workers=True)
        assert st is not None
        workers = sorted(w["pid"] for w in st["workers"])
        router = st["routers"][0]["pid"]
        os.kill(router, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            def new_router() -> bool:
                try:
                    st2 = ln.state()
                except ValueError:
                    return False
                pids = [r["pid"] for r in st2.get("routers", [])]
                return bool(pids) and router not in pids and httpx.get(ln.url + "/ready", timeout=2).status_code == 200

            wait_for(new_router, 60, "a new router serving", step_s=0.3)
            took = time.monotonic() - t0
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(router, signal.SIGCONT)
        r = httpx.post(ln.url + "/v1/completions", json={"model": "dplb-sim", "prompt": "p", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 200
        assert sorted(w["pid"] for w in ln.state()["workers"]) == workers
        log = ln.log.read_text()
        assert "router published no heartbeat for" in log and "--router-restart-after 3" in log, log[-3000:]
        assert "router restarted (restart #1)" in log, log[-3000:]
        assert 3 <= took < 30, took
        print(f"frozen router replaced and serving {took:.1f} s after SIGSTOP (--router-restart-after 3)")



def test_launch_restarts_a_frozen_router_group_child_past_router_restart_after(tmp_path: Path) -> None:
    """--router-restart-after applies to each child of a --router-processes group: the launcher hands it to the
    group's parent, which kills a SIGSTOPped child (its share of connections black-holed) once its router slot's
    heartbeat is that old, not after its slower /health probes (~10 s), and starts a new one, which serves; its
    sibling is untouched, and the launcher does not judge the children itself."""
    with launched(tmp_path, "--num-workers", "1", "--router-processes", "2", "--router-restart-after", "3") as ln:
        st = ln.wait_ready(90, workers=True)
        assert st is not None
        wait_for(lambda: len(ln.state().get("routers", [])) == 2, 30, "both router processes in the segment")
        routers = {r["process_index"]: r["pid"] for r in ln.state()["routers"]}
        frozen, sibling = routers[0], routers[1]
        os.kill(frozen, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            wait_for(lambda: process_gone(frozen), 30, "the frozen router process killed", step_s=0.1)
            killed_s = time.monotonic() - t0

            def replaced() -> bool:
                pids = {r["pid"] for r in ln.state().get("routers", []) if (r["heartbeat_age_s"] or 99) < 2}
                return frozen not in pids and sibling in pids and len(pids) == 2

            wait_for(replaced, 60, "a new router process beside the sibling", step_s=0.3)
            replaced_s = time.monotonic() - t0
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(frozen, signal.SIGCONT)
        for _ in range(6):  # new connections, spread over both processes by SO_REUSEPORT
            r = httpx.post(ln.url + "/v1/completions", json={"model": "dplb-sim", "prompt": "p", "max_tokens": 2},
                           timeout=10)
            assert r.status_code == 200
        log = (Path(ln.run_dir) / "router.log").read_text()  # the group parent's log: it judged and killed it
        assert f"router process 0 (pid {frozen}) published no heartbeat for" in log, log[-3000:]
        assert "(--restart-after 3)" in log, log[-3000:]
        assert "gave no /health answer" not in log, log[-3000:]
        assert "published no heartbeat" not in ln.log.read_text()  # one judge: the launcher left it to the parent
        assert 2.4 <= killed_s < 7, killed_s  # the last heartbeat is up to 0.5 s before the SIGSTOP
        print(f"frozen group child killed {killed_s:.1f} s and replaced {replaced_s:.1f} s after SIGSTOP "
              "(--router-restart-after 3)")


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rpartition(")")[2].split()[1])


def test_launch_restarts_a_frozen_router_group_parent_once_none_of_its_children_serves(tmp_path: Path) -> None:
    """A --router-processes group's parent holds no router slot: the launcher judges the group by its children. A
    SIGSTOPped parent with one child left serving is not judged (well past the bound); once its last child dies too,
    nothing listens, and the launcher kills the group and restarts it within --router-restart-after plus the grace
    (the parent's own restart backoff and a child's start), with one WARNING; requests are served again."""
    limit = 1.0
    bound = limit + group_grace_s()
    with launched(tmp_path, "--num-workers", "1", "--router-processes", "2", "--router-restart-after", "1") as ln:
        assert ln.wait_ready(90, workers=True) is not None
        wait_for(lambda: len(ln.state().get("routers", [])) == 2, 30, "both router processes in the segment")
        children = [r["pid"] for r in ln.state()["routers"]]
        parent = _ppid(children[0])
        assert _ppid(children[1]) == parent and _ppid(parent) == ln.proc.pid
        os.kill(parent, signal.SIGSTOP)
        try:
            os.kill(children[0], signal.SIGKILL)
            time.sleep(bound + 3)  # the sibling serves: the group is not judged
            assert not process_gone(parent), ln.log.read_text()[-3000:]
            assert httpx.get(ln.url + "/ready", timeout=5).status_code == 200
            os.kill(children[1], signal.SIGKILL)
            t0 = time.monotonic()
            wait_for(lambda: process_gone(parent), bound + 15, "the frozen group's parent killed", step_s=0.1)
            killed_s = time.monotonic() - t0
            wait_for(lambda: _ready(ln.url), 60, "a new group serving", step_s=0.3)
            serving_s = time.monotonic() - t0
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(parent, signal.SIGCONT)
        for _ in range(4):
            r = httpx.post(ln.url + "/v1/completions", json={"model": "dplb-sim", "prompt": "p", "max_tokens": 2},
                           timeout=10)
            assert r.status_code == 200
        log = ln.log.read_text()
        assert log.count(f"router group (parent pid {parent}) has had no router process publishing a heartbeat") == 1, \
            log[-3000:]
        assert "router restarted (restart #1)" in log, log[-3000:]
        assert bound - limit - 0.5 <= killed_s < bound + 5, killed_s  # the last heartbeat: ≤ 0.5 s before the kill
        print(f"frozen group parent killed {killed_s:.1f} s and a new group serving {serving_s:.1f} s after its last "
              f"child died (--router-restart-after 1, grace {group_grace_s():g} s)")


def test_the_router_restart_default_is_the_router_units_watchdog() -> None:
    """One bound for a frozen router, under the launcher and under systemd."""
    unit = (Path(__file__).parent.parent / "deploy/systemd/dplb-router.service").read_text()
    assert f"\nWatchdogSec={ROUTER_RESTART_AFTER_S:g}\n" in unit


def test_a_worker_started_by_hand_whose_parent_left_stops_at_once_on_sigterm(tmp_path: Path) -> None:
    """Only a worker whose parent made the segment (dplb launch) waits for the routers when its parent is gone: a
    worker started from a shell that has exited (its parent is not the segment's creator) drains at its SIGTERM
    while the router still serves, as before."""
    with cluster(str(tmp_path), 1, start_workers=False, wait_router_ready=False) as c:
        log = os.path.join(c.run_dir, "worker-0.log")
        cmd = " ".join(dplb_cmd("worker", "--worker-id", "0", "--uds", c.sock(0), "--metrics-port", "0"))
        # The shell waits on its stdin while the worker starts (the worker's parent), then exits: orphaned.
        sh = subprocess.Popen(["sh", "-c", f"{cmd} >{log} 2>&1 & echo $!; read x"], env=c.env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert sh.stdout is not None and sh.stdin is not None
        pid = int(sh.stdout.readline())
        try:
            c.wait_ready(0)
            sh.stdin.close()
            sh.wait(10)
            wait_for(lambda: httpx.get(c.url + "/ready", timeout=2).status_code == 200, 30, "the router ready")
            os.kill(pid, signal.SIGTERM)
            wait_for(lambda: process_gone(pid), 15, "the worker to stop while the router serves")
            assert "is gone; serving while a router" not in Path(log).read_text()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
