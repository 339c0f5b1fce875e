"""Shared fixtures: a real shm segment in a private tmpfs-backed directory, cleaned up after each test."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from multiprocessing import resource_tracker
from pathlib import Path

import pytest
from cluster import need
from proc_tags import become_subreaper, kill_tagged, new_tag, tagged_procs

from dplb.state.shm import SHM_DIR

# Orphans of what the tests start come back to this process instead of PID 1, so a leak check finds them by
# ancestry (tests/proc_tags.py) and never mistakes another user's processes for the test's.
become_subreaper()
# The spawn context's resource tracker lives as long as this process: start it now, before any module's tag, so
# the leak check never takes it for something a module left behind (and never kills it under a later module).
resource_tracker.ensure_running()
LEAK_GRACE_S = 15.0  # a child stopped at a module's end may take this long to exit (a draining vLLM engine)


@pytest.fixture(autouse=True, scope="module")
def no_leaked_processes(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test module (its fixtures torn down): every process the module started must be gone. What is
    left after :data:`LEAK_GRACE_S` is killed and fails the module, with the command lines: a leaked router or
    engine would keep its port, socket or memory and falsify later tests (found by ancestry and start time,
    tests/proc_tags.py, so nothing this suite did not start is ever touched)."""
    tag = new_tag()
    yield
    deadline = time.monotonic() + LEAK_GRACE_S
    while (left := tagged_procs(tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    if left:
        kill_tagged(tag)
        pytest.fail(f"{request.module.__name__} left {len(left)} process(es) running (killed now): "
                    + "; ".join(cmd[:160] for _, cmd in left[:5]))


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


#: Test modules that start the real vLLM engine: one pytest-xdist unit, so two engines never share the cores.
VLLM_MODULE_PREFIX = "test_vllm_"


def _unit(nodeid: str) -> str:
    """The unit of work a pytest-xdist worker takes whole: the test's module, or ``"vllm"`` for every real-vLLM
    module."""
    path = nodeid.split("::", 1)[0]
    return "vllm" if os.path.basename(path).startswith(VLLM_MODULE_PREFIX) else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """For ``pytest -n N`` (the README's test command): each module goes whole to one worker, so its module-scoped
    fixtures (clusters, engines) start once and its leak check sees all it started; the real-vLLM modules go
    together, in the order :func:`pytest_collection_modifyitems` gives (xdist's reorder by size is turned off)."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class ModuleUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return ModuleUnits(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The real-vLLM unit first (a stable sort keeps every module's own order), so the slowest unit overlaps the
    rest under pytest-xdist."""
    items.sort(key=lambda it: _unit(it.nodeid) != "vllm")
