"""What a killed engine leaves in /dev/shm (dplb/ops/shm_leftovers.py), with real processes, real
``multiprocessing.shared_memory`` files and semaphores, and real SIGKILLs: a process tree like vLLM's worker (a group
leader whose child makes and maps ``psm_*`` files and a spawn-context ``multiprocessing`` lock, ``sem.mp-*``) is
recorded, killed and reaped; what it alone mapped is removed, what another live process still maps is not, and
nothing it never mapped is touched."""

from __future__ import annotations

import _multiprocessing
import contextlib
import os
import signal
import subprocess
import sys
from multiprocessing import resource_tracker, shared_memory

from cluster import wait_for

from dplb.ops.children import Child
from dplb.ops.shm_leftovers import (
    SWEEP_FOR_S,
    ShmLeftovers,
    descendants,
    mapped_semaphores,
    mapped_shm,
    remove_if_unused,
)

# A group leader ("the worker") whose child ("the EngineCore") makes two psm_ files and a lock for spawned processes
# (a named semaphore, as vLLM's engine makes: sem.mp-*), maps a third psm_ file and opens a semaphore it is given,
# prints the names of its own and sleeps. Its resource tracker is in the group, killed with it (as vLLM's).
TREE = r"""
import subprocess, sys
engine = r'''
import multiprocessing, sys, time
import _multiprocessing
from multiprocessing import shared_memory
mine = [shared_memory.SharedMemory(create=True, size=4096) for _ in range(2)]
shared = shared_memory.SharedMemory(name=sys.argv[1])
lock = multiprocessing.get_context("spawn").Lock()
given = _multiprocessing.SemLock._rebuild(0, 1, 1, sys.argv[2])
print(" ".join(m.name for m in mine), "sem." + lock._semlock.name[1:], flush=True)
time.sleep(120)
'''
p = subprocess.Popen([sys.executable, "-c", engine, *sys.argv[1:]], stdout=sys.stdout)
p.wait()
"""
SEM_KIND, SEM_VALUE = 1, 1  # (_multiprocessing.SemLock: SEMAPHORE, value; maxvalue the same)


def _semaphore(tag: str) -> str:
    """A named semaphore this test process makes and keeps open (mapped) until it exits, untracked: its name."""
    name = f"/mp-t10-{tag}-{os.getpid()}"
    _SEMS.append(_multiprocessing.SemLock(SEM_KIND, SEM_VALUE, SEM_VALUE, name, False))
    return name


_SEMS: list[object] = []


def _untrack(name: str) -> None:
    """This test process made ``name`` and unlinks it itself: its resource tracker must not complain."""
    resource_tracker.unregister(f"/{name}", "shared_memory")


def test_a_killed_engines_own_shared_memory_is_removed_and_a_shared_one_kept(tmp_path) -> None:  # type: ignore[no-untyped-def]
    shared = shared_memory.SharedMemory(create=True, size=4096)  # mapped by this process too: in use
    bystander = shared_memory.SharedMemory(create=True, size=4096)  # never mapped by the tree: never a candidate
    _untrack(shared.name)
    _untrack(bystander.name)
    shared_sem, bystander_sem = _semaphore("shared"), _semaphore("bystander")
    kept = {f"/dev/shm/{shared.name}", f"/dev/shm/sem.{shared_sem[1:]}"}
    out = tmp_path / "names"
    leader = None
    try:
        with open(out, "w") as f:
            leader = subprocess.Popen([sys.executable, "-c", TREE, shared.name, shared_sem], stdout=f,
                                      process_group=0)
        names = wait_for(lambda: out.read_text().split(), 30, "the engine's shared memory")
        mine = {f"/dev/shm/{n}" for n in names}
        own_sem = next(p for p in mine if "/sem.mp-" in p)
        assert os.path.exists(own_sem) and len(mine) == 3, mine
        tree = descendants(leader.pid)
        assert len(tree) >= 2 and leader.pid in tree  # the engine (and its resource tracker)
        wait_for(lambda: mapped_shm(tree) == mine - {own_sem} | {f"/dev/shm/{shared.name}"}, 10,
                 "the tree's mappings")
        assert mapped_semaphores(tree)[0] == {own_sem, f"/dev/shm/sem.{shared_sem[1:]}"}  # by inode, not name
        c = Child("worker 0", [], {}, str(tmp_path / "w.log"), proc=leader, shm=ShmLeftovers("worker 0"))
        c.watch()
        assert c.shm is not None and c.shm.seen == mine | kept
        assert remove_if_unused(sorted(mine)[0]) is False  # mapped by the live engine: never removed
        assert remove_if_unused(own_sem) is False
        os.kill(leader.pid, signal.SIGKILL)  # the worker dies; its engine lives on in the group until reaped
        leader.wait(10)
        c.reap()  # killpg of what is left, as the launcher does, then the candidates
        removed = wait_for(lambda: c.shm.sweep() or None, 10, "the leftovers removed")  # type: ignore[union-attr]
        assert set(removed) == mine, removed
        assert not any(os.path.exists(p) for p in mine)
        assert all(os.path.exists(p) for p in kept) and os.path.exists(f"/dev/shm/{bystander.name}")
        assert os.path.exists(f"/dev/shm/sem.{bystander_sem[1:]}")
        assert set(c.shm.pending) == kept  # still mapped here: tried again later
    finally:
        if leader is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(leader.pid, signal.SIGKILL)
        for m in (shared, bystander):
            m.close()
            m.unlink()
        for name in (shared_sem, bystander_sem):
            _multiprocessing.sem_unlink(name)


def test_a_candidate_in_use_past_the_sweep_window_is_kept_and_forgotten(tmp_path) -> None:  # type: ignore[no-untyped-def]
    shared = shared_memory.SharedMemory(create=True, size=4096)
    _untrack(shared.name)
    path = f"/dev/shm/{shared.name}"
    now = [100.0]
    lo = ShmLeftovers("worker 1", clock=lambda: now[0])
    try:
        lo.seen = {path}
        lo.reaped()
        assert lo.sweep() == [] and path in lo.pending
        now[0] += SWEEP_FOR_S + 1
        assert lo.sweep() == [] and not lo.pending and os.path.exists(path)
        lo.seen = {path}
        lo.reaped()
        shared.close()  # nobody maps it now
        assert lo.sweep() == [path] and not os.path.exists(path)
    finally:
        shared.close()
        if os.path.exists(path):
            shared.unlink()
    assert remove_if_unused(path) is False  # gone: nothing to do
