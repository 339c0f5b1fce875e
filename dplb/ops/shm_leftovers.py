"""Shared-memory files a killed engine leaves in ``/dev/shm`` (docs/DESIGN.md §10): vLLM's processes share memory
through Python's ``multiprocessing.shared_memory`` (files ``/dev/shm/psm_*``) and synchronise with its named
semaphores (``multiprocessing`` locks made for spawned processes: glibc's ``sem_open`` files
``/dev/shm/sem.mp-*``, 32 bytes each); the process that made one unlinks it as it stops, or its resource tracker
does, but a SIGKILLed ``EngineCore`` or worker (the OOM killer, a CUDA error, the launcher's ``killpg`` of what a
dead worker left, the resource tracker included) leaves it behind: 160 MiB apparent per ``psm_`` file, one file per
semaphore, for as long as the host runs.

Contract
- :class:`ShmLeftovers` is one supervised worker's: :meth:`ShmLeftovers.record` (the launcher calls it every
  :data:`RECORD_EVERY_S` while the worker runs) notes every ``/dev/shm/psm_*`` file mapped by the worker or one of
  its descendants (``/proc/PID/maps``; descendants from ``/proc/PID/task/*/children``), and every
  ``/dev/shm/sem.mp-*`` file whose inode they map (:func:`mapped_semaphores`: the process that made a semaphore
  maps it under glibc's temporary name, shown ``(deleted)``, so the name is found by the inode the mapping pins).
  Only files this worker's own processes were seen mapping are ever candidates: nothing is removed by name or age.
- After the worker's process group is reaped, :meth:`ShmLeftovers.reaped` turns what was recorded into candidates
  and :meth:`ShmLeftovers.sweep` removes each candidate that is a regular file of this user and that **no process
  has open or mapped** — proved by the kernel, not by scanning other processes: a write lease (``F_SETLEASE``,
  ``F_WRLCK``) is granted only while no other open file description of the file exists, and a mapping holds one
  (root's and other users' processes included). The lease is held across the ``unlink``. A candidate still in use
  is tried again at later sweeps for :data:`SWEEP_FOR_S`, then kept (logged once); where leases cannot be taken
  (``/proc/sys/fs/leases-enable`` 0, a filesystem without them), nothing is removed (logged once). Each removal is
  one INFO line. Never raises.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import time
from collections.abc import Callable

log = logging.getLogger("dplb.launch")
SHM_DIR = "/dev/shm"
PREFIX = "psm_"  # multiprocessing.shared_memory's names (CPython's _SHM_NAME_PREFIX, POSIX)
#: multiprocessing's named semaphores: CPython's SemLock names ``/mp-XXXXXXXX`` (synchronize.py), which glibc's
#: ``sem_open`` keeps as ``/dev/shm/sem.mp-XXXXXXXX`` (sem_overview(7)); made by ``sem_open`` under a temporary
#: ``sem.XXXXXX`` name then linked, so its maker's mapping shows that name.
SEM_PREFIX = "sem.mp-"
RECORD_EVERY_S = 5.0  # the launcher's look at each worker's mappings; an engine's segments live as long as it does
SWEEP_FOR_S = 30.0  # a candidate still in use after this long is kept (another process shares it)


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (``/proc/PID/task/TID/children``, Linux ≥ 3.5); gone ones are skipped."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(OSError), open(f"/proc/{p}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
    return out


def mapped_shm(pids: list[int], prefix: str = PREFIX) -> set[str]:
    """The ``/dev/shm/<prefix>*`` files the processes ``pids`` map now (unreadable or gone processes skipped)."""
    want = f"{SHM_DIR}/{prefix}"
    found: set[str] = set()
    for p in pids:
        with contextlib.suppress(OSError), open(f"/proc/{p}/maps", errors="replace") as f:
            for line in f:
                at = line.find(want)
                if at >= 0:
                    found.add(line[at:].rstrip("\n").removesuffix(" (deleted)"))
    return found


def _sem_inodes(pids: list[int]) -> set[int]:
    """The inodes of the ``/dev/shm/sem.*`` files (named semaphores, under any name, unlinked ones too) that the
    processes ``pids`` map now."""
    want = f"{SHM_DIR}/sem."
    found: set[int] = set()
    for p in pids:
        with contextlib.suppress(OSError), open(f"/proc/{p}/maps", errors="replace") as f:
            for line in f:
                if want in line:  # address perms offset dev inode path
                    with contextlib.suppress(IndexError, ValueError):
                        found.add(int(line.split(None, 5)[4]))
    return found


def mapped_semaphores(pids: list[int], skip: set[int] | None = None) -> tuple[set[str], set[int]]:
    """(the ``/dev/shm/sem.mp-*`` files whose inode the processes ``pids`` map now, their inodes). Inodes in
    ``skip`` are not looked for (found before); ``/dev/shm`` is listed only when one is left (an unlinked semaphore's
    is looked for at each call: one directory listing). A mapping pins its inode, so an inode matched while mapped
    is that file (regular, on ``/dev/shm``'s filesystem)."""
    inodes = _sem_inodes(pids) - (skip or set())
    found: set[str] = set()
    matched: set[int] = set()
    if not inodes:
        return found, matched
    with contextlib.suppress(OSError):
        dev = os.stat(SHM_DIR).st_dev
        with os.scandir(SHM_DIR) as it:
            for e in it:
                if e.name.startswith(SEM_PREFIX) and e.inode() in inodes:
                    with contextlib.suppress(OSError):
                        st = e.stat(follow_symlinks=False)
                        if stat.S_ISREG(st.st_mode) and st.st_dev == dev:
                            found.add(e.path)
                            matched.add(st.st_ino)
    return found, matched


def remove_if_unused(path: str) -> bool | None:
    """Unlink ``path`` when it is a regular file of this user that no process has open or mapped (module
    docstring: a write lease, held across the unlink). True: removed; False: in use (or gone); None: cannot tell
    (no lease possible here)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return False
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        except BlockingIOError:
            return False  # another open file description: a process has it open or mapped
        except OSError:
            return None
        try:
            if os.stat(path, follow_symlinks=False).st_ino != st.st_ino:
                return False  # replaced at the path meanwhile: not the file looked at
            os.unlink(path)
            return True
        finally:
            with contextlib.suppress(OSError):
                fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    finally:
        os.close(fd)


class ShmLeftovers:
    """The ``psm_*`` and ``sem.mp-*`` files of one supervised worker (``name``: for the log), recorded while it runs
    and removed once its process tree is gone (module docstring). ``clock``: monotonic seconds."""

    def __init__(self, name: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.clock = clock
        self.seen: set[str] = set()
        self.sem_inodes: set[int] = set()  # the inodes of the semaphore files in seen
        self.pending: dict[str, float] = {}  # candidate → when to stop trying
        self.next_record = 0.0
        self._no_lease_logged = False

    def record(self, leader: int) -> None:
        """Note the files ``leader`` and its descendants map now (every :data:`RECORD_EVERY_S` at most)."""
        now = self.clock()
        if now < self.next_record:
            return
        self.next_record = now + RECORD_EVERY_S
        tree = descendants(leader)
        sems, inodes = mapped_semaphores(tree, self.sem_inodes)
        self.seen |= mapped_shm(tree) | sems
        self.sem_inodes |= inodes

    def reaped(self) -> None:
        """The worker's process group is gone: what it mapped becomes candidates for :meth:`sweep`."""
        until = self.clock() + SWEEP_FOR_S
        for path in self.seen:
            self.pending.setdefault(path, until)
        self.seen = set()
        self.sem_inodes = set()
        self.next_record = 0.0

    def sweep(self) -> list[str]:
        """Remove the candidates nothing uses any more; returns the paths removed."""
        removed = []
        now = self.clock()
        for path, until in list(self.pending.items()):
            done = remove_if_unused(path)
            if done:
                removed.append(path)
                log.info("%s: removed %s, which its killed engine left in %s and no process uses", self.name, path,
                         SHM_DIR)
            elif done is None:
                if not self._no_lease_logged:
                    log.warning("%s: cannot tell whether %s is still in use (no file lease here); left in place",
                                self.name, path)
                    self._no_lease_logged = True
            elif os.path.lexists(path) and now < until:
                continue  # still in use: a process of the killed group not reaped yet, or a sharer
            elif os.path.lexists(path):
                log.warning("%s: %s, which its engine mapped, is still in use after %.0f s; left in place",
                            self.name, path, SWEEP_FOR_S)
            del self.pending[path]
        return removed
