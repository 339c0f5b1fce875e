"""Response-id rings (docs/DESIGN.md §3.8): every router process on a segment learns the ``/v1/responses`` ids the
others relayed, with their worker and tenant.

Real segment, real mmap; router processes are stood in for by router slots claimed under distinct live pids (this
process and its parent), except in the torn-write test, where a real second process writes while this one reads.
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import time

import pytest

from dplb.errors import ConfigError
from dplb.router.ownership import OwnedResponseIds
from dplb.router.routes import ResponseIds
from dplb.state.layout import RESPONSE_RING_ENTRIES, RESPONSE_RING_SIZE, response_rings_offset
from dplb.state.response_rings import NO_TENANT, ResponseRing, entry_value, id_key, value_worker
from dplb.state.router_slots import RouterSlots
from dplb.state.shm import Segment
from dplb.tenants import DEFAULT_TENANT, parse_tenants, tenant_tag

A, B = os.getpid(), os.getppid()  # two live pids: registry entries of live processes are never reclaimed
N = RESPONSE_RING_ENTRIES


@pytest.fixture
def seg(shm_path: str):  # type: ignore[no-untyped-def]
    s = Segment.create(shm_path, 4)
    yield s
    s.close()


@pytest.fixture
def pair(seg: Segment):  # type: ignore[no-untyped-def]
    a = RouterSlots.claim(seg.path, 4, 30000, 0, pid=A)
    b = RouterSlots.claim(seg.path, 4, 30000, 1, pid=B)
    assert a is not None and b is not None and a.index != b.index
    yield a, b
    a.close()
    b.close()


def _pairs(flat: list[int] | None) -> list[tuple[int, int]]:
    assert flat is not None
    return list(zip(flat[::2], flat[1::2], strict=True))


def test_entries_are_laid_out_as_documented_and_reach_only_the_peers(pair: tuple[RouterSlots, RouterSlots]) -> None:
    a, b = pair
    assert a.responses.drain() is None and b.responses.drain() is None  # nothing written anywhere yet
    a.responses.append(id_key("resp_1"), entry_value(2, 77))
    q = memoryview(a._mm).cast("Q")
    h = (response_rings_offset(4) + a.index * RESPONSE_RING_SIZE) >> 3
    assert (q[h], q[h + 1]) == (1, 1) and q[h + 2] & 1  # head, reserve; the epoch is set and never 0
    assert (q[h + 8], q[h + 9]) == (id_key("resp_1"), 3 << 56 | 77)  # key, tenant tag | (worker + 1) << 56
    q.release()
    assert _pairs(b.responses.drain()) == [(id_key("resp_1"), 3 << 56 | 77)]
    assert b.responses.drain() is None  # nothing new
    assert a.responses.drain() is None  # its own entries are never handed back to it
    assert value_worker(entry_value(63, (1 << 56) - 1)) == 63


def test_wrap_around_keeps_ring_order(pair: tuple[RouterSlots, RouterSlots]) -> None:
    a, b = pair
    for i in range(N - 10):
        a.responses.append(i, entry_value(1, i))
    assert len(_pairs(b.responses.drain())) == N - 10
    for i in range(N - 10, N + 30):  # the next copy runs past the ring's end: two slices
        a.responses.append(i, entry_value(1, i))
    got = _pairs(b.responses.drain())
    assert got == [(i, entry_value(1, i)) for i in range(N - 10, N + 30)]
    assert b.responses.lost == 0


def test_a_reader_behind_loses_the_oldest_and_counts_them(pair: tuple[RouterSlots, RouterSlots]) -> None:
    a, b = pair
    for i in range(N + 500):
        a.responses.append(i, entry_value(0, 5))
    got = _pairs(b.responses.drain())
    assert [k for k, _ in got] == list(range(500, N + 500)) and b.responses.lost == 500


def test_an_append_in_progress_never_hands_over_a_torn_entry(pair: tuple[RouterSlots, RouterSlots]) -> None:
    """A writer that has stored ``reserve`` for 3 entries and overwritten the first of them (the key, not yet its
    value): the reader's copy of the oldest entries cannot be trusted and is dropped, counted as lost."""
    a, b = pair
    for i in range(N):
        a.responses.append(i, entry_value(1, i))
    q = memoryview(a._mm).cast("Q")
    h = (response_rings_offset(4) + a.index * RESPONSE_RING_SIZE) >> 3
    q[h + 1] = N + 3  # reserve: 3 entries being written over slots 0..2
    q[h + 8] = 999_999  # slot 0's key overwritten, its value still the old entry's
    got = _pairs(b.responses.drain())
    q.release()
    assert got == [(i, entry_value(1, i)) for i in range(3, N)] and b.responses.lost == 3


def test_a_new_owner_adopts_the_old_ring(seg: Segment, pair: tuple[RouterSlots, RouterSlots]) -> None:
    """A router process that dies and is replaced (a group's parent restarts a child into its old slot): the new
    owner learns the ids its predecessor relayed from the ring (they voided it before: its follow-ups got 404),
    drops the predecessor's half-done append, and appends after the old entries; a peer reads only the new ones."""
    a, b = pair
    for i in range(10):
        a.responses.append(i, entry_value(1, 1))
    assert len(_pairs(b.responses.drain())) == 10
    q = a.responses._q
    h = a.responses._h
    q[h + 1] = q[h] + 1  # the predecessor died mid-append: reserve ahead of head, its entry never published
    index = a.index
    a.close()
    c = RouterSlots.claim(seg.path, 4, 30000, 0, pid=A)  # takes the freed slot
    assert c is not None and c.index == index
    assert [k for k, _ in _pairs(c.responses.drain())] == list(range(10))  # the predecessor's, once
    assert c.responses.drain() is None
    for i in range(3):
        c.responses.append(100 + i, entry_value(2, 2))
    assert [k for k, _ in _pairs(b.responses.drain())] == [100, 101, 102]
    assert c.responses.drain() is None and b.responses.lost == 0
    c.close()


def test_entries_naming_no_worker_of_the_segment_are_dropped(pair: tuple[RouterSlots, RouterSlots]) -> None:
    a, b = pair
    a.responses.append(1, entry_value(4, 0))  # a 4-worker segment has no worker 4
    a.responses.append(2, 0)  # worker field 0: no worker
    a.responses.append(3, entry_value(3, 0))
    assert _pairs(b.responses.drain()) == [(3, entry_value(3, 0))]


def _writer(path: str, index: int, total: int) -> None:
    """Append ``total`` entries to router slot ``index``'s ring of the 4-worker segment at ``path`` (another
    process: the ring's owner)."""
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), 0)
    ring = ResponseRing(mm, 4, index)
    for i in range(total):
        ring.append(i, entry_value(i % 4, (i * 2654435761) & 0xFFFFFFFFFFFF))
    ring.close()
    mm.close()


def test_a_reader_racing_a_real_writer_gets_only_whole_entries_in_order(seg: Segment) -> None:
    """A second process appends as fast as it can (lapping the reader many times) while this one drains: every entry
    read is whole (its value matches its key) and in order, and what was read plus what was counted lost is every
    entry written."""
    a = RouterSlots.claim(seg.path, 4, 30000, 0, pid=A)
    b = RouterSlots.claim(seg.path, 4, 30000, 1, pid=B)
    assert a is not None and b is not None
    total = 400_000
    proc = multiprocessing.get_context("spawn").Process(target=_writer, args=(seg.path, a.index, total))
    proc.start()
    got: list[tuple[int, int]] = []
    head = b.responses._head_words  # every ring's head word
    try:
        n = 0
        while proc.is_alive():
            n += 1
            if n % 8 == 0:  # now and then fall a ring behind (whatever the two processes' speeds): a lap for sure
                behind = (got[-1][0] + 1 if got else 0) + RESPONSE_RING_ENTRIES + 64
                while proc.is_alive() and head[a.index] < behind:
                    time.sleep(0.0005)
            new = b.responses.drain()
            if new:
                got += _pairs(new)
        proc.join(30)
        got += _pairs(b.responses.drain() or [])
    finally:
        a.close()
        b.close()
    assert proc.exitcode == 0
    keys = [k for k, _ in got]
    assert all(v == entry_value(k % 4, (k * 2654435761) & 0xFFFFFFFFFFFF) for k, v in got), "a torn entry was read"
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    assert len(got) + b.responses.lost == total and keys[-1] == total - 1
    assert b.responses.lost > 0, "the writer never lapped the reader: the race was not exercised"


def test_response_ids_are_shared_between_router_processes(pair: tuple[RouterSlots, RouterSlots]) -> None:
    """What a router process remembers, its peers know (worker and tenant), read from the ring only on a miss; a
    later rebinding of the same id (a client reusing its request_id) by another process wins everywhere."""
    a, b = pair
    ida, idb = ResponseIds(100, lambda: a.responses), ResponseIds(100, lambda: b.responses)
    ida.remember("resp_one", 3)
    assert ida.worker_of("resp_one") == 3 and idb.worker_of("resp_one") == 3
    assert idb.worker_of("resp_unknown") is None
    idb.remember("chat-1", 1)
    ida.remember("chat-1", 2)  # a replays b's binding first: its own, newer, wins
    idb.sync()  # the monitor step
    assert ida.worker_of("chat-1") == idb.worker_of("chat-1") == 2
    # A hit is answered from the map: the ring is not read (a peer's entry written meanwhile stays unread).
    b.responses.append(id_key("resp_one"), entry_value(0, NO_TENANT))
    assert ida.worker_of("resp_one") == 3 and a.responses.drain() is not None


class _Ticket:
    def __init__(self, name: str) -> None:
        self.tenant = type("T", (), {"name": name})()


class _Ex:
    def __init__(self, name: str | None) -> None:
        self.tenant = _Ticket(name) if name is not None else None


def test_owned_ids_carry_their_tenant_to_the_other_processes(pair: tuple[RouterSlots, RouterSlots]) -> None:
    a, b = pair
    oa, ob = OwnedResponseIds(100, lambda: a.responses), OwnedResponseIds(100, lambda: b.responses)
    oa.remember("resp_x", 1, _Ex("chat"))
    oa.remember("resp_y", 0, _Ex(None))
    assert ob.owner_of("resp_x") == tenant_tag("chat") != tenant_tag("batch") and ob.worker_of("resp_x") == 1
    assert ob.owner_of("resp_y") == NO_TENANT and ob.owner_of("resp_z") is None
    assert tenant_tag(DEFAULT_TENANT) not in (NO_TENANT, tenant_tag("chat"))


def test_tenant_names_sharing_a_tag_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import dplb.tenants as tenants

    doc = {"tenants": {"alpha": {"api_key_sha256": ["a" * 64]}, "beta": {"api_key_sha256": ["b" * 64]}}}
    assert parse_tenants("t.toml", doc).by_name("beta") is not None
    monkeypatch.setattr(tenants, "tenant_tag", lambda name: 5 if name in ("alpha", "beta") else 6)
    with pytest.raises(ConfigError, match=r"tenants\.beta: its name hashes to the same response-ownership tag as alpha"):
        parse_tenants("t.toml", doc)
