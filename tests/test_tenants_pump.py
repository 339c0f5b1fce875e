"""The fair queue's pump in a router group (docs/DESIGN.md §15): a process does not grant a freed slot to a less
urgent request while a peer process has a more urgent one queued, and publishes its own most urgent queued class.

Real parts: a real segment with a READY worker, the router's own :class:`RouterState` and :class:`Gate` on it, and a
peer router slot claimed under a second live pid (this process's parent), written exactly as a peer router process
would write it (tests/test_shm_routers.py does the same at the slot level).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dplb.config import PolicyConfig, RouterConfig
from dplb.obs.metrics_router import RouterMetrics
from dplb.router.admission import Waiter
from dplb.router.models import ServedModels
from dplb.router.state import RouterState
from dplb.router.tenancy import Gate, Ticket
from dplb.state.router_slots import RouterSlots
from dplb.state.shm import Lifecycle, Segment, WorkerState
from tests.test_tenants_cluster import write_tenants

SLOTS = 2  # the worker's max_num_seqs: the room the pump grants from


@pytest.fixture
def group(shm_path: str, tmp_path: Path) -> Iterator[tuple[Gate, RouterSlots, Segment]]:
    """A gate on one READY worker with :data:`SLOTS` free slots, and a peer router's slot in the same segment."""
    seg = Segment.create(shm_path, 1)
    seg.writer(0).publish_now(WorkerState(0, pid=os.getpid(), lifecycle=Lifecycle.READY,
                                          heartbeat_mono_ns=time.monotonic_ns(), max_num_seqs=SLOTS))
    tenants = write_tenants(tmp_path / "tenants.toml")  # chat: interactive, batch: batch (and two more of batch)
    cfg = RouterConfig(PolicyConfig(), run_dir=str(tmp_path), shm_path=shm_path, tenants_file=tenants)
    state = RouterState(cfg, RouterMetrics("test"))
    peer = RouterSlots.claim(shm_path, 1, cfg.port, 1, pid=os.getppid())
    assert state.slots is not None and peer is not None
    state.slots.refresh_peers()
    peer.refresh_peers()
    gate = Gate(cfg, state, RouterMetrics("test").registry, reject=None, models=ServedModels(1))
    yield gate, peer, seg
    peer.close()
    state.slots.close()
    seg.close()


def queue(gate: Gate, tenant: str) -> Ticket:
    """Queue one request of ``tenant`` as :meth:`WaitingRoom.wait` does (a ticket with a pending future, a waiter)."""
    t = next(t for t in gate.config.tenants if t.name == tenant)
    assert gate.fq is not None
    tk = Ticket(gate.fq, t, gate.config.rank(t.priority), None)
    tk.fut = asyncio.get_running_loop().create_future()
    tk.waiter = Waiter(t.name, t.weight, tk.rank, 10, tk)
    gate.fq.arrive(t.name)
    gate.fq.push(tk.waiter)
    return tk


def test_a_peers_urgent_class_stops_a_local_less_urgent_grant_until_it_is_served(group) -> None:  # type: ignore[no-untyped-def]
    gate, peer, _ = group

    async def main() -> None:
        peer.publish_urgent(0)  # the peer has an interactive request queued
        batch = queue(gate, "batch")
        gate.room.pump()
        assert batch.fut is not None and not batch.fut.done(), "granted a batch request ahead of the peer's"
        assert gate.fq is not None and gate.fq.length == 1
        assert peer.peers_urgent() == 1  # this process published its own most urgent queued class: batch

        chat = queue(gate, "chat")  # a local request of the peer's class is not held back
        gate.room.pump()
        assert chat.fut is not None and chat.fut.done() and chat.granted_to == 0
        assert not batch.fut.done()

        peer.publish_urgent(None)  # the peer's request was served: the batch request gets the slot left
        gate.room.pump()
        assert batch.fut.done() and batch.granted_to == 0
        assert gate.fq.length == 0 and peer.peers_urgent() is None  # nothing queued here any more

    asyncio.run(main())


def test_a_peers_less_urgent_class_does_not_hold_back_a_local_grant(group) -> None:  # type: ignore[no-untyped-def]
    gate, peer, _ = group

    async def main() -> None:
        peer.publish_urgent(1)  # the peer has only batch queued
        chat, batch = queue(gate, "chat"), queue(gate, "batch")
        gate.room.pump()  # both classes are at least as urgent as the peer's: both slots are granted here
        assert chat.fut is not None and batch.fut is not None and chat.fut.done() and batch.fut.done()

    asyncio.run(main())


def test_a_full_worker_grants_nothing_and_the_class_stays_published(group) -> None:  # type: ignore[no-untyped-def]
    gate, peer, seg = group

    async def main() -> None:
        seg.writer(0).publish_now(WorkerState(0, pid=os.getpid(), lifecycle=Lifecycle.READY,
                                              heartbeat_mono_ns=time.monotonic_ns(), max_num_seqs=SLOTS,
                                              num_running=SLOTS))
        gate.state.inflight[0] = SLOTS  # both slots are this process's requests in flight
        batch = queue(gate, "batch")
        gate.room.pump()
        assert batch.fut is not None and not batch.fut.done()
        assert peer.peers_urgent() == 1  # the peer sees what waits here even though nothing was granted
        gate.state.inflight[0] = SLOTS - 1  # one ends
        gate.room.pump()
        assert batch.fut.done() and batch.granted_to == 0

    asyncio.run(main())


def test_a_slot_held_for_the_tenant_served_next_is_not_granted_until_the_hold_expires(group) -> None:  # type: ignore[no-untyped-def]
    """A chat (interactive) request ends while a batch request waits: its slot is held for chat's next request
    (anticipation), so the pump does not grant it; unclaimed, the hold ends after ``anticipation_s`` and the tick
    grants the slot to the batch request."""
    gate, _, _ = group

    async def main() -> None:
        assert gate.fq is not None
        gate.fq.anticipation_s = 0.05
        gate.state.inflight[0] = SLOTS
        batch = queue(gate, "batch")
        gate.room.pump()
        assert batch.fut is not None and not batch.fut.done()
        chat_t = next(t for t in gate.config.tenants if t.name == "chat")
        ended = Ticket(gate.fq, chat_t, 0, None)
        ended.relayed = True
        gate.state.inflight[0] = SLOTS - 1  # chat's request on worker 0 ended
        gate.room.anticipate(0, ended)
        gate.room.pump()
        assert gate.room.free() == {0: 0} and gate.fq.holding == 1 and not batch.fut.done()
        await asyncio.wait_for(batch.fut, 2.0)  # the ticker expires the hold and grants the slot
        assert batch.granted_to == 0 and gate.fq.holding == 0 and gate.room.held[0] == 0

    asyncio.run(main())
