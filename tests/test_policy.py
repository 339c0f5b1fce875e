"""Scoring policy: hand-computed score tables, filters, ties, in-flight correction, affinity, baseline, config."""

from __future__ import annotations

from collections import Counter

import pytest

from dplb.config import PolicyConfig, parse_weights
from dplb.decision import (
    REASON_AFFINITY,
    REASON_ALL_OVER_CAP,
    REASON_NO_WORKERS,
    REASON_NONE_ROUTABLE,
    REASON_POLICY,
    REASON_SCORE,
)
from dplb.errors import ConfigError
from dplb.policy import make_policy
from dplb.shm import Lifecycle, WorkerState

NOW = 10**12  # monotonic ns used as "now" in every test
STEP = 10**9  # 1 s: a snapshot this much later counts every request sent before it (grace: half an interval)
GiB = 1 << 30


def ws(k: int, *, run: int = 0, wait: int = 0, kv: float = 0.0, lat: float = 0.0, life: Lifecycle = Lifecycle.READY,
       age_ms: float = 0.0, pid: int | None = None, used: int = 0, total: int = 0, hb: int | None = None,
       max_seqs: int = 0) -> WorkerState:
    """A published worker state; ``age_ms`` back-dates the heartbeat relative to NOW."""
    return WorkerState(
        k, pid=1000 + k if pid is None else pid, lifecycle=life,
        heartbeat_mono_ns=(NOW - int(age_ms * 1e6)) if hb is None else hb, num_running=run, num_waiting=wait,
        kv_cache_usage=kv, avg_latency_s=lat, gpu_memory_used_bytes=used, gpu_memory_total_bytes=total,
        max_num_seqs=max_seqs,
    )


def policy(name: str = "dplb", n: int = 4, baseline: float | None = None, **kw: object):  # type: ignore[no-untyped-def]
    p = make_policy(PolicyConfig(name=name, **kw), n)  # type: ignore[arg-type]
    if baseline is not None:
        for _ in range(50):
            p.observe_latency(baseline)
        assert p.baseline_s == baseline
    return p


# ---- hand-computed scores ------------------------------------------------------------------------------------
# (running, waiting, kv, avg_latency, baseline) -> (term_queue, term_memory, term_latency, score)
SCORE_TABLE = [
    # idle worker, no baseline: every term 1
    ((0, 0, 0.0, 0.0, None), (1.0, 1.0, 1.0, 1.0)),
    # queue 4 of 16, KV half used, latency half the baseline: .4·.75 + .3·.5 + .3·.5 = 0.6
    ((2, 2, 0.5, 1.0, 2.0), (0.75, 0.5, 0.5, 0.6)),
    # queue over the soft cap clamps to 0; latency above baseline clamps to 0; KV 0.9
    ((10, 10, 0.9, 5.0, 2.0), (0.0, 0.1, 0.0, 0.03)),
    # no baseline yet: latency term neutral (1) even for a slow worker
    ((8, 0, 0.25, 9.0, None), (0.5, 0.75, 1.0, 0.2 + 0.225 + 0.3)),
    # baseline exists but the worker has served nothing yet: neutral
    ((0, 4, 1.0, 0.0, 3.0), (0.75, 0.0, 1.0, 0.3 + 0.0 + 0.3)),
]


@pytest.mark.parametrize(("inputs", "want"), SCORE_TABLE)
def test_score_table(inputs: tuple, want: tuple) -> None:  # type: ignore[type-arg]
    run, wait, kv, lat, base = inputs
    p = policy(n=1, baseline=base)
    d = p.pick([ws(0, run=run, wait=wait, kv=kv, lat=lat)], NOW)
    c = d.candidates[0]
    assert (c.term_queue, c.term_memory, c.term_latency) == pytest.approx(want[:3])
    assert c.score == pytest.approx(want[3])
    assert d.worker == 0 and d.reason == REASON_SCORE


def test_gpu_memory_signal_uses_nvml_ratio() -> None:
    p = policy(n=2, memory_signal="gpu")
    d = p.pick([ws(0, kv=0.0, used=72 * GiB, total=80 * GiB), ws(1, kv=0.9, used=40 * GiB, total=80 * GiB)], NOW)
    c0, c1 = d.candidates
    assert c0.memory_ratio == pytest.approx(0.9) and c0.term_memory == pytest.approx(0.1)
    assert c1.term_memory == pytest.approx(0.5)
    assert d.worker == 1  # KV says worker 0, NVML says worker 1
    # no GPU (total 0): neutral memory term
    d = policy(n=1, memory_signal="gpu").pick([ws(0)], NOW)
    assert d.candidates[0].term_memory == 1.0


def test_best_score_wins() -> None:
    p = policy(n=3, baseline=1.0)
    snap = [ws(0, run=8, kv=0.5, lat=0.5), ws(1, run=1, kv=0.2, lat=0.4), ws(2, run=1, kv=0.9, lat=2.0)]
    d = p.pick(snap, NOW)
    scores = [c.score for c in d.candidates]
    assert scores == pytest.approx([0.4 * 0.5 + 0.3 * 0.5 + 0.3 * 0.5, 0.4 * 15 / 16 + 0.3 * 0.8 + 0.3 * 0.6,
                                    0.4 * 15 / 16 + 0.3 * 0.1 + 0.0])
    assert d.worker == 1 and d.ranked() == [1, 0, 2]  # 0.795 > 0.5 > 0.405


def test_max_queue_from_worker() -> None:
    p = policy(n=1, max_queue_from_worker=True)
    c = p.pick([ws(0, run=64, max_seqs=256)], NOW).candidates[0]
    assert c.max_queue == 256 and c.term_queue == pytest.approx(0.75)


# ---- filters and no-choice reasons ---------------------------------------------------------------------------
def test_empty_segment_means_no_workers() -> None:
    d = policy(n=4).pick([WorkerState(k) for k in range(4)], NOW)
    assert d.worker is None and d.reason == REASON_NO_WORKERS
    assert {c.why for c in d.candidates} == {"unregistered"}


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        (ws(0, age_ms=601), "stale"),
        (ws(0, life=Lifecycle.DRAINING), "draining"),
        (ws(0, life=Lifecycle.WARMING), "not_ready"),
        (ws(0, life=Lifecycle.STARTING), "not_ready"),
        (ws(0, life=Lifecycle.STOPPED), "not_ready"),
        (WorkerState(0, pid=5, lifecycle=Lifecycle.READY, heartbeat_mono_ns=NOW, torn=True), "torn"),
    ],
)
def test_ineligible_workers_are_never_picked(bad: WorkerState, why: str) -> None:
    p = policy(n=2)
    # the bad worker is idle, the good one is loaded: the bad one would win on score
    for _ in range(10):
        d = p.pick([bad, ws(1, run=15, kv=0.95)], NOW)
        assert d.worker == 1
        assert d.candidates[0].why == why and not d.candidates[0].eligible
    d = p.pick([bad, ws(1, life=Lifecycle.DRAINING)], NOW)
    assert d.worker is None and d.reason == REASON_NONE_ROUTABLE


def test_stale_boundary_is_three_intervals() -> None:
    p = policy(n=1, state_interval_ms=200)
    assert p.pick([ws(0, age_ms=600)], NOW).worker == 0
    assert p.pick([ws(0, age_ms=600.001)], NOW).worker is None


def test_hard_cap_excludes_and_reports_all_over_cap() -> None:
    p = policy(n=2, hard_queue_cap=8)
    d = p.pick([ws(0, run=8), ws(1, run=7)], NOW)
    assert d.worker == 1 and d.candidates[0].why == "over_cap"
    d = p.pick([ws(0, run=8), ws(1, run=9)], NOW)
    assert d.worker is None and d.reason == REASON_ALL_OVER_CAP


def test_exclude_for_retry() -> None:
    p = policy(n=3)
    d = p.pick([ws(0), ws(1, run=5), ws(2, run=9)], NOW, exclude={0})
    assert d.worker == 1 and d.candidates[0].why == "excluded"


# ---- ties, the in-flight correction and bursts ---------------------------------------------------------------
def test_ties_rotate_over_equal_workers() -> None:
    p = policy(n=4)
    seen = []
    for i in range(8):
        snap = [ws(k, hb=NOW - i) for k in range(4)]  # new heartbeat each time: correction reset, all tied
        seen.append(p.pick(snap, NOW).worker)
    assert Counter(seen) == {0: 2, 1: 2, 2: 2, 3: 2}


@pytest.mark.parametrize("name", ["dplb", "least_loaded"])
def test_burst_of_64_on_unchanged_snapshots_spreads_16_each(name: str) -> None:
    """64 picks inside one publish window: only the in-flight correction tells workers apart."""
    p = policy(name, n=4)
    snap = [ws(k) for k in range(4)]
    counts = Counter(p.pick(snap, NOW).worker for _ in range(64))
    assert all(15 <= counts[k] <= 17 for k in range(4)), counts


def test_correction_counts_until_a_newer_snapshot() -> None:
    p = policy(n=2)
    snap = [ws(0), ws(1, run=3)]
    assert [p.pick(snap, NOW).worker for _ in range(3)] == [0, 0, 0]  # 0 reaches queue 3
    assert p.correction(0) == 3
    d = p.pick(snap, NOW)  # tied at 3: rotation decides
    assert d.candidates[0].queue == 3 and d.candidates[0].correction == 3
    # A snapshot taken right after the sends may not count them yet (in a socket, being parsed): they stay.
    c0 = p.correction(0)
    assert c0 >= 3
    just_after = [ws(0, run=1, hb=NOW + 1), ws(1, run=3, hb=NOW + 1)]
    assert p.pick(just_after, NOW + 1).candidates[0].correction == c0
    # One taken more than half a state interval (100 ms) after them counts them: the correction is forgotten.
    later = NOW + STEP
    d = p.pick([ws(0, run=1, hb=later), ws(1, run=3, hb=later)], later)
    assert d.candidates[0].correction == 0 and d.candidates[0].queue == 1 and d.worker == 0
    assert p.correction(0) == 1  # that last pick, sent after the snapshot


# ---- latency baseline ----------------------------------------------------------------------------------------
def test_baseline_is_p95_nearest_rank_and_freezes_after_50() -> None:
    p = policy(n=1)
    for i in range(1, 50):
        p.observe_latency(float(i))
        assert p.baseline_s is None
    p.observe_latency(50.0)
    assert p.baseline_s == 48.0  # ceil(0.95·50) = 48th smallest of 1..50
    for _ in range(100):
        p.observe_latency(1000.0)
    assert p.baseline_s == 48.0
    d = p.pick([ws(0, run=1, lat=24.0)], NOW)
    assert d.baseline_s == 48.0 and d.candidates[0].term_latency == pytest.approx(0.5)


def test_baseline_ignores_nonsense() -> None:
    p = policy(n=1, baseline_window=2)
    for x in (float("nan"), float("inf"), -1.0, 0.0):
        p.observe_latency(x)
    assert p.baseline_s is None


# ---- prefix affinity -----------------------------------------------------------------------------------------
def test_affinity_sticks_within_margin_and_yields_beyond_it() -> None:
    p = policy(n=4, affinity_margin=0.1)
    snap = [ws(k) for k in range(4)]
    first = p.pick(snap, NOW, prefix_hash=42)
    assert first.reason == REASON_SCORE  # a new prefix goes where the score says, and is remembered there
    pref = first.worker
    assert first.preferred == pref
    # stays while within the margin: 0.1 of score = 0.25 of the queue term = 4 requests on max_queue 16
    later = [p.pick([ws(k, hb=NOW + i * STEP) for k in range(4)], NOW + i * STEP, prefix_hash=42) for i in range(1, 5)]
    assert all(d.worker == pref and d.reason == REASON_AFFINITY for d in later)
    loaded = [ws(k, run=(5 if k == pref else 0), hb=NOW + 6 * STEP) for k in range(4)]  # preferred 0.125 behind
    d = p.pick(loaded, NOW + 6 * STEP, prefix_hash=42)
    assert d.worker != pref and d.reason == REASON_SCORE and d.preferred == pref
    # the prefix still lives on its first worker: back there once it is within the margin again
    assert p.pick([ws(k, hb=NOW + 7 * STEP) for k in range(4)], NOW + 7 * STEP, prefix_hash=42).worker == pref


def test_unique_prefixes_never_trade_load_for_affinity() -> None:
    """Requests whose prefix was never seen (no shared system prompt) go to the best score, exactly as without
    affinity: 49 distinct prefixes, each on a fresh snapshot where worker 2 is less loaded, all go to worker 2."""
    fresh = policy(n=4, affinity_margin=0.1)
    picks = [fresh.pick([ws(k, run=(0 if k == 2 else 3), hb=NOW + h * STEP) for k in range(4)], NOW + h * STEP,
                        prefix_hash=h) for h in range(1, 50)]
    assert all(d.worker == 2 and d.reason == REASON_SCORE for d in picks)


def test_affinity_spreads_new_prefixes_by_load_and_memory_is_bounded() -> None:
    from dplb.policy import AFFINITY_PREFIXES

    p = policy(n=4)
    snap = [ws(k) for k in range(4)]
    prefs = [p.pick(snap, NOW, prefix_hash=h).worker for h in range(400)]  # one snapshot: the correction spreads
    assert all(c == 100 for c in Counter(prefs).values()), Counter(prefs)
    # each prefix returns to its worker
    again = [p.pick([ws(k, hb=NOW + 1) for k in range(4)], NOW + 1, prefix_hash=h).worker for h in range(400)]
    assert again == prefs
    for h in range(10_000, 10_000 + 2 * AFFINITY_PREFIXES):
        p.pick(snap, NOW, prefix_hash=h)
    assert len(p._owner) == AFFINITY_PREFIXES  # type: ignore[attr-defined]


def test_owner_gone_moves_the_prefix() -> None:
    p = policy(n=3)
    first = p.pick([ws(k) for k in range(3)], NOW, prefix_hash=7).worker
    gone = [ws(k, life=(Lifecycle.DRAINING if k == first else Lifecycle.READY), hb=NOW + 1) for k in range(3)]
    moved = p.pick(gone, NOW + 1, prefix_hash=7)
    assert moved.worker != first
    back = [ws(k, hb=NOW + 2) for k in range(3)]
    assert p.pick(back, NOW + 2, prefix_hash=7).worker == moved.worker  # it now lives on the new worker


def test_prefix_hash_policy_is_pure_affinity() -> None:
    a, b = policy("prefix_hash", n=4), policy("prefix_hash", n=4)
    snap = [ws(k) for k in range(4)]
    prefs = [a.pick(snap, NOW, prefix_hash=h).worker for h in range(400)]
    assert prefs == [b.pick(snap, NOW, prefix_hash=h).worker for h in range(400)]  # same in every process
    assert all(60 <= c <= 140 for c in Counter(prefs).values()), Counter(prefs)
    loaded = [ws(k, run=(12 if k == prefs[0] else 0)) for k in range(4)]
    assert a.pick(loaded, NOW, prefix_hash=0).worker == prefs[0]  # blind to load


def test_affinity_disabled_with_zero_margin() -> None:
    p = policy(n=2, affinity_margin=0.0)
    assert p.pick([ws(0), ws(1)], NOW, prefix_hash=7).reason == REASON_SCORE


# ---- other policies ------------------------------------------------------------------------------------------
def test_round_robin_cycles_and_skips_ineligible() -> None:
    p = policy("round_robin", n=3)
    snap = [ws(0), ws(1, life=Lifecycle.DRAINING), ws(2, run=100)]
    assert [p.pick(snap, NOW).worker for _ in range(4)] == [0, 2, 0, 2]
    assert p.pick(snap, NOW).reason == REASON_POLICY


def test_least_loaded_uses_four_waiting_plus_running() -> None:
    p = policy("least_loaded", n=2)
    # worker 0: 4·1 + 0 = 4; worker 1: 4·0 + 3 = 3
    assert p.pick([ws(0, wait=1), ws(1, run=3)], NOW).worker == 1


def test_power_of_two_takes_the_shorter_of_two() -> None:
    p = policy("power_of_two", n=2, seed=3)
    assert {p.pick([ws(0, run=9, hb=NOW + i * STEP), ws(1, run=1, hb=NOW + i * STEP)], NOW + i * STEP).worker
            for i in range(20)} == {1}


def test_random_is_seeded_and_uses_all() -> None:
    a = [policy("random", n=4, seed=1).pick([ws(k) for k in range(4)], NOW).worker for _ in range(1)]
    p, q = policy("random", n=4, seed=1), policy("random", n=4, seed=1)
    sa = [p.pick([ws(k) for k in range(4)], NOW).worker for _ in range(100)]
    sb = [q.pick([ws(k) for k in range(4)], NOW).worker for _ in range(100)]
    assert sa == sb and set(sa) == {0, 1, 2, 3} and a[0] == sa[0]


def test_fallback_without_state_is_least_inflight() -> None:
    p = policy(n=3)
    assert p.pick_without_state([3, 1, 2]) == 1
    assert p.pick_without_state([3, 1, 2], exclude={1}) == 2
    with pytest.raises(LookupError):
        p.pick_without_state([0, 0], exclude={0, 1})


def test_decision_to_dict_has_every_input() -> None:
    d = policy(n=2, baseline=1.0).pick([ws(0, run=1, kv=0.2, lat=0.5), ws(1, life=Lifecycle.WARMING)], NOW)
    out = d.to_dict()
    c0 = out["candidates"][0]  # type: ignore[index]
    for key in ("num_running", "num_waiting", "correction", "queue", "kv_cache_usage", "gpu_memory_used_bytes",
                "avg_latency_s", "term_queue", "term_memory", "term_latency", "score", "why", "state_age_s"):
        assert key in c0
    assert out["worker"] == 0 and out["baseline_s"] == 1.0
    assert out["candidates"][1]["lifecycle"] == "warming"  # type: ignore[index]


# ---- configuration -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"weights": (0.5, 0.3, 0.3)}, "sum to 1"),
        ({"weights": (1.2, -0.1, -0.1)}, "≥ 0"),
        ({"max_queue": -1}, "max_queue"),
        ({"max_queue": 0}, "max_queue"),
        ({"hard_queue_cap": -3}, "hard_queue_cap"),
        ({"baseline_window": 0}, "baseline_window"),
        ({"memory_signal": "nvml"}, "memory_signal"),
        ({"affinity_margin": 2.0}, "affinity_margin"),
        ({"name": "fastest"}, "unknown"),
        ({"state_interval_ms": 0}, "state_interval_ms"),
    ],
)
def test_invalid_config_refused(kw: dict, needle: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ConfigError, match=needle):
        PolicyConfig(**kw)


def test_parse_weights() -> None:
    assert parse_weights("0.5,0.25,0.25") == (0.5, 0.25, 0.25)
    for bad in ("0.4,0.3", "a,b,c", ""):
        with pytest.raises(ConfigError):
            parse_weights(bad)


# ---- regressions -------------------------------------------------------------------------------------------------
def test_restarted_worker_does_not_attract_the_whole_burst() -> None:
    """Regression (fresh-eyes trial): after `kill -9` + restart, 173 of 200 requests herded onto the fresh worker —
    its latency term was 1 (only the warm-up was measured) while loaded peers were at 0, and queues past max_queue
    all scored 0. Now a worker without a latency sample gets its peers' mean term and ties go to the shorter queue,
    so the burst evens out the total queues."""
    p = policy(n=4, baseline=2.0)
    snap = [ws(k, run=20, lat=8.0) for k in range(3)] + [ws(3)]  # worker 3: fresh, no latency sample, idle
    counts = Counter(p.pick(snap, NOW).worker for _ in range(200))
    queues = [20 + counts[k] for k in range(3)] + [counts[3]]
    assert max(queues) - min(queues) <= 1, (counts, queues)
    assert counts[3] == 65  # 20 to catch up with its peers, then a quarter of the remaining 180


def test_equal_scores_past_the_soft_cap_prefer_the_shorter_queue() -> None:
    p = policy(n=2)
    for _ in range(5):
        assert p.pick([ws(0, run=30, hb=NOW - 1), ws(1, run=20, hb=NOW - 1)], NOW).worker == 1


def test_fresh_worker_latency_term_is_the_peers_mean() -> None:
    p = policy(n=3, baseline=2.0, latency_deadband=0.0)
    d = p.pick([ws(0, run=1, lat=1.0), ws(1, run=1, lat=1.5), ws(2)], NOW)
    assert [c.term_latency for c in d.candidates] == pytest.approx([0.5, 0.25, 0.375])
    assert d.candidates[2].score == pytest.approx(0.4 + 0.3 + 0.3 * 0.375)  # idle and sample-less: neutral


def test_ttft_latency_signal_uses_ttft_and_its_own_baseline() -> None:
    """--latency-signal ttft: the term is 1 − avg_ttft/baseline, the baseline the P95 of observed TTFTs."""
    p = make_policy(PolicyConfig(latency_signal="ttft"), 2)
    for _ in range(50):
        p.observe_latency(9.0)  # E2E only (no body byte): not a TTFT sample
    assert p.baseline_s is None
    for _ in range(50):
        p.observe_latency(9.0, 0.2)
    assert p.baseline_s == 0.2
    snap = [WorkerState(k, pid=1000 + k, lifecycle=Lifecycle.READY, heartbeat_mono_ns=NOW, avg_latency_s=1.0,
                        avg_ttft_s=0.05 * (k + 1), num_running=1) for k in range(2)]
    terms = [c.term_latency for c in p.pick(snap, NOW).candidates]
    assert terms == pytest.approx([0.75, 0.5])
    with pytest.raises(ConfigError):
        PolicyConfig(latency_signal="tpot")  # type: ignore[arg-type]


def test_latency_deadband_equal_workers_share_a_burst_evenly() -> None:
    """Equal workers whose mean latencies differ by noise (±20 %) split a 24-request burst 6/6/6/6 with the
    default deadband; without it the luckiest worker takes more (the bursty benchmark's P99 suffered)."""
    lats = (1.0, 1.25, 0.8, 1.1)
    snap = [ws(k, run=1, lat=lat) for k, lat in enumerate(lats)]
    with_band = policy(n=4, baseline=2.0)
    assert Counter(with_band.pick(snap, NOW).worker for _ in range(24)) == {0: 6, 1: 6, 2: 6, 3: 6}
    no_band = policy(n=4, baseline=2.0, latency_deadband=0.0)
    assert max(Counter(no_band.pick(snap, NOW).worker for _ in range(24)).values()) >= 7


def test_latency_deadband_keeps_a_really_slower_worker_apart() -> None:
    p = policy(n=4, baseline=2.0)
    d = p.pick([ws(0, run=1, lat=1.0), ws(1, run=1, lat=1.1), ws(2, run=1, lat=0.95), ws(3, run=1, lat=2.0)], NOW)
    terms = [c.term_latency for c in d.candidates]
    mean = (1.0 + 1.1 + 0.95 + 2.0) / 4  # 1.2625: band ±0.316 holds workers 0–2, not the half-speed worker 3
    assert terms[:3] == pytest.approx([1 - mean / 2.0] * 3)
    assert terms[3] == pytest.approx(0.0)
    with pytest.raises(ConfigError):
        PolicyConfig(latency_deadband=1.0)


def test_idle_worker_with_an_old_slow_mean_is_not_starved() -> None:
    """Regression (hardening): a worker whose last requests were slow kept that mean while idle (it only changes
    with new requests), so under light load it got no traffic at all. Idle, it now gets the peers' latency term."""
    p = policy(n=3, baseline=2.0)
    snap = [ws(0, lat=4.0), ws(1, run=1, lat=1.0), ws(2, run=1, lat=1.0)]
    d = p.pick(snap, NOW)
    assert d.worker == 0
    assert [c.term_latency for c in d.candidates] == pytest.approx([0.5, 0.5, 0.5])
    busy = p.pick([ws(0, run=1, lat=4.0, hb=NOW + 1), ws(1, run=1, lat=1.0, hb=NOW + 1),
                   ws(2, run=1, lat=1.0, hb=NOW + 1)], NOW + 1)
    assert busy.worker != 0 and busy.candidates[0].term_latency == 0.0  # with work queued, its own mean counts
