"""Eligibility filters, table-driven (one row per rule), and the one ``routable()`` every view uses."""

from __future__ import annotations

import pytest

from dplb.config import PolicyConfig
from dplb.policy import PickContext, RouteRequest, routable
from dplb.policy.decision import Candidate
from dplb.policy.filters import HEALTH_FILTERS, REQUEST_FILTERS, build_filters
from dplb.state.shm import Lifecycle, WorkerState

NOW = 10**12


def cand(*, pid: int = 7, torn: bool = False, age_ms: float = 0.0, life: Lifecycle = Lifecycle.READY,
         queue: int = 0, k: int = 0) -> Candidate:
    w = WorkerState(k, pid=pid, lifecycle=life, heartbeat_mono_ns=NOW - int(age_ms * 1e6), torn=torn)
    return Candidate(w, 0, queue, int(age_ms * 1e6))


CFG = PolicyConfig(state_interval_ms=200, hard_queue_cap=8)
# (filter class, candidate, context kwargs, expected why)
TABLE = [
    ("Registered", cand(), {}, "ok"),
    ("Registered", cand(pid=0), {}, "unregistered"),
    ("Consistent", cand(torn=True), {}, "torn"),
    ("Consistent", cand(), {}, "ok"),
    ("Fresh", cand(age_ms=600), {}, "ok"),  # 3 × 200 ms is still fresh
    ("Fresh", cand(age_ms=600.001), {}, "stale"),
    ("Ready", cand(life=Lifecycle.DRAINING), {}, "draining"),
    ("Ready", cand(life=Lifecycle.WARMING), {}, "not_ready"),
    ("Ready", cand(life=Lifecycle.STARTING), {}, "not_ready"),
    ("Ready", cand(life=Lifecycle.STOPPED), {}, "not_ready"),
    ("Ready", cand(), {}, "ok"),
    ("NotHeldOut", cand(k=2), {"held": frozenset({2})}, "held_out"),
    ("NotHeldOut", cand(k=1), {"held": frozenset({2})}, "ok"),
    ("NotEjected", cand(k=3), {"ejected": frozenset({3})}, "ejected"),
    ("NotEjected", cand(k=3), {}, "ok"),
    ("CanServe", cand(k=2), {"cannot_serve": frozenset({2})}, "cannot_serve"),
    ("CanServe", cand(k=1), {"cannot_serve": frozenset({2})}, "ok"),
    ("NotTried", cand(k=1), {"exclude": frozenset({1})}, "excluded"),
    ("NotTried", cand(k=0), {"exclude": frozenset({1})}, "ok"),
    ("UnderHardCap", cand(queue=7), {}, "ok"),
    ("UnderHardCap", cand(queue=8), {}, "over_cap"),
]


@pytest.mark.parametrize(("name", "c", "ctx_kw", "want"), TABLE)
def test_filter_table(name: str, c: Candidate, ctx_kw: dict, want: str) -> None:  # type: ignore[type-arg]
    f = next(f for f in build_filters(CFG) if type(f).__name__ == name)
    req = RouteRequest(exclude=ctx_kw.pop("exclude", frozenset()), cannot_serve=ctx_kw.pop("cannot_serve", frozenset()))
    f.apply([c], PickContext(NOW, req, None, **ctx_kw))
    assert c.why == want
    assert want == "ok" or want in f.reasons


def test_hard_cap_zero_means_no_cap() -> None:
    c = cand(queue=10_000)
    for f in build_filters(PolicyConfig()):
        f.apply([c], PickContext(NOW, RouteRequest(), None))
    assert c.why == "ok"


def test_first_rejection_wins_and_health_comes_first() -> None:
    """A draining worker that is also over the cap and excluded is reported as draining (the worker's health
    outranks request-level reasons), and ``routable`` is False only for health reasons."""
    c = cand(life=Lifecycle.DRAINING, queue=9, k=1)
    for f in build_filters(CFG):
        f.apply([c], PickContext(NOW, RouteRequest(exclude=frozenset({1})), None))
    assert c.why == "draining" and not c.routable
    c2 = cand(queue=9)
    for f in build_filters(CFG):
        f.apply([c2], PickContext(NOW, RouteRequest(), None))
    assert c2.why == "over_cap" and c2.routable and not c2.eligible
    assert all(cls.health for cls in HEALTH_FILTERS) and not any(cls.health for cls in REQUEST_FILTERS)


def test_routable_is_what_ready_metrics_and_state_show() -> None:
    snap = [WorkerState(0, pid=1, lifecycle=Lifecycle.READY, heartbeat_mono_ns=NOW),
            WorkerState(1, pid=2, lifecycle=Lifecycle.WARMING, heartbeat_mono_ns=NOW),
            WorkerState(2, pid=3, lifecycle=Lifecycle.READY, heartbeat_mono_ns=NOW - 10**9),
            WorkerState(3, pid=4, lifecycle=Lifecycle.READY, heartbeat_mono_ns=NOW, num_running=99),
            WorkerState(4)]
    whys = [c.why for c in routable(snap, NOW, PolicyConfig(hard_queue_cap=8), held=frozenset({3}))]
    assert whys == ["ok", "not_ready", "stale", "held_out", "unregistered"]
    # request-level filters never make a worker unroutable: a full worker is still up
    assert [c.why for c in routable(snap[3:4], NOW, PolicyConfig(hard_queue_cap=8))] == ["ok"]


PROMPT = b'[{"role":"user","content":"' + b"a long shared question " * 30 + b'"}]'


@pytest.mark.parametrize(("why", "kw"), [
    ("draining", {}), ("excluded", {"exclude": frozenset({1})}), ("cannot_serve", {"cannot_serve": frozenset({1})}),
    ("ejected", {}), ("held_out", {}),
])
def test_a_prefix_never_pulls_a_request_past_the_filters(why: str, kw: dict) -> None:  # type: ignore[type-arg]
    """Worker 1 holds the prompt's whole prefix (the policy routed it there first); when a filter rejects worker 1
    the request goes elsewhere, and worker 1 is neither chosen nor preferred."""
    from dplb.policy import make_policy

    p = make_policy(PolicyConfig(), 3)
    snap = [WorkerState(k, pid=10 + k, lifecycle=Lifecycle.READY, heartbeat_mono_ns=NOW) for k in range(3)]
    first = p.pick(snap, NOW, RouteRequest(PROMPT, exclude=frozenset({0, 2})))
    assert first.worker == 1
    assert p.pick(snap, NOW, RouteRequest(PROMPT)).worker == 1  # the prefix pulls it back to worker 1
    if why == "draining":
        snap[1] = WorkerState(1, pid=11, lifecycle=Lifecycle.DRAINING, heartbeat_mono_ns=NOW)
    d = p.pick(snap, NOW, RouteRequest(PROMPT, **kw), held=frozenset({1}) if why == "held_out" else frozenset(),
               ejected=frozenset({1}) if why == "ejected" else frozenset())
    assert d.candidates[1].why == why and d.worker in (0, 2) and d.preferred != 1


@pytest.mark.parametrize("row", [r for r in TABLE if r[0] in ("Registered", "Consistent", "Fresh", "Ready")])
def test_state_why_is_the_state_filters_in_order(row: tuple) -> None:  # type: ignore[type-arg]
    """The policy applies the four state filters while it builds the candidates (``state_why``); it must give the
    first rejection the filter chain gives, for every row of the table and for a worker failing several."""
    from dplb.policy.filters import state_why

    c = row[1]
    fresh = next(f for f in build_filters(CFG) if type(f).__name__ == "Fresh")
    chain = Candidate(c.state, 0, 0, c.age_ns)
    for f in build_filters(CFG, health_only=True)[:4]:
        f.apply([chain], PickContext(NOW, RouteRequest(), None))
    assert state_why(c.state, c.age_ns, fresh.stale_ns) == chain.why  # type: ignore[attr-defined]
    worst = cand(pid=0, torn=True, age_ms=10_000, life=Lifecycle.DRAINING)
    assert state_why(worst.state, worst.age_ns, fresh.stale_ns) == "unregistered"  # type: ignore[attr-defined]
