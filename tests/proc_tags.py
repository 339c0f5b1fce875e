"""Processes a test started, found by ancestry and start time or by a tag in their environment — never by command
line.

A test that checks for leftover processes (or kills them in its cleanup) must only ever see what it started: on a
shared host another user's DPLB stack or vLLM engine has the same command line (the tiny model's path, ``VLLM::``).
Two marks, either of which makes a process the test's:

- **Ancestry.** The test process is a child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``, set by ``conftest.py``):
  an orphan of anything it started (a vLLM ``EngineCore`` whose worker was SIGKILLed) is re-parented to it, not to
  PID 1, so it stays a descendant. A descendant started after :func:`new_tag` belongs to that tag (tests run one at
  a time in this process).
- **Environment.** ``DPLB_TEST_TAG`` set by :func:`tagged_env` is inherited by the whole tree. Not enough alone:
  a process that sets its title (vLLM's ``setproctitle``) overwrites the memory ``/proc/PID/environ`` reads.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import uuid

TAG_VAR = "DPLB_TEST_TAG"
PR_SET_CHILD_SUBREAPER = 36
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_TAG_START: dict[str, int] = {}  # tag → boot-relative start, in clock ticks


def become_subreaper() -> bool:
    """Make this process the reaper of its descendants' orphans (Linux ≥ 3.4). False where unsupported."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _now_ticks() -> int:
    with open("/proc/uptime") as f:
        return int(float(f.read().split()[0]) * _CLK_TCK)


def new_tag() -> str:
    """A fresh tag (10 hex characters); processes this process starts from now on belong to it."""
    tag = uuid.uuid4().hex[:10]
    _TAG_START[tag] = _now_ticks() - 1  # /proc/uptime and starttime round differently: one tick of slack
    return tag


def tagged_env(tag: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) plus ``DPLB_TEST_TAG=tag``, for ``subprocess.Popen(env=…)``."""
    out = dict(os.environ if env is None else env)
    out[TAG_VAR] = tag
    return out


def _stat(pid: str) -> tuple[str, int, int] | None:
    """(state, ppid, starttime in ticks) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[0].decode(), int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def ppid(pid: int) -> int:
    """The parent pid of process ``pid``, or -1 when it is gone."""
    st = _stat(str(pid))
    return -1 if st is None else st[1]


def tagged_procs(tag: str) -> list[tuple[int, str]]:
    """``(pid, command line)`` of every live process of ``tag`` (module docstring: a descendant of this process
    started after the tag, or one whose environment carries it). Zombies (exited, waiting to be reaped: they hold
    no resources) are left out; processes that vanish while scanning are skipped."""
    want = f"{TAG_VAR}={tag}".encode()
    since = _TAG_START.get(tag)
    stats = {name: st for name in os.listdir("/proc") if name.isdigit() and (st := _stat(name)) is not None}
    me = os.getpid()

    def descends(pid: int) -> bool:
        for _ in range(64):
            st = stats.get(str(pid))
            if st is None:
                return False
            pid = st[1]
            if pid == me:
                return True
        return False

    found: list[tuple[int, str]] = []
    for name, (state, _, start) in stats.items():
        if state == "Z" or int(name) == me:
            continue
        ours = since is not None and start >= since and descends(int(name))
        try:
            if not ours:
                with open(f"/proc/{name}/environ", "rb") as f:
                    ours = want in f.read().split(b"\0")
            if not ours:
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        found.append((int(name), cmd))
    return found


def kill_tagged(tag: str) -> list[int]:
    """SIGKILL every live process of ``tag`` (see :func:`tagged_procs`); returns their pids."""
    pids = [pid for pid, _ in tagged_procs(tag)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids
