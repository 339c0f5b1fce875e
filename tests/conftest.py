"""Shared fixtures: a real shm segment in a private tmpfs-backed directory, cleaned up after each test."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator

import pytest

from dplb.shm import SHM_DIR


@pytest.fixture
def shm_path() -> Iterator[str]:
    """A fresh path under /dev/shm (real tmpfs) that is removed after the test."""
    base = SHM_DIR if os.path.isdir(SHM_DIR) else "/tmp"
    path = os.path.join(base, f"dplb_state_test_{uuid.uuid4().hex[:12]}")
    yield path
    for p in (path,):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)
