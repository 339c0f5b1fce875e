"""The tests' process tracking finds exactly what a test started: its tree and its orphans, never a stranger with
the same command line (a leak check that matched command lines once killed another user's stack on a shared host)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from proc_tags import kill_tagged, new_tag, tagged_env, tagged_procs

SLEEP = "import time; time.sleep(60)"
# A parent that starts a grandchild and exits at once: the grandchild is orphaned and keeps running with the same
# command line as the stranger; with ``setproctitle`` it would also lose the environment /proc shows.
ORPHANER = [sys.executable, "-c", f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {SLEEP!r}])"]


def _wait(pred, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.mark.parametrize("env_tag", [True, False], ids=["environment", "ancestry-only"])
def test_tagged_tree_is_found_and_killed_and_strangers_are_not(env_tag: bool) -> None:
    stranger = subprocess.Popen([sys.executable, "-c", SLEEP])  # same command line, started before the tag
    time.sleep(0.05)
    tag = new_tag()
    try:
        parent = subprocess.Popen(ORPHANER, env=tagged_env(tag) if env_tag else None)
        assert parent.wait(10) == 0
        _wait(lambda: tagged_procs(tag))
        found = tagged_procs(tag)
        assert len(found) == 1 and "time.sleep(60)" in found[0][1], found  # the orphan, not the exited parent
        assert stranger.pid not in [pid for pid, _ in found]
        assert kill_tagged(tag) == [found[0][0]]
        _wait(lambda: not tagged_procs(tag))
        assert tagged_procs(tag) == []
        assert stranger.poll() is None  # untouched
    finally:
        stranger.kill()
        stranger.wait(10)
        kill_tagged(tag)


def _noop() -> None:
    """Target for a spawned child: exits at once."""


def test_the_resource_tracker_of_this_process_is_never_a_leak() -> None:
    """A spawned child (the shm torn-read stress, the orphan-segment test) uses this process's multiprocessing
    resource tracker, which lives until pytest exits. conftest starts it before any tag, so a module's leak check
    neither reports it nor kills it (CI once failed two modules on it)."""
    import multiprocessing as mp

    tag = new_tag()
    proc = mp.get_context("spawn").Process(target=_noop)
    proc.start()
    proc.join(30)
    assert proc.exitcode == 0
    _wait(lambda: not tagged_procs(tag), timeout=5)
    assert [cmd for _, cmd in tagged_procs(tag) if "resource_tracker" in cmd] == []
    assert tagged_procs(tag) == []
