"""Shared fixtures: a real shm segment in a private tmpfs-backed directory, cleaned up after each test."""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cluster import need
from proc_tags import become_subreaper

from dplb.state.shm import SHM_DIR

# Orphans of what the tests start come back to this process instead of PID 1, so a leak check finds them by
# ancestry (tests/proc_tags.py) and never mistakes another user's processes for the test's.
become_subreaper()


@pytest.fixture
def shm_path() -> Iterator[str]:
    """A fresh path under /dev/shm (real tmpfs) that is removed after the test."""
    base = SHM_DIR if os.path.isdir(SHM_DIR) else "/tmp"
    path = os.path.join(base, f"dplb_state_test_{uuid.uuid4().hex[:12]}")
    yield path
    for p in (path,):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """``tmpfs("64k")`` mounts a real tmpfs of that size (like an undersized /dev/shm); unmounted afterwards.
    Skips when this user cannot mount (not root)."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        mnt = tmp_path / f"tmpfs-{size}-{len(mounted)}"
        mnt.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", str(mnt)], check=False)


@pytest.fixture
def prometheus_bin() -> str:
    """The ``prometheus`` binary (skipped locally without it, a failure in CI)."""
    return need("prometheus")
