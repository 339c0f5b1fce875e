"""What a killed engine leaves in /dev/shm (dplb/ops/shm_leftovers.py), with real processes, real
``multiprocessing.shared_memory`` files and real SIGKILLs: a process tree like vLLM's worker (a group leader whose
child makes and maps ``psm_*`` files) is recorded, killed and reaped; what it alone mapped is removed, what another
live process still maps is not, and nothing it never mapped is touched."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from multiprocessing import resource_tracker, shared_memory

from cluster import wait_for

from dplb.ops.children import Child
from dplb.ops.shm_leftovers import SWEEP_FOR_S, ShmLeftovers, descendants, mapped_shm, remove_if_unused

# A group leader ("the worker") whose child ("the EngineCore") makes two psm_ files, maps a third one it is given,
# prints their names and sleeps. The child's resource tracker is the leader's, killed with the group (as vLLM's).
TREE = r"""
import subprocess, sys
engine = r'''
import sys, time
from multiprocessing import shared_memory
mine = [shared_memory.SharedMemory(create=True, size=4096) for _ in range(2)]
shared = shared_memory.SharedMemory(name=sys.argv[1])
print(" ".join(m.name for m in mine), flush=True)
time.sleep(120)
'''
p = subprocess.Popen([sys.executable, "-c", engine, sys.argv[1]], stdout=sys.stdout)
p.wait()
"""


def _untrack(name: str) -> None:
    """This test process made ``name`` and unlinks it itself: its resource tracker must not complain."""
    resource_tracker.unregister(f"/{name}", "shared_memory")


def test_a_killed_engines_own_shared_memory_is_removed_and_a_shared_one_kept(tmp_path) -> None:  # type: ignore[no-untyped-def]
    shared = shared_memory.SharedMemory(create=True, size=4096)  # mapped by this process too: in use
    bystander = shared_memory.SharedMemory(create=True, size=4096)  # never mapped by the tree: never a candidate
    _untrack(shared.name)
    _untrack(bystander.name)
    out = tmp_path / "names"
    leader = None
    try:
        with open(out, "w") as f:
            leader = subprocess.Popen([sys.executable, "-c", TREE, shared.name], stdout=f, process_group=0)
        names = wait_for(lambda: out.read_text().split(), 30, "the engine's shared memory")
        mine = {f"/dev/shm/{n}" for n in names}
        tree = descendants(leader.pid)
        assert len(tree) >= 2 and leader.pid in tree  # the engine (and its resource tracker)
        wait_for(lambda: mapped_shm(tree) == mine | {f"/dev/shm/{shared.name}"}, 10, "the tree's mappings")
        c = Child("worker 0", [], {}, str(tmp_path / "w.log"), proc=leader, shm=ShmLeftovers("worker 0"))
        c.watch()
        assert c.shm is not None and c.shm.seen == mine | {f"/dev/shm/{shared.name}"}
        assert remove_if_unused(sorted(mine)[0]) is False  # mapped by the live engine: never removed
        os.kill(leader.pid, signal.SIGKILL)  # the worker dies; its engine lives on in the group until reaped
        leader.wait(10)
        c.reap()  # killpg of what is left, as the launcher does, then the candidates
        removed = wait_for(lambda: c.shm.sweep() or None, 10, "the leftovers removed")  # type: ignore[union-attr]
        assert set(removed) == mine, removed
        assert not any(os.path.exists(p) for p in mine)
        assert os.path.exists(f"/dev/shm/{shared.name}") and os.path.exists(f"/dev/shm/{bystander.name}")
        assert list(c.shm.pending) == [f"/dev/shm/{shared.name}"]  # still mapped here: tried again later
    finally:
        if leader is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(leader.pid, signal.SIGKILL)
        for m in (shared, bystander):
            m.close()
            m.unlink()


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
