"""Tenant tables (docs/DESIGN.md §3.9): every router process on a segment sees what the others admitted of each
limited tenant, and :class:`dplb.router.group_quota.GroupQuota` turns it into group-wide limits.

Real segment, real mmap; router processes are stood in for by router slots claimed under distinct live pids (this
process and its parent), as in tests/test_response_rings.py.
"""

from __future__ import annotations

import logging
import os
import time
from types import SimpleNamespace

import pytest

from dplb.router.group_quota import GroupQuota
from dplb.router.limits import TenantLimits
from dplb.state.layout import TENANT_TABLE_ENTRIES, TENANT_TABLE_SIZE, tenant_tables_offset
from dplb.state.router_slots import ROUTER_STALE_S, RouterSlots
from dplb.state.shm import Segment
from dplb.state.tenant_tables import ENTRY_WORDS
from dplb.tenants import Tenant, TenantsConfig, tenant_tag

A, B = os.getpid(), os.getppid()


@pytest.fixture
def pair(shm_path: str):  # type: ignore[no-untyped-def]
    seg = Segment.create(shm_path, 2)
    a = RouterSlots.claim(seg.path, 2, 30000, 0, pid=A)
    b = RouterSlots.claim(seg.path, 2, 30000, 1, pid=B)
    assert a is not None and b is not None and a.index != b.index
    yield a, b
    a.close()
    b.close()
    seg.close()


def _word(s: RouterSlots, entry: int, w: int) -> int:
    q = memoryview(s._mm).cast("Q")
    try:
        return int(q[((tenant_tables_offset(2) + s.index * TENANT_TABLE_SIZE) >> 3) + entry * ENTRY_WORDS + w])
    finally:
        q.release()


def test_a_peer_reads_open_requests_and_the_deltas_since_its_last_look(pair: tuple[RouterSlots, RouterSlots]) -> None:
    a, b = pair
    tag = tenant_tag("t")
    got = a.tenants.assign([tag])
    e = got[tag]
    assert _word(a, e, 1) == tag and 0 < _word(a, e, 2) <= time.monotonic_ns()  # key, created
    assert b.tenants.peers(tag, [a.index]) == (0, 0, 0)
    a.tenants.write(e, 3, 5, 500, 20)
    assert _word(a, e, 0) % 2 == 0 and _word(a, e, 0) > 0  # seqlock even when idle
    assert b.tenants.peers(tag, [a.index]) == (3, 5, 480)  # created after b started: read from zero
    a.tenants.write(e, 1, 7, 600, 220)
    assert b.tenants.peers(tag, [a.index]) == (1, 2, -100)  # only what changed since; a refund is a negative delta
    assert b.tenants.peers(tag, [a.index]) == (1, 0, 0)
    assert b.tenants.peers(tenant_tag("other"), [a.index]) == (0, 0, 0)  # no entry there: nothing


def test_tags_sharing_a_position_and_duplicates_get_their_own_entries(pair: tuple[RouterSlots, RouterSlots]) -> None:
    a, b = pair
    t1, t2 = 5, 5 + TENANT_TABLE_ENTRIES  # the same value mod 64: positions are the owner's choice, never a hash
    got = a.tenants.assign([t1, t2, t1, 0])
    assert set(got) == {t1, t2} and got[t1] != got[t2]
    a.tenants.write(got[t1], 1, 1, 10, 0)
    a.tenants.write(got[t2], 2, 4, 40, 0)
    assert b.tenants.peers(t1, [a.index]) == (1, 1, 10)
    assert b.tenants.peers(t2, [a.index]) == (2, 4, 40)


def test_a_full_table_leaves_the_rest_to_the_fallback(pair: tuple[RouterSlots, RouterSlots],
                                                      caplog: pytest.LogCaptureFixture) -> None:
    a, b = pair
    got = a.tenants.assign(range(1, TENANT_TABLE_ENTRIES + 2))
    assert len(got) == TENANT_TABLE_ENTRIES and TENANT_TABLE_ENTRIES + 1 not in got
    # the gate's side: a limited tenant beyond the table is limited per process divided by the group's size
    names = [f"t{i}" for i in range(TENANT_TABLE_ENTRIES + 1)]
    tc = TenantsConfig(path="t.toml", tenants=tuple(Tenant(n, (), requests_per_s=4) for n in names))
    gq = GroupQuota(SimpleNamespace(slots=b), {})  # type: ignore[arg-type]
    gq.configure(tc)
    b.refresh_peers()
    assert b.has_peers
    lost = Tenant(names[-1], (), requests_per_s=4)
    with caplog.at_level(logging.WARNING, "dplb.router.tenants"):
        assert gq.sync(lost, None) == (0, 2)
        assert gq.sync(lost, None) == (0, 2)
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1  # one WARNING per tenant
    assert "divided among the 2 router processes" in caplog.records[0].message
    lim = TenantLimits(lost)
    assert lim.check(1, scale=2) is None and lim.check(1, scale=2) is None  # 4/s divided by 2: two of four
    assert lim.check(1, scale=2) is not None


def test_a_reload_keeps_counters_frees_removed_and_reads_added_from_zero(
        pair: tuple[RouterSlots, RouterSlots]) -> None:
    a, b = pair
    keep, drop, add = tenant_tag("keep"), tenant_tag("drop"), tenant_tag("add")
    got = a.tenants.assign([keep, drop])
    a.tenants.write(got[keep], 1, 10, 100, 0)
    a.tenants.write(got[drop], 1, 10, 100, 0)
    assert b.tenants.peers(keep, [a.index]) == (1, 10, 100)
    assert b.tenants.peers(drop, [a.index]) == (1, 10, 100)
    again = a.tenants.assign([keep, add])
    assert again[keep] == got[keep] and _word(a, got[keep], 4) == 10  # kept entry, kept counters
    assert b.tenants.peers(drop, [a.index]) == (0, 0, 0)  # freed: its open request no longer counts
    a.tenants.write(again[add], 2, 3, 30, 0)
    assert b.tenants.peers(add, [a.index]) == (2, 3, 30)  # a new entry is read from zero
    a.tenants.write(again[keep], 0, 11, 150, 0)
    assert b.tenants.peers(keep, [a.index]) == (0, 1, 50)


def test_an_entry_older_than_its_reader_is_read_from_its_first_look(pair: tuple[RouterSlots, RouterSlots]) -> None:
    a, b = pair
    tag = tenant_tag("t")
    e = a.tenants.assign([tag])[tag]
    a.tenants.write(e, 0, 100, 1000, 0)
    b.tenants.start_ns = time.monotonic_ns()  # b started after the entry was made (a process joining the group)
    b.tenants._cursors.clear()
    assert b.tenants.peers(tag, [a.index]) == (0, 0, 0)  # its past is not debited into fresh buckets
    a.tenants.write(e, 0, 101, 1010, 0)
    assert b.tenants.peers(tag, [a.index]) == (0, 1, 10)


def test_a_dead_peer_stops_counting_and_a_torn_entry_counts_nothing(pair: tuple[RouterSlots, RouterSlots]) -> None:
    a, b = pair
    tag = tenant_tag("t")
    e = a.tenants.assign([tag])[tag]
    a.tenants.write(e, 2, 2, 0, 0)
    b.refresh_peers()
    assert b.peer_slots == [a.index]
    assert b.tenants.peers(tag, b.peer_slots) == (2, 2, 0)
    # torn: the owner is mid-write (odd seq) for every copy; admission goes on, the delta is caught up later
    q = memoryview(a._mm).cast("Q")
    w = ((tenant_tables_offset(2) + a.index * TENANT_TABLE_SIZE) >> 3) + e * ENTRY_WORDS
    a.tenants.write(e, 2, 5, 0, 0)
    q[w] += 1  # the seq the owner leaves while it writes
    assert b.tenants.peers(tag, b.peer_slots) == (0, 0, 0)
    q[w] += 1
    assert b.tenants.peers(tag, b.peer_slots) == (2, 3, 0)
    # a's process dies: its heartbeat goes stale, its slot is no peer any more and its open requests drop out
    si = (a._off >> 3) + 2
    q[si] = time.monotonic_ns() - int((ROUTER_STALE_S + 1) * 1e9)
    q.release()
    b.refresh_peers()
    assert b.peer_slots == [] and not b.has_peers
    assert b.tenants.peers(tag, b.peer_slots) == (0, 0, 0)


def test_a_new_owner_starts_from_an_empty_table(shm_path: str) -> None:
    seg = Segment.create(shm_path, 2)
    try:
        a = RouterSlots.claim(seg.path, 2, 30000, 0, pid=A)
        assert a is not None
        tag = tenant_tag("t")
        a.tenants.write(a.tenants.assign([tag])[tag], 4, 4, 4, 0)
        a.close()
        again = RouterSlots.claim(seg.path, 2, 30000, 0, pid=A)
        assert again is not None and again.index == a.index
        assert all(_word(again, i, 1) == 0 for i in range(TENANT_TABLE_ENTRIES))
        again.close()
    finally:
        seg.close()


def test_group_quota_debits_the_peers_consumption_and_counts_their_open_requests(
        pair: tuple[RouterSlots, RouterSlots]) -> None:
    a, b = pair
    t = Tenant("t", (), requests_per_s=5, tokens_per_min=600, max_concurrent=3)
    tc = TenantsConfig(path="t.toml", tenants=(t,))
    open_a: dict[str, int] = {"t": 0}
    qa = GroupQuota(SimpleNamespace(slots=a), open_a)  # type: ignore[arg-type]
    qb = GroupQuota(SimpleNamespace(slots=b), {})  # type: ignore[arg-type]
    qa.configure(tc)
    qb.configure(tc)
    assert not qa.grouped(t)  # alone: the gate calls nothing more
    a.refresh_peers()
    b.refresh_peers()
    assert qa.grouped(t) and qb.grouped(t) and not qa.grouped(Tenant("free", ()))  # an unlimited tenant: never
    la, lb = TenantLimits(t), TenantLimits(t)
    for _ in range(3):  # a admits three of 100 tokens
        assert qa.sync(t, la) == (0, 1) and la.check(100) is None
    open_a["t"] = 3
    qa.publish(t, 3, 300)
    assert qb.sync(t, lb) == (3, 1)  # a's three open requests count against max_concurrent in b
    assert lb.requests is not None and lb.tokens is not None
    assert 2 <= lb.requests.level < 2.1 and 300 <= lb.tokens.level < 301
    assert int(dict(lb.headers())[b"x-ratelimit-remaining-requests"]) == 2  # the group's remaining
    open_a["t"] = 2
    qa.publish(t, 0, -90)  # one ended, 90 tokens given back
    assert qb.sync(t, lb) == (2, 1) and 390 <= lb.tokens.level < 391
    # a's peer list changes (b restarted, say): a's next call writes every entry again with the gate's open counts
    open_a["t"] = 5
    a.refresh_peers()
    assert qa.sync(t, la) == (0, 1)
    assert qb.sync(t, lb) == (5, 1)
