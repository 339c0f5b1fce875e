"""The workers' KV rings (dplb.state.kv_rings) and the prefix index that follows them (PrefixIndex.apply_engine):
round trip, overflow, a restarted writer, torn copies under a concurrent writer, and the index's table of truths."""

from __future__ import annotations

import threading

import pytest

from dplb.policy.prefix import PrefixIndex
from dplb.state.kv_rings import OP_CLEARED, OP_REMOVED, OP_STORED, split
from dplb.state.layout import KV_RING_ENTRIES
from dplb.state.shm import Segment

S, R, C = OP_STORED << 56, OP_REMOVED << 56, OP_CLEARED << 56


def test_round_trip_and_mask(shm_path: str) -> None:
    seg = Segment.create(shm_path, 3)
    try:
        w1, w2 = seg.kv_writer(1), seg.kv_writer(2)
        w1.reset(128)
        w2.reset(64)
        rd = seg.kv_reader()
        assert rd.drain() is None and rd.refresh_mask(0) == 0
        w1.enable(5)
        w2.enable(5)
        w1.append(OP_STORED, [7, 8])
        w1.append(OP_REMOVED, [7])
        got = rd.drain()
        assert got == {1: [S | 7, S | 8, R | 7]} and [split(v) for v in got[1]][2] == (OP_REMOVED, 7)
        assert rd.drain() is None  # nothing new: one load per worker
        assert rd.refresh_mask(10**9, 128) == 0b010  # worker 2 hashes 64-byte blocks: not ours
        assert rd.counters(1)["events"] == 1 and rd.counters(0)["events"] == 0
        w1.close()
        w2.close()
    finally:
        seg.close()


def test_overflow_and_restart_clear_first(shm_path: str) -> None:
    seg = Segment.create(shm_path, 2)
    try:
        w = seg.kv_writer(0)
        w.reset(128)
        rd = seg.kv_reader()
        w.append(OP_STORED, list(range(1, KV_RING_ENTRIES + 101)))
        got = rd.drain()
        assert got is not None
        assert got[0][0] == C and len(got[0]) == KV_RING_ENTRIES + 1 and got[0][1] == S | 101 and rd.lost == 100
        w.reset(128)  # the worker restarted: its ring starts again at 0
        w.append(OP_STORED, [5])
        assert rd.drain() == {0: [C, S | 5]}
        w.close()
    finally:
        seg.close()


def test_torn_copies_never_deliver_a_mix(shm_path: str) -> None:
    """A writer appending as fast as it can while a reader drains: every delivery either continues exactly where
    the last one stopped, or starts with CLEARED (the reader lost some and says so) — never lapped entries."""
    seg = Segment.create(shm_path, 1)
    try:
        w = seg.kv_writer(0)
        w.reset(128)
        rd = seg.kv_reader()
        stop = threading.Event()
        total = 300_000

        def write() -> None:
            i = 1
            while i <= total and not stop.is_set():
                w.append(OP_STORED, list(range(i, i + 64)))
                i += 64

        t = threading.Thread(target=write)
        t.start()
        last, clears = 0, 0
        try:
            done = False
            while not done:
                done = not t.is_alive()  # one more drain after the writer finished
                got = rd.drain()
                if got is None:
                    continue
                raw = got[0]
                if raw[0] == C:
                    clears += 1
                    raw = raw[1:]
                    if raw:
                        last = (raw[0] & ((1 << 56) - 1)) - 1
                keys = [v & ((1 << 56) - 1) for v in raw]
                assert keys == list(range(last + 1, last + 1 + len(keys)))
                if keys:
                    last = keys[-1]
        finally:
            stop.set()
            t.join()
        assert last >= total - 64
        w.close()
    finally:
        seg.close()


NOW = 10**12
SEC = 10**9


@pytest.mark.parametrize(("events", "sent_age_s", "ring", "want"), [
    # no events: the sent-bytes index (ttl 600 s)
    (0b00, 5.0, [], [3, 0]),
    # event-fed, sent 5 s ago and never confirmed: speculation (2 s) is over
    (0b01, 5.0, [], [0, 0]),
    # event-fed, sent 1 s ago: still speculative
    (0b01, 1.0, [], [3, 0]),
    # event-fed, confirmed the first two blocks only
    (0b01, 5.0, [S | 1, S | 2], [2, 0]),
    # confirmed, then the engine evicted block 2 (tail first): one block left
    (0b01, 5.0, [S | 1, S | 2, S | 3, R | 3, R | 2], [1, 0]),
    # confirmed on worker 1 though worker 0 was sent them: truth wins
    (0b11, 5.0, [], [0, 0]),
    # cleared after a confirmation: nothing left
    (0b01, 5.0, [S | 1, S | 2, C], [0, 0]),
])
def test_index_follows_the_engine(events: int, sent_age_s: float, ring: list[int], want: list[int]) -> None:
    idx = PrefixIndex(1000, 600.0, 2, speculative_ttl_s=2.0)
    keys = [1, 2, 3]
    idx.record(keys, 0, NOW - int(sent_age_s * SEC))
    idx.events = events
    idx.apply_engine(0, ring, NOW)
    assert idx.match(keys, NOW) == want


def test_confirmations_for_unsent_keys_and_capacity() -> None:
    idx = PrefixIndex(3, 600.0, 2)
    idx.events = 0b10
    idx.apply_engine(1, [S | 1, S | 2, S | 3, S | 4], NOW)  # a 4th key pushes the oldest out (LRU of 3)
    assert len(idx) == 3 and idx.match([1, 2], NOW) == [0, 0] and idx.match([2, 3, 4], NOW) == [0, 3]
    idx.apply_engine(1, [R | 9], NOW)  # removing what is not there is a no-op
    assert len(idx) == 3


def test_confirmed_depths_for_views() -> None:
    """What /debug/decisions shows next to the belief: the leading blocks each engine confirmed."""
    idx = PrefixIndex(100, 600.0, 3)
    idx.events = 0b011
    idx.record([1, 2, 3], 2, NOW)  # worker 2 has no events: never "confirmed"
    idx.apply_engine(0, [S | 1, S | 2, S | 3], NOW)
    idx.apply_engine(1, [S | 1, S | 3], NOW)
    assert idx.confirmed([1, 2, 3]) == [3, 1, 0] and idx.confirmed([]) == [0, 0, 0]
