"""Ops kit: systemd units verify clean, env-file emission, sd_notify READY/WATCHDOG, and every doctor check."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from cluster import ROOT, cluster, dplb_cmd, free_port, need

from dplb.ops import doctor
from dplb.ops.ports import stack_ports
from dplb.runtime.gpu import GpuInfo
from dplb.state.shm import Lifecycle, Segment, WorkerState

UNITS = ["dplb.target", "dplb-segment.service", "dplb-router.service", "dplb-worker@.service"]


def test_systemd_units_verify_without_any_output(tmp_path) -> None:  # type: ignore[no-untyped-def]
    sa = need("systemd-analyze")
    dplb_bin = shutil.which("dplb") or os.path.join(os.path.dirname(sys.executable), "dplb")
    assert os.access(dplb_bin, os.X_OK), dplb_bin
    for u in UNITS:
        with open(os.path.join(ROOT, "deploy", "systemd", u)) as f:
            text = f.read()
        assert "/opt/dplb/venv/bin/dplb" in text or u == "dplb.target"
        (tmp_path / u).write_text(text.replace("/opt/dplb/venv/bin/dplb", dplb_bin))
    units = [str(tmp_path / u) for u in ["dplb.target", "dplb-segment.service", "dplb-router.service"]]
    units.append(str(tmp_path / "dplb-worker@0.service"))
    (tmp_path / "dplb-worker@0.service").symlink_to(tmp_path / "dplb-worker@.service")
    r = subprocess.run([sa, "verify", *units], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "" and r.stderr.strip() == "", r.stdout + r.stderr


def test_units_keep_gpus_visible_and_notify() -> None:
    with open(os.path.join(ROOT, "deploy", "systemd", "dplb-worker@.service")) as f:
        w = f.read()
    assert "\nPrivateDevices=" not in w and "\nDevicePolicy=" not in w  # /dev/nvidia* must stay visible
    for key in ("Type=notify", "WatchdogSec=", "Restart=on-failure", "RuntimeDirectoryPreserve=yes",
                "EnvironmentFile=/etc/dplb/worker-%i.env", "User=dplb"):
        assert key in w


def test_emit_systemd_env_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    model = tmp_path / "models" / "llama"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    out = tmp_path / "etc"
    r = subprocess.run(dplb_cmd("launch", "--num-workers", "2", "--tensor-parallel-size", "2", "--model",
                                str(model), "--emit-systemd", str(out), "--max-model-len", "4096"),
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "SIM" not in r.stderr
    w0 = (out / "worker-0.env").read_text()
    w1 = (out / "worker-1.env").read_text()
    assert "CUDA_VISIBLE_DEVICES=0,1\n" in w0 and "CUDA_VISIBLE_DEVICES=2,3\n" in w1
    # the defaults, carried to the worker
    assert "--engine vllm --drain-timeout 30 --stall-after 5 --stall-restart-after 120 " in w1
    assert f"--model {model} --tensor-parallel-size 2 --max-model-len 4096" in w1
    common = (out / "dplb.env").read_text()
    assert "DPLB_NUM_WORKERS=2" in common and "DPLB_SHM_PATH=/dev/shm/dplb_state_systemd" in common


def test_emit_systemd_again_with_fewer_workers_removes_what_it_wrote_for_the_others(tmp_path: Path) -> None:
    """Regression: emitting 2 workers, then 1, left worker-1.env and the placement drop-ins behind (a unit
    started from them ran a worker the configuration no longer has, pinned where it said). Only DPLB's files go."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs to pin two workers")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    out = tmp_path / "units"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    base = ["launch", "--model", str(model), "--emit-systemd", str(out)]
    r = subprocess.run(dplb_cmd(*base, "--num-workers", "2", "--worker-cpus", f"{cpus[0]}|{cpus[1]}",
                                "--router-cpus", str(cpus[-1])), capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    dropin = {k: out / f"dplb-worker@{k}.service.d" / "placement.conf" for k in range(2)}
    router_dropin = out / "dplb-router.service.d" / "placement.conf"
    assert (out / "worker-1.env").exists() and dropin[1].exists() and router_dropin.exists()
    assert "removed" not in r.stderr, r.stderr
    (out / "worker-7.env").write_text("# my notes\n")  # an operator's files: kept
    (out / "dplb-worker@1.service.d" / "override.conf").write_text("[Service]\nNice=5\n")
    r = subprocess.run(dplb_cmd(*base, "--num-workers", "1", "--worker-cpus", str(cpus[0]), "--router-cpus", "off"),
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert not (out / "worker-1.env").exists() and not dropin[1].exists() and dropin[0].exists()
    assert not router_dropin.exists()  # the router is not pinned now; its stop timeout stays
    assert [p.name for p in router_dropin.parent.iterdir()] == ["stop.conf"]
    assert (out / "worker-7.env").read_text() == "# my notes\n"
    assert (out / "dplb-worker@1.service.d" / "override.conf").exists()
    line = next(ln for ln in r.stderr.splitlines() if ln.startswith("removed "))
    assert line.split(" (")[0].split()[1:] == [str(router_dropin), str(dropin[1]), str(out / "worker-1.env")], line


def test_emit_systemd_checks_the_model_first_and_says_when_it_emits_the_sim(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Regression: --emit-systemd skipped the --model check `dplb launch` makes (a missing model directory was
    written into the units) and emitted sim units without a word when --model was left out."""
    out = tmp_path / "etc"
    r = subprocess.run(dplb_cmd("launch", "--num-workers", "2", "--model", str(tmp_path / "no-such-model"),
                                "--emit-systemd", str(out)), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no-such-model" in r.stderr, r.stderr
    assert not out.exists()  # refused before any file is written
    r = subprocess.run(dplb_cmd("launch", "--num-workers", "2", "--emit-systemd", str(out), "--sim-bogus-flag"),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--sim-bogus-flag" in r.stderr and not out.exists(), r.stderr
    r = subprocess.run(dplb_cmd("launch", "--num-workers", "2", "--emit-systemd", str(out)), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "no --model given" in r.stderr and "SIM engine" in r.stderr, r.stderr
    assert "--engine sim" in (out / "worker-0.env").read_text()


@pytest.mark.parametrize("flags", [
    ("--stall-after", "-1"), ("--stall-after", "nan"), ("--stall-after", "1e9"),
    ("--stall-after", "2", "--stall-restart-after", "1"), ("--stall-restart-after", "1e9"),
    ("--drain-timeout", "-5"), ("--max-start-failures", "0"), ("--metrics-port-base", "70000"),
    ("--idle-timeout", "-3"), ("--weights", "queue=1,"), ("--sse-keepalive", "-1"),
])
def test_emit_systemd_refuses_what_launch_and_the_router_refuse(tmp_path, flags: tuple[str, ...]) -> None:  # type: ignore[no-untyped-def]
    """Regression: --emit-systemd skipped the launcher's flag checks and the router's configuration, so
    `--stall-after -1` (or a stray comma in --weights) was written into units that then failed at every start."""
    out = tmp_path / "etc"
    r = subprocess.run(dplb_cmd("launch", "--num-workers", "2", "--emit-systemd", str(out), *flags),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "error:" in r.stderr, r.stderr
    assert not out.exists()  # refused before any file is written
    r = subprocess.run(dplb_cmd("launch", "--num-workers", "2", "--run-dir", str(tmp_path / "run"), *flags),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "error:" in r.stderr, r.stderr  # the same flags, refused the same way at launch


def test_sd_notify_ready_and_watchdog_from_a_real_worker(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    sock_path = str(tmp_path / "notify.sock")
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(sock_path)
    rx.settimeout(20)
    monkeypatch.setenv("NOTIFY_SOCKET", sock_path)
    monkeypatch.setenv("WATCHDOG_USEC", "400000")  # ping every 0.2 s
    with cluster(str(tmp_path), 1, start_workers=False, wait_router_ready=False) as c:
        got = []
        while not any(m.startswith("READY=1") for m in got):
            got.append(rx.recv(4096).decode())  # the router's READY comes first, then the worker's
        c.start_worker(0)
        msgs = []
        while len([m for m in msgs if m.startswith("READY=1")]) < 1 or "WATCHDOG=1" not in msgs:
            msgs.append(rx.recv(4096).decode())
        assert any("worker 0 ready" in m for m in msgs), msgs
    rx.close()


def test_router_pings_the_systemd_watchdog_from_its_run_loop(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """No worker at all: every datagram is the router's. READY=1 once it listens, then WATCHDOG=1 repeatedly."""
    sock_path = str(tmp_path / "notify.sock")
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(sock_path)
    rx.settimeout(20)
    monkeypatch.setenv("NOTIFY_SOCKET", sock_path)
    monkeypatch.setenv("WATCHDOG_USEC", "400000")  # ping every 0.2 s at most
    with cluster(str(tmp_path), 1, start_workers=False, wait_router_ready=False):
        msgs = [rx.recv(4096).decode()]
        while msgs.count("WATCHDOG=1") < 3:
            msgs.append(rx.recv(4096).decode())
        assert msgs[0].startswith("READY=1"), msgs
    rx.close()


# ---- doctor: each failure produced on purpose ------------------------------------------------------------------
GiB = 1 << 30


def test_doctor_plan_and_gpus() -> None:
    assert doctor.check_gpus([]).status == "warn"
    assert doctor.check_gpus([GpuInfo(0, "H200", 141 * GiB)]).status == "pass"
    bad = doctor.check_plan([0, 1, 2], 2, 1)
    assert bad.status == "fail" and "3 GPU(s)" in bad.detail and "--num-workers 3" in bad.fix
    assert doctor.check_plan([0, 1, 2, 3], 2, 2).status == "pass"
    over = doctor.check_plan([], 65, 1)  # dplb launch refuses 65 workers: so does the pre-flight check
    assert over.status == "fail" and "--num-workers must be 1..64" in over.detail
    assert over.fix != over.detail and "--num-workers" in over.fix  # a fix, not the message again


def _llama_config(tmp_path, **kw: object) -> str:  # type: ignore[no-untyped-def]
    # Llama-3-70B-like: 80 layers, hidden 8192, GQA 8 KV heads, bf16 → ~141 GB of weights.
    cfg = {"hidden_size": 8192, "num_hidden_layers": 80, "vocab_size": 128256, "intermediate_size": 28672,
           "num_attention_heads": 64, "num_key_value_heads": 8, "torch_dtype": "bfloat16", **kw}
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def test_doctor_model_too_large_says_which_tp(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = _llama_config(tmp_path)
    est = doctor.estimate_weight_bytes(json.loads((tmp_path / "model" / "config.json").read_text()))
    assert 135e9 < est < 145e9  # 70.6 B parameters × 2 bytes
    gpus = [GpuInfo(i, "A100-80GB", 80 * GiB) for i in range(4)]
    c = doctor.check_model_memory(model, gpus, 1)
    assert c.status == "fail" and "--tensor-parallel-size 4" in c.fix and "0.85" in c.fix
    assert doctor.check_model_memory(model, gpus, 4).status == "pass"


def _make_orphan_segment(path: str) -> None:
    Segment.create(path, 1).close()


def test_doctor_stale_segment_and_shm(tmp_path) -> None:  # type: ignore[no-untyped-def]
    d = tmp_path / "shm"
    d.mkdir()
    p = mp.get_context("spawn").Process(target=_make_orphan_segment, args=(str(d / "dplb_state_1"),))
    p.start()
    p.join(30)
    c = doctor.check_stale_segments(str(d))
    assert c.status == "warn" and "dplb_state_1" in c.detail and "rm " in c.fix
    live = Segment.create(str(d / "dplb_state_2"), 1)  # created by this (live) process: not stale
    assert "dplb_state_2" not in doctor.check_stale_segments(str(d)).detail
    live.close()
    assert doctor.check_shm(str(d)).status in ("pass", "warn")


def test_segment_create_refuses_a_segment_a_live_process_uses(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Regression: ``dplb segment create`` replaced a running stack's segment (its ``dplb state`` then showed
    ``model=-``). The systemd case: the creator (``dplb segment create`` itself) is dead, a worker is alive."""
    path = str(tmp_path / "dplb_state_live")
    create = dplb_cmd("segment", "create", "--shm-path", path, "--num-workers", "1", "--model", "first")
    env = {k: v for k, v in os.environ.items() if k != "DPLB_SHM_PATH"}
    assert subprocess.run(create, capture_output=True, text=True, timeout=60, env=env).returncode == 0
    with Segment.attach(path) as seg:  # a live worker publishes into its slot (this test's process)
        seg.writer(0).publish_now(WorkerState(0, pid=os.getpid(), lifecycle=Lifecycle.READY))
    again = [*create[:-1], "second"]
    r = subprocess.run(again, capture_output=True, text=True, timeout=60, env=env)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("dplb segment: error: "), r.stderr
    assert f"pids {os.getpid()}" in lines[0] and "systemctl stop dplb.target" in lines[0], r.stderr
    with Segment.attach(path, writable=False) as seg:  # untouched
        assert seg.header.model == "first" and seg.read(0).pid == os.getpid()
    with Segment.attach(path) as seg:  # the worker left: the segment is stale and may be recreated
        seg.writer(0).clear()
    r = subprocess.run(again, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    with Segment.attach(path, writable=False) as seg:
        assert seg.header.model == "second"


def test_segment_remove_refuses_a_segment_a_live_process_uses_unless_forced(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Regression: ``dplb segment remove`` deleted a running stack's segment with exit 0 and no output (its routers
    fell back to their own counts, the launcher's frozen-worker watchdog went off), while ``create`` refused."""
    path = str(tmp_path / "dplb_state_live")
    env = {k: v for k, v in os.environ.items() if k != "DPLB_SHM_PATH"}
    seg_cmd = lambda *a: subprocess.run(dplb_cmd("segment", *a, "--shm-path", path), capture_output=True,  # noqa: E731
                                        text=True, timeout=60, env=env)
    assert seg_cmd("create", "--num-workers", "1").returncode == 0
    with Segment.attach(path) as seg:  # a live worker publishes into its slot (this test's process)
        seg.writer(0).publish_now(WorkerState(0, pid=os.getpid(), lifecycle=Lifecycle.READY))
    r = seg_cmd("remove")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("dplb segment: error: "), r.stderr
    assert f"pids {os.getpid()}" in lines[0] and "remove --force" in lines[0], r.stderr
    assert os.path.exists(path)
    r = seg_cmd("create", "--num-workers", "1", "--force")
    assert r.returncode == 2 and "--force applies to `dplb segment remove` only" in r.stderr, r.stderr
    r = seg_cmd("remove", "--force")
    assert r.returncode == 0 and not os.path.exists(path), r.stderr
    assert f"removed {path} while pids {os.getpid()} used it (--force)" in r.stdout, r.stdout
    assert seg_cmd("create", "--num-workers", "1").returncode == 0
    assert seg_cmd("remove").returncode == 0 and not os.path.exists(path)  # stale (no live process): removed
    assert seg_cmd("remove").returncode == 0  # already gone: nothing to do


def test_doctor_calls_out_docker_64mb_shm(tmpfs) -> None:  # type: ignore[no-untyped-def]
    c = doctor.check_shm(str(tmpfs("64m")))
    assert c.status == "warn" and "Docker" in c.detail and "--shm-size" in c.fix


def test_doctor_ports_and_run_dir() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        c = doctor.check_ports(stack_ports("127.0.0.1", port, "127.0.0.1", []))
        assert c.status == "fail" and str(port) in c.detail
    assert doctor.check_ports(stack_ports("127.0.0.1", free_port(), "127.0.0.1", [])).status == "pass"
    assert doctor.check_run_dir("/etc/hostname/dplb-run").status == "fail"  # under a regular file
    assert doctor.check_run_dir("/tmp/dplb-doctor-test/run").status == "pass"
    assert not os.path.exists("/tmp/dplb-doctor-test")  # tried, then removed again


def _unwritable_dir(tmp_path: Path) -> str:
    """An existing directory this user cannot create files in (root writes through modes: sysfs, then)."""
    if os.geteuid() == 0:
        return "/sys"
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    return str(d)


@pytest.mark.parametrize("where", ["/proc/x", "/proc/x/run", "unwritable", "unwritable/run", "file/run"])
def test_doctor_and_launch_agree_about_a_run_dir(tmp_path: Path, where: str) -> None:
    """Regression: ``dplb doctor --run-dir /proc/x`` said "[PASS] run_dir /proc/x is writable (creatable in /proc)"
    (a permission test, which root passes) while ``dplb launch --run-dir /proc/x`` refused it. One check now tries
    it for both: the same words in doctor's FAIL and launch's one line, nothing started or left behind."""
    (tmp_path / "file").write_text("")
    path = where.replace("unwritable", _unwritable_dir(tmp_path)).replace("file", str(tmp_path / "file"))
    doc = subprocess.run(dplb_cmd("doctor", "--port", str(free_port()), "--metrics-port-base", "0", "--run-dir",
                                  path, "--json"), capture_output=True, text=True, timeout=60)
    check = next(c for c in json.loads(doc.stdout) if c["name"] == "run_dir")
    assert doc.returncode == 1 and check["status"] == "fail" and check["detail"].endswith(
        ("No such file or directory", "Permission denied", "Operation not permitted", "Not a directory")), check
    shm = f"/dev/shm/dplb_state_rundir_{os.getpid()}"
    launch = subprocess.run(dplb_cmd("launch", "--num-workers", "1", "--port", str(free_port()), "--metrics-port-base",
                                     "0", "--run-dir", path, "--shm-path", shm), capture_output=True, text=True,
                            timeout=60)
    assert launch.returncode == 2 and launch.stderr.count("\n") == 1, launch.stderr
    assert f"{check['detail']}; {check['fix']}" in launch.stderr, (check, launch.stderr)
    assert not os.path.exists(shm) and (where == "unwritable" or not os.path.lexists(path))


def test_doctor_cli_exit_code() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = subprocess.run(dplb_cmd("doctor", "--host", "127.0.0.1", "--port", str(port), "--json"),
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    checks = {c["name"]: c for c in json.loads(r.stdout)}
    assert checks["ports"]["status"] == "fail"
    assert set(checks) == {"gpus", "plan", "model_memory", "shm", "stale_segments", "ports", "run_dir", "build"}
    assert checks["build"]["status"] == "pass", checks["build"]  # pure Python, or a whole current build


def test_emit_systemd_keeps_every_router_flag_and_the_key_out_of_shared_files(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Regression: --emit-systemd wrote only host/port/policy into DPLB_ROUTER_ARGS, so the
    deployed router ran without the --api-key and every other router flag given. Now every router flag reaches the
    unit (parsed back here into the same RouterConfig) and the key goes to router.env (0600) alone. Regression: a
    flag that turns something off (--no-direct-relay, --no-panic-routing) was written with its value
    ("--no-direct-relay False"), which the router refuses to parse."""
    import argparse
    import dataclasses
    import shlex
    import stat

    from dplb.router.cli import add_router_args, router_config

    flags = ["--port", "31555", "--weights", "queue=0.5,memory=0.2,latency=0.3", "--router-processes", "3",
             "--cors-allowed-origins", "https://a.example", "--api-key-exempt", "/health", "--prefix-block-bytes",
             "256", "--sse-keepalive", "15", "--allow-runtime-lora", "--policy-plugin", "json", "--no-direct-relay",
             "--no-panic-routing", "--router-restart-after", "5"]
    r = subprocess.run(dplb_cmd("launch", "--num-workers", "2", "--api-key", "s3cret", "--emit-systemd", str(tmp_path),
                                *flags), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    common = (tmp_path / "dplb.env").read_text()
    assert "s3cret" not in common and all("s3cret" not in p.read_text() for p in tmp_path.glob("worker-*.env"))
    key = tmp_path / "router.env"
    assert "DPLB_API_KEY=s3cret\n" in key.read_text() and stat.S_IMODE(key.stat().st_mode) == 0o600
    line = next(ln for ln in common.splitlines() if ln.startswith("DPLB_ROUTER_ARGS="))
    p = argparse.ArgumentParser()
    add_router_args(p)

    def cfg(argv: list[str]):  # type: ignore[no-untyped-def]
        c = router_config(p.parse_args(argv), run_dir="/run/dplb", shm_path=None, num_workers=2)
        return dataclasses.replace(c, api_key=None)

    argv = shlex.split(line.partition("=")[2])
    assert cfg(argv) == cfg(flags)
    assert [a for a in argv if a in ("--processes", "--router-processes")] == ["--processes"], argv  # said once
    unit = Path(ROOT, "deploy/systemd/dplb-router.service").read_text()
    assert "EnvironmentFile=-/etc/dplb/router.env" in unit
