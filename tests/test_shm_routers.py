"""Router slots (docs/DESIGN.md §3.4): several router processes share their in-flight correction through the segment.

Real segment, real mmap; router processes are stood in for by slots claimed under distinct pids (live ones: this
process and its parent), written and read exactly as two router processes would.
"""

from __future__ import annotations

import os
import time

import pytest

from dplb.config import PolicyConfig
from dplb.policy import make_policy
from dplb.state.layout import (
    KV_RING_SIZE,
    MAX_ROUTERS,
    PREFIX_RING_SIZE,
    RESPONSE_RING_SIZE,
    TENANT_TABLE_SIZE,
    decode_header,
)
from dplb.state.router_slots import ROUTER_SLOT_SIZE, RouterSlots, read_router_slots, routers_offset
from dplb.state.shm import Lifecycle, Segment, WorkerState

A, B = os.getpid(), os.getppid()  # two live pids: registry entries of live processes are never reclaimed
HOUR = 3600 * 10**9


@pytest.fixture
def seg(shm_path: str):  # type: ignore[no-untyped-def]
    s = Segment.create(shm_path, 4)
    yield s
    s.close()


def _pair(seg: Segment) -> tuple[RouterSlots, RouterSlots]:
    a = RouterSlots.claim(seg.path, 4, 30000, 0, pid=A)
    b = RouterSlots.claim(seg.path, 4, 30000, 1, pid=B)
    assert a is not None and b is not None and a.index != b.index
    a.refresh_peers()
    b.refresh_peers()
    return a, b


def test_slots_are_registered_and_laid_out_as_documented(seg: Segment) -> None:
    a, b = _pair(seg)
    a.publish(2, 3, 5, 123)
    with open(seg.path, "rb") as f:
        raw = f.read()
    h = decode_header(seg.path, raw, len(raw))
    assert {(pid, port) for pid, port in h.routers} == {(A, 30000), (B, 30000)}
    off = routers_offset(4) + a.index * ROUTER_SLOT_SIZE
    assert int.from_bytes(raw[off + 8:off + 12], "little") == A
    assert int.from_bytes(raw[off + 64 + 32:off + 64 + 36], "little") == 3  # worker 2: pending
    assert int.from_bytes(raw[off + 64 + 36:off + 64 + 40], "little") == 5  # inflight
    assert int.from_bytes(raw[off + 64 + 40:off + 64 + 48], "little") == 123  # last sent
    assert len(raw) == (routers_offset(4) + MAX_ROUTERS * (ROUTER_SLOT_SIZE + PREFIX_RING_SIZE) + 4 * KV_RING_SIZE
                        + MAX_ROUTERS * RESPONSE_RING_SIZE + MAX_ROUTERS * TENANT_TABLE_SIZE)
    shown = {r["pid"]: r for r in read_router_slots(raw, 4)}
    assert shown[A]["pending"] == [0, 0, 3, 0] and shown[A]["inflight"] == [0, 0, 5, 0]
    a.publish(2, 1, 4)  # a release: the counts change, the last send stays
    a.publish(1, 7, 2**32 - 1, 456)
    with open(seg.path, "rb") as f:
        raw = f.read()
    entries = [tuple(int.from_bytes(raw[e:e + n], "little") for e, n in ((o, 4), (o + 4, 4), (o + 8, 8)))
               for o in (off + 64 + 16 * k for k in range(4))]
    assert entries == [(0, 0, 0), (7, 2**32 - 1, 456), (1, 4, 123), (0, 0, 0)]
    assert int.from_bytes(raw[off + 24:off + 32], "little") == 456  # the last send to any worker
    assert shown[B]["process_index"] == 1
    b.close()
    a.refresh_peers()
    with open(seg.path, "rb") as f:
        raw = f.read()
    assert not a.has_peers and B not in {p for p, _ in decode_header(seg.path, raw, len(raw)).routers}
    a.close()


@pytest.mark.parametrize(
    ("pending", "inflight", "sent_at", "cutoff", "want"),
    [
        (2, 2, 1000, 900, 2),  # sent after the worker's snapshot (minus grace): not in its queue yet
        (2, 2, 800, 900, 0),  # last send before the cutoff: the worker's own queue counts it
        (3, 1, 1000, 900, 1),  # capped by in-flight: completed requests are in no queue
        (0, 4, 1000, 900, 0),  # nothing pending (the snapshot already counts the open requests)
    ],
)
def test_peer_correction_table(seg: Segment, pending: int, inflight: int, sent_at: int, cutoff: int,
                               want: int) -> None:
    a, b = _pair(seg)
    b.publish(1, pending, inflight, sent_at)
    got = a.peer_correction([0, cutoff, 0, 0], now_ns=sent_at, horizon_ns=HOUR)
    assert got is not None and got[1] == want and got[0] == got[2] == got[3] == 0
    assert b.peer_correction([0, 0, 0, 0], sent_at, HOUR) is None  # its own slot is never counted
    a.close()
    b.close()


def test_idle_peer_and_dead_peer_cost_nothing(seg: Segment) -> None:
    a, b = _pair(seg)
    b.publish(0, 1, 1, 1000)
    assert a.peer_correction([0] * 4, now_ns=1000 + 2 * 10**9, horizon_ns=10**9) is None  # sent nothing lately
    # A peer whose heartbeat is older than ROUTER_STALE_S is dropped by the next refresh (its owner died or hung).
    seg_q = memoryview(b._mm).cast("Q")
    seg_q[b._si + 2] = time.monotonic_ns() - 10 * 10**9
    seg_q.release()
    a.refresh_peers()
    assert not a.has_peers
    a.close()
    b.close()


def test_a_torn_peer_slot_is_skipped(seg: Segment) -> None:
    a, b = _pair(seg)
    b.publish(0, 1, 1, 1000)
    q = b._q
    q[b._si] += 1  # the writer is mid-update (odd seq) for good
    assert a.peer_correction([0] * 4, 1000, HOUR) is None
    q[b._si] += 1
    assert a.peer_correction([0] * 4, 1000, HOUR) == [1, 0, 0, 0]
    a.close()
    b.close()


def test_two_routers_spread_a_burst_like_one(seg: Segment) -> None:
    """Two router processes alternate picks over 8 idle workers whose snapshots count nothing yet: sharing the
    correction through the router slots sends the 8 requests to 8 different workers; without it each router
    believes the workers it did not use idle and the two pile onto the same ones."""
    seg.close()
    os.unlink(seg.path)
    seg8 = Segment.create(seg.path, 8)
    now = time.monotonic_ns()
    snap = [WorkerState(k, pid=100 + k, lifecycle=Lifecycle.READY, heartbeat_mono_ns=now - 10**7) for k in range(8)]
    for share in (True, False):
        ra = RouterSlots.claim(seg8.path, 8, 1, 0, pid=A)
        rb = RouterSlots.claim(seg8.path, 8, 1, 1, pid=B)
        assert ra is not None and rb is not None
        ra.refresh_peers()
        rb.refresh_peers()
        pa, pb = make_policy(PolicyConfig(prefix_block_bytes=0), 8), make_policy(PolicyConfig(prefix_block_bytes=0), 8)
        pb._rot = 3  # the two processes' tie rotations are unrelated
        inflight = {A: [0] * 8, B: [0] * 8}
        chosen = []
        for i in range(8):
            pol, me, pid = (pa, ra, A) if i % 2 == 0 else (pb, rb, B)
            cutoffs = [w.heartbeat_mono_ns - pol.grace_ns for w in snap]
            shared = me.peer_correction(cutoffs, now, HOUR) if share else None
            k = pol.pick(snap, now, inflight=inflight[pid], shared=shared).worker
            assert k is not None
            inflight[pid][k] += 1
            me.publish(k, pol.correction(k), inflight[pid][k], now)
            chosen.append(k)
        if share:
            assert sorted(chosen) == list(range(8)), chosen
        else:
            assert len(set(chosen)) < 8, chosen
        ra.close()
        rb.close()
    seg8.close()


def test_prefix_rings_replay_what_a_peer_learnt(seg: Segment) -> None:
    from dplb.policy.prefix import PrefixIndex, block_hashes
    from dplb.state.layout import PREFIX_RING_ENTRIES

    a, b = _pair(seg)
    keys = block_hashes(b"x" * 128 * 20, 128)
    ia, ib = PrefixIndex(65536, 300, 4), PrefixIndex(65536, 300, 4)
    a.publish_prefix(2, ia.record(keys, 2, 1000))
    got = b.drain_prefix()
    assert got == {2: keys}  # raw entries by worker, in ring order
    for w, ks in got.items():
        ib.record(ks, w, 1000)
    assert ib.match(keys, 1000) == [0, 0, 20, 0]  # B now knows worker 2 holds the whole prefix
    assert b.drain_prefix() == {}  # nothing new: one load per peer
    assert ia.record(keys, 2, 1000) == []  # re-sent within a second: nothing new to tell the others
    a.publish_prefix(7, [5])  # a worker this segment does not have: dropped
    assert b.drain_prefix() == {}
    # A reader that falls more than a ring behind loses the oldest entries and says so.
    many = list(range(1, PREFIX_RING_ENTRIES + 101))
    a.publish_prefix(1, many)
    got = b.drain_prefix()
    assert len(got[1]) == PREFIX_RING_ENTRIES and got[1][0] == 101 and b.prefix_lost == 100
    ib.record(got[1], 1, 2000)
    assert ib.match([PREFIX_RING_ENTRIES + 100], 2000)[1] == 1 and ib.match([1], 2000)[1] == 0
    a.close()
    b.close()


def test_a_stale_older_layout_segment_is_replaced_a_live_one_refused(shm_path: str) -> None:
    """Regression: `dplb launch --shm-path` on a version-1 segment said "not a DPLB segment" and refused,
    while the router's error told the user that launch recreates it. A DPLB segment of another layout is now
    replaced when none of its recorded processes lives, and refused (naming them) while one does."""
    import struct
    import subprocess
    import sys

    from dplb.errors import ShmPathError
    from dplb.state.segments import check_takeover

    Segment.create(shm_path, 2).close()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with open(shm_path, "r+b") as f:
        f.seek(4)
        f.write(struct.pack("<H", 1))  # an older DPLB's layout version
        f.seek(24)
        f.write(struct.pack("<I", dead.pid))  # its creator is gone
    check_takeover(shm_path)  # stale: may be replaced
    Segment.create(shm_path, 2, replace=True).close()
    Segment.attach(shm_path).close()  # the current layout now
    with open(shm_path, "r+b") as f:
        f.seek(4)
        f.write(struct.pack("<H", 1))  # creator: this (live) process
    with pytest.raises(ShmPathError, match=f"made by another DPLB version .* processes {os.getpid()} still use it"):
        check_takeover(shm_path)


def test_prefix_ring_torn_copies_never_deliver_lapped_entries(seg: Segment) -> None:
    """A peer appending as fast as it can while this process drains (threads switch inside the append loop): every
    delivery continues exactly where the last stopped, or the reader counts a loss first — never an entry the
    writer overwrote while it was copied (a head read after the copy misses an append in progress; the writer's
    reserve word does not)."""
    import threading

    from dplb.state.layout import PREFIX_RING_ENTRIES

    a, b = _pair(seg)
    stop = threading.Event()
    total, step = 1_000_000, PREFIX_RING_ENTRIES // 2

    def write() -> None:
        i = 1
        while i <= total and not stop.is_set():
            a.publish_prefix(0, list(range(i, i + step)))
            i += step

    t = threading.Thread(target=write)
    t.start()
    last, lost_seen, deliveries = 0, 0, 0
    try:
        done = False
        while not done:
            done = not t.is_alive()
            got = b.drain_prefix().get(0, [])
            if not got:
                continue
            deliveries += 1
            if b.prefix_lost != lost_seen:  # a loss was counted: the delivery may start later
                lost_seen = b.prefix_lost
                last = got[0] - 1
            assert got == list(range(last + 1, last + 1 + len(got))), (last, got[:3], got[-3:])
            last = got[-1]
    finally:
        stop.set()
        t.join()
    assert last >= total - step  # the last append arrived
    assert deliveries >= 3  # the reader really ran beside the writer
    a.close()
    b.close()


def test_peers_see_the_most_urgent_class_a_process_has_queued(seg: Segment) -> None:
    """A router group's fair queues: each process publishes its most urgent queued class, so a process about to
    grant a freed slot to a less urgent request leaves it to the peer's more urgent one."""
    a, b = _pair(seg)
    assert b.peers_urgent() is None  # nothing queued anywhere
    a.publish_urgent(1)
    assert b.peers_urgent() == 1 and a.peers_urgent() is None  # only peers count
    a.publish_urgent(0)
    assert b.peers_urgent() == 0
    a.publish_urgent(None)
    assert b.peers_urgent() is None
    a.publish_urgent(2)
    a.close()  # a closed slot is no peer and its value is void
    b.refresh_peers()
    assert b.peers_urgent() is None
    b.close()


def test_claim_never_registers_in_a_segment_that_replaced_the_attached_one(seg: Segment) -> None:
    """A router attached one file; `dplb segment create` replaced it before the router claimed its slot: the claim
    touches neither the new file's registry nor its slots (the router re-attaches the new file on its next step)."""
    attached = seg.inode
    os.unlink(seg.path)
    new = Segment.create(seg.path, 4)
    try:
        def registered() -> list[tuple[int, int]]:
            with open(seg.path, "rb") as f:
                raw = f.read()
            return list(decode_header(seg.path, raw, len(raw)).routers)

        assert RouterSlots.claim(seg.path, 4, 30000, 0, pid=A, inode=attached) is None
        assert registered() == []
        mine = RouterSlots.claim(seg.path, 4, 30000, 0, pid=A, inode=new.inode)
        assert mine is not None and registered() == [(A, 30000)]
        mine.close()
    finally:
        new.close()
