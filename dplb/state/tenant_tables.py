"""Tenant tables of the state segment: every router process tells the others what each limited tenant consumed, so
a tenant's limits hold for the router group as a whole (docs/DESIGN.md §3.9, §15).

A router process enforces a tenant's ``requests_per_s``, ``tokens_per_min`` and ``max_concurrent`` with its own
buckets (:mod:`dplb.router.limits`); alone, N processes would admit N times the quota. So each process publishes, per
tenant, its open requests and monotonic counters of what it admitted, and before an admission a process with live
peers adds their open requests to its own and debits its buckets by what they admitted since it last looked
(:mod:`dplb.router.group_quota`).

Byte layout (little-endian; table r at :func:`dplb.state.layout.tenant_tables_offset` + r·TENANT_TABLE_SIZE, after
the response-id rings; written only by the owner of router slot r, :mod:`dplb.state.router_slots`)::

    entry i < TENANT_TABLE_ENTRIES = 64 at 64·i, eight u64 words:
      0   u64  seq                    seqlock counter of this entry (odd while the owner writes it)
      8   u64  key                    the tenant's tag (dplb.tenants.tenant_tag: < 2^56, never 0); 0 = free entry
      16  u64  created_mono_ns        CLOCK_MONOTONIC ns when the owner created the entry (its counters start then)
      24  u64  inflight               the owner's open requests of the tenant (not monotonic)
      32  u64  requests               requests the owner admitted (monotonic)
      40  u64  tokens_taken           tokens the owner took from the tenant's bucket: reservations and corrections
                                      upwards (monotonic)
      48  u64  tokens_given           tokens the owner gave back: corrections downwards, refunds (monotonic)
      56  u64  reserved (zero)

Why a tag, not the name: an entry stays 64 bytes whatever the name; tags are the same in every process and across
reloads, and a tenants file whose names would share a tag is refused at load (:mod:`dplb.tenants`), so two tenants
of one file never share an entry. An entry's position is the owner's choice (the first free one); a reader finds a
tag by scanning the 64 key words once and remembers the position, checked on every read.

Protocol: the owner increments ``seq`` (odd), stores the words, increments it again; a reader copies an entry
between two equal even ``seq`` loads and gives up after :data:`READ_RETRIES` (that peer counts nothing this time;
its counters are monotonic, so the next read catches up). Only the slots of live peers are read (pid set, heartbeat
within ``ROUTER_STALE_S``): a dead process's open requests stop counting within 2 s. A new owner of a slot zeroes
its table (:meth:`TenantTables.claim`); its entries get new creation times, so readers restart from zero counters.

A reader's cursor per (peer slot, tag) keeps the entry's creation time and the counters it last saw; the deltas
since are what the peer consumed meanwhile. An entry created after the reader started is read from zero (all its
consumption is new); an entry older than the reader is read from the values found at the first look (its past is
not debited twice into a fresh process's full buckets: at a process's start, a peer's consumption of the previous
moments is not counted — at most one bucket).
"""

from __future__ import annotations

import mmap
import struct
import time
from collections.abc import Iterable, Sequence
from typing import Final

from dplb.state.layout import MAX_ROUTERS, TENANT_TABLE_ENTRIES, TENANT_TABLE_SIZE, tenant_tables_offset

#: Words per entry (64 bytes).
ENTRY_WORDS: Final = 8
#: Copies of a peer's entry a reader tries before it counts nothing from that peer this time.
READ_RETRIES: Final = 64
_TABLE_WORDS: Final = TENANT_TABLE_SIZE >> 3
_ENTRY: Final = struct.Struct("<8Q")  # one entry (module docstring), for the display reader
assert TENANT_TABLE_SIZE == TENANT_TABLE_ENTRIES * ENTRY_WORDS * 8


class TenantTables:
    """Router slot ``index``'s tenant table in the mapping ``mm`` of a segment with ``num_workers`` worker slots (the
    single writer: :meth:`claim`, :meth:`assign`, :meth:`write`) and a reader of the others' (:meth:`peers`, its
    own cursors). Construction does not touch the segment. Not thread-safe (one event loop)."""

    def __init__(self, mm: mmap.mmap, num_workers: int, index: int) -> None:
        if not 0 <= index < MAX_ROUTERS:
            raise ValueError(f"router slot {index} has no tenant table ({MAX_ROUTERS} slots)")
        self.index = index
        self._q = memoryview(mm).cast("Q")
        base = tenant_tables_offset(num_workers) >> 3
        self._tables = [base + r * _TABLE_WORDS for r in range(MAX_ROUTERS)]  # each table's first word
        self._t = self._tables[index]
        self._pos: dict[int, int] = {}  # own tag → entry
        self._seq = [0] * TENANT_TABLE_ENTRIES
        #: (peer slot, tag) → [entry, created_mono_ns, requests, net tokens] as last read
        self._cursors: dict[tuple[int, int], list[int]] = {}
        self.start_ns = time.monotonic_ns()

    # ---- owner -----------------------------------------------------------------------------------------------
    def claim(self) -> None:
        """Take this slot's table over: every entry zeroed (a previous owner's counters are void)."""
        t = self._t
        self._q[t:t + _TABLE_WORDS] = memoryview(bytes(TENANT_TABLE_SIZE)).cast("Q")
        self._pos.clear()
        self._seq = [0] * TENANT_TABLE_ENTRIES

    def assign(self, tags: Iterable[int]) -> dict[int, int]:
        """Give every tag of ``tags`` an entry: a tag already here keeps its entry and counters, a new one takes the
        first free entry (zero counters, created now), a tag no longer listed frees its entry. Returns ``{tag:
        entry}`` for the tags that got one: not a duplicate, a zero, or beyond the :data:`TENANT_TABLE_ENTRIES`."""
        want: list[int] = []
        for tag in tags:
            if tag and tag not in want:
                want.append(tag)
        keep = set(want)
        for tag, i in list(self._pos.items()):
            if tag not in keep:
                self._store(i, (0, 0, 0, 0, 0, 0))
                del self._pos[tag]
        used = set(self._pos.values())
        free = [i for i in range(TENANT_TABLE_ENTRIES) if i not in used]
        for tag in want:
            if tag not in self._pos and free:
                i = free.pop(0)
                self._pos[tag] = i
                self._store(i, (tag, time.monotonic_ns(), 0, 0, 0, 0))
        return dict(self._pos)

    def write(self, entry: int, inflight: int, requests: int, taken: int, given: int) -> None:
        """Publish the owner's counts of the tenant at ``entry`` (an entry :meth:`assign` returned)."""
        q = self._q
        w = self._t + entry * ENTRY_WORDS
        seq = self._seq[entry] + 1
        q[w] = seq
        q[w + 3] = inflight
        q[w + 4] = requests
        q[w + 5] = taken
        q[w + 6] = given
        q[w] = self._seq[entry] = seq + 1

    def _store(self, entry: int, words: tuple[int, int, int, int, int, int]) -> None:
        q = self._q
        w = self._t + entry * ENTRY_WORDS
        seq = self._seq[entry] + 1
        q[w] = seq
        for j, v in enumerate(words):
            q[w + 1 + j] = v
        q[w] = self._seq[entry] = seq + 1

    # ---- reader ----------------------------------------------------------------------------------------------
    def peers(self, tag: int, slots: Sequence[int]) -> tuple[int, int, int]:
        """What the live peers at router ``slots`` hold of tenant ``tag``: (their open requests now, requests they
        admitted since the last call, tokens they took net of what they gave back since the last call). A peer
        without an entry for the tag, or whose entry stayed torn, counts nothing (module docstring)."""
        inflight = d_req = d_tok = 0
        for r in slots:
            got = self._read(r, tag)
            if got is None:
                continue
            cur, created, n_in, n_req, taken, given = got
            net = taken - given
            if cur[1] != created:  # first look at this entry, or the entry was recreated (new owner, reload)
                cur[1] = created
                if created >= self.start_ns:
                    cur[2] = cur[3] = 0
                else:
                    cur[2], cur[3] = n_req, net
            inflight += n_in
            d_req += n_req - cur[2]
            d_tok += net - cur[3]
            cur[2], cur[3] = n_req, net
        return inflight, d_req, d_tok

    def _read(self, r: int, tag: int) -> tuple[list[int], int, int, int, int, int] | None:
        """Peer ``r``'s entry for ``tag`` under its seqlock: (cursor, created, inflight, requests, taken, given)."""
        q = self._q
        cur = self._cursors.get((r, tag))
        if cur is None:
            cur = self._cursors[(r, tag)] = [-1, 0, 0, 0]
        for attempt in range(2):
            if cur[0] < 0 or attempt:
                keys = q[self._tables[r] + 1:self._tables[r] + _TABLE_WORDS:ENTRY_WORDS].tolist()
                cur[0] = keys.index(tag) if tag in keys else -1
                if cur[0] < 0:
                    return None
            w = self._tables[r] + cur[0] * ENTRY_WORDS
            for _ in range(READ_RETRIES):
                seq = q[w]
                if seq & 1:
                    continue
                words = q[w + 1:w + 7].tolist()
                if q[w] == seq:
                    break
            else:
                return None  # torn every time: nothing from this peer now, its monotonic counters catch up later
            if words[0] == tag:
                return cur, words[1], words[2], words[3], words[4], words[5]
        return None

    def close(self) -> None:
        """Release the view (the mapping belongs to the caller)."""
        self._q.release()


def read_tenant_table(mm: mmap.mmap | bytes, num_workers: int, slot: int) -> list[dict[str, int | float]]:
    """Router slot ``slot``'s used entries, for display (``dplb state``): per entry its ``tag`` (int), ``inflight``,
    ``requests``, ``tokens_taken``, ``tokens_given`` and ``age_s`` (seconds since its owner created it: the counters
    start then), in entry order. Each entry is copied under its seqlock; one still torn after :data:`READ_RETRIES`
    copies is left out. A segment too short to hold the table (or ``slot`` out of range) reads as no entries."""
    base = tenant_tables_offset(num_workers) + slot * TENANT_TABLE_SIZE
    if not 0 <= slot < MAX_ROUTERS or len(mm) < base + TENANT_TABLE_SIZE:
        return []
    now = time.monotonic_ns()
    out: list[dict[str, int | float]] = []
    for i in range(TENANT_TABLE_ENTRIES):
        off = base + i * ENTRY_WORDS * 8
        for _ in range(READ_RETRIES):
            seq, tag, created, inflight, requests, taken, given, _z = _ENTRY.unpack_from(mm, off)
            if not seq & 1 and _ENTRY.unpack_from(mm, off)[0] == seq:
                break
        else:
            continue
        if tag:
            out.append({"tag": tag, "inflight": inflight, "requests": requests, "tokens_taken": taken,
                        "tokens_given": given, "age_s": round(max(0, now - created) / 1e9, 3)})
    return out


__all__ = ["ENTRY_WORDS", "READ_RETRIES", "TenantTables", "read_tenant_table"]
