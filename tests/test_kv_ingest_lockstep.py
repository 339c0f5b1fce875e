"""The router's KV ingest against straightforward references, in lock step over random streams:
``KvRingReader.drain`` (copies by slices) against an entry-by-entry copy of the same rules, through wrap-around,
laps, torn copies (a reserve ahead of the head) and restarts; ``PrefixIndex.apply_engine`` (ops told by range)
against a shift-and-mask loop of the same rules, and ``record`` (which reuses the last match's walk) against a
key-by-key marking, interleaved with ``match``, through duplicate keys, unknown ops, clears, stale and speculative
entries and LRU/TTL evictions — the same deliveries, counts, entries, LRU order and learnt keys every step."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from dplb.policy.prefix import _REFRESH_NS as REFRESH_NS
from dplb.policy.prefix import PrefixIndex
from dplb.state.kv_rings import OP_CLEARED, OP_REMOVED, OP_STORED, KvRingReader
from dplb.state.layout import KV_RING_ENTRIES
from dplb.state.shm import Segment

_KEY_MASK = (1 << 56) - 1
_MASK = KV_RING_ENTRIES - 1


def reference_drain(rd: KvRingReader) -> dict[int, list[int]] | None:
    """The documented drain rules, one entry at a time (``rd``'s own cursors and ``lost``)."""
    heads = rd._head_words.tolist()
    out: dict[int, list[int]] = {}
    for w, h in enumerate(rd._heads):
        head, start = heads[w], rd._seen[w]
        if head == start:
            continue
        lost = 0
        if head < start:  # restarted
            start, lost = 0, 1
        if head - start > KV_RING_ENTRIES:  # fell behind by more than the ring
            lost += head - start - KV_RING_ENTRIES
            start = head - KV_RING_ENTRIES
        raw = [rd._q[h + 8 + (i & _MASK)] for i in range(start, head)]
        over = rd._q[h + 7] - KV_RING_ENTRIES - start  # lapped under the copy
        if over > 0:
            lost += over
            raw = raw[over:]
        rd._seen[w] = head
        if lost:
            rd.lost += lost
            raw.insert(0, OP_CLEARED << 56)
        out[w] = raw
    return out or None


def reference_apply(idx: PrefixIndex, worker: int, entries: Sequence[int], now_ns: int) -> None:
    """The documented apply_engine rules, op and key split by shift and mask."""
    idx._walk = None
    m = idx._map
    bit = 1 << worker
    for v in entries:
        op, key = v >> 56, v & _KEY_MASK
        if op == OP_STORED:
            e = m.get(key)
            if e is None:
                m[key] = [0, now_ns, bit]
            elif not e[2] & bit:
                e[2] |= bit
                m.move_to_end(key)
        elif op == OP_REMOVED:
            e = m.get(key)
            if e is not None:
                e[0] &= ~bit
                e[2] &= ~bit
                if not (e[0] | e[2]):
                    del m[key]
        elif op == OP_CLEARED:
            idx.forget_worker(worker)
    while len(m) > idx.capacity:
        m.popitem(last=False)


def reference_record(idx: PrefixIndex, keys: Sequence[int], worker: int, now_ns: int) -> list[int]:
    """The documented record rules: a full walk of ``worker``'s (the last match's, when it had every block) only
    stamped while fresh, every other key marked one by one; then the LRU and TTL evictions."""
    m = idx._map
    stale = now_ns - REFRESH_NS
    walk, idx._walk = idx._walk, None
    start = 0
    if walk is not None and walk[0] is keys and walk[1] == now_ns and walk[2] >> worker & 1:
        start = len(keys)
        for i, e in enumerate(walk[3]):
            if e[1] < stale:
                start = i
                break
            e[1] = now_ns
    bit = 1 << worker
    changed = []
    for key in keys[start:]:
        e = m.get(key)
        if e is None:
            m[key] = [bit, now_ns, 0]
            changed.append(key)
            continue
        if not e[0] & bit:
            e[0] |= bit
            changed.append(key)
        elif e[1] < stale:
            changed.append(key)
        if e[1] < stale:
            m.move_to_end(key)
        e[1] = now_ns
    cutoff = now_ns - idx._ttl_ns
    while m and (len(m) > idx.capacity or next(iter(m.values()))[1] < cutoff):
        m.popitem(last=False)
    return changed


@pytest.mark.parametrize("seed", range(6))
def test_drain_matches_the_reference(shm_path: str, seed: int) -> None:
    rng = random.Random(seed)
    seg = Segment.create(shm_path, 3)
    try:
        writers = [seg.kv_writer(k) for k in range(3)]
        for w in writers:
            w.reset(128)
        rd, ref = seg.kv_reader(), KvRingReader(seg._mm, 3)  # two readers, each with its own cursors
        q = rd._q
        delivered = 0
        for _ in range(400):
            k = rng.randrange(3)
            r = rng.random()
            if r < 0.04:
                writers[k].reset(128)  # a restart: the head goes back to 0
            elif r < 0.10:
                # a writer in the middle of an append: its reserve ahead of the head (the copy may be lapped)
                h = rd._heads[k]
                q[h + 7] = q[h] + rng.choice((1, 50, KV_RING_ENTRIES - 3, KV_RING_ENTRIES + 7, 3 * KV_RING_ENTRIES))
            else:
                n = rng.choice((0, 1, 5, 64, 700, KV_RING_ENTRIES - 1, KV_RING_ENTRIES + 300))
                op = rng.choice((OP_STORED, OP_REMOVED, OP_CLEARED))
                first = rng.randrange(1 << 42)
                writers[k].append(op, list(range(first, first + n)))
            if rng.random() < 0.5:
                got, want = rd.drain(), reference_drain(ref)
                assert got == want
                assert rd.lost == ref.lost and rd._seen == ref._seen
                delivered += sum(len(v) for v in got.values()) if got else 0
        assert delivered > 10 * KV_RING_ENTRIES  # the streams wrapped the rings many times
        for w in writers:
            w.close()
        rd.close()
        ref.close()
    finally:
        seg.close()


def _entries(rng: random.Random, keys: list[int]) -> list[int]:
    out = []
    for _ in range(rng.choice((0, 1, 3, 12, 40))):
        op = rng.choice((OP_STORED,) * 4 + (OP_REMOVED,) * 4 + (OP_CLEARED, 0, 4, 255))
        key = rng.choice(keys) if rng.random() < 0.9 else rng.randrange(1 << 42)
        out.append(op << 56 | (0 if op == OP_CLEARED and rng.random() < 0.5 else key))
    return out


@pytest.mark.parametrize("seed", range(8))
def test_apply_engine_matches_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    workers = rng.choice((1, 3, 8, 9))
    cap = rng.choice((5, 40, 1000))
    a, b = PrefixIndex(cap, 3.0, workers, 1.0), PrefixIndex(cap, 3.0, workers, 1.0)
    a.events = b.events = rng.randrange(1 << workers)
    keys = [(i << 32) | rng.randrange(1 << 32) for i in range(60)] + list(range(10))
    now = 10**12
    for _ in range(1500):
        now += rng.choice((0, 1, 10**8, 6 * 10**8))
        w = rng.randrange(workers)
        r = rng.random()
        if r < 0.5:
            entries = _entries(rng, keys)
            a.apply_engine(w, entries, now)
            reference_apply(b, w, entries, now)
        elif r < 0.9:
            start = rng.randrange(len(keys))
            prompt = keys[start : start + rng.randrange(1, 20)]
            assert a.match(prompt, now) == b.match(prompt, now)
            assert a.record(prompt, w, now) == reference_record(b, prompt, w, now)
        else:
            a.events = b.events = rng.randrange(1 << workers)
        assert list(a._map.items()) == list(b._map.items())  # the same entries in the same LRU order
    assert len(a) > 0
