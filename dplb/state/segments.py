"""Finding state segments and telling live ones from stale ones (``dplb state``, ``dplb doctor``, ``dplb launch``).

A segment is *live* while any process it records is alive: its creator (the launcher, or ``dplb segment create``
under systemd, which exits at once), a router in its router registry, or a worker that wrote its slot. Only a
segment with no live process is stale, and only a stale DPLB segment under ``/dev/shm`` is ever suggested for removal.

:func:`remove_abandoned` is how a stack whose ``dplb launch`` died (SIGKILL, the OOM killer) leaves nothing behind:
its last process removes the segment on the way out. It is called only by a process whose parent was the segment's
creator and is gone (under systemd the creator is a oneshot and the processes' parent is systemd itself: never).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from dataclasses import dataclass, field

from dplb.errors import DPLBError, ShmPathError
from dplb.state.layout import (
    HEADER_SIZE,
    MAX_WORKERS,
    ROUTER_ENTRY,
    ROUTERS_OFFSET,
    SLOT_SIZE,
    is_dplb_segment,
    pid_alive,
)
from dplb.state.shm import SHM_DIR, Lifecycle, Segment, SegmentHeader, list_segments


@dataclass
class SegmentInfo:
    """What one segment file says about its users. ``error`` is set (and ``header`` None) when it cannot be read."""

    path: str
    header: SegmentHeader | None = None
    error: str = ""
    worker_pids: list[int] = field(default_factory=list)

    @property
    def live_pids(self) -> list[int]:
        """Recorded processes (creator, routers, workers) that are alive now."""
        if self.header is None:
            return []
        pids = [self.header.creator_pid] + [p for p, _ in self.header.routers] + self.worker_pids
        return sorted({p for p in pids if p and pid_alive(p)})

    @property
    def stale(self) -> bool:
        """A readable segment none of whose recorded processes is alive."""
        return self.header is not None and not self.live_pids

    def describe(self) -> str:
        """One line: path, creator pid, router pids and ports, run dir, live or stale."""
        h = self.header
        if h is None:
            return f"{self.path}: unreadable ({self.error})"
        routers = ", ".join(f"pid {p} port {port}" + ("" if pid_alive(p) else " (dead)") for p, port in h.routers)
        state = f"live (pids {', '.join(map(str, self.live_pids))})" if self.live_pids else "stale (no live process)"
        return (f"{self.path}: {h.num_workers} workers, creator pid {h.creator_pid}, "
                f"router(s) {routers or 'none'}, run dir {h.run_dir or '?'}, {state}")


def inspect(path: str) -> SegmentInfo:
    """Read ``path``'s header and worker pids. Never raises for a bad file (``error`` says what is wrong)."""
    try:
        with Segment.attach(path, writable=False) as seg:
            return SegmentInfo(path, seg.header, worker_pids=[w.pid for w in seg.read_all() if w.pid])
    except DPLBError as e:
        return SegmentInfo(path, error=str(e).split(". ")[0].split(": ", 1)[-1])
    except OSError as e:
        return SegmentInfo(path, error=e.strerror or str(e))


def segments(directory: str = SHM_DIR) -> list[SegmentInfo]:
    """Every ``dplb_state_*`` file in ``directory``, newest header first (unreadable ones last)."""
    infos = [inspect(p) for p in list_segments(directory)]
    return sorted(infos, key=lambda i: -(i.header.created_unix_ns if i.header else 0))


def check_takeover(path: str) -> None:
    """Refuse to (re)create a segment over ``path`` when it is used by live processes or is not a DPLB segment.
    A missing path or a stale DPLB segment passes. Raises :class:`ShmError` naming the processes and what to do."""
    if not os.path.lexists(path):
        return
    info = inspect(path)
    if info.header is None and is_dplb_segment(path):  # another layout version (an older DPLB made it)
        live = older_layout_live_pids(path)
        if live:
            raise ShmPathError(f"segment '{path}' was made by another DPLB version ({info.error}) and processes "
                               f"{', '.join(map(str, live))} still use it. Stop that stack, or pass another "
                               "--shm-path (or unset DPLB_SHM_PATH)", path)
        return  # stale: replaced atomically by the new segment
    if info.header is None:
        raise ShmPathError(f"'{path}' exists and is not a DPLB segment ({info.error}); DPLB will not overwrite or "
                           "remove it. Pass another --shm-path (or unset DPLB_SHM_PATH)", path)
    if info.live_pids:
        raise ShmPathError(f"segment {info.describe()}: another DPLB stack uses it. Stop that stack, or pass "
                           "another --shm-path (or unset DPLB_SHM_PATH)", path)


def older_layout_live_pids(path: str) -> list[int]:
    """Live processes recorded in a DPLB segment of another layout version, from the fields every version keeps at
    the same place: the creator pid (offset 24), the router registry's first 8 entries (1184, 8 bytes each) and the
    worker slots' pids (4096 + k·192 + 8). Empty when none is alive or the file cannot be read."""
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER_SIZE + MAX_WORKERS * SLOT_SIZE)
    except OSError:
        return []
    v1_routers = 8  # entries every layout has at ROUTERS_OFFSET (version 1 had 8, version 2 has 16)
    if len(raw) < ROUTERS_OFFSET + v1_routers * ROUTER_ENTRY.size:
        return []
    n = min(int.from_bytes(raw[8:10], "little"), MAX_WORKERS)
    pids = [int.from_bytes(raw[24:28], "little")]  # creator_pid (dplb.state.shm's header layout)
    pids += [ROUTER_ENTRY.unpack_from(raw, ROUTERS_OFFSET + i * ROUTER_ENTRY.size)[0] for i in range(v1_routers)]
    pids += [int.from_bytes(raw[o:o + 4], "little") for o in (HEADER_SIZE + k * SLOT_SIZE + 8 for k in range(n))
             if o + 4 <= len(raw)]
    return sorted({p for p in pids if p and pid_alive(p)})


def process_gone(pid: int) -> bool:
    """True when process ``pid`` no longer runs: it does not exist, or it is a zombie (exited, not yet reaped by its
    parent: it holds no mapping and will never act again)."""
    if not pid_alive(pid):
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):  # gone since, or no /proc: as pid_alive said
        return False


def remove_abandoned(path: str, creator: int) -> bool:
    """Remove the segment at ``path`` when it was made by process ``creator``, ``creator`` is gone
    (:func:`process_gone`) and no other process uses it any more: no live router left in its registry (a router
    leaves it as it stops), no live worker whose slot is not ``stopped`` (a worker writes ``stopped`` as it stops),
    this process excepted. What the last process of a stack whose ``dplb launch`` died does as it exits (module
    docstring). Decided and done under the segment file's ``flock`` (the routers' registry lock), so that of the
    last processes stopping together one removes it; a file that is not a DPLB segment, or not this one any more
    (another inode at the path), is never touched. Returns True when it removed the file; never raises."""
    me = os.getpid()
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with Segment.attach(path, writable=False) as seg:
            if seg.inode != os.fstat(fd).st_ino or seg.header.creator_pid != creator or not process_gone(creator):
                return False
            users = [p for p, _ in seg.header.routers if p and p != me and not process_gone(p)]
            users += [w.pid for w in seg.read_all()
                      if w.pid and w.pid != me and w.lifecycle != Lifecycle.STOPPED and not process_gone(w.pid)]
            if users or os.stat(path).st_ino != seg.inode:
                return False
            os.unlink(path)
            return True
    except (DPLBError, OSError):
        return False
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)  # releases the lock
