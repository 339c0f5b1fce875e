"""The launcher's watchdog: a supervised process that lives but has stopped publishing its heartbeat into the segment
(SIGSTOPped; a worker's collector wedged; a router's event loop blocked) is killed, process group and all, so that
``dplb launch`` restarts it like any exit (docs/DESIGN.md §10). Under systemd each unit's ``WatchdogSec`` does this.

Contract: each function judges one child on the segment now at the path (never a removed one) and returns whether
it killed it; the caller (:class:`dplb.ops.launcher.Launcher`) reaps and restarts it. A router group's children are
not judged here: their group parent judges them (:mod:`dplb.router.supervisor`). A limit of 0 turns the judgement
off. Each kill is one WARNING line naming the age, the flag and the limit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time

from dplb.ops.children import Child
from dplb.state.shm import Segment

log = logging.getLogger("dplb.launch")


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
    its children are judged by the parent itself (:mod:`dplb.router.supervisor`), with the same limit."""
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


def _kill_group(c: Child) -> None:
    """SIGKILL ``c``'s process group (its own: :class:`Child` starts each child as a group leader)."""
    assert c.proc is not None
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(c.proc.pid, signal.SIGKILL)
