"""The tests' process tracking finds exactly what a test started: its tree and its orphans, never a stranger with
the same command line (a leak check that matched command lines once killed another user's stack on a shared host)."""

from __future__ import annotations

import subprocess
import sys
import time

from proc_tags import kill_tagged, new_tag, tagged_env, tagged_procs

# A parent that starts a grandchild and exits at once: the grandchild is orphaned (re-parented to PID 1 or a
# subreaper) and keeps running with the same command line as the stranger below.
SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]
ORPHANER = [sys.executable, "-c",
            "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])"]


def test_tagged_tree_is_found_and_killed_and_strangers_are_not() -> None:
    tag = new_tag()
    stranger = subprocess.Popen(SLEEPER)  # same command line, not started under the tag
    try:
        parent = subprocess.Popen(ORPHANER, env=tagged_env(tag))
        assert parent.wait(10) == 0
        deadline = time.monotonic() + 10
        while not (found := tagged_procs(tag)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(found) == 1 and "time.sleep(60)" in found[0][1], found  # the orphan, not the exited parent
        assert stranger.pid not in [pid for pid, _ in found]
        assert kill_tagged(tag) == [found[0][0]]
        deadline = time.monotonic() + 10
        while tagged_procs(tag) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tagged_procs(tag) == []
        assert stranger.poll() is None  # untouched
    finally:
        stranger.kill()
        stranger.wait(10)
        kill_tagged(tag)
