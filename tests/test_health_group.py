"""Ejection shared by a router group (dplb.router.health over dplb.state.health_board), table-driven: two
:class:`WorkerHealth` on a real segment, each publishing into its own router slot's health table and reading the
other's, with one fake clock. Router processes are stood in for by router slots claimed under distinct live pids
(this process and its parent), as in tests/test_tenant_tables.py.
"""

from __future__ import annotations

import logging
import os

import pytest

from dplb.router.health import MAX_FAILS, UNREACHABLE_S, Outcome, WorkerHealth
from dplb.state.health_board import GEN_WORD
from dplb.state.router_slots import RouterSlots
from dplb.state.shm import Segment, WorkerState

A, B = os.getpid(), os.getppid()
F, OK, U = Outcome.UPSTREAM_5XX, Outcome.OK, Outcome.UNREACHABLE
STEP_S = 0.01  # clock advance per attempt (distinct times)


class Clock:
    """Fake CLOCK_MONOTONIC seconds shared by both processes."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Group:
    """Two router processes' health on one segment: ``h[p]`` for p in "ab"."""

    def __init__(self, seg: Segment) -> None:
        self.clock, self.pid = Clock(), 7
        self.counted: dict[str, list[int]] = {"a": [], "b": []}
        self.slots = {p: RouterSlots.claim(seg.path, 2, 30000, i, pid=pid) for i, (p, pid) in enumerate((("a", A),
                                                                                                    ("b", B)))}
        assert all(s is not None for s in self.slots.values())
        self.h: dict[str, WorkerHealth] = {}
        self.peers: dict[str, list[int]] = {}
        for p, other in (("a", "b"), ("b", "a")):
            s = self.slots[p]
            assert s is not None
            h = WorkerHealth(2, pid_of=lambda k: self.pid, on_eject=self.counted[p].append, clock=self.clock)
            h.share(s.health)
            other_slots = self.slots[other]
            assert other_slots is not None
            self.h[p], self.peers[p] = h, [other_slots.index]

    def attempt(self, p: str, outcome: Outcome, pick: bool = True) -> None:
        """Process ``p`` picks (reading its peer's table; not with ``pick`` False: a request picked before the
        previous steps) and reports ``outcome`` on worker 0."""
        self.clock.t += STEP_S
        if pick:
            self.h[p].sync(self.peers[p])
        self.h[p].report(0, outcome)

    def ejected(self, p: str) -> bool:
        self.h[p].sync(self.peers[p])
        return 0 in self.h[p].ejected([WorkerState(0, pid=self.pid), WorkerState(1, pid=8)])

    def close(self) -> None:
        for s in self.slots.values():
            if s is not None:
                s.close()


@pytest.fixture
def group(shm_path: str):  # type: ignore[no-untyped-def]
    seg = Segment.create(shm_path, 2)
    g = Group(seg)
    yield g
    g.close()
    seg.close()


# (case, steps, ejected in a, ejected in b, ejections counted by a, by b). Steps: "aF" process a's attempt failed
# (also "OK", "U" refused; a trailing "~": reported without a pick first), "+S" the clock moves S seconds, "pid" worker 0 restarted, "b-alone" b's peer died.
SHARED = [
    ("a ejects after MAX_FAILS; b adopts it, counted once", ["aF"] * MAX_FAILS, True, True, 1, 0),
    ("failures in a row add up across the processes", ["aF", "bF", "aF"], True, True, 1, 0),
    ("the process that reaches MAX_FAILS ejects and counts", ["aF", "aF", "bF"], True, True, 0, 1),
    ("one short of MAX_FAILS in all does not", ["aF", "bF"], False, False, 0, 0),
    ("a success published by a peer ends the streak", ["aF", "aF", "bOK", "bF"], False, False, 0, 0),
    ("a success in the process itself ends its own streak", ["aF", "bF", "bOK", "aF"], False, False, 0, 0),
    ("failures in b while adopted count for nothing: one ejection", ["aF"] * MAX_FAILS + ["bF"] * 5, True, True, 1,
     0),
    ("a refused connection ejects in both (not a failure ejection)", ["aU"], True, True, 0, 0),
    ("the adopted ejection ends with the same expiry", ["aF"] * MAX_FAILS + [f"+{UNREACHABLE_S}"], False, False, 1,
     0),
    ("a restart (new pid) lifts the adopted ejection too", ["aF"] * MAX_FAILS + ["pid"], False, False, 1, 0),
    ("a peer's expired ejection is not adopted late", ["aU", f"+{UNREACHABLE_S}", "bF"], False, False, 0, 0),
    ("a dead peer's streak stops counting", ["aF", "aF", "b-alone", "bF"], False, False, 0, 0),
    ("a streak begun before a peer's success starts over after it", ["aF", "bOK", "aF", "aF", "aF"], True, True,
     1, 0),
    ("two failures, a peer's success, then MAX_FAILS more eject", ["aF", "aF", "bOK"] + ["aF"] * MAX_FAILS, True,
     True, 1, 0),
    ("a keep-alive client on one process after a peer's success", ["aF", "bOK"] + ["aF"] * 10, True, True, 1, 0),
    ("a success picked before the streak began still ends it", ["bOK", "aF", "bOK~", "aF", "aF"], False, False, 0,
     0),
    ("after the shared ejection every streak starts over", ["aF", "bF", "aF", f"+{UNREACHABLE_S}", "bF", "aF"],
     False, False, 1, 0),
]


@pytest.mark.parametrize(("case", "steps", "in_a", "in_b", "by_a", "by_b"), SHARED, ids=[c[0] for c in SHARED])
def test_shared_ejection(group: Group, case: str, steps: list[str], in_a: bool, in_b: bool, by_a: int,
                         by_b: int) -> None:
    for s in steps:
        if s.startswith("+"):
            group.clock.t += float(s[1:])
        elif s == "pid":
            group.pid += 1
        elif s == "b-alone":
            group.peers["b"] = []
        else:
            group.attempt(s[0], {"F": F, "OK": OK, "U": U}[s[1:].rstrip("~")], pick=not s.endswith("~"))
    assert (group.ejected("a"), group.ejected("b")) == (in_a, in_b), case
    assert (len(group.counted["a"]), len(group.counted["b"])) == (by_a, by_b), case


def test_an_adoption_is_logged_at_debug_only(group: Group, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="dplb.router")
    for _ in range(MAX_FAILS):
        group.attempt("a", F)
    assert group.ejected("b")
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "ejecting it" in warnings[0].getMessage(), warnings
    adopted = [r for r in caplog.records if "ejected by the router process" in r.getMessage()]
    assert len(adopted) == 1 and adopted[0].levelno == logging.DEBUG


def test_a_torn_table_is_read_at_the_next_look(group: Group) -> None:
    """The owner is mid-write (odd health_gen) for every copy: the reader takes nothing and reads it once even."""
    a = group.slots["a"]
    assert a is not None
    group.attempt("a", U)
    q = memoryview(a._mm).cast("Q")
    gw = (a._off >> 3) + GEN_WORD
    q[gw] += 1  # the generation the owner leaves while it writes
    try:
        assert not group.ejected("b")
    finally:
        q[gw] += 1
        q.release()
    assert group.ejected("b")
