"""The shipped systemd units (deploy/systemd/) and what ``dplb launch --emit-systemd`` derives for them: stop order
(router before workers), stop timeouts from the drain flags, ``systemctl reload``, paths a unit cannot see, and the
hardening (``systemd-analyze verify`` and ``security --offline``, skipped locally without systemd-analyze)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from cluster import ROOT, dplb_cmd, need

from dplb.ops.systemd_units import closed_to

UNITS = Path(ROOT, "deploy", "systemd")


def stop_timeouts(drain_notice_s: float, drain_timeout_s: float) -> tuple[int, int]:
    from dplb.ops.systemd_units import stop_timeouts as rule  # imported here: a test fails alone without it

    return rule(drain_notice_s, drain_timeout_s)


def _unit(name: str) -> str:
    return (UNITS / name).read_text()


def _values(text: str, key: str) -> list[str]:
    """Every value of ``key=`` in a unit's text (a key may repeat)."""
    return re.findall(rf"^{re.escape(key)}=(.*)$", text, re.M)


def _install(out: Path) -> list[str]:
    """Copy the units into ``out`` (the real dplb executable in ExecStart=) with two worker instances; returns the
    unit paths to verify."""
    dplb_bin = shutil.which("dplb") or os.path.join(os.path.dirname(sys.executable), "dplb")
    for u in ("dplb.target", "dplb-segment.service", "dplb-router.service", "dplb-worker@.service"):
        (out / u).write_text(_unit(u).replace("/opt/dplb/venv/bin/dplb", dplb_bin))
    for k in range(2):
        (out / f"dplb-worker@{k}.service").symlink_to(out / "dplb-worker@.service")
    return [str(out / u) for u in ("dplb.target", "dplb-segment.service", "dplb-router.service",
                                   "dplb-worker@0.service", "dplb-worker@1.service")]


def _verify(out: Path, units: list[str]) -> None:
    sa = need("systemd-analyze")
    r = subprocess.run([sa, "verify", *units], capture_output=True, text=True, cwd=out, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "" and r.stderr.strip() == "", r.stdout + r.stderr


def test_workers_are_ordered_before_the_router_so_the_router_stops_first(tmp_path: Path) -> None:
    """Regression: no ordering between the workers and the router, so `systemctl stop dplb.target` (or a reboot)
    SIGTERMed them together: clients got 503 `no worker is ready` during the router's --drain-notice. systemd stops
    in the inverse of the start order (systemd.unit(5)); the template says Before= the router (an After= on the
    template name would match no instance), so the router stops first and the workers after it exits."""
    worker, router = _unit("dplb-worker@.service"), _unit("dplb-router.service")
    assert "dplb-router.service" in " ".join(_values(worker, "Before"))
    assert not any("dplb-worker" in v for v in _values(router, "Before") + _values(router, "After"))
    assert "dplb-router.service" not in " ".join(_values(worker, "Requires") + _values(worker, "BindsTo"))
    # No template name in a Before=/After= anywhere: it would order nothing.
    for u in UNITS.glob("*.service"):
        assert not any("@.service" in v for v in _values(u.read_text(), "Before") + _values(u.read_text(), "After"))
    _verify(tmp_path, _install(tmp_path))  # no ordering cycle, nothing it cannot parse


def test_shipped_stop_timeouts_are_the_rule_for_the_default_flags() -> None:
    from dplb.cli import build_parser

    args = build_parser().parse_args(["launch"])
    router_s, worker_s = stop_timeouts(args.drain_notice, args.drain_timeout)
    assert _values(_unit("dplb-router.service"), "TimeoutStopSec") == [str(router_s)]
    assert _values(_unit("dplb-worker@.service"), "TimeoutStopSec") == [str(worker_s)]


def test_emit_systemd_derives_the_stop_timeouts_from_the_drain_flags(tmp_path: Path) -> None:
    """Regression: TimeoutStopSec=30 was fixed in the router unit and --emit-systemd ignored --drain-notice and
    --drain-timeout (the workers' env did not even carry --drain-timeout): systemd SIGKILLed a router still in its
    drain notice. Now drop-ins carry the rule's values and every worker gets the flag."""
    out = tmp_path / "etc"
    r = subprocess.run(dplb_cmd("launch", "--num-workers", "2", "--drain-notice", "25", "--drain-timeout", "12",
                                "--emit-systemd", str(out)), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    router_s, worker_s = stop_timeouts(25, 12)
    assert router_s >= 25 + 20 and worker_s >= 12 + 12  # the notice, the router's own stop; drain, servers' stop
    assert f"\n[Service]\nTimeoutStopSec={router_s}\n" in (out / "dplb-router.service.d" / "stop.conf").read_text()
    assert f"\n[Service]\nTimeoutStopSec={worker_s}\n" in (out / "dplb-worker@.service.d" / "stop.conf").read_text()
    for k in range(2):
        assert "--drain-timeout 12 " in (out / f"worker-{k}.env").read_text()
    assert "stop.conf" in r.stdout and "daemon-reload" in r.stdout
    units = _install(out)  # the drop-ins beside the units: systemd-analyze reads them
    if shutil.which("systemd-analyze"):
        _verify(out, units)


def test_emit_systemd_hands_router_restart_after_to_the_router_units_group_parent(tmp_path: Path) -> None:
    """Under systemd a --processes N router's parent judges its children's heartbeats by --router-restart-after, the
    value dplb launch would use: a non-default value reaches DPLB_ROUTER_ARGS and parses back to the router's
    configuration; the default is the router unit's WatchdogSec and is not written."""
    from dplb.config import ROUTER_RESTART_AFTER_S

    def router_args(*flags: str) -> list[str]:
        out = tmp_path / "etc"
        r = subprocess.run(dplb_cmd("launch", "--num-workers", "1", "--router-processes", "2", *flags,
                                    "--emit-systemd", str(out)), capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        env = (out / "dplb.env").read_text()
        return shlex.split(next(ln for ln in env.splitlines() if ln.startswith("DPLB_ROUTER_ARGS=")).partition("=")[2])

    argv = router_args("--router-restart-after", "4")
    assert float(argv[argv.index("--router-restart-after") + 1]) == 4, argv
    r = subprocess.run(dplb_cmd("router", *argv, "--num-workers", "1", "--router-restart-after", "0.5"),
                       capture_output=True, text=True, timeout=60)  # the router checks the value it is given
    assert r.returncode == 2 and "--router-restart-after) must be 0 (off) or 1..86400" in r.stderr, r.stderr
    assert "--router-restart-after" not in router_args() and "--restart-after" not in router_args()
    assert _values(_unit("dplb-router.service"), "WatchdogSec") == [f"{ROUTER_RESTART_AFTER_S:g}"]


def test_group_parent_waits_for_the_drain_notice_before_killing_its_children() -> None:
    """Regression: the router group's parent SIGKILLed its children 20 s after SIGTERM, even in the middle of a
    longer --drain-notice they were still serving."""
    from dplb.config import PolicyConfig, RouterConfig
    from dplb.router import supervisor

    waits: list[float] = []

    class Proc:
        pid = 1

        def send_signal(self, sig: int) -> None:
            pass

        def wait(self, timeout: float | None = None) -> int:
            waits.append(timeout or 0.0)
            return 0

    cfg = RouterConfig(PolicyConfig(), run_dir="/run/dplb", drain_notice_s=40.0)
    group = supervisor.RouterGroup(cfg)
    group.members[0].proc = Proc()  # type: ignore[assignment]
    assert group._stop() == 0
    assert waits and waits[0] > 40.0 + supervisor.STOP_TIMEOUT_S - 1, waits


def test_router_unit_reloads_the_tenants_file_on_systemctl_reload() -> None:
    """Regression: no ExecReload=, so `systemctl reload dplb-router` failed although SIGHUP reloads --tenants."""
    (reload,) = _values(_unit("dplb-router.service"), "ExecReload")
    assert reload == "/bin/kill -HUP $MAINPID"
    assert os.access("/bin/kill", os.X_OK)


@pytest.mark.parametrize("path,option", [("/tmp/dplb/tenants.toml", "PrivateTmp=yes"),
                                         ("/var/tmp/tenants.toml", "PrivateTmp=yes"),
                                         ("/home/ops/tenants.toml", "ProtectHome=yes")])
def test_emit_systemd_refuses_a_tenants_file_the_router_unit_cannot_see(tmp_path: Path, path: str,
                                                                        option: str) -> None:
    """Regression: --emit-systemd accepted --tenants under /tmp; the router unit (PrivateTmp=yes, ProtectHome=yes)
    has its own /tmp and no homes, so it could not start. One line, nothing written."""
    out = tmp_path / "etc"
    r = subprocess.run(dplb_cmd("launch", "--num-workers", "1", "--tenants", path, "--emit-systemd", str(out)),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode in (1, 2) and "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if "SIM" not in ln]
    assert len(lines) == 1 and option in lines[0] and path in lines[0], r.stderr
    assert not out.exists()


def test_emit_systemd_warns_of_a_model_under_tmp_and_writes_it_absolute(tmp_path: Path) -> None:
    """The worker units have their own /tmp too (PrivateTmp=yes): a --model there gets a loud warning; a relative
    --model is written absolute (the units run in /)."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    out = tmp_path / "etc"
    r = subprocess.run(dplb_cmd("launch", "--num-workers", "1", "--model", "m", "--emit-systemd", str(out)),
                       capture_output=True, text=True, timeout=60, cwd=tmp_path,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stderr
    assert "WARNING" in r.stderr and "PrivateTmp=yes" in r.stderr
    assert f"--model {tmp_path / 'm'} " in (out / "worker-0.env").read_text()


def test_emit_systemd_warns_of_a_model_the_units_user_cannot_read() -> None:
    """Regression: --emit-systemd wrote a --model under a 0700 directory (~/.cache of root) without a word; the
    worker units run as user dplb, which cannot enter it. A readable model gets no warning."""
    top = Path(tempfile.mkdtemp(prefix="dplb-model-", dir="/dev/shm"))  # not /tmp: that has its own warning
    try:
        model = top / "home" / "m"
        model.mkdir(parents=True)
        (model / "config.json").write_text("{}")
        cmd = dplb_cmd("launch", "--num-workers", "1", "--model", str(model), "--emit-systemd", str(top / "etc"))
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": ROOT}
        for mode, warned in ((0o755, False), (0o700, True)):
            (top / "home").chmod(mode)
            top.chmod(0o755)
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
            assert r.returncode == 0, r.stderr
            assert ("runs as user dplb, which cannot read it" in r.stderr) is warned, r.stderr
            if warned:
                assert f"{top / 'home'} is mode 0700" in r.stderr, r.stderr
        assert closed_to(str(model), "root") is None  # root needs no permission bits
        (top / "home").chmod(0o711)  # enterable, and the model directory itself readable: fine
        assert closed_to(str(model), "dplb-no-such-user") is None
        model.chmod(0o700)
        assert "is mode 0700" in (closed_to(str(model), "dplb-no-such-user") or "")
    finally:
        for d in (top, top / "home", top / "home" / "m"):
            d.chmod(0o755)
        shutil.rmtree(top)


def test_units_are_hardened_but_the_worker_keeps_its_gpus(tmp_path: Path) -> None:
    """`systemd-analyze security` scored the router 6.9 MEDIUM and the worker 7.7 EXPOSED. The router takes every
    cheap option; the worker none that closes /dev/nvidia* (ProtectClock implies DeviceAllow=char-rtc, which turns
    the device policy to a list) or breaks CUDA's JIT or NCCL's sockets."""
    router, worker = _unit("dplb-router.service"), _unit("dplb-worker@.service")
    common = {"RestrictNamespaces": "yes", "SystemCallArchitectures": "native", "ProtectHostname": "yes",
              "ProtectKernelLogs": "yes", "CapabilityBoundingSet": "", "UMask": "0077"}
    for key, value in {**common, "ProtectClock": "yes", "PrivateDevices": "yes", "MemoryDenyWriteExecute": "yes",
                       "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6 AF_NETLINK"}.items():
        assert _values(router, key) == [value], key
    for key, value in common.items():
        assert _values(worker, key) == [value], key
    for key in ("ProtectClock", "PrivateDevices", "DevicePolicy", "DeviceAllow", "MemoryDenyWriteExecute",
                "RestrictAddressFamilies", "SystemCallFilter"):
        assert not _values(worker, key), key
    units = _install(tmp_path)
    sa = need("systemd-analyze")
    for unit, most in ((units[2], 4.0), (units[3], 5.0)):
        r = subprocess.run([sa, "security", "--offline=yes", unit], capture_output=True, text=True, cwd=tmp_path,
                           timeout=120)
        m = re.search(r"Overall exposure level for \S+: (\d+\.\d)", r.stdout)
        assert m and float(m[1]) <= most, r.stdout[-2000:] + r.stderr
