"""Health tables of the state segment: every router process tells the others which workers it ejected and how its
failure streak on each worker stands, so the processes of a router group eject a failing worker as one router
(docs/DESIGN.md §3.4; the verdicts are :mod:`dplb.router.health`'s).

Byte layout (little-endian; inside router slot r, :mod:`dplb.state.router_slots`, written only by its owner)::

    40  u64  health_gen              generation of the health table: odd while the owner writes it, + 2 per write
    HEALTH_TABLE_OFFSET (1088) + 32·k, per worker k < MAX_WORKERS:
      0   u64  until_mono_ns         the owner ejected k until then (CLOCK_MONOTONIC ns; 0 = never)
      8   u32  pid                   k's pid when the owner ejected it (a different pid in k's slot lifts it)
      12  u32  fails                 the owner's current streak of failed attempts on k (0 = none)
      16  u64  streak_mono_ns        when that streak's first failure was reported (0 = no streak)
      24  u64  reset_mono_ns         when the owner last ended the streaks on k: a success it published, or its
                                     ejection of k for failures (0 = never)

Protocol: a seqlock whose counter is ``health_gen`` (the slot's ``seq`` does not cover the table: the owner's
in-flight entries are written on every dispatch and would make every reader copy the table again). The owner makes
``health_gen`` odd, stores the entry's four words, makes it even; a reader loads ``health_gen`` of each live peer
(one 8-byte load: the pick's cost when nothing changed), and only when it differs from the one it last copied, copies
the table between two equal even loads (after :data:`READ_RETRIES` torn copies it takes nothing from that peer and
tries again at the next call). A new owner of a slot continues the previous owner's generation (a reader that
remembers the old value sees a change) over a zeroed table.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Sequence
from typing import Final

from dplb.state.layout import (
    HEADER_SIZE,
    HEALTH_ENTRY_SIZE,
    HEALTH_TABLE_OFFSET,
    MAX_ROUTERS,
    ROUTER_SLOT_SIZE,
    SLOT_SIZE,
)

#: One worker's entry: until_mono_ns, pid, fails, streak_mono_ns, reset_mono_ns.
HEALTH_ENTRY: Final = struct.Struct("<QIIQQ")
#: Fields per worker in :meth:`HealthBoard.changed`'s flat tuples.
FIELDS: Final = 5
#: The word of ``health_gen`` in a router slot (offset 40).
GEN_WORD: Final = 5
#: Copies of a peer's table a reader tries before it takes nothing from that peer this time.
READ_RETRIES: Final = 64
assert HEALTH_ENTRY.size == HEALTH_ENTRY_SIZE and HEALTH_TABLE_OFFSET % 8 == 0


class HealthBoard:
    """Router slot ``index``'s health table in the mapping ``mm`` of a segment with ``num_workers`` worker slots (the
    single writer: :meth:`claim`, :meth:`write`) and the reader of its peers' (:meth:`changed`). Construction reads
    the slot's generation (the previous owner's) and writes nothing. Not thread-safe (one event loop)."""

    def __init__(self, mm: mmap.mmap, num_workers: int, index: int) -> None:
        if not 0 <= index < MAX_ROUTERS:
            raise ValueError(f"router slot {index} has no health table ({MAX_ROUTERS} slots)")
        self.index, self.num_workers = index, num_workers
        self._mm = mm
        self._q = memoryview(mm).cast("Q")
        base = HEADER_SIZE + num_workers * SLOT_SIZE  # router slot 0 (dplb.state.router_slots.routers_offset)
        self._slot = [(base + r * ROUTER_SLOT_SIZE) >> 3 for r in range(MAX_ROUTERS)]  # each slot's first word
        self._table = self._slot[index] + (HEALTH_TABLE_OFFSET >> 3)
        self._gen = int(self._q[self._slot[index] + GEN_WORD])
        self._seen = [0] * MAX_ROUTERS  # each peer's generation last copied
        self._peers: Sequence[int] | None = None
        self._fmt = struct.Struct("<" + "QIIQQ" * num_workers)

    # ---- owner -----------------------------------------------------------------------------------------------
    def claim(self) -> None:
        """Take the table over: zeroed, under a generation above the previous owner's."""
        q, g = self._q, self._gen + 1 + (self._gen & 1)  # odd, above any value the previous owner left
        gw = self._slot[self.index] + GEN_WORD
        q[gw] = g
        off = self._table << 3
        self._mm[off:off + HEALTH_ENTRY_SIZE * self.num_workers] = bytes(HEALTH_ENTRY_SIZE * self.num_workers)
        q[gw] = self._gen = g + 1

    def write(self, worker: int, until_ns: int, pid: int, fails: int, streak_ns: int, reset_ns: int) -> None:
        """Publish this owner's view of ``worker``: ejected until ``until_ns`` (CLOCK_MONOTONIC ns; 0 = not) while
        its pid is ``pid``, ``fails`` failures in a row since ``streak_ns``, streaks ended at ``reset_ns``."""
        q = self._q
        gw = self._slot[self.index] + GEN_WORD
        g = self._gen + 1
        q[gw] = g
        w = self._table + 4 * worker
        q[w] = until_ns
        q[w + 1] = (pid & 0xFFFFFFFF) | (fails & 0xFFFFFFFF) << 32
        q[w + 2] = streak_ns
        q[w + 3] = reset_ns
        q[gw] = self._gen = g + 1

    # ---- readers ---------------------------------------------------------------------------------------------
    def changed(self, peers: Sequence[int]) -> list[tuple[int, tuple[int, ...]]] | None:
        """The tables of the live ``peers`` (router slot indices) that changed since the last call: (slot, flat
        tuple of ``until_mono_ns, pid, fails, streak_mono_ns, reset_mono_ns`` per worker). None when none changed
        (one load per peer). A peer missing from ``peers`` is copied again when it comes back."""
        if peers is not self._peers:
            self._peers = peers
            for r in range(MAX_ROUTERS):
                if r not in peers:
                    self._seen[r] = 0
        q, seen = self._q, self._seen
        out: list[tuple[int, tuple[int, ...]]] | None = None
        for r in peers:
            g = q[self._slot[r] + GEN_WORD]
            if g == seen[r]:
                continue
            v = self._read(r)
            if v is None:
                continue  # torn every time: again at the next call
            seen[r] = v[0]
            if out is None:
                out = []
            out.append((r, v[1]))
        return out

    def _read(self, r: int) -> tuple[int, tuple[int, ...]] | None:
        q = self._q
        gw = self._slot[r] + GEN_WORD
        off = (self._slot[r] << 3) + HEALTH_TABLE_OFFSET
        end = off + HEALTH_ENTRY_SIZE * self.num_workers
        for _ in range(READ_RETRIES):
            g = q[gw]
            if g & 1:
                continue
            raw = self._mm[off:end]
            if q[gw] == g:
                return g, self._fmt.unpack(raw)
        return None

    def close(self) -> None:
        """Release the view of the mapping (the owner's :meth:`dplb.state.router_slots.RouterSlots.close`)."""
        self._q.release()


__all__ = ["FIELDS", "GEN_WORD", "HEALTH_ENTRY", "HealthBoard"]
