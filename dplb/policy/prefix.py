"""Approximate prefix-cache routing state: prompt bytes → chained block hashes, and a bounded index block → workers.

Contract
- :func:`block_hashes` cuts a prompt's bytes into fixed blocks of ``block_bytes`` (a trailing partial block is
  dropped, as vLLM only caches full blocks) and hashes them as a **chain**: block i's key covers every byte of
  blocks 0..i, like vLLM's block hashes (``vllm/v1/core/kv_cache_utils.py``, ``hash_block_tokens`` with the parent
  hash). Equal keys at depth i mean equal prefixes of ``(i+1)·block_bytes`` bytes (up to hash collisions).
- What is hashed (the router hands the prompt's raw bytes to the policy, see :mod:`dplb.router.proxy`; the prefix
  scorer and the ``prefix_hash`` picker hash them): for chat, the raw JSON bytes of ``messages``
  exactly as the client sent them; for completions, the raw bytes of ``prompt``. Raw bytes, not a canonical
  rendering: a client re-sends a conversation's history serialised the same way every turn, so turn k+1's bytes
  start with turn k's bytes minus the closing ``]``; decoding ``messages`` to render them canonically would cost
  ~40 µs for a 32 KB history and only helps clients that re-order keys between turns.
- Hash: CRC-32 continued over the blocks (``zlib.crc32(block, previous)`` is the CRC of all bytes so far), with
  the block index in the high bits: one C call per block (32 KB at 128-byte blocks: ~45 µs on the 2-core dev
  machine; at 64-byte blocks ~95 µs, hence the default of 128). Not cryptographic: a client can forge a prefix
  that collides with another's, which can at most bias where its own request is routed (load terms still apply).
- :class:`PrefixIndex` maps block key → bitmask of the workers that were sent that block, with the last time it was
  sent. It is an LRU of at most ``capacity`` blocks (one entry ≈ :data:`ENTRY_BYTES` bytes: 65,536 blocks ≈ 12 MB),
  and an entry older than ``ttl_s`` counts as absent and is evicted. :meth:`PrefixIndex.match` walks the request's
  keys from the first block and returns, per worker, how many leading blocks it was sent; :meth:`record` adds a
  routed request's blocks for its worker; :meth:`forget_worker` drops a worker (restart: its cache is empty).

How stale the index may be. For a worker without KV events it remembers what was *sent*, not what the engine still
holds: an engine evicts cached blocks under KV pressure (vLLM: LRU of free blocks) long before ``ttl_s``, and until
the LRU capacity or the TTL drops them the index may believe a worker still holds a prefix it lost. For an
event-fed worker (:attr:`PrefixIndex.events`; its worker translates the engine's KV events into these keys and
publishes them in its KV ring, :mod:`dplb.state.kv_rings`, applied by :meth:`PrefixIndex.apply_engine`) a block
counts when the engine confirmed it, or for ``speculative_ttl_s`` after it was sent (the request may still be
queued); an eviction is believed one event lag after it happened (docs/DESIGN.md §5, "staleness"). A wrong belief
costs one routing preference (the request pays its prefill on that worker), never a failure; ``dplb bench compare``
prints the index's predicted hit rate next to the engines' measured ``vllm:prefix_cache_*`` hit rate, and the
workers publish the per-request prediction error (``dplb_prefix_prediction_error_tokens_total``).
"""

from __future__ import annotations

import struct
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final

from dplb.state.kv_rings import OP_CLEARED, OP_REMOVED, OP_STORED

#: Most blocks hashed per request (128 KiB at 128-byte blocks): a longer prompt is told apart by then, and hashing
#: a 32 MB body whole would cost ~50 ms of the event loop.
MAX_PREFIX_BLOCKS: Final = 1024
_REFRESH_NS: Final = 1_000_000_000  # LRU position is refreshed at most once a second per block
#: Measured size of one index entry (key int, [mask, time] list, OrderedDict slot), bytes; see tests/test_prefix.py.
ENTRY_BYTES: Final = 188
#: The KV-ring entries of each op lie in ``[op << 56, (op + 1) << 56)`` (:mod:`dplb.state.kv_rings`).
_STORED_TAG: Final = OP_STORED << 56
_REMOVED_TAG: Final = OP_REMOVED << 56
_CLEARED_TAG: Final = OP_CLEARED << 56
assert (OP_STORED, OP_REMOVED, OP_CLEARED) == (1, 2, 3)  # consecutive: apply_engine tells them by range
#: How long an event-fed worker counts a block it was sent but has not confirmed, s: the gap between routing and
#: the engine's BlockStored (queueing + one step + the event path, well under a second at the knee), as llm-d's
#: precise scorer's speculative entries (2 s).
SPECULATIVE_TTL_S: Final = 2.0


def block_hashes(data: bytes | memoryview | Any, block_bytes: int, max_blocks: int = 0) -> list[int]:
    """Chained keys of the full ``block_bytes``-byte blocks of ``data`` (``max_blocks`` > 0: at most that many;
    ``data``: bytes, or a buffer whose ``len`` is its byte count: ``msgspec.Raw``, a byte ``memoryview``).

    Returns a list of non-negative ints below 2**48 (below 2**42 with ``max_blocks`` ≤ :data:`MAX_PREFIX_BLOCKS`, as
    the router slots' rings need): ``(block_index << 32) | crc32(data[: (i+1)·block_bytes])``. Empty when ``data``
    is None or shorter than one block, or ``block_bytes`` is 0.
    """
    if block_bytes <= 0 or data is None or len(data) < block_bytes:  # (no full block: no copy, no view)
        return []
    if type(data) is not bytes:
        # msgspec.Raw / memoryview: one copy of the bytes that are hashed (not of a long prompt's tail)
        view = memoryview(data)
        data = bytes(view[: max_blocks * block_bytes] if max_blocks else view)
    n = len(data) // block_bytes
    if max_blocks and n > max_blocks:
        n = max_blocks
    chunks = _CHUNKERS.get(block_bytes)
    if chunks is None:
        chunks = _CHUNKERS[block_bytes] = struct.Struct(f"{block_bytes}s").iter_unpack
    crc = _crc32
    h = 0
    hi = 0  # i << 32 for block i
    out: list[int] = []
    for (block,) in chunks(memoryview(data)[: n * block_bytes]):  # the blocks cut in C, no slice per block
        h = crc(block, h)
        out.append(hi | h)
        hi += _BLOCK_STEP
    return out


def _set_bits(out: list[int], mask: int, value: int) -> None:
    """``out[w] = value`` for every bit ``w`` set in ``mask`` (a byte of the mask at a time: :data:`_BYTE_BITS`)."""
    base = 0
    while mask:
        for b in _BYTE_BITS[mask & 255]:
            out[base + b] = value
        mask >>= 8
        base += 8


#: Byte value → the positions of its set bits.
_BYTE_BITS: Final = tuple(tuple(b for b in range(8) if m >> b & 1) for m in range(256))
#: Block size (bytes) → ``iter_unpack`` of a ``"{size}s"`` struct: cuts a buffer into its blocks in one call.
_CHUNKERS: Final[dict[int, Callable[[Any], Iterator[tuple[bytes]]]]] = {}
_BLOCK_STEP: Final = 1 << 32
_crc32: Final = zlib.crc32  # (Final: compiled, a C static instead of a module attribute lookup per call)


class PrefixIndex:
    """Bounded LRU: block key → [bitmask of workers sent that block, last-sent CLOCK_MONOTONIC ns, bitmask of
    workers whose engine confirmed it].

    ``capacity``: most entries kept (blocks, > 0); ``ttl_s``: a block not sent for this long counts as absent for
    a worker without events; ``speculative_ttl_s``: the same for an event-fed worker (:attr:`events`) until its
    engine confirms the block; ``num_workers``: worker ids 0..n−1 (a bit each). Not thread-safe (one event loop).
    """

    __slots__ = ("_all", "_map", "_spec_ns", "_ttl_ns", "_walk", "capacity", "events", "num_workers")

    def __init__(self, capacity: int, ttl_s: float, num_workers: int,
                 speculative_ttl_s: float = SPECULATIVE_TTL_S) -> None:
        self.capacity = capacity
        #: Bit w set: worker w's engine confirms what it holds (its KV ring), so what was only sent to it counts
        #: for ``speculative_ttl_s`` instead of ``ttl_s``.
        self.events = 0
        self._spec_ns = int(speculative_ttl_s * 1e9)
        self.num_workers = num_workers
        self._ttl_ns = int(ttl_s * 1e9)
        self._all = (1 << num_workers) - 1
        self._map: OrderedDict[int, list[int]] = OrderedDict()
        # The last match's walk while the index is unchanged: (keys, now_ns, workers with every block, entries).
        self._walk: tuple[Sequence[int], int, int, list[list[int]]] | None = None

    def __len__(self) -> int:
        return len(self._map)

    @property
    def approx_bytes(self) -> int:
        """Estimated memory of the entries, bytes (entries × :data:`ENTRY_BYTES`)."""
        return len(self._map) * ENTRY_BYTES

    def match(self, keys: list[int], now_ns: int) -> list[int]:
        """Leading blocks of ``keys`` each worker holds (list indexed by worker id; 0 = no match).

        Walks from the first block and stops as soon as no worker has the next one, so an unmatched prompt costs
        one lookup. A worker holds a block when its engine confirmed it (event-fed workers, :attr:`events`), or
        when it was sent the block within ``ttl_s`` (a worker without events) or within ``speculative_ttl_s`` (an
        event-fed worker whose confirmation has not arrived yet). The walk (the entries of the leading blocks that
        some worker holds, and which workers hold every block) is remembered until the index changes, so that
        :meth:`record` of the same keys at the same ``now_ns`` (the routed request) does not look them up again.
        """
        self._walk = None
        cutoff = now_ns - self._ttl_ns
        # Sent at or after ``spec``: held by every worker it was sent to; between ``cutoff`` and ``spec``: only by
        # the workers without events (``keep``; all of them when none has events); before ``cutoff``: by nobody.
        spec = now_ns - self._spec_ns
        if spec < cutoff:
            spec = cutoff
        keep = ~self.events
        cur = self._all
        depth: list[int] | None = None  # made at the first block not every worker has
        walked: list[list[int]] = []  # the entries of the blocks every worker in ``cur`` has
        for e in map(self._map.get, keys):  # the lookups in C, and the walk stops at the first miss
            if e is not None:
                held, t, confirmed = e
                if t >= spec:
                    nxt = cur & (held | confirmed)
                elif t >= cutoff:
                    nxt = cur & (held & keep | confirmed)
                else:
                    nxt = cur & confirmed
                if nxt == cur:
                    walked.append(e)
                    continue
            else:
                nxt = 0
            i = len(walked)  # the workers that lose this block have the i before it
            if depth is None:  # every worker is in ``cur``: those that keep the block are set again later
                depth = [i] * self.num_workers
            else:
                _set_bits(depth, cur & ~nxt, i)
            if not nxt:
                if i:
                    self._walk = (keys, now_ns, 0, walked)  # nobody has every block: the entries found
                return depth
            cur = nxt
            walked.append(e)  # type: ignore[arg-type]  # nxt != 0: e is an entry
        if not keys:
            return [0] * self.num_workers
        self._walk = (keys, now_ns, cur, walked)
        i = len(walked)
        if depth is None:
            return [i] * self.num_workers
        if cur & (cur - 1):
            _set_bits(depth, cur, i)  # workers that have every block
        else:  # one worker has
            depth[cur.bit_length() - 1] = i
        return depth

    def confirmed(self, keys: Sequence[int]) -> list[int]:
        """Leading blocks of ``keys`` each worker's engine confirmed (views only: ``/debug/decisions``, not the
        hot path); 0 for a worker without events."""
        depth = [0] * self.num_workers
        get = self._map.get
        cur = self.events
        for i, key in enumerate(keys):
            e = get(key)
            nxt = cur & e[2] if e is not None else 0
            gone = cur & ~nxt
            while gone:
                b = gone & -gone
                depth[b.bit_length() - 1] = i
                gone ^= b
            cur = nxt
            if not cur:
                return depth
        while cur:
            b = cur & -cur
            depth[b.bit_length() - 1] = len(keys)
            cur ^= b
        return depth

    def apply_engine(self, worker: int, entries: Sequence[int], now_ns: int) -> None:
        """Apply worker ``worker``'s KV-ring entries (``op << 56 | key``, :mod:`dplb.state.kv_rings`), in order:
        stored → the worker's confirmed bit (a new entry if the key is unknown; an entry that gains the bit becomes
        the most recent in the LRU), removed → the worker's bits cleared (the entry dropped when no bit is left),
        cleared → the worker forgotten (:meth:`forget_worker`); any other op is skipped. Then the oldest entries
        beyond ``capacity`` are evicted.

        An entry's op is told by the range it lies in (``op << 56 <= entry < (op + 1) << 56``) and its key is
        ``entry − (op << 56)``: comparisons and one subtraction, no shift and mask per entry."""
        self._walk = None
        m = self._map
        bit = 1 << worker
        off = ~bit
        get = m.get
        move = m.move_to_end
        for v in entries:
            if v < _REMOVED_TAG:
                if v >= _STORED_TAG:
                    key = v - _STORED_TAG
                    e = get(key)
                    if e is None:
                        m[key] = [0, now_ns, bit]
                    elif not e[2] & bit:
                        e[2] |= bit
                        move(key)
            elif v < _CLEARED_TAG:
                key = v - _REMOVED_TAG
                e = get(key)
                if e is not None:
                    if not (e[0] | e[2]) & off:  # nothing but this worker's bits: nothing left
                        del m[key]
                    elif (e[0] | e[2]) & bit:
                        e[0] &= off
                        e[2] &= off
            elif v < _CLEARED_TAG + _STORED_TAG:
                self.forget_worker(worker)
        while len(m) > self.capacity:
            m.popitem(last=False)

    def record(self, keys: Sequence[int], worker: int, now_ns: int) -> list[int]:
        """``keys`` were sent to ``worker`` at ``now_ns``: mark them (most recent in the LRU), then evict the oldest
        entries beyond ``capacity`` and any older than ``ttl_s``. Returns the keys whose entry changed beyond a
        time stamp: new, new for ``worker``, or refreshed after ``_REFRESH_NS`` (what other router processes must
        learn, :mod:`dplb.state.router_slots`)."""
        m = self._map
        stale = now_ns - _REFRESH_NS
        walk, self._walk = self._walk, None
        start = 0
        if walk is not None and walk[0] is keys and walk[1] == now_ns:
            walked = walk[3]  # the entries of the leading keys, as the last match found them (nothing changed since)
            if walk[2] >> worker & 1:
                # ``worker`` has every block: where the entries were sent within _REFRESH_NS, only their time
                # stamps change (no lookup, no LRU move, nothing to learn).
                start = len(keys)
                for e in walked:
                    if e[1] < stale:
                        start = walked.index(e)
                        break
                    e[1] = now_ns
            else:
                # Otherwise the leading entries already sent to ``worker`` within _REFRESH_NS: :meth:`_mark` would
                # only stamp them (no lookup needed); from the first other one on, it marks them.
                bit = 1 << worker
                start = len(walked)
                for i, e in enumerate(walked):
                    if e[1] < stale or not e[0] & bit:
                        start = i
                        break
                    e[1] = now_ns
        changed = self._mark(keys[start:] if start else keys, 1 << worker, now_ns) if start < len(keys) else []
        cutoff = now_ns - self._ttl_ns
        while m and (len(m) > self.capacity or next(iter(m.values()))[1] < cutoff):
            m.popitem(last=False)
        return changed

    def _mark(self, keys: Sequence[int], bit: int, now_ns: int) -> list[int]:
        """:meth:`record`'s entry updates, key by key; returns the keys that changed beyond a time stamp."""
        m = self._map
        move = m.move_to_end
        stale = now_ns - _REFRESH_NS
        changed: list[int] = []
        for key in keys:
            e = m.get(key)
            if e is None:
                m[key] = [bit, now_ns, 0]
                changed.append(key)
            else:
                if not e[0] & bit:
                    e[0] |= bit
                    changed.append(key)
                elif e[1] < stale:
                    changed.append(key)
                if e[1] < stale:  # LRU order to within _REFRESH_NS: a hot block is not moved on every request
                    move(key)
                e[1] = now_ns
        return changed

    def forget_worker(self, worker: int) -> int:
        """Drop ``worker`` from every entry (it restarted: its prefix cache is empty). O(entries); called once per
        restart. Returns how many entries lost the worker."""
        self._walk = None
        bit = 1 << worker
        dropped = 0
        m = self._map
        for key in [k for k, e in m.items() if (e[0] | e[2]) & bit]:
            e = m[key]
            e[0] &= ~bit
            e[2] &= ~bit
            dropped += 1
            if not (e[0] | e[2]):
                del m[key]
        return dropped
