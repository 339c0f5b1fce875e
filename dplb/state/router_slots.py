"""Router slots of the state segment: each router process publishes what it has sent to every worker
(docs/DESIGN.md §3.4).

Several router processes (``dplb router --processes N``, or separate routers on one segment) route on the same
worker slots. Each keeps an optimistic in-flight correction for requests its workers' last snapshots may not
count yet (:mod:`dplb.policy.core`); without sharing it, N processes each believe an idle worker idle and a burst
lands on it N times over. So every router process owns one router slot and publishes, per worker, its own
correction and in-flight count; every process adds the others' to its own.

Byte layout (little-endian; after the worker slots, at :func:`routers_offset` = HEADER_SIZE + n·SLOT_SIZE; see
:mod:`dplb.state.shm` for the header and worker slots)::

    Router slot r at routers_offset(n) + r·ROUTER_SLOT_SIZE (3136 bytes; r < MAX_ROUTERS = 16; r is also the
    router's entry in the header's router registry, claimed under flock by dplb.state.layout.register_router),
    written only by its owner
      0   u64  seq                    seqlock counter (same protocol as a worker slot), covers the slot but its
                                      health table
      8   u32  pid                    owner process (0 = free)
      12  u16  port                   owner's TCP port
      14  u16  process_index          index within its router group (0 for a single-process router)
      16  u64  heartbeat_mono_ns      CLOCK_MONOTONIC ns, refreshed by the owner's monitor (every ≤ 0.5 s)
      24  u64  last_sent_mono_ns      the owner's most recent dispatch to any worker
      32  u64  urgent                 the most urgent priority class the owner's fair queue holds, + 1 (0: none
                                      queued; dplb.router.tenancy), one 8-byte store outside the seqlock
      40  u64  health_gen             generation of the health table below (its own seqlock counter,
                                      dplb.state.health_board)
      48..63 reserved (zeros)
      64 + 16·k  per worker k < MAX_WORKERS:
                 u32 pending          the owner's correction for k: requests sent after k's last snapshot
                                      (minus half an interval), capped by its in-flight count to k
                 u32 inflight         the owner's open requests to k
                 u64 last_sent_mono_ns the owner's most recent dispatch to k
      1088 + 32·k  per worker k < MAX_WORKERS: the owner's health entry for k (ejection, failure streak; layout
                 and protocol in dplb.state.health_board)

    Prefix ring r at routers_offset(n) + MAX_ROUTERS·ROUTER_SLOT_SIZE + r·PREFIX_RING_SIZE, written only by the
    owner of router slot r
      0   u64  head                   entries ever written (the next one goes to head mod PREFIX_RING_ENTRIES)
      8   u64  reserve                the head the entries being written will reach (≥ head; = head when idle)
      16..63 reserved
      64 + 8·i  u64 entry             prefix block key (dplb.policy.prefix.block_hashes, < 2^42) | (worker + 1) << 56

Each router slot also owns a response-id ring after the KV rings (:mod:`dplb.state.response_rings`, its own byte
layout): :attr:`RouterSlots.responses`, adopted by :meth:`RouterSlots.claim`; and a tenant table after the
response-id rings (:mod:`dplb.state.tenant_tables`): :attr:`RouterSlots.tenants`, zeroed by :meth:`RouterSlots.claim`.
Its health table (inside the slot, its own generation counter) is :attr:`RouterSlots.health`
(:mod:`dplb.state.health_board`), zeroed by :meth:`RouterSlots.claim`.

How the prefix index is shared: each process keeps its own :class:`dplb.policy.prefix.PrefixIndex` (the hot path reads
only local memory) and appends to its ring every block key its index learnt from a pick (new, new for that worker,
or refreshed after a second: :meth:`PrefixIndex.record`'s return); before each pick a process replays the entries its
peers appended since it last looked into its own index (:meth:`RouterSlots.drain_prefix`). So every process learns
what every other sent, one pick later at most. A reader more than PREFIX_RING_ENTRIES behind loses the oldest
entries (counted in ``prefix_lost``); the writer stores ``reserve`` before it overwrites a slot, so a reader
checks ``reserve`` (not ``head``) after its copy and drops every entry an append in progress may have lapped — a
head read after the copy misses the entries being written. In steady multi-turn traffic a request adds only its
new turn's blocks.

How a reader counts the others (:meth:`RouterSlots.peer_correction`): for each other live router slot and worker
k, ``min(pending, inflight)`` when that router's last dispatch to k is newer than k's current heartbeat minus half
a state interval, else 0 (everything it sent before that is in the worker's own published queue). A router that has
not picked since k's newest snapshot still publishes the count it had: at most one interval's sends are counted
twice, never forgotten. A dead router stops sending, so its entries fall under the cutoff within one interval; its
slot is skipped once its heartbeat is older than :data:`ROUTER_STALE_S` and reclaimed by the next router that
registers. Cost on the hot path: one 8-byte load per peer, plus one seqlocked copy of a peer that sent recently.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import sys
import time
from collections.abc import Sequence
from typing import Any, Final

from dplb.state.health_board import HealthBoard
from dplb.state.layout import (
    HEADER_SIZE,
    MAX_ROUTERS,
    PREFIX_RING_ENTRIES,
    PREFIX_RING_SIZE,
    ROUTER_SLOT_SIZE,
    SLOT_SIZE,
    register_router_fd,
    segment_size,
    unregister_router,
)
from dplb.state.response_rings import ResponseRing
from dplb.state.tenant_tables import TenantTables

ROUTER_HEAD: Final = struct.Struct("<IHHQQ")  # pid, port, process_index, heartbeat, last_sent (after seq)
ROUTER_ENTRY: Final = struct.Struct("<IIQ")  # pending, inflight, last_sent
ROUTER_STALE_S: Final = 2.0  # a router slot whose heartbeat is older is ignored (its owner died or hung)
READ_RETRIES: Final = 64
assert ROUTER_SLOT_SIZE % 64 == 0 and ROUTER_ENTRY.size == 16
# The owner stores words through a native-order view ("Q") where the layout says little-endian (seq, times, entries).
assert sys.byteorder == "little"

def routers_offset(num_workers: int) -> int:
    """Offset of router slot 0 in a segment with ``num_workers`` worker slots, bytes."""
    return HEADER_SIZE + num_workers * SLOT_SIZE


def routers_size() -> int:
    """Bytes of the router-slot area (:data:`MAX_ROUTERS` slots and as many prefix rings)."""
    return MAX_ROUTERS * (ROUTER_SLOT_SIZE + PREFIX_RING_SIZE)


_RING_MASK: Final = PREFIX_RING_ENTRIES - 1
_KEY_MASK: Final = (1 << 56) - 1
assert PREFIX_RING_ENTRIES & _RING_MASK == 0


class RouterSlots:
    """This router process's slot (the single writer) and a reader of every other router's slot.

    ``claim()`` maps the router area writable and takes a slot; without write access (a read-only segment) it
    returns None and the router routes on its own correction alone. Not thread-safe (one event loop).
    """

    def __init__(self, path: str, fd: int, mm: mmap.mmap, num_workers: int, index: int) -> None:
        self.path, self._fd, self._mm, self.num_workers, self.index = path, fd, mm, num_workers, index
        self._base = routers_offset(num_workers)
        self._q = memoryview(mm).cast("Q")  # aligned 8-byte loads/stores of seq and time words
        self._off = self._base + index * ROUTER_SLOT_SIZE
        self._si = self._off >> 3
        self._ei = self._si + 8  # word of worker 0's entry (at slot offset 64)
        self._seq = self._q[self._si] + (self._q[self._si] & 1)
        self._entries = struct.Struct("<" + "IIQ" * num_workers)
        rings = self._base + MAX_ROUTERS * ROUTER_SLOT_SIZE
        self._ring_q = [(rings + r * PREFIX_RING_SIZE) >> 3 for r in range(MAX_ROUTERS)]  # each ring's head word
        self._ring_seen = [0] * MAX_ROUTERS  # peers' ring entries already replayed
        self.prefix_lost = 0  # peers' entries overwritten before this process read them
        self._peers: list[int] = []
        self._peer_rings: list[int] = []
        #: True when another live router shares the segment (as of the last :meth:`refresh_peers`; an attribute,
        #: not a property: read on every decision).
        self.has_peers = False
        #: The router slots of the live peers (as of the last :meth:`refresh_peers`).
        self.peer_slots: list[int] = []
        #: This slot's tenant table and the reader of the others' (:mod:`dplb.state.tenant_tables`).
        self.tenants = TenantTables(mm, num_workers, index)
        #: This slot's response-id ring and the reader of the others' (:mod:`dplb.state.response_rings`).
        self.responses = ResponseRing(mm, num_workers, index)
        #: This slot's health table and the reader of the others' (:mod:`dplb.state.health_board`).
        self.health = HealthBoard(mm, num_workers, index)
        self._sent_any = 0
        self.pid = os.getpid()

    @classmethod
    def claim(cls, path: str, num_workers: int, port: int, process_index: int = 0,
              pid: int | None = None, inode: int | None = None) -> RouterSlots | None:
        """Register process ``pid`` (default: this one) in the segment at ``path`` (``num_workers`` worker slots)
        and take its router slot, zeroed; registry entry and slot are in the one file opened here. ``inode``: the
        file the caller attached (:attr:`dplb.state.shm.Segment.inode`); a different file at the path now (the
        segment was replaced meanwhile) is left untouched. Returns None when the segment cannot be written, was
        replaced, or every slot belongs to a live router."""
        pid = os.getpid() if pid is None else pid
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            return None
        try:
            if inode is not None and os.fstat(fd).st_ino != inode:
                raise ValueError("replaced")
            index = register_router_fd(fd, port, pid)
            if index is None:
                raise ValueError("not writable or full")
            mm = mmap.mmap(fd, segment_size(num_workers), access=mmap.ACCESS_WRITE)  # up to the response rings
        except (OSError, ValueError):
            os.close(fd)
            return None
        slots = cls(path, fd, mm, num_workers, index)
        slots.pid = pid
        slots._write_head(pid, port, process_index, clear=True)
        slots._q[slots._ring_q[index]] = slots._q[slots._ring_q[index] + 1] = 0  # empty: a previous owner's are void
        slots.responses.adopt()
        slots.tenants.claim()
        slots.health.claim()
        slots.refresh_peers()
        return slots

    # ---- owner -----------------------------------------------------------------------------------------------
    def _write_head(self, pid: int, port: int, process_index: int, clear: bool = False) -> None:
        q, si = self._q, self._si
        seq = self._seq + 1
        q[si] = seq
        if clear:
            self._mm[self._off + 8:self._off + ROUTER_SLOT_SIZE] = bytes(ROUTER_SLOT_SIZE - 8)
        ROUTER_HEAD.pack_into(self._mm, self._off + 8, pid, port & 0xFFFF, process_index & 0xFFFF,
                              time.monotonic_ns(), self._sent_any)
        q[si] = self._seq = seq + 1

    def publish(self, worker: int, pending: int, inflight: int, sent_now_ns: int = 0) -> None:
        """Publish this router's ``pending`` correction and ``inflight`` count for ``worker``; ``sent_now_ns``
        (CLOCK_MONOTONIC ns) when a request was just dispatched to it (0: a release, the send time is kept)."""
        q, si = self._q, self._si
        seq = self._seq + 1
        q[si] = seq
        e = self._ei + 2 * worker  # the entry as two 8-byte words: pending | inflight << 32, then last_sent
        if sent_now_ns:
            self._sent_any = sent_now_ns
            q[si + 3] = sent_now_ns
            q[e + 1] = sent_now_ns
        q[e] = pending | inflight << 32
        q[si] = self._seq = seq + 1

    def heartbeat(self) -> None:
        """Refresh this slot's heartbeat (the monitor calls it every tick) and the list of live peers."""
        self._q[self._si + 2] = time.monotonic_ns()
        self.refresh_peers()

    def refresh_peers(self) -> None:
        """Recompute which other router slots are live (pid set, heartbeat within :data:`ROUTER_STALE_S`)."""
        now = time.monotonic_ns()
        limit = int(ROUTER_STALE_S * 1e9)
        peers, rings = [], []
        for r in range(MAX_ROUTERS):
            if r == self.index:
                continue
            si = (self._base + r * ROUTER_SLOT_SIZE) >> 3
            pid = self._q[si + 1] & 0xFFFFFFFF
            if pid and now - self._q[si + 2] <= limit:
                peers.append(si)
                rings.append(r)
            else:
                self._ring_seen[r] = 0  # a later owner starts its ring at 0
        self._peers, self._peer_rings = peers, rings
        self.peer_slots = rings
        self.has_peers = bool(peers)

    def publish_urgent(self, rank: int | None) -> None:
        """Publish the most urgent priority class this process has queued (None: nothing queued)."""
        self._q[self._si + 4] = 0 if rank is None else rank + 1

    def peers_urgent(self) -> int | None:
        """The most urgent priority class any live peer has queued (None: none has a request queued). One load per
        peer."""
        q = self._q
        best = 0
        for si in self._peers:
            v = q[si + 4]
            if v and (not best or v < best):
                best = v
        return best - 1 if best else None

    # ---- prefix rings ----------------------------------------------------------------------------------------
    def publish_prefix(self, worker: int, keys: list[int]) -> None:
        """Append ``keys`` (block keys this process's index learnt, sent to ``worker``) to this process's ring."""
        q = self._q
        h = self._ring_q[self.index]
        head = q[h]
        tag = (worker + 1) << 56
        base = h + 8
        q[h + 1] = head + len(keys)  # reserve first: readers learn these slots are being overwritten
        for key in keys:
            q[base + (head & _RING_MASK)] = key | tag
            head += 1
        q[h] = head  # entries first, then the head that publishes them (single 8-byte store; x86-64 TSO)

    def drain_prefix(self) -> dict[int, list[int]]:
        """What the peers' rings gained since the last call: ``{worker: [block key, …]}`` in ring order (raw
        entries; the policy decides what they mean). Entries naming no worker of this segment are dropped. Costs
        one load per peer when nothing is new (then returns an empty dict)."""
        q = self._q
        seen = self._ring_seen
        by_worker: dict[int, list[int]] = {}
        for r in self._peer_rings:
            h = self._ring_q[r]
            head = q[h]
            start = seen[r]
            if head == start:
                continue
            if head < start:  # a new owner restarted the ring
                start = 0
            if head - start > PREFIX_RING_ENTRIES:
                self.prefix_lost += head - start - PREFIX_RING_ENTRIES
                start = head - PREFIX_RING_ENTRIES
            base = h + 8
            raw = [q[base + (i & _RING_MASK)] for i in range(start, head)]
            # entries the writer lapped while we copied, an append in progress included (its reserve)
            overwritten = max(q[h], q[h + 1]) - PREFIX_RING_ENTRIES - start
            if overwritten > 0:
                self.prefix_lost += overwritten
                raw = raw[overwritten:]
            seen[r] = head
            for v in raw:
                w = (v >> 56) - 1
                if 0 <= w < self.num_workers:
                    by_worker.setdefault(w, []).append(v & _KEY_MASK)
        return by_worker

    def close(self) -> None:
        """Zero this slot, leave the registry, unmap. Idempotent; never raises."""
        if self._fd < 0:
            return
        with contextlib.suppress(Exception):
            self._write_head(0, 0, 0, clear=True)
        unregister_router(self.path, self.pid)
        self.responses.close()
        self.tenants.close()
        self.health.close()
        self._q.release()
        with contextlib.suppress(BufferError):
            self._mm.close()
        os.close(self._fd)
        self._fd = -1

    # ---- readers ---------------------------------------------------------------------------------------------
    def _read_entries(self, si: int) -> tuple[int, ...] | None:
        q = self._q
        off = si << 3
        for _ in range(READ_RETRIES):
            seq = q[si]
            if seq & 1:
                continue
            raw = self._mm[off + 64:off + 64 + 16 * self.num_workers]
            if q[si] == seq:
                return self._entries.unpack(raw)
        return None  # torn READ_RETRIES times: count nothing from it this pick

    def peer_correction(self, cutoffs: Sequence[int], now_ns: int, horizon_ns: int) -> list[int] | None:
        """Per worker k: the other routers' requests to k that k's last snapshot may not count — Σ over live peers
        of ``min(pending, inflight)`` when the peer's last dispatch to k is ≥ ``cutoffs[k]`` (k's heartbeat minus
        half an interval, CLOCK_MONOTONIC ns). Peers that sent nothing in the last ``horizon_ns`` are skipped with
        one load. Returns None when no peer contributes (the common single-router case)."""
        out: list[int] | None = None
        q = self._q
        n = min(self.num_workers, len(cutoffs))
        floor = min(cutoffs) if cutoffs else 0
        for si in self._peers:
            sent = q[si + 3]
            if not sent or sent < floor or now_ns - sent > horizon_ns:  # nothing it sent can be uncounted
                continue
            v = self._read_entries(si)
            if v is None:
                continue
            if out is None:
                out = [0] * len(cutoffs)
            for k in range(n):
                if v[3 * k + 2] >= cutoffs[k]:
                    p, i = v[3 * k], v[3 * k + 1]
                    out[k] += p if p < i else i
        return out

    def peer_inflight(self) -> list[int]:
        """Per worker: the open requests of the other live routers (for ``dplb_worker_requests_inflight``)."""
        out = [0] * self.num_workers
        self.refresh_peers()
        for si in self._peers:
            v = self._read_entries(si)
            if v is not None:
                for k in range(self.num_workers):
                    out[k] += v[3 * k + 1]
        return out


def router_inflight(mm: mmap.mmap, q: memoryview, num_workers: int, worker: int,
                    now_ns: int | None = None) -> dict[int, int]:
    """What each live router process believes ``worker`` has in flight: ``{router pid: open requests}`` for every
    router slot whose pid is set and whose heartbeat is within :data:`ROUTER_STALE_S` (``now_ns``: CLOCK_MONOTONIC
    ns, default now). ``mm`` is a segment mapping with ``num_workers`` worker slots and ``q`` its
    ``memoryview.cast("Q")``; each slot is read under its seqlock (one torn :data:`READ_RETRIES` times is left out).
    The worker's reconciler compares it with the requests open on its socket (docs/DESIGN.md §8.1)."""
    base = routers_offset(num_workers)
    now = time.monotonic_ns() if now_ns is None else now_ns
    limit = int(ROUTER_STALE_S * 1e9)
    out: dict[int, int] = {}
    entry = 64 + 16 * worker + 4
    for r in range(MAX_ROUTERS):
        off = base + r * ROUTER_SLOT_SIZE
        si = off >> 3
        for _ in range(READ_RETRIES):
            seq = q[si]
            if seq & 1:
                continue
            pid, hb = q[si + 1] & 0xFFFFFFFF, q[si + 2]
            (inflight,) = struct.unpack_from("<I", mm, off + entry)
            if q[si] == seq:
                if pid and now - hb <= limit:
                    out[pid] = out.get(pid, 0) + inflight
                break
    return out


def read_router_slots(mm: mmap.mmap | bytes, num_workers: int) -> list[dict[str, Any]]:
    """Decode every used router slot of a segment's bytes (``dplb state --json``): pid, port, process index,
    heartbeat age (seconds) and per-worker pending/inflight lists. Not seqlocked: for display only."""
    base = routers_offset(num_workers)
    now = time.monotonic_ns()
    out: list[dict[str, Any]] = []
    for r in range(MAX_ROUTERS):
        off = base + r * ROUTER_SLOT_SIZE
        if len(mm) < off + ROUTER_SLOT_SIZE:
            break
        pid, port, idx, hb, _ = ROUTER_HEAD.unpack_from(mm, off + 8)
        if not pid:
            continue
        ent = [ROUTER_ENTRY.unpack_from(mm, off + 64 + 16 * k) for k in range(num_workers)]
        out.append({"slot": r, "pid": pid, "port": port, "process_index": idx,
                    "heartbeat_age_s": round((now - hb) / 1e9, 3) if hb else None,
                    "pending": [e[0] for e in ent], "inflight": [e[1] for e in ent]})
    return out
