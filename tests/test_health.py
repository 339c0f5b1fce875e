"""Worker health state machine (dplb.router.health), table-driven without processes: heartbeat hysteresis for
fresh, late, stale, flapping, restarted and on-probation workers; ejection by outcome streaks with a fake clock;
the outcome classification of a complete response."""

from __future__ import annotations

import logging

import pytest

from dplb.router.health import MAX_FAILS, READMIT_INTERVALS, UNREACHABLE_S, Outcome, Verdict, WorkerHealth
from dplb.state.shm import STALE_INTERVALS, Lifecycle, WorkerState

INTERVAL_MS = 100
STALE_MS = STALE_INTERVALS * INTERVAL_MS  # 300: older is stale
READMIT_MS = READMIT_INTERVALS * INTERVAL_MS  # 500: fresh this long at every observation to come back
R, S = Lifecycle.READY, Lifecycle.STARTING
T0 = 10**12  # monotonic ns of the first observation


def _snap(age_ms: float, pid: int, life: Lifecycle, now: int) -> list[WorkerState]:
    return [WorkerState(0, pid=pid, lifecycle=life, heartbeat_mono_ns=now - int(age_ms * 1e6))]


def _fresh(t0: int, t1: int, step: int = 100, pid: int = 7) -> list[tuple[int, float, int, Lifecycle]]:
    """Observations every ``step`` ms from ``t0`` to ``t1`` ms (inclusive) of a fresh, ready worker."""
    return [(t, 0.0, pid, R) for t in range(t0, t1 + 1, step)]


def _stale(t0: int, t1: int, pid: int = 7) -> list[tuple[int, float, int, Lifecycle]]:
    """Observations every 100 ms from ``t0`` to ``t1`` ms of a worker whose heartbeat stopped at ``t0`` - 400 ms."""
    return [(t, t - t0 + STALE_MS + 100, pid, R) for t in range(t0, t1 + 1, 100)]


# (case, observations (t ms, heartbeat age ms, pid, lifecycle), the times (ms) at which worker 0 is held out)
HYSTERESIS = [
    ("fresh", _fresh(0, 2000), set()),
    ("one late heartbeat shorter than the stale limit", [*_fresh(0, 400), (500, STALE_MS, 7, R),
                                                         *_fresh(600, 1000)], set()),
    ("stale", [*_fresh(0, 200), *_stale(300, 1000)], set(range(300, 1001, 100))),
    ("on probation, then back after READMIT intervals fresh",
     [*_fresh(0, 200), *_stale(300, 500), *_fresh(600, 1500)],
     # fresh since 600: still held at 600..1000 (< 500 ms), routed again from 1100.
     set(range(300, 1001, 100))),
    ("flapping stays out until steadily fresh",
     [*_fresh(0, 200), *_stale(300, 400), *_fresh(500, 700), *_stale(800, 900), *_fresh(1000, 1300),
      *_stale(1400, 1500), *_fresh(1600, 2500)],
     set(range(300, 2001, 100))),  # fresh since 1600: back at 2100
    ("restarted under a new pid: lifted at once", [*_fresh(0, 200), *_stale(300, 500), *_fresh(600, 1000, pid=8)],
     set(range(300, 501, 100))),
    ("never seen ready (starting) going stale: its lifecycle gates it",
     [(0, 0.0, 7, S), (100, 0.0, 7, S), (200, STALE_MS + 100, 7, R), (300, STALE_MS + 200, 7, R)], set()),
    ("stale before it was ever seen fresh under this pid",
     [*_fresh(0, 200, pid=7), *_stale(300, 600, pid=8)], set()),
    ("unregistered slots are ignored", [*_fresh(0, 200), (300, 10_000.0, 0, R), *_fresh(400, 600)], set()),
]


@pytest.mark.parametrize(("case", "obs", "held_at"), HYSTERESIS, ids=[c[0] for c in HYSTERESIS])
def test_heartbeat_hysteresis(case: str, obs: list[tuple[int, float, int, Lifecycle]], held_at: set[int]) -> None:
    h = WorkerHealth(1, pid_of=lambda k: 7)
    seen = set()
    for t, age, pid, life in obs:
        now = T0 + t * 1_000_000
        held = h.observe(_snap(age, pid, life, now), now, INTERVAL_MS)
        assert held == h.held_out(), (case, t)
        if held:
            assert held == {0}
            seen.add(t)
    assert seen == held_at, case


def test_hysteresis_logs_one_line_each_way(caplog: pytest.LogCaptureFixture) -> None:
    h = WorkerHealth(1, pid_of=lambda k: 7)
    caplog.set_level(logging.INFO, "dplb.router")
    for t, age, pid, life in [*_fresh(0, 200), *_stale(300, 800), *_fresh(900, 2000)]:
        now = T0 + t * 1_000_000
        h.observe(_snap(age, pid, life, now), now, INTERVAL_MS)
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("is stale" in m for m in msgs) == 1 and sum("routing to it again" in m for m in msgs) == 1, msgs
    assert not h.watching and h.held_out() == frozenset()


def test_torn_slot_does_not_end_probation() -> None:
    h = WorkerHealth(1, pid_of=lambda k: 7)
    for t, age, pid, life in [*_fresh(0, 200), *_stale(300, 400)]:
        now = T0 + t * 1_000_000
        h.observe(_snap(age, pid, life, now), now, INTERVAL_MS)
    now = T0 + 2000 * 1_000_000
    torn = [WorkerState(0, pid=9, lifecycle=R, heartbeat_mono_ns=now, torn=True)]
    assert h.observe(torn, now, INTERVAL_MS) == {0}  # a torn read says nothing, not even "restarted"


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


F, OK = Outcome.UPSTREAM_5XX, Outcome.OK
# (case, outcomes on worker 0, ejected after them, ejections counted)
EJECTION = [
    ("MAX_FAILS failures in a row eject", [F] * MAX_FAILS, True, 1),
    ("one short of MAX_FAILS does not", [F] * (MAX_FAILS - 1), False, 0),
    ("a success resets the streak", [F, F, OK, F, F], False, 0),
    ("timeouts, broken and unanswered connections are failures",
     [Outcome.TIMEOUT, Outcome.BROKEN, Outcome.NO_ANSWER], True, 1),
    ("streams the worker failed with its own error event are failures", [Outcome.FAILED_STREAM] * MAX_FAILS, True,
     1),
    ("503 (queue full) and 4xx are not failures", [Outcome.FULL, Outcome.UPSTREAM_4XX] * 5, False, 0),
    ("503 and 4xx reset the streak", [F, F, Outcome.FULL, F, F, Outcome.UPSTREAM_4XX, F], False, 0),
    ("a draining refusal or an early client disconnect says nothing",
     [F, F, Outcome.DRAINING, Outcome.CLIENT_LEFT_EARLY, F], True, 1),
    ("a client leaving mid-response counts as an answer", [F, F, Outcome.CLIENT_LEFT, F, F], False, 0),
    ("a refused connection ejects at once (not counted as a failure ejection)", [Outcome.UNREACHABLE], True, 0),
    ("the streak starts over after an ejection", [F] * (MAX_FAILS + MAX_FAILS - 1), True, 1),
    ("failures while ejected (the streams a dead worker held, breaking one by one) eject it once",
     [F] * (4 * MAX_FAILS), True, 1),
]


@pytest.mark.parametrize(("case", "outcomes", "ejected", "counted"), EJECTION, ids=[c[0] for c in EJECTION])
def test_ejection(case: str, outcomes: list[Outcome], ejected: bool, counted: int) -> None:
    clock, ejections = Clock(), []
    h = WorkerHealth(2, pid_of=lambda k: 7, on_eject=ejections.append, clock=clock)
    for o in outcomes:
        h.report(0, o)
    snap = [WorkerState(0, pid=7), WorkerState(1, pid=8)]
    assert h.ejected(snap) == (frozenset({0}) if ejected else frozenset()), case
    assert h.any_ejected == ejected and ejections == [0] * counted, case
    clock.t += UNREACHABLE_S - 0.5
    assert h.ejected(snap) == (frozenset({0}) if ejected else frozenset()), case  # still out before
    clock.t += 0.5
    assert h.ejected(snap) == frozenset() and not h.any_ejected, case  # back after UNREACHABLE_S


def test_failures_count_again_once_the_ejection_ends_or_the_worker_restarted() -> None:
    clock, ejections, pid = Clock(), [], [7]
    h = WorkerHealth(1, pid_of=lambda k: pid[0], on_eject=ejections.append, clock=clock)
    for _ in range(2 * MAX_FAILS):
        h.report(0, F)
    assert ejections == [0]
    clock.t += UNREACHABLE_S  # over: a new streak ejects again
    for _ in range(MAX_FAILS):
        h.report(0, F)
    assert ejections == [0, 0]
    pid[0] = 9  # restarted while ejected: its failures are its own
    for _ in range(MAX_FAILS):
        h.report(0, F)
    assert ejections == [0, 0, 0]


def test_restart_lifts_an_ejection_early() -> None:
    clock = Clock()
    h = WorkerHealth(1, pid_of=lambda k: 7, clock=clock)
    h.report(0, Outcome.UNREACHABLE)
    assert h.ejected([WorkerState(0, pid=7)]) == {0}
    assert h.ejected([WorkerState(0, pid=0)]) == {0}  # an empty slot is not a restart
    assert h.ejected(None) == {0}  # without a segment: the deadline alone
    assert h.ejected([WorkerState(0, pid=9)]) == frozenset()  # a new process
    assert not h.any_ejected


@pytest.mark.parametrize(("status", "outcome"), [
    (200, Outcome.OK), (204, Outcome.OK), (302, Outcome.OK), (400, Outcome.UPSTREAM_4XX),
    (404, Outcome.UPSTREAM_4XX), (429, Outcome.UPSTREAM_4XX), (500, Outcome.UPSTREAM_5XX),
    (502, Outcome.UPSTREAM_5XX), (503, Outcome.FULL), (504, Outcome.UPSTREAM_5XX)])
def test_outcome_of_a_complete_response(status: int, outcome: Outcome) -> None:
    o = Outcome.of_status(status)
    assert o is outcome and o.reusable  # a complete response leaves the connection reusable
    assert o.recorded == ("ok" if status < 400 else "upstream_4xx" if status < 500 else "upstream_5xx")
    assert o.latency_sample == (status < 400)
    assert (o.verdict is Verdict.FAILURE) == (status >= 500 and status != 503)


def test_only_complete_responses_keep_the_connection_and_only_answered_attempts_are_timed() -> None:
    for o in Outcome:
        assert o.reusable == (o in (Outcome.OK, Outcome.UPSTREAM_4XX, Outcome.UPSTREAM_5XX, Outcome.FULL,
                                    Outcome.FAILED_STREAM)), o
    # Attempts that never reached the worker's answer phase record no duration.
    assert {o for o in Outcome if o.recorded is None} == {Outcome.UNREACHABLE, Outcome.DRAINING, Outcome.NO_ANSWER}


def test_the_same_snapshot_still_goes_stale() -> None:
    """Observing the very same states again changes nothing until a fresh worker's heartbeat passes the stale
    limit; then it is held out as if the snapshot were new."""
    h = WorkerHealth(1, lambda k: 7)
    snap = _snap(0.0, 7, R, T0)
    ms = 1_000_000
    for t in range(0, STALE_MS + 1, 50):
        assert h.observe(snap, T0 + t * ms, INTERVAL_MS) == frozenset()
    assert h.observe(snap, T0 + (STALE_MS + 1) * ms, INTERVAL_MS) == frozenset({0})
    assert h.observe(snap, T0 + (STALE_MS + 2) * ms, INTERVAL_MS) == frozenset({0})
