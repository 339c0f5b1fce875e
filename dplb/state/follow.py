"""Following the segment at one path: a long-lived holder's mapping, re-made when the file is removed or replaced.

Contract
- :meth:`SegmentFollower.current` returns the mapping of the segment file that is at the path now, or None while
  there is none that can be used (missing, unreadable, another layout, fewer slots than ``min_workers``). One
  ``stat`` per call while nothing changes.
- A mapping whose file was removed or replaced is closed at once and never read again: the workers moved to the
  new file, so its heartbeats stopped, and judging them would call live workers frozen.
- Logs (logger ``log``, every line names ``who``): one WARNING when the file disappears or is replaced, one INFO
  when a new one is attached, one ERROR per distinct reason a file at the path cannot be used; a missing file is
  the expected wait and logs nothing more.
- ``on_attach(segment)`` runs on every newly attached mapping (not the first) before :meth:`current` returns it;
  the text it returns is added to the INFO line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from dplb.errors import ShmError, ShmMissingError
from dplb.state.shm import Segment


class SegmentFollower:
    """Holds the mapping of the segment at ``segment.path`` and keeps it on the file that is there now."""

    def __init__(self, segment: Segment, *, who: str, log: logging.Logger, while_missing: str,
                 min_workers: int = 1, writable: bool = True,
                 on_attach: Callable[[Segment], str] | None = None) -> None:
        self.path = segment.path
        self.segment: Segment | None = segment  #: the current mapping (None while there is none); no ``stat``
        #: CLOCK_MONOTONIC seconds when :attr:`segment` was attached (figures in it are no older than that)
        self.attached_at = time.monotonic()
        self._who, self._log, self._while_missing = who, log, while_missing
        self._min_workers, self._writable, self._on_attach = min_workers, writable, on_attach
        self._problem = ""
        self.reattached = 0  #: how many times a new file at the path was attached

    def current(self) -> Segment | None:
        """The mapping of the segment now at the path (re-attached when it changed), or None while there is none."""
        seg = self.segment
        if seg is not None:
            if seg.still_present():
                return seg
            self.segment = None
            seg.close()
            self._problem = ""
            self._log.warning("%s: state segment %s was removed or replaced; %s until a segment is back at that path "
                              "(`dplb segment create --shm-path %s --num-workers %d`)", self._who, self.path,
                              self._while_missing, self.path, seg.num_workers)
        return self._attach()

    def _attach(self) -> Segment | None:
        try:
            seg = Segment.attach(self.path, writable=self._writable)
        except ShmError as e:
            self._failed(e)
            return None
        if seg.num_workers < self._min_workers:
            seg.close()
            self._failed(ShmError(f"segment {self.path} has {seg.num_workers} worker slots, fewer than the "
                                  f"{self._min_workers} workers; ignoring it (recreate it with `dplb segment create "
                                  f"--shm-path {self.path} --num-workers {self._min_workers}`)", self.path))
            return None
        extra = self._on_attach(seg) if self._on_attach is not None else ""
        self.segment, self.attached_at, self._problem = seg, time.monotonic(), ""
        self.reattached += 1
        self._log.info("%s: attached the state segment %s that is now at that path (%d workers)%s", self._who,
                       self.path, seg.num_workers, f"; {extra}" if extra else "")
        return seg

    def _failed(self, e: ShmError) -> None:
        msg = str(e)
        if msg != self._problem and not isinstance(e, ShmMissingError):
            self._log.error("%s: cannot use the state segment at %s: %s", self._who, self.path, msg)
        self._problem = msg

    def close(self) -> None:
        """Unmap the current mapping, if any (the file stays)."""
        if self.segment is not None:
            self.segment.close()
            self.segment = None


__all__ = ["SegmentFollower"]
