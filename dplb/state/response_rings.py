"""Response-id rings of the state segment: every router process tells the others which worker created each
``/v1/responses`` id it relayed, and for which tenant (docs/DESIGN.md §3.8).

vLLM keeps a stored response in the memory of the engine that made it, so ``GET /v1/responses/{id}``, ``…/cancel``
and ``previous_response_id`` must reach that worker (:class:`dplb.router.routes.ResponseIds`), and with a tenants
file only for the tenant that created it (:mod:`dplb.router.ownership`). A router process learns an id from the
answer it relays; its peers (``dplb router --processes N``, or another router on the same segment) learn it from this
process's ring.

Byte layout (little-endian; ring r at :func:`dplb.state.layout.response_rings_offset` + r·RESPONSE_RING_SIZE, after
the KV rings; written only by the owner of router slot r, :mod:`dplb.state.router_slots`)::

      0   u64  head                   entries ever written (the next goes to head mod RESPONSE_RING_ENTRIES = 4096)
      8   u64  reserve                the head the entries being written will reach (≥ head; = head when idle)
      16  u64  epoch                  the owner's claim: CLOCK_MONOTONIC ns when it took the slot, never 0 (0: the
                                      ring was never written); a new owner writes a new one
      24..63 reserved (zeros)
      64 + 16·i  u64 key              :func:`id_key` of the response id
      72 + 16·i  u64 value            tenant tag | (worker + 1) << 56: the creating worker, and the creating
                                      request's tenant (:func:`dplb.tenants.tenant_tag`, < 2^56; 0 = no tenant)

Why a hash: ids are 1..256 characters (a client may choose its ``request_id``), and a fixed 8-byte key keeps every
entry 16 bytes, the ring 64 KiB and a router's map bounded whatever the ids. Collision odds (BLAKE2b is a PRF: its
64-bit output is uniform): a lookup of an id nobody created matches a remembered one with probability ≤ C / 2^64
(C ≤ 65 536 ids in a router's map: 3.6·10⁻¹⁵ per lookup); two remembered ids share a key (the later one shadows the
earlier) with probability ≈ C² / 2^65 (1.2·10⁻¹⁰ for a full map). A client cannot aim at another tenant's id
without a second preimage of the 64-bit hash (~2^64 hashes), and a collision it made would only refuse it: the
entry keeps its creator's tenant tag. Tenant tags are hashes too; a tenants file whose names would share a tag is
refused when it is loaded (:func:`dplb.tenants.parse_tenants`).

Protocol (the prefix ring's, :mod:`dplb.state.router_slots`, with two words per entry and an epoch): the owner
stores ``reserve`` (where this append ends), then the key and value words, then the head (aligned 8-byte stores;
x86-64 keeps store order). A reader copies entries ``[start, head)``, then checks ``reserve``: every entry below
``reserve − RESPONSE_RING_ENTRIES`` may have been overwritten under it and is dropped (a torn entry is never
returned), and re-reads the epoch: a changed one (the slot changed owner meanwhile) voids the copy. A reader more than
RESPONSE_RING_ENTRIES behind loses the oldest entries. Every loss is counted in :attr:`ResponseRing.lost`; a lost id
is one the router cannot tell the creator of (routed by score; refused to tenants, fail closed).

A reader starts at the beginning of every ring (a process that joins a group learns the ids its peers relayed
before, as far as their rings reach) and reads every slot's ring, live owner or not: a dead router's ids stay valid
on their workers. A new owner of a slot adopts its ring (:meth:`ResponseRing.adopt`): it reads the previous owner's
entries once, like a peer's, and appends after them under the same epoch, so a restarted process of a group keeps
answering the follow-ups of the responses its predecessor relayed. The epoch changes only for a ring never written.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
import time
from typing import Final

from dplb.state.layout import MAX_ROUTERS, RESPONSE_RING_ENTRIES, RESPONSE_RING_SIZE, response_rings_offset
from dplb.tenants import TENANT_TAG_BITS

_MASK: Final = RESPONSE_RING_ENTRIES - 1
_STRIDE: Final = RESPONSE_RING_SIZE >> 3  # words from one ring's head to the next
#: The ring head and an entry as documented (docs/DESIGN.md §3.8; tests/test_design_doc.py checks them): the code
#: reads and writes them as aligned u64 words.
RESPONSE_HEAD: Final = struct.Struct("<QQQ")
RESPONSE_ENTRY: Final = struct.Struct("<QQ")
#: The tenant-tag bits of an entry's value (the worker is above them).
TAG_MASK: Final = (1 << TENANT_TAG_BITS) - 1
#: The tag of a response created without a tenant.
NO_TENANT: Final = 0
assert RESPONSE_RING_ENTRIES & _MASK == 0 and TENANT_TAG_BITS == 56
assert 64 + RESPONSE_ENTRY.size * RESPONSE_RING_ENTRIES == RESPONSE_RING_SIZE


def id_key(response_id: str) -> int:
    """The ring key of ``response_id``: BLAKE2b with an 8-byte digest of its UTF-8 bytes, as a little-endian u64
    (module docstring: why a hash, and the collision odds)."""
    return int.from_bytes(hashlib.blake2b(response_id.encode(), digest_size=8).digest(), "little")


def entry_value(worker: int, tag: int) -> int:
    """The value word of an entry: ``worker`` (0..63) created it for the tenant tagged ``tag`` (< 2^56)."""
    return (worker + 1) << TENANT_TAG_BITS | tag


def value_worker(value: int) -> int:
    """The worker of an entry's value word."""
    return (value >> TENANT_TAG_BITS) - 1


class ResponseRing:
    """Router slot ``index``'s ring in the mapping ``mm`` of a segment with ``num_workers`` worker slots (the single
    writer: :meth:`adopt`, :meth:`append`) and a reader of every other slot's ring (:meth:`drain`, its own cursors).
    Construction does not touch the segment. Not thread-safe (one event loop). ``lost``: peers' entries this reader
    could not read (module docstring)."""

    def __init__(self, mm: mmap.mmap, num_workers: int, index: int) -> None:
        if not 0 <= index < MAX_ROUTERS:
            raise ValueError(f"router slot {index} has no response ring ({MAX_ROUTERS} slots)")
        self.num_workers, self.index = num_workers, index
        self._q = memoryview(mm).cast("Q")
        base = response_rings_offset(num_workers) >> 3
        self._rings = [base + r * _STRIDE for r in range(MAX_ROUTERS)]  # each ring's head word
        self._h = self._rings[index]
        # Every ring's head and epoch word (strided views: ``tolist()`` loads them all in one call).
        self._head_words = self._q[base : base + MAX_ROUTERS * _STRIDE : _STRIDE]
        self._epoch_words = self._q[base + 2 : base + MAX_ROUTERS * _STRIDE : _STRIDE]
        self._seen = [0] * MAX_ROUTERS
        self._epochs = [0] * MAX_ROUTERS
        self._head = 0
        self.lost = 0

    # ---- owner -----------------------------------------------------------------------------------------------
    def adopt(self) -> None:
        """Take this slot's ring over (the owner's claim). A previous owner's entries stay: the worker that created
        an id does not change when the router process that relayed it dies, and a restarted process of a group
        takes its predecessor's slot, so voiding them lost every id it had relayed (follow-ups 404). This process's
        next :meth:`drain` reads them once, as a peer's; appends continue after them. An append the previous owner
        left half-done never published its entry (``reserve`` back to ``head``); a ring never written gets its
        epoch."""
        q, h = self._q, self._h
        q[h + 1] = q[h]
        if q[h + 2] == 0:
            q[h + 2] = time.monotonic_ns() | 1
        self._head = q[h]
        self._seen[self.index], self._epochs[self.index] = 0, q[h + 2]

    def append(self, key: int, value: int) -> None:
        """Publish one entry: ``key`` (:func:`id_key`) and ``value`` (:func:`entry_value`)."""
        q, h = self._q, self._h
        head = self._head
        q[h + 1] = head + 1  # reserve first: readers learn this slot is being overwritten
        i = h + 8 + 2 * (head & _MASK)
        q[i] = key
        q[i + 1] = value
        q[h] = self._head = self._seen[self.index] = head + 1  # the entry first, then the head that publishes it

    # ---- reader ----------------------------------------------------------------------------------------------
    def drain(self) -> list[int] | None:
        """What the other slots' rings gained since the last call, as a flat ``[key, value, key, value, …]`` in ring
        order (ring by ring); entries naming no worker of this segment are dropped. None when nothing is new (two
        strided loads when no ring moved)."""
        heads, epochs = self._head_words.tolist(), self._epoch_words.tolist()
        seen, known = self._seen, self._epochs
        if heads == seen and epochs == known:
            return None
        out: list[int] = []
        for r, h in enumerate(self._rings):  # (this slot's own ring only once, after adopt: append keeps it seen)
            if heads[r] == seen[r] and epochs[r] == known[r]:
                continue
            self._read(r, h, heads[r], epochs[r], out)
        return out or None

    def _read(self, r: int, h: int, head: int, epoch: int, out: list[int]) -> None:
        """Append ring ``r``'s new entries (up to ``head``, under ``epoch``) to ``out``; advance its cursor."""
        q = self._q
        start = self._seen[r] if epoch == self._epochs[r] else 0  # a new owner's ring starts at 0
        self._epochs[r] = epoch
        if head < start:  # (cannot happen under one epoch; read from the start rather than trust it)
            start = 0
        if head - start > RESPONSE_RING_ENTRIES:
            self.lost += head - start - RESPONSE_RING_ENTRIES
            start = head - RESPONSE_RING_ENTRIES
        a = h + 8 + 2 * (start & _MASK)  # the copy in one or two slices (where it wraps), in ring order
        b = a + 2 * (head - start)
        end = h + 8 + 2 * RESPONSE_RING_ENTRIES
        raw = q[a:b].tolist() if b <= end else q[a:end].tolist() + q[h + 8 : b - 2 * RESPONSE_RING_ENTRIES].tolist()
        over = q[h + 1] - RESPONSE_RING_ENTRIES - start  # entries the writer lapped (or is lapping) under the copy
        if q[h + 2] != epoch:  # the slot changed owner under the copy: nothing in it can be trusted
            self.lost += head - start
            self._seen[r], self._epochs[r] = 0, 0  # the next drain reads the new owner's ring from its start
            return
        self._seen[r] = head
        if over > 0:
            self.lost += min(over, head - start)
            raw = raw[2 * over:]
        n = self.num_workers
        for i in range(0, len(raw), 2):
            v = raw[i + 1]
            if 0 <= (v >> TENANT_TAG_BITS) - 1 < n:
                out.append(raw[i])
                out.append(v)

    def close(self) -> None:
        """Release the views (the mapping belongs to the caller)."""
        self._head_words.release()
        self._epoch_words.release()
        self._q.release()


__all__ = ["NO_TENANT", "RESPONSE_ENTRY", "RESPONSE_HEAD", "TAG_MASK", "ResponseRing", "entry_value", "id_key",
           "value_worker"]
