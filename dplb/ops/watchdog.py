"""The launcher's watchdog: a supervised process that lives but has stopped publishing its heartbeat into the segment
(SIGSTOPped; a worker's collector wedged; a router's event loop blocked) is killed, process group and all, so that
``dplb launch`` restarts it like any exit (docs/DESIGN.md §10). Under systemd each unit's ``WatchdogSec`` does this.

Contract: each function judges one child on the segment now at the path (never a removed one) and returns whether
it killed it; the caller (:class:`dplb.ops.launcher.Launcher`) reaps and restarts it. A router group's children are
not judged one by one here: their group parent judges them (:mod:`dplb.router.supervisor`). The group as a whole is
judged here by its children (:func:`kill_if_group_unserved`): the parent holds no router slot, so a frozen parent
whose children then die would leave nothing listening and nobody to notice. A limit of 0 turns the judgement off.
Each kill is one WARNING line naming the age, the flag and the limit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time

from dplb.ops.children import Child
from dplb.router.supervisor import BACKOFF_MAX_S
from dplb.state.shm import Segment

log = logging.getLogger("dplb.launch")
#: How long a group's child may take from its start to its first heartbeat (imports, segment attach, listen), counted
#: into :func:`group_grace_s`: a whole group (parent, then 2 children) was serving 3.7 s after its start on a loaded
#: 2-core box (tests/test_launch_orphans.py), so this leaves room for a slower host.
GROUP_CHILD_START_S = 10.0


def kill_if_worker_frozen(seg: Segment, k: int, w: Child, limit_s: float, attached_at: float) -> bool:
    """Kill worker ``k`` (``w``) when its own slot's heartbeat in ``seg`` has been stale ``limit_s``
    (``--stall-restart-after``) seconds while its process lives: such a worker cannot exit by itself, as a stalled
    one does (:mod:`dplb.worker.process`). In a recreated segment (``attached_at``: monotonic seconds when the
    launcher mapped it), a slot still unwritten that long after it was attached counts the same (the worker never
    re-published)."""
    if limit_s <= 0 or w.proc is None:
        return False
    s = seg.read(k)
    if s.torn:
        return False
    if not s.pid and not s.heartbeat_mono_ns:  # nothing published into this (recreated) segment yet
        age_s = time.monotonic() - max(attached_at, w.started_at)
    elif s.pid != w.proc.pid or not s.heartbeat_mono_ns:
        return False
    else:
        age_s = (time.monotonic_ns() - s.heartbeat_mono_ns) / 1e9
    if age_s <= limit_s:
        return False
    log.warning("%s published nothing for %.0f s (--stall-restart-after %g) though its process lives (stopped or "
                "wedged); killing it to restart it", w.name, age_s, limit_s)
    _kill_group(w)
    return True


def kill_if_router_frozen(seg: Segment, r: Child, limit_s: float) -> bool:
    """Kill the single-process router ``r`` (its process group, waited for; the caller restarts it) when its router
    slot's heartbeat in ``seg`` (written by its monitor every ≤ 0.5 s) is older than ``limit_s``
    (``--router-restart-after``) while its process lives; True when it was killed. A slot not written yet (a
    process starting, a recreated segment) is not judged. A ``--router-processes`` group's parent holds no slot:
    its children are judged by the parent itself (:mod:`dplb.router.supervisor`), with the same limit, and the
    group by them (:func:`kill_if_group_unserved`)."""
    if limit_s <= 0 or r.proc is None:
        return False
    for s in seg.router_slots():
        age = s["heartbeat_age_s"]
        if s["pid"] != r.proc.pid or age is None or age <= limit_s:
            continue
        log.warning("router published no heartbeat for %.0f s (--router-restart-after %g) though its process "
                    "lives (stopped, or its event loop blocked); killing it to restart it", age, limit_s)
        _kill_group(r)
        r.proc.wait()
        return True
    return False


def group_grace_s() -> float:
    """Seconds a router group may have no serving child beyond ``--router-restart-after`` before the launcher
    judges it (:func:`kill_if_group_unserved`): the parent's longest restart backoff for a failing child
    (:data:`dplb.router.supervisor.BACKOFF_MAX_S`) plus a child's start (:data:`GROUP_CHILD_START_S`)."""
    return BACKOFF_MAX_S + GROUP_CHILD_START_S


def kill_if_group_unserved(seg: Segment, r: Child, limit_s: float, attached_at: float) -> bool:
    """Kill the ``--router-processes`` group ``r`` (its parent's process group: parent and children, waited for;
    the caller restarts it) when its parent lives but no router slot in ``seg`` has belonged to a living child of
    it (by pid and ``/proc`` ppid) with a heartbeat at most ``limit_s`` (``--router-restart-after``) old for longer
    than ``limit_s`` + :func:`group_grace_s` seconds (counted from the last such sighting, the group's start, or
    ``attached_at``, when the launcher mapped a recreated segment: monotonic seconds). A parent that works restarts
    a dead or frozen child well within that, so this judges a parent that is stopped or wedged. A group with one
    child serving is never judged. True when it was killed."""
    if limit_s <= 0 or r.proc is None:
        return False
    now = time.monotonic()
    if _group_serves(seg, r.proc.pid, limit_s):
        r.extra["group_served_at"] = now
        return False
    seen = r.extra.get("group_served_at")
    since = max(seen if isinstance(seen, float) else 0.0, r.started_at, attached_at)
    if now - since <= limit_s + group_grace_s():
        return False
    log.warning("router group (parent pid %d) has had no router process publishing a heartbeat for %.0f s "
                "(--router-restart-after %g plus %.0f s for its own restarts) though its parent lives (stopped, or "
                "wedged); killing the group to restart it", r.proc.pid, now - since, limit_s, group_grace_s())
    _kill_group(r)
    r.proc.wait()
    return True


def _group_serves(seg: Segment, parent: int, limit_s: float) -> bool:
    """True when a router slot in ``seg`` belongs to a living child of process ``parent`` and its heartbeat is at
    most ``limit_s`` seconds old."""
    for s in seg.router_slots():
        age = s["heartbeat_age_s"]
        if age is not None and age <= limit_s and _living_parent_of(s["pid"]) == parent:
            return True
    return False


def _living_parent_of(pid: int) -> int | None:
    """Process ``pid``'s parent pid (``/proc/PID/stat``), or None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if len(fields) < 2 or fields[0] == b"Z" else int(fields[1])


def _kill_group(c: Child) -> None:
    """SIGKILL ``c``'s process group (its own: :class:`Child` starts each child as a group leader)."""
    assert c.proc is not None
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(c.proc.pid, signal.SIGKILL)
