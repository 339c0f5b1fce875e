"""Stall detection by engine progress (docs/DESIGN.md §6): which workers hold requests their engine does not work on.

Contract
- A worker's heartbeat comes from its collector thread, not from its engine, so a stopped or deadlocked engine
  (vLLM's EngineCore stopped, an NCCL hang, a wedged GPU) keeps a fresh heartbeat and frozen gauges. Its progress
  does not move: ``progress_total`` of its slot (tokens + prompt tokens + engine iterations, §3.3) and
  ``progress_mono_ns``, the time it last moved.
- A worker **owes** progress from the moment it has outstanding requests (the routers' in-flight counts, given by
  the caller: a stopped engine's own queue gauges freeze) until its progress moves. Owing it longer than
  ``stall_after_s`` (measured from the later of the last progress and the start of the debt) makes it **stalled**.
  A debt is forgiven when the requests leave before that (a client gave up before the engine got to it, or another
  process's stall check failed them first); the worker is then **suspect** (:meth:`StallDetector.suspect`) until
  its progress moves: its requests left without any progress.
- A stalled worker stays stalled until its progress moves (no flapping in on a fresh heartbeat). Its outstanding
  requests are to be failed (:attr:`StallDetector.cut`); then, every ``stall_after_s`` without outstanding requests,
  it may take **one** request as a probe (:meth:`StallDetector.excluded` leaves it out of the set): the probe's
  progress brings it back, a probe that gets none is failed like the rest after ``stall_after_s``. Whether the
  caller sends it one is the caller's choice (the router does only as a last resort, :mod:`dplb.router.state`).
- A stalled worker is never *ready*, probe or not (:meth:`StallDetector.stalled`): what the readiness surfaces
  (``/ready``, the host report) count. An idle stalled worker's own probe (:mod:`dplb.worker.stall_probe`) is what
  brings back an engine that recovers without traffic.
- With ``heed_flag`` (the routers) the worker's own published verdict counts too: a ready worker whose slot has
  ``FLAG_STALLED`` (its collector's check, :mod:`dplb.worker.collector`) is stalled from that observation on, with
  its last progress as the stall's start, and no longer when the flag clears (its progress moved, or its check
  lifted it). That is what finds a stall whose requests all left before ``stall_after_s`` (a client timeout
  shorter than it): the router forgives that debt, but the worker, then suspect, probes its own engine
  (:mod:`dplb.worker.stall_probe`) and its check flags the probe that gets no progress. A stall the router also
  found on its own (a debt of its own overdue) is the router's and lifts only with progress. The worker's check on
  its own slot leaves ``heed_flag`` off: the flag there is its own output.
- A worker that restarted (another pid), is not ``ready``, or whose engine does not report progress
  (``progress_mono_ns`` 0) is never stalled; its state is reset.
- Pure state: no I/O but logs; time from the caller (CLOCK_MONOTONIC ns). Used by the router (routing, failing
  requests fast) and by the worker itself (withholding systemd's watchdog, exiting after ``--stall-restart-after``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Final

from dplb.state.shm import FLAG_STALLED, Lifecycle, WorkerState

log = logging.getLogger("dplb.stall")
_READY: Final = Lifecycle.READY

_NONE: Final[frozenset[int]] = frozenset()


class StallDetector:
    """Stall state of ``num_workers`` workers (module docstring). ``stall_after_s`` > 0 seconds; ``heed_flag``: a
    worker's own ``FLAG_STALLED`` makes it stalled too (the routers).

    After each :meth:`observe`: :attr:`newly_stalled` (workers that became stalled at this observation),
    :attr:`recovered` (stalled workers whose progress moved, or whose flag cleared with ``heed_flag``), :attr:`cut`
    (stalled workers whose outstanding requests are to be failed now)."""

    def __init__(self, num_workers: int, stall_after_s: float, heed_flag: bool = False) -> None:
        if stall_after_s <= 0:
            raise ValueError(f"stall_after_s must be > 0, got {stall_after_s}")
        n = num_workers
        self.stall_after_ns = int(stall_after_s * 1e9)
        self._pid = [0] * n
        self._progress = [0] * n
        self._owed_since = [0] * n  # ns; 0 = owes nothing
        self._stalled_since = [0] * n  # ns of the last progress (or debt start) when it stalled; 0 = not stalled
        self._free_since = [0] * n  # ns since which a stalled worker has no outstanding request (probe timing)
        self._suspect = [False] * n  # a debt was forgiven without progress since it began
        self._heed_flag = heed_flag
        self._by_flag = [False] * n  # stalled on the worker's own verdict only (lifts when its flag clears)
        self.newly_stalled: frozenset[int] = frozenset()
        self.recovered: frozenset[int] = frozenset()
        self.cut: frozenset[int] = frozenset()

    def observe(self, snap: Sequence[WorkerState], outstanding: Sequence[int], now_ns: int) -> None:
        """Update from one snapshot and the outstanding requests per worker (routers' in-flight counts)."""
        new: set[int] = set()
        back: set[int] = set()
        cut: set[int] = set()
        for w in snap:
            k = w.worker_id
            if w.pid != self._pid[k] or w.progress_total != self._progress[k] or w.lifecycle != _READY \
                    or not w.progress_mono_ns:
                if self._stalled_since[k] and w.pid == self._pid[k] and w.progress_total != self._progress[k]:
                    back.add(k)
                    log.warning("worker %d: engine progress resumed after %.1f s; routing to it again", k,
                                (now_ns - self._stalled_since[k]) / 1e9)
                self._pid[k], self._progress[k] = w.pid, w.progress_total
                self._owed_since[k] = self._stalled_since[k] = self._free_since[k] = 0
                self._suspect[k] = self._by_flag[k] = False
            n_out = outstanding[k] if k < len(outstanding) else 0
            if self._heed_flag and not w.torn:  # (a torn read's flags mean nothing)
                self._follow_flag(w, n_out, now_ns, new, back)
            busy = n_out > 0
            if not busy:
                if self._owed_since[k] and not self._stalled_since[k]:
                    self._suspect[k] = True
                self._owed_since[k] = 0
                if self._stalled_since[k] and not self._free_since[k]:
                    self._free_since[k] = now_ns
                continue
            self._free_since[k] = 0
            if not self._owed_since[k]:
                self._owed_since[k] = now_ns
            if w.lifecycle != _READY or not w.progress_mono_ns:
                continue
            ref = max(self._owed_since[k], w.progress_mono_ns)
            if now_ns - ref <= self.stall_after_ns:
                continue
            if not self._stalled_since[k]:
                self._stalled_since[k] = ref
                new.add(k)
                log.error("worker %d: engine made no progress for %.1f s with %d request(s) outstanding; stalled: "
                          "not routing to it and failing its requests until its progress resumes", k,
                          (now_ns - w.progress_mono_ns) / 1e9, outstanding[k])
            self._by_flag[k] = False  # the router's own verdict now: lifts only with progress
            cut.add(k)
        self.newly_stalled, self.recovered, self.cut = frozenset(new), frozenset(back), frozenset(cut)

    def _follow_flag(self, w: WorkerState, n_out: int, now_ns: int, new: set[int], back: set[int]) -> None:
        """Take worker ``w``'s own verdict (``FLAG_STALLED``; ``n_out`` requests outstanding): stalled while it is
        set, lifted when it clears on a worker stalled on it only (module docstring)."""
        k = w.worker_id
        flagged = bool(w.flags & FLAG_STALLED) and w.lifecycle == _READY and w.progress_mono_ns > 0
        if flagged and not self._stalled_since[k]:
            self._stalled_since[k], self._by_flag[k] = w.progress_mono_ns, True
            new.add(k)
            log.error("worker %d: engine made no progress for %.1f s with %d request(s) outstanding; stalled (the "
                      "worker's own stall check says so): not routing to it until its progress resumes", k,
                      (now_ns - w.progress_mono_ns) / 1e9, n_out)
        elif not flagged and self._by_flag[k]:
            back.add(k)
            log.warning("worker %d: its own stall check lifted the stall after %.1f s; routing to it again", k,
                        (now_ns - self._stalled_since[k]) / 1e9)
            self._stalled_since[k] = self._free_since[k] = 0
            self._by_flag[k] = False

    @property
    def any_stalled(self) -> bool:
        """Whether some worker is stalled (what a pick asks first)."""
        return any(self._stalled_since)

    def stalled(self) -> frozenset[int]:
        """Workers stalled right now (probing or not): none of them is ready."""
        if not any(self._stalled_since):  # the common case
            return _NONE
        return frozenset(k for k, t in enumerate(self._stalled_since) if t)

    def excluded(self, now_ns: int) -> frozenset[int]:
        """Stalled workers not to route to at ``now_ns``: all but those free of requests for ``stall_after_s``
        (they may take one probe request)."""
        if not any(self._stalled_since):  # the common case, on every pick
            return _NONE
        lim = self.stall_after_ns
        return frozenset(k for k, t in enumerate(self._stalled_since)
                         if t and not (self._free_since[k] and now_ns - self._free_since[k] >= lim))

    def suspect(self, worker: int) -> bool:
        """Whether requests left ``worker`` before it was found stalled, with no progress since they came
        (module docstring); False again once its progress moves."""
        return self._suspect[worker]

    def no_progress_s(self, worker: int, now_ns: int) -> float:
        """Seconds since a stalled worker's last progress (0.0 when it is not stalled)."""
        t = self._stalled_since[worker]
        return (now_ns - t) / 1e9 if t else 0.0


__all__ = ["StallDetector"]
