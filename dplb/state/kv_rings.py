"""KV rings of the state segment: each worker tells the routers what its engine's prefix cache really holds, in the
router's own block keys (docs/DESIGN.md §3.7).

Byte layout (little-endian; ring w at :func:`dplb.state.layout.kv_rings_offset` + w·KV_RING_SIZE, written only by
worker w)::

      0   u64  head                   entries ever written (the next goes to head mod KV_RING_ENTRIES)
      8   u64  events_since_mono_ns   CLOCK_MONOTONIC ns since when the worker translates its engine's KV events
                                      (0: it does not; the routers keep their sent-bytes index for it)
      16  u64  compared_total         requests whose router prediction was compared with the engine's cached tokens
      24  u64  cached_tokens_total    Σ engine cached prompt tokens over those requests
      32  u64  predicted_tokens_total Σ router-predicted cached tokens over those requests
      40  u64  error_tokens_total     Σ |predicted − cached| over those requests
      48  u32  block_bytes            the router block size the worker hashes prompts with (must equal the routers')
      52  u32  lost_batches           engine event batches the worker's subscription lost (sequence gaps)
      56  u64  reserve                the head the entries being written will reach (≥ head; = head when idle)
      64 + 8·i  u64 entry             op << 56 | block key (dplb.policy.prefix.block_hashes, < 2^42)

Ops: :data:`OP_STORED` (the engine holds every token of the key's bytes: a confirmation), :data:`OP_REMOVED` (it no
longer does), :data:`OP_CLEARED` (key 0: it holds nothing). The writer stores ``reserve`` (where this append will
end), then the entries, then the head (aligned 8-byte stores; x86-64 keeps store order): a reader that copied
entries from ``start`` checks ``reserve`` afterwards, and every entry below ``reserve − KV_RING_ENTRIES`` may have
been overwritten under it (checking the head instead would miss the append in progress). Counters are single aligned
8-byte stores (a reader may see them one update apart, fine for metrics). Every reader keeps its own cursor per ring
(:class:`KvRingReader`). A reader that fell more than KV_RING_ENTRIES behind, whose copy the writer lapped meanwhile
(torn), or that sees the head go back (the worker restarted) cannot know what it missed: it gets an
:data:`OP_CLEARED` first (drop every confirmation of that worker) and counts the loss in ``lost``; forgetting costs
affinity, never a wrong belief.
"""

from __future__ import annotations

import mmap
import struct
from typing import Final

from dplb.state.layout import KV_RING_ENTRIES, KV_RING_SIZE, kv_rings_offset

OP_STORED: Final = 1
OP_REMOVED: Final = 2
OP_CLEARED: Final = 3
_KEY_MASK: Final = (1 << 56) - 1
_MASK: Final = KV_RING_ENTRIES - 1
assert KV_RING_ENTRIES & _MASK == 0 and KV_RING_SIZE % 64 == 0
_COUNTERS: Final = ("compared_total", "cached_tokens_total", "predicted_tokens_total", "error_tokens_total")
_TAIL: Final = struct.Struct("<II")  # block_bytes, lost_batches at offset 48
#: The 64-byte ring head as documented (docs/DESIGN.md §3.7; tests/test_design_doc.py checks it).
KV_HEAD: Final = struct.Struct("<QQQQQQIIQ")
assert KV_HEAD.size == 64
#: How often a reader re-reads which workers translate events (CLOCK_MONOTONIC ns).
MASK_REFRESH_NS: Final = 250_000_000


class KvRingWriter:
    """Worker ``worker``'s ring in the mapping ``mm`` of a segment with ``num_workers`` slots; the single writer
    (callers serialise their calls). Construction does not touch the ring; :meth:`reset` does."""

    def __init__(self, mm: mmap.mmap, num_workers: int, worker: int) -> None:
        if not 0 <= worker < num_workers:
            raise ValueError(f"worker {worker} has no KV ring in a segment of {num_workers} workers")
        self._mm = mm
        self._off = kv_rings_offset(num_workers) + worker * KV_RING_SIZE
        self._q = memoryview(mm).cast("Q")
        self._h = self._off >> 3
        self._head = 0

    def reset(self, block_bytes: int) -> None:
        """Empty the ring and its counters (a worker's start) and record ``block_bytes``; events stay off until
        :meth:`enable`."""
        q, h = self._q, self._h
        q[h + 1] = 0
        for i in range(2, 6):
            q[h + i] = 0
        _TAIL.pack_into(self._mm, self._off + 48, block_bytes, 0)
        q[h] = q[h + 7] = self._head = 0

    def enable(self, since_mono_ns: int) -> None:
        """Say that this worker's entries follow its engine from ``since_mono_ns`` on (0: stopped)."""
        self._q[self._h + 1] = since_mono_ns

    def append(self, op: int, keys: list[int] | tuple[int, ...]) -> None:
        """Append ``op`` for each of ``keys`` (one entry each; :data:`OP_CLEARED` takes ``[0]``)."""
        q, h = self._q, self._h
        head = self._head
        q[h + 7] = head + len(keys)  # reserve first: readers know these slots are being overwritten
        tag = op << 56
        base = h + 8
        for key in keys:
            q[base + (head & _MASK)] = key | tag
            head += 1
        q[h] = self._head = head  # entries first, then the head that publishes them

    def compare(self, cached: int, predicted: int) -> None:
        """Count one request: the engine's ``cached`` prompt tokens against the router's ``predicted`` ones."""
        q, h = self._q, self._h
        q[h + 2] += 1
        q[h + 3] += cached
        q[h + 4] += predicted
        q[h + 5] += abs(predicted - cached)

    def lost_batches(self, n: int) -> None:
        """Record that the engine subscription has lost ``n`` batches in all."""
        struct.pack_into("<I", self._mm, self._off + 52, n & 0xFFFFFFFF)

    def close(self) -> None:
        """Release the view (the mapping belongs to the segment)."""
        self._q.release()


class KvRingReader:
    """A router process's reader of every worker's ring (its own cursors). Not thread-safe (one event loop).
    ``lost``: entries this reader could not read (each such gap also produced an :data:`OP_CLEARED`)."""

    def __init__(self, mm: mmap.mmap, num_workers: int) -> None:
        self.num_workers = num_workers
        self._q = memoryview(mm).cast("Q")
        self._mm = mm
        base = kv_rings_offset(num_workers) >> 3
        self._heads = [base + w * (KV_RING_SIZE >> 3) for w in range(num_workers)]
        # Every ring's head word (a strided view: ``tolist()`` loads them all in one call).
        self._head_words = self._q[base : base + num_workers * (KV_RING_SIZE >> 3) : KV_RING_SIZE >> 3]
        self._seen = self._head_words.tolist()  # start at the present: the index starts empty anyway
        self.events_mask = 0
        self._mask_at = -MASK_REFRESH_NS
        self.lost = 0

    def refresh_mask(self, now_ns: int, block_bytes: int = 0) -> int:
        """Bit w set when worker w translates its engine's events (into keys of ``block_bytes``-byte blocks, when
        given: a worker hashing with another block size is left out); re-read at most every
        :data:`MASK_REFRESH_NS` (``now_ns``: CLOCK_MONOTONIC ns)."""
        if now_ns - self._mask_at >= MASK_REFRESH_NS:
            q, mm = self._q, self._mm
            self.events_mask = sum(1 << w for w, h in enumerate(self._heads) if q[h + 1] and (
                not block_bytes or struct.unpack_from("<I", mm, (h << 3) + 48)[0] == block_bytes))
            self._mask_at = now_ns
        return self.events_mask

    def drain(self) -> dict[int, list[int]] | None:
        """What the rings gained since the last call: ``{worker: [op << 56 | key, …]}`` in ring order, with an
        :data:`OP_CLEARED` entry first where entries were lost; None when nothing is new (one load per worker)."""
        heads = self._head_words.tolist()
        seen = self._seen
        if heads == seen:  # nothing new anywhere (every pick asks)
            return None
        q = self._q
        out: dict[int, list[int]] | None = None
        for w, h in enumerate(self._heads):
            head = heads[w]
            start = seen[w]
            if head == start:
                continue
            lost = 0
            if head < start:  # the worker restarted (its ring was reset): everything before is void
                start, lost = 0, 1
            if head - start > KV_RING_ENTRIES:
                lost += head - start - KV_RING_ENTRIES
                start = head - KV_RING_ENTRIES
            a = h + 8 + (start & _MASK)  # the copy in one or two slices (where it wraps), in ring order
            b = a + head - start
            end = h + 8 + KV_RING_ENTRIES
            raw = q[a:b].tolist() if b <= end else q[a:end].tolist() + q[h + 8 : b - KV_RING_ENTRIES].tolist()
            over = q[h + 7] - KV_RING_ENTRIES - start  # entries the writer lapped (or is lapping) under the copy
            if over > 0:
                lost += over
                raw = raw[over:]
            seen[w] = head
            if lost:
                self.lost += lost
                raw.insert(0, OP_CLEARED << 56)
            if out is None:
                out = {}
            out[w] = raw
        return out

    def counters(self, worker: int) -> dict[str, int]:
        """Worker ``worker``'s published figures: the four comparison counters, ``block_bytes``, ``lost_batches``
        and ``events`` (1 when it translates its engine's events)."""
        h = self._heads[worker]
        q = self._q
        out = {name: q[h + 2 + i] for i, name in enumerate(_COUNTERS)}
        bb, lost = _TAIL.unpack_from(self._mm, (h << 3) + 48)
        out.update(block_bytes=bb, lost_batches=lost, events=1 if q[h + 1] else 0)
        return out

    def close(self) -> None:
        """Release the views (the mapping belongs to the segment)."""
        self._head_words.release()
        self._q.release()


def split(entry: int) -> tuple[int, int]:
    """``(op, key)`` of a raw ring entry."""
    return entry >> 56, entry & _KEY_MASK
