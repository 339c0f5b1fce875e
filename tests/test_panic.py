"""Panic routing (docs/DESIGN.md §5.1): when no worker can take a request and some are held out only by the heartbeat
hysteresis (fresh again, ready, on probation), the router routes among those instead of answering 503.

Table-driven without processes: which workers a pick lets in, on both pick paths (the fused columns of profile
``dplb`` and the candidate objects of the others), and the monitor's view (:func:`dplb.policy.panic_set`) over the
hysteresis state machine in time. Then end to end with real sim workers: both SIGSTOPped past the stale limit,
SIGCONT, and the requests right after are answered 200 in panic (decisions, metrics, one log line each way), or
503 ``no_routable_worker`` with ``--no-panic-routing``.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from cluster import cluster, completion, log_count, wait_for

from dplb.config import PolicyConfig
from dplb.policy import RouteRequest, make_policy, panic_set, routable
from dplb.policy.decision import REASON_NONE_ROUTABLE, REASON_PANIC
from dplb.router.health import READMIT_INTERVALS, WorkerHealth
from dplb.state.shm import STALE_INTERVALS, Lifecycle, WorkerState
from dplb.tenants import hash_key

NOW = 10**12
INTERVAL_MS = 200
STALE_MS = STALE_INTERVALS * INTERVAL_MS
R = Lifecycle.READY

# One worker of a table row: its published state and the router's verdicts on it.
#   ok: fresh and ready        held: fresh and ready, on probation       busy: as ok with 8 requests running
#   stale / held_stale: heartbeat older than the stale limit (not held / held)
#   held_ejected / held_stalled / held_draining: on probation and also ejected / stalled / draining
#   ejected: fresh and ready, ejected       warming: lifecycle warming       none: never registered
KINDS = ("ok", "held", "busy", "stale", "held_stale", "held_ejected", "held_stalled", "held_draining", "ejected",
         "warming", "none")


def _row(kinds: tuple[str, ...]) -> tuple[list[WorkerState], dict[str, frozenset[int]]]:
    snap = []
    for k, kind in enumerate(kinds):
        assert kind in KINDS, kind
        age_ms = STALE_MS + 400 if kind in ("stale", "held_stale") else 10
        life = Lifecycle.DRAINING if kind == "held_draining" else Lifecycle.WARMING if kind == "warming" else R
        snap.append(WorkerState(k, pid=0 if kind == "none" else 100 + k, lifecycle=life,
                                heartbeat_mono_ns=NOW - age_ms * 1_000_000, num_running=8 if kind == "busy" else 0))
    verdicts = {"held": frozenset(k for k, kind in enumerate(kinds) if kind.startswith("held")),
                "ejected": frozenset(k for k, kind in enumerate(kinds) if kind.endswith("ejected")),
                "stalled": frozenset(k for k, kind in enumerate(kinds) if kind == "held_stalled")}
    return snap, verdicts


# (case, workers, request / config, the workers the picks choose (empty: nobody), a panic decision, panic_set's)
TABLE: list[tuple[str, tuple[str, ...], dict[str, Any], set[int], bool, set[int]]] = [
    ("all on probation: routed among them", ("held", "held"), {}, {0, 1}, True, {0, 1}),
    ("one routable: probation holds", ("ok", "held"), {}, {0}, False, set()),
    ("stale on probation stays out", ("held", "held_stale"), {}, {0}, True, {0}),
    ("ejected on probation stays out", ("held_ejected", "held"), {}, {1}, True, {1}),
    ("stalled on probation stays out", ("held_stalled", "held"), {}, {1}, True, {1}),
    ("draining on probation stays out", ("held_draining", "held"), {}, {1}, True, {1}),
    ("ejected and routable otherwise", ("ejected", "held"), {}, {1}, True, {1}),
    ("only unsafe ones on probation: 503", ("held_ejected", "held_stale", "held_draining"), {}, set(), False, set()),
    ("nobody on probation: 503", ("stale", "warming", "none"), {}, set(), False, set()),
    ("--no-panic-routing: 503", ("held", "held"), {"panic_routing": False}, set(), False, {0, 1}),
    ("a retry still skips the worker it tried", ("held", "held"), {"exclude": {0}}, {1}, True, {0, 1}),
    ("the routable worker was tried: the retry goes to probation", ("ok", "held"), {"exclude": {0}}, {1}, True,
     set()),
    ("the routable worker is over the hard cap", ("busy", "held"), {"hard_queue_cap": 4}, {1}, True, set()),
    ("nobody on probation serves the model: 503", ("held", "held"), {"cannot_serve": {0, 1}}, set(), False, {0, 1}),
]


@pytest.mark.parametrize("profile", ["dplb", "least_loaded", "round_robin"])
@pytest.mark.parametrize(("case", "kinds", "opts", "may", "panic", "monitor"), TABLE, ids=[r[0] for r in TABLE])
def test_who_a_pick_lets_in(profile: str, case: str, kinds: tuple[str, ...], opts: dict[str, Any], may: set[int],
                            panic: bool, monitor: set[int]) -> None:
    snap, verdicts = _row(kinds)
    cfg = PolicyConfig(name=profile, state_interval_ms=INTERVAL_MS, hard_queue_cap=opts.get("hard_queue_cap", 0),
                       panic_routing=opts.get("panic_routing", True))
    pol = make_policy(cfg, len(kinds))
    chosen = set()
    for _ in range(2 * len(kinds)):  # ties rotate: every worker it may choose is chosen once in a while
        req = RouteRequest(None, frozenset(opts.get("exclude", ())), frozenset(opts.get("cannot_serve", ())))
        d = pol.pick(snap, NOW, req, **verdicts)
        assert (d.reason == REASON_PANIC) == panic, (d.reason, d.to_dict())
        if d.worker is None:
            assert not may and d.reason == REASON_NONE_ROUTABLE, d.reason
            break
        chosen.add(d.worker)
        assert d.worker in may, d.to_dict()
        view = d.to_dict()["candidates"]
        assert [c["held_out"] for c in view] == [k in verdicts["held"] for k in range(len(kinds))]  # type: ignore[index]
        if panic:  # the chosen worker shows eligible (why ok) and held out: panic let it in
            assert view[d.worker]["why"] == "ok" and view[d.worker]["held_out"]  # type: ignore[index]
            assert d.worker in d.ranked()  # a retry's order has it
    assert chosen == may
    # What the monitor says (the health view, no request; the router asks only with panic routing on).
    cands = routable(snap, NOW, cfg, verdicts["held"], verdicts["ejected"], verdicts["stalled"])
    assert set(panic_set(cands, verdicts["ejected"], verdicts["stalled"])) == monitor


def test_a_panic_pick_counts_its_request_and_a_dry_run_never_panics() -> None:
    snap, verdicts = _row(("held", "held"))
    pol = make_policy(PolicyConfig(state_interval_ms=INTERVAL_MS), 2)
    assert pol.pick(snap, NOW, dry_run=True, **verdicts).worker is None  # a metrics scrape chooses nothing
    assert [pol.correction(k) for k in range(2)] == [0, 0]
    d = pol.pick(snap, NOW, **verdicts)
    assert d.reason == REASON_PANIC and d.worker is not None
    # The in-flight correction of the chosen worker counts it, as for any pick (the next one goes elsewhere).
    assert [pol.correction(k) for k in range(2)] == [int(k == d.worker) for k in range(2)]
    assert pol.pick(snap, NOW, **verdicts).worker == 1 - d.worker


@pytest.mark.parametrize("profile", ["dplb", "least_loaded"])
def test_panic_picks_rotate_among_equal_workers(profile: str) -> None:
    """Equal workers whose requests completed (no in-flight correction): ties rotate one worker per request in panic
    as in normal routing (the pick that found nobody takes no turn; when it took one, every panic pick of two chose the same worker)."""
    snap, verdicts = _row(("held", "held"))
    pol = make_policy(PolicyConfig(name=profile, state_interval_ms=INTERVAL_MS), 2)
    got = [pol.pick(snap, NOW, inflight=[0, 0], **verdicts).worker for _ in range(4)]
    assert sorted(got) == [0, 0, 1, 1], got


def _obs(t_ms: int, ages_ms: tuple[float, float]) -> list[WorkerState]:
    now = NOW + t_ms * 1_000_000
    return [WorkerState(k, pid=100 + k, lifecycle=R, heartbeat_mono_ns=now - int(a * 1e6)) for k, a in enumerate(ages_ms)]


FRESH, STALE = 10.0, STALE_MS + 100.0
READMIT_MS = READMIT_INTERVALS * INTERVAL_MS
# (case, observations every interval: (t ms, heartbeat ages ms of workers 0 and 1), the times (ms) in panic)
IN_TIME = [
    ("both stale at once, then fresh: panic while both are on probation",
     [(t, (FRESH, FRESH)) for t in range(0, 600, 200)] + [(t, (STALE, STALE)) for t in range(600, 1400, 200)]
     + [(t, (FRESH, FRESH)) for t in range(1400, 3200, 200)],
     # fresh from 1400: both on probation until READMIT_MS later (2400), routable from there on.
     set(range(1400, 1400 + READMIT_MS, 200))),
    ("one stale: the other serves, no panic",
     [(t, (FRESH, FRESH)) for t in range(0, 600, 200)] + [(t, (STALE, FRESH)) for t in range(600, 1400, 200)]
     + [(t, (FRESH, FRESH)) for t in range(1400, 3200, 200)], set()),
    ("staggered: panic only while neither is readmitted",
     [(t, (FRESH, FRESH)) for t in range(0, 600, 200)] + [(t, (STALE, STALE)) for t in range(600, 1000, 200)]
     + [(t, (FRESH, STALE)) for t in range(1000, 1600, 200)] + [(t, (FRESH, FRESH)) for t in range(1600, 3400, 200)],
     set(range(1000, 1000 + READMIT_MS, 200))),  # worker 0 fresh from 1000, readmitted at 2000
    ("flapping through probation: panic ends while both are stale again, resumes when fresh",
     [(t, (FRESH, FRESH)) for t in range(0, 600, 200)] + [(t, (STALE, STALE)) for t in range(600, 1000, 200)]
     + [(t, (FRESH, FRESH)) for t in range(1000, 1400, 200)] + [(t, (STALE, STALE)) for t in range(1400, 1800, 200)]
     + [(t, (FRESH, FRESH)) for t in range(1800, 3400, 200)],
     set(range(1000, 1400, 200)) | set(range(1800, 1800 + READMIT_MS, 200))),
]


@pytest.mark.parametrize(("case", "obs", "panic_at"), IN_TIME, ids=[c[0] for c in IN_TIME])
def test_panic_over_the_hysteresis_in_time(case: str, obs: list[tuple[int, tuple[float, float]]],
                                           panic_at: set[int]) -> None:
    """The router's monitor step: observe (the hysteresis), then the panic set over the health view."""
    health = WorkerHealth(2, lambda k: 100 + k)
    cfg = PolicyConfig(state_interval_ms=INTERVAL_MS)
    got = set()
    for t, ages in obs:
        snap = _obs(t, ages)
        now = NOW + t * 1_000_000
        held = health.observe(snap, now, INTERVAL_MS)
        ps = panic_set(routable(snap, now, cfg, held))
        if ps:
            got.add(t)
            assert ps == {k for k in range(2) if ages[k] == FRESH}, (t, ps)
    assert got == panic_at


# ---- end to end: real sim workers, real signals ---------------------------------------------------------------
def _ask(url: str, i: int, key: str = "") -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else None
    return httpx.post(url + "/v1/completions", json=completion(i, max_tokens=2, stream=False), headers=headers,
                      timeout=10)


def _fresh_again(seg: Any, pids: list[int]) -> None:
    """Wait until both workers published a heartbeat after SIGCONT (fresh in the segment)."""
    wait_for(lambda: all(seg.read(k).pid == pids[k] and not seg.read(k).is_stale(seg.state_interval_ms)
                         for k in range(2)), 10, "both workers to publish again")


def _freeze_both(c: Any, pids: list[int], what: str) -> str:
    """SIGSTOP both workers until the router saw both stale; a request meanwhile is refused (stale workers are not
    let in, panic or not). Returns its 503 body."""
    log0 = log_count(c.router_log(), "heartbeat is stale")
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: log_count(c.router_log(), "heartbeat is stale") >= log0 + 2, 10,
                 f"the router to see both workers stale ({what})", step_s=0.05)
        r = _ask(c.url, 100)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_routable_worker", r.text
        return r.text
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def test_both_workers_stale_then_fresh_are_routed_in_panic_and_the_flag_turns_it_off(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Both sim workers frozen past the stale limit, then SIGCONT: right after, while both are on probation
    (READMIT_INTERVALS × 200 ms = 1 s), requests are answered 200 with reason ``panic`` in /debug/decisions,
    ``dplb_router_panic_routed_total`` counts them and the router logs one line entering panic and one leaving it.
    With ``--no-panic-routing`` the same moment answers 503 no_routable_worker naming held_out."""
    window = READMIT_INTERVALS * INTERVAL_MS / 1000
    with cluster(str(tmp_path), 2, state_interval_ms=INTERVAL_MS) as c:
        seg = c.segment
        pids = [c.workers[k].pid for k in range(2)]
        assert _ask(c.url, 0).status_code == 200
        assert "stale" in _freeze_both(c, pids, "panic on")
        _fresh_again(seg, pids)
        t_fresh = time.monotonic()
        answers = [_ask(c.url, i) for i in range(1, 4)]
        took = time.monotonic() - t_fresh
        assert took < window, f"the requests took {took:.2f} s, past the probation window: inconclusive"
        assert [r.status_code for r in answers] == [200] * 3, [r.text for r in answers]
        decisions = httpx.get(c.url + "/debug/decisions?limit=3", timeout=5).json()
        assert [d["reason"] for d in decisions] == ["panic"] * 3, decisions
        assert all(x["held_out"] for d in decisions for x in d["candidates"]), decisions
        for d in decisions:  # scored as usual: the profile chose the best score
            assert d["candidates"][d["worker"]]["score"] == max(x["score"] for x in d["candidates"]), d
        assert c.metric("dplb_router_panic_routed_total") == 3
        assert sum(c.metric("dplb_routing_decisions_total", {"reason": "panic", "worker": str(k)}) or 0
                   for k in range(2)) == 3
        # Readmitted after the probation: normal routing again, one log line each way, the gauge back at 0.
        wait_for(lambda: log_count(c.router_log(), "panic routing over") == 1, 10, "the panic to end")
        log = c.router_log()
        assert log_count(log, "no worker is routable; routing among workers [0, 1]") == 1, log
        assert _ask(c.url, 4).status_code == 200
        assert httpx.get(c.url + "/debug/decisions?limit=1", timeout=5).json()[0]["reason"] == "score"
        assert c.metric("dplb_router_panic") == 0 and c.metric("dplb_router_panic_routed_total") == 3

        c.start_router("--no-panic-routing")
        assert 'panic_routing="false"' in httpx.get(c.url + "/metrics", timeout=5).text
        assert _ask(c.url, 50).status_code == 200  # seen routable by this router before it goes stale
        _freeze_both(c, pids, "panic off")
        _fresh_again(seg, pids)
        t_fresh = time.monotonic()
        r = _ask(c.url, 5)
        took = time.monotonic() - t_fresh
        assert took < window, f"the request took {took:.2f} s, past the probation window: inconclusive"
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_routable_worker", r.text
        assert "worker 0: held_out" in r.text and "worker 1: held_out" in r.text, r.text
        wait_for(lambda: _ask(c.url, 6).status_code == 200, 10, "the workers to be readmitted")
        assert c.metric("dplb_router_panic_routed_total") == 0
        assert "routing among workers" not in c.router_log().split("DPLB router listening")[-1]


def test_with_tenants_queued_requests_are_granted_and_routed_in_panic(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With ``--tenants`` the fair queue grants by room: both workers frozen with their batch slots full (2 each), so 4
    more requests queue in the router; past the stale limit, SIGCONT. While both are on probation (2.5 s) the gate counts
    the panic set's room: the queued requests are granted and routed in panic (answered 200 with reason ``panic``,
    counted), not held until the probation ends (which is what happened when the gate saw only routable workers)."""
    tf = tmp_path / "tenants.toml"
    tf.write_text(f'[tenants.a]\napi_key_sha256 = ["{hash_key("key-a")}"]\n')
    slots = ["--sim-max-num-seqs", "2"]
    with cluster(str(tmp_path), 2, worker_args={0: slots, 1: slots}, router_args=["--tenants", str(tf)],
                 state_interval_ms=500) as c:  # stale 1.5 s after SIGSTOP: time to fill the slots and the queue
        pids = [c.workers[k].pid for k in range(2)]
        assert _ask(c.url, 0, "key-a").status_code == 200
        log0 = log_count(c.router_log(), "heartbeat is stale")
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(8) as pool:
                running = [pool.submit(_ask, c.url, i, "key-a") for i in range(1, 5)]  # the frozen workers' 4 slots
                wait_for(lambda: sum(c.metric("dplb_routing_decisions_total", {"reason": "score", "worker": str(k)})
                                     or 0 for k in range(2)) == 5, 10, "4 requests sent to the frozen workers")
                queued = [pool.submit(_ask, c.url, i, "key-a") for i in range(5, 9)]
                wait_for(lambda: c.metric("dplb_tenant_queued_requests", {"tenant": "a"}) == 4, 10,
                         "4 requests queued in the router")
                wait_for(lambda: log_count(c.router_log(), "heartbeat is stale") >= log0 + 2, 10,
                         "the router to see both workers stale", step_s=0.05)
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)
                t_cont = time.monotonic()
                answers = [f.result() for f in queued]
                ready = httpx.get(c.url + "/ready", timeout=5)
                took = time.monotonic() - t_cont
                assert [r.status_code for r in answers] == [200] * 4, [r.text for r in answers]
                assert [f.result().status_code for f in running] == [200] * 4
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        decisions = httpx.get(c.url + "/debug/decisions?limit=4", headers={"authorization": "Bearer key-a"},
                              timeout=5).json()
        assert [d["reason"] for d in decisions] == ["panic"] * 4, (f"{took:.2f} s after SIGCONT", decisions)
        assert c.metric("dplb_router_panic_routed_total") == 4
        # /ready stays 503 in panic (the host has no routable worker: a front balancer should send elsewhere), and
        # says that requests that arrive are served anyway.
        assert took < 2.5, f"{took:.2f} s after SIGCONT, past the probation: inconclusive"
        assert ready.status_code == 503 and ready.json()["error"]["code"] == "no_routable_worker", ready.text
        assert "served by panic routing among workers [0, 1]" in ready.text, ready.text
        wait_for(lambda: log_count(c.router_log(), "panic routing over") == 1, 10, "the panic to end")
        assert httpx.get(c.url + "/ready", timeout=5).status_code == 200
