"""Processes a test started, found by a tag in their environment — never by command line.

A test that checks for leftover processes (or kills them in its cleanup) must only ever see what it started: on a
shared host another user's DPLB stack or vLLM engine has the same command line (the tiny model's path, ``VLLM::``).
Every process inherits its parent's environment, and re-parenting (an orphan adopted by PID 1) does not change it,
so a per-test ``DPLB_TEST_TAG`` set on the process the test starts marks its whole tree, orphans included.
"""

from __future__ import annotations

import contextlib
import os
import signal
import uuid

TAG_VAR = "DPLB_TEST_TAG"


def new_tag() -> str:
    """A fresh tag: 10 hex characters."""
    return uuid.uuid4().hex[:10]


def tagged_env(tag: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) plus ``DPLB_TEST_TAG=tag``, for ``subprocess.Popen(env=…)``."""
    out = dict(os.environ if env is None else env)
    out[TAG_VAR] = tag
    return out


def tagged_procs(tag: str) -> list[tuple[int, str]]:
    """``(pid, command line)`` of every live process whose environment carries ``DPLB_TEST_TAG=tag``; zombies
    (exited, waiting to be reaped: they hold no resources) are left out. Processes that vanish or whose environment
    cannot be read while scanning are skipped."""
    want = f"{TAG_VAR}={tag}".encode()
    found: list[tuple[int, str]] = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if want not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError):
            continue
        found.append((int(name), cmd))
    return found


def kill_tagged(tag: str) -> list[int]:
    """SIGKILL every live process tagged ``tag`` (see :func:`tagged_procs`); returns their pids."""
    pids = [pid for pid, _ in tagged_procs(tag)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids
