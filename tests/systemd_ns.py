"""A real systemd (the host's ``/lib/systemd/systemd``) as PID 1 of its own PID and mount namespace, for the live
tests of DPLB's units (tests/test_systemd_live.py); nothing of the host's changes.

``unshare --pid --fork --mount --mount-proc`` runs a shell that prepares the namespace's view and execs systemd:
- its own cgroup ``dplbtest-<tag>`` under each writable cgroup hierarchy (systemd in a container treats the cgroup it
  starts in as its root and creates ``init.scope`` and ``system.slice`` below it); removed at :meth:`stop`;
- a private ``/run`` and ``/dev/shm`` (tmpfs), a copy-on-write ``/etc`` (overlayfs on a tmpfs upper: the README's
  ``cp … /etc/systemd/system/`` and ``/etc/dplb`` land there), an empty ``/etc/systemd/system`` (none of the host's
  units or enablement links) and an empty ``/opt``;
- a system user ``dplb`` (the units' ``User=``) in that ``/etc/passwd``;
- ``/opt/dplb/venv``: a venv whose interpreter and site-packages are bind mounts of this test's (a unit with
  ``ProtectHome=yes`` cannot see one under /root, nor ``PrivateTmp=yes`` one under /tmp), and whose ``bin/dplb``
  imports this checkout's ``dplb`` (bound at ``/run/dplbtest/src``), with ``LD_LIBRARY_PATH`` at the bound
  interpreter's lib (a pyenv build's RUNPATH names /root, which ``ProtectHome=yes`` hides: the system's older
  libpython would be loaded);
- ``SYSTEMD_UNIT_PATH=/etc/systemd/system:/run/dplbtest/base``: the base holds empty ``sysinit.target``,
  ``basic.target`` … (what ``DefaultDependencies=yes`` names) and a ``service.d`` drop-in that sends every service's
  output to ``/run/dplbtest/logs/<unit>.log`` (there is no journald);
- systemd's own log (``--log-target=console``) goes to a pty bound over ``/dev/console`` (systemd writes its log
  only to a terminal), which a thread copies into ``systemd.log``.
systemd boots ``--unit=dplbtest.target`` (starts nothing); the test talks to it with ``nsenter … systemctl``.
``dplbtest.target`` is ordered ``After=`` the units the test names (``keep``): ordering only, it starts none, but the
reference keeps a stopped unit loaded, with its timestamps and restart count (systemd unloads an inactive unit that
nothing active references, e.g. the units of a stopped ``dplb.target``, and ``systemctl show`` then reads zeros).
:meth:`stop` SIGKILLs the namespace's PID 1, which kills every process in it.
"""

from __future__ import annotations

import contextlib
import os
import pty
import pwd
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
import uuid
from pathlib import Path

SYSTEMD = "/lib/systemd/systemd"
CGROUP = "/sys/fs/cgroup"
_BASE_TARGETS = ("dplbtest", "sysinit", "basic", "shutdown", "umount", "final", "exit", "sockets", "timers", "paths",
                 "slices", "local-fs", "local-fs-pre", "swap", "network", "network-online", "multi-user")
_BOOT = r"""
set -eu
for h in $DPLBTEST_CGROUPS; do mkdir "$h/$DPLBTEST_CG"; echo $$ > "$h/$DPLBTEST_CG/cgroup.procs"; done
mount -t tmpfs -o mode=0755 tmpfs /run
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
T=/run/dplbtest
mkdir -p $T/py $T/site $T/src/dplb $T/upper $T/work $T/logs $T/base
mount --bind "$DPLBTEST_PYBASE" $T/py
mount --bind "$DPLBTEST_SITE" $T/site
mount --bind "$DPLBTEST_SRC/dplb" $T/src/dplb
cp -r "$DPLBTEST_HOSTDIR/base/." $T/base/
mount -t overlay overlay -o lowerdir=/etc,upperdir=$T/upper,workdir=$T/work /etc
mount -t tmpfs -o mode=0755 tmpfs /etc/systemd/system
echo "dplb:x:$DPLBTEST_UID:$DPLBTEST_UID:DPLB:/var/lib/dplb:/usr/sbin/nologin" >> /etc/passwd
echo "dplb:x:$DPLBTEST_UID:" >> /etc/group
mount -t tmpfs -o mode=0755 tmpfs /opt
V=/opt/dplb/venv
mkdir -p $V/bin "$V/lib/$DPLBTEST_PYLIB/site-packages"
mount --bind $T/site "$V/lib/$DPLBTEST_PYLIB/site-packages"
printf 'home = %s\ninclude-system-site-packages = false\n' $T/py/bin > $V/pyvenv.cfg
ln -s "$T/py/bin/$DPLBTEST_PYNAME" $V/bin/python
printf 'import sys\nsys.path.insert(0, "%s")\nfrom dplb.cli import main\nsys.exit(main())\n' $T/src > $V/bin/dplb.py
printf '#!/bin/sh\nexport LD_LIBRARY_PATH=%s\nexec %s %s "$@"\n' $T/py/lib $V/bin/python $V/bin/dplb.py > $V/bin/dplb
chmod 0755 $V/bin/dplb
mount --bind "$DPLBTEST_CONSOLE" /dev/console
exec env -i container=dplbtest SYSTEMD_UNIT_PATH=/etc/systemd/system:$T/base PATH=/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 $DPLBTEST_SYSTEMD --system --unit=dplbtest.target --log-target=console --log-level=info \
    --log-time=yes --show-status=no
"""


def _cgroup_roots() -> list[str]:
    """The cgroup hierarchies systemd uses: the unified one on a cgroup v2 host, else the ``name=systemd`` and (when
    mounted) the unified one of a hybrid host."""
    if os.path.exists(f"{CGROUP}/cgroup.controllers"):
        return [CGROUP]
    return [h for h in (f"{CGROUP}/systemd", f"{CGROUP}/unified") if os.path.isdir(h)]


def cannot_boot() -> str | None:
    """Why a private systemd cannot run here (None when it can): not root, no systemd binary, no unshare/nsenter, no
    overlayfs, no writable cgroup hierarchy."""
    if os.geteuid() != 0:
        return "needs root (mount and PID namespaces, cgroups)"
    if not os.access(SYSTEMD, os.X_OK):
        return f"no {SYSTEMD} (apt-get install systemd)"
    missing = [t for t in ("unshare", "nsenter", "systemctl") if shutil.which(t) is None]
    if missing:
        return f"no {' '.join(missing)} (util-linux, systemd)"
    with open("/proc/filesystems") as f:
        if "overlay" not in f.read():
            return "the kernel has no overlayfs"
    roots = _cgroup_roots()
    if not roots or not all(os.access(h, os.W_OK) for h in roots):
        return f"no writable cgroup hierarchy under {CGROUP}"
    return None


def _free_uid() -> int:
    """A uid (and gid) no account of the host uses, for the namespace's ``dplb`` user."""
    for uid in range(61000, 62000):
        try:
            pwd.getpwuid(uid)
        except KeyError:
            return uid
    raise RuntimeError("no free uid in 61000..61999")


class PrivateSystemd:
    """systemd as PID 1 of a private PID + mount namespace (module docstring). ``pid``: its PID on the host."""

    def __init__(self, tmp: Path, src: str, keep: tuple[str, ...] = ()) -> None:
        self.tmp, self.src, self.keep = tmp, src, keep
        self.tag = uuid.uuid4().hex[:10]
        self.cgroups = [f"{h}/dplbtest-{self.tag}" for h in _cgroup_roots()]
        self.console = tmp / "systemd.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.pid = 0
        self.master, self.slave = pty.openpty()
        self.copier = threading.Thread(target=self._copy_console, daemon=True)

    def _copy_console(self) -> None:
        """Copy what systemd writes to its console (the pty) into ``systemd.log`` until the pty closes."""
        with open(self.console, "ab", buffering=0) as out:
            while True:
                try:
                    data = os.read(self.master, 65536)
                except OSError:
                    return
                if not data:
                    return
                out.write(data.replace(b"\r\n", b"\n"))

    def start(self, timeout_s: float = 60) -> None:
        """Boot it and wait until ``systemctl`` answers. RuntimeError (with systemd's log) when it does not."""
        base = self.tmp / "base"
        (base / "service.d").mkdir(parents=True)
        for t in _BASE_TARGETS:
            (base / f"{t}.target").write_text(f"[Unit]\nDescription={t} (private systemd of a DPLB test)\n")
        with open(base / "dplbtest.target", "a") as f:  # not stopped by shutdown.target: it keeps the references
            f.write("DefaultDependencies=no\n" + (f"After={' '.join(self.keep)}\n" if self.keep else ""))
        (base / "service.d" / "50-dplbtest-log.conf").write_text(
            "[Service]\nStandardOutput=append:/run/dplbtest/logs/%n.log\nStandardError=inherit\n")
        self.console.write_bytes(b"")
        purelib = sysconfig.get_paths()["purelib"]
        env = {**os.environ, "DPLBTEST_CG": f"dplbtest-{self.tag}", "DPLBTEST_CGROUPS": " ".join(_cgroup_roots()),
               "DPLBTEST_PYBASE": sys.base_prefix, "DPLBTEST_SITE": purelib, "DPLBTEST_SRC": self.src,
               "DPLBTEST_PYLIB": os.path.basename(os.path.dirname(purelib)),
               "DPLBTEST_PYNAME": os.path.basename(os.path.realpath(sys.executable)),
               "DPLBTEST_HOSTDIR": str(self.tmp), "DPLBTEST_UID": str(_free_uid()),
               "DPLBTEST_CONSOLE": os.ttyname(self.slave), "DPLBTEST_SYSTEMD": SYSTEMD}
        self.copier.start()
        with open(self.tmp / "boot.log", "wb") as out:
            self.proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount", "--mount-proc", "--propagation",
                                          "private", "bash", "-c", _BOOT], env=env, stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if not self.pid:
                self.pid = self._init_pid()
            elif self.ctl("is-system-running", check=False).stdout.strip() in ("running", "degraded"):
                return
            time.sleep(0.2)
        raise RuntimeError(f"private systemd did not come up: {self.log()[-3000:]}")

    def _init_pid(self) -> int:
        """The host PID of the namespace's PID 1 once it runs systemd (0 before)."""
        assert self.proc is not None
        try:
            with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
                kids = f.read().split()
            if kids and os.path.realpath(f"/proc/{kids[0]}/exe") == os.path.realpath(SYSTEMD):
                return int(kids[0])
        except OSError:
            pass
        return 0

    def run(self, argv: list[str], check: bool = True, timeout: float = 180,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` as root inside the namespace (its PID and mount view); CalledProcessError with its output
        when ``check`` and it fails."""
        r = subprocess.run(["nsenter", "--target", str(self.pid), "--pid", "--mount", "--", *argv],
                           capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} failed ({r.returncode}): {r.stdout}{r.stderr}\n"
                                 f"systemd log:\n{self.log()[-4000:]}")
        return r

    def ctl(self, *args: str, check: bool = True, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        """``systemctl ARGS`` against the private systemd."""
        return self.run(["systemctl", "--no-pager", "--no-ask-password", *args], check=check, timeout=timeout)

    def show(self, unit: str, *props: str) -> dict[str, str]:
        """``systemctl show -p PROPS UNIT`` as a dict."""
        out = self.ctl("show", "-p", ",".join(props), unit).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def path(self, inside: str) -> str:
        """The host path of ``inside`` as the namespace sees it (through ``/proc/PID/root``)."""
        return f"/proc/{self.pid}/root{inside}"

    def unit_log(self, unit: str) -> str:
        """What ``unit``'s processes wrote to stdout/stderr (the base drop-in's log file), "" before any."""
        try:
            with open(self.path(f"/run/dplbtest/logs/{unit}.log"), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def log(self) -> str:
        """systemd's own log (and the boot script's errors)."""
        return "".join(p.read_text(errors="replace") for p in (self.tmp / "boot.log", self.console) if p.exists())

    def stop(self) -> None:
        """SIGKILL the namespace's PID 1 (the kernel kills every process of the namespace), reap ``unshare`` and
        remove the test's cgroups."""
        if self.proc is None:
            os.close(self.master)
            os.close(self.slave)
            return
        if self.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        if self.proc.poll() is None:
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        deadline = time.monotonic() + 15
        for cg in self.cgroups:
            while os.path.isdir(cg):
                for d, _subdirs, _files in sorted(os.walk(cg), key=lambda w: -w[0].count("/")):
                    with contextlib.suppress(OSError):  # not empty yet: its processes are still exiting
                        os.rmdir(d)
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        os.close(self.slave)  # the copier reads what is left, then EIO ends it
        self.copier.join(5)
        os.close(self.master)
