"""The policy end to end (seed weights): hand-computed score tables, filters, ties, in-flight correction, baseline,
profiles, config. Per-plugin tables are beside it: tests/test_filters.py, tests/test_scorers.py, tests/test_prefix.py."""

from __future__ import annotations

from collections import Counter

import pytest

from dplb.config import PREFIX_WEIGHTS, SEED_WEIGHTS, PolicyConfig, parse_weights
from dplb.errors import ConfigError
from dplb.policy import RouteRequest, make_policy
from dplb.policy.decision import (
    REASON_AFFINITY,
    REASON_ALL_OVER_CAP,
    REASON_NO_WORKERS,
    REASON_NONE_ROUTABLE,
    REASON_POLICY,
    REASON_SCORE,
    Decision,
)
from dplb.policy.prefix import block_hashes
from dplb.state.shm import Lifecycle, WorkerState

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
    kw.setdefault("prefix_block_bytes", 0)  # the seed's three terms and weights unless a test asks for prefixes
    p = make_policy(PolicyConfig(name=name, **kw), n)  # type: ignore[arg-type]
    if baseline is not None:
        for _ in range(50):
            p.observe_latency(baseline)
        assert p.baseline_s == baseline
    return p


def latency_terms(d: Decision) -> list[float]:
    return [d.terms(c)["latency"] for c in d.candidates]


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
    assert list(d.terms(c).values()) == pytest.approx(want[:3])
    assert c.score == pytest.approx(want[3])
    assert d.worker == 0 and d.reason == REASON_SCORE


def test_gpu_memory_signal_uses_nvml_ratio() -> None:
    p = policy(n=2, memory_signal="gpu")
    d = p.pick([ws(0, kv=0.0, used=72 * GiB, total=80 * GiB), ws(1, kv=0.9, used=40 * GiB, total=80 * GiB)], NOW)
    c0, c1 = d.to_dict()["candidates"]  # type: ignore[misc]
    assert c0["memory_ratio"] == pytest.approx(0.9) and c0["terms"]["memory"] == pytest.approx(0.1)
    assert c1["terms"]["memory"] == pytest.approx(0.5)
    assert d.worker == 1  # KV says worker 0, NVML says worker 1
    # no GPU (total 0): neutral memory term
    d = policy(n=1, memory_signal="gpu").pick([ws(0)], NOW)
    assert d.terms(d.candidates[0])["memory"] == 1.0


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
    c = p.pick([ws(0, run=64, max_seqs=256)], NOW).to_dict()["candidates"][0]  # type: ignore[index]
    assert c["max_queue"] == 256 and c["terms"]["queue"] == pytest.approx(0.75)


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
    d = p.pick([ws(0), ws(1, run=5), ws(2, run=9)], NOW, RouteRequest(exclude=frozenset({0})))
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


def test_correction_never_exceeds_the_routers_own_inflight() -> None:
    """Regression: three quick sequential requests inside one state interval counted as three queued requests
    although all had completed (the router's in-flight was 0), so a conversation's next turn spilled away from the
    worker holding its history. The correction is capped by the router's own in-flight count."""
    p = policy(n=2)
    snap = [ws(0), ws(1)]
    for _ in range(3):
        p.pick(snap, NOW, inflight=[0, 0])
    assert p.correction(0) + p.correction(1) == 3  # the send log still has them
    d = p.pick(snap, NOW, inflight=[0, 0])
    assert [c.correction for c in d.candidates] == [0, 0]  # nothing is open: nothing uncounted can be queued
    d = p.pick(snap, NOW, inflight=[1, 0])
    assert d.candidates[0].correction == 1 and d.candidates[0].queue == 1


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
    assert d.baseline_s == 48.0 and latency_terms(d) == pytest.approx([0.5])


def test_baseline_ignores_nonsense() -> None:
    p = policy(n=1, baseline_window=2)
    for x in (float("nan"), float("inf"), -1.0, 0.0):
        p.observe_latency(x)
    assert p.baseline_s is None


# ---- prefix profiles ------------------------------------------------------------------------------------------
def blocks(conv: int, turns: int = 1) -> bytes:
    """Raw ``messages`` of a chat prompt: one 1 KB system prompt shared by every conversation, then ``turns``
    turns."""
    body = b'[{"role":"system","content":"' + b"You are helpful. " * 60 + b'"}'
    for t in range(turns):
        body += f',{{"role":"user","content":"conversation {conv} turn {t} '.encode() + b"words " * 40 + b'"}'
    return body + b"]"


def test_dplb_profile_sends_a_conversations_next_turn_to_its_history() -> None:
    """40 conversations × 3 turns on 4 equal workers; each turn's 40 requests are in flight together (every
    snapshot publishes the queue so far). Turn 1: the shared system prompt first pulls new conversations to the
    worker that has it, until its queue makes it spill (the headroom rule), so every worker soon has it and load
    decides. Later turns go back to the worker holding their history; queues stay within the spill bound."""
    p = policy(n=4, prefix_block_bytes=128)
    home: dict[int, int] = {}
    hb = NOW
    outcomes: Counter[str] = Counter()
    for turn in range(1, 4):
        queue = [0, 0, 0, 0]
        for conv in range(40):
            hb += STEP
            d = p.pick([ws(k, run=queue[k], hb=hb) for k in range(4)], hb, RouteRequest(blocks(conv, turn)))
            assert d.worker is not None
            queue[d.worker] += 1
            if turn > 1:  # home: where its history (the previous turn) went
                outcomes["home" if d.worker == home[conv] else "moved"] += 1
                outcomes[str(d.prefix_outcome())] += 1
            home[conv] = d.worker
        assert max(queue) - min(queue) <= 8, (turn, queue)  # ~8 queued is where a full match spills
    assert outcomes["home"] >= 72 and outcomes["hit"] >= 72, outcomes  # ≥ 90 % of the 80 later turns


def test_prefix_hash_profile_is_pure_affinity() -> None:
    a, b = policy("prefix_hash", n=4, prefix_block_bytes=128), policy("prefix_hash", n=4, prefix_block_bytes=128)
    snap = [ws(k) for k in range(4)]
    reqs = [f"prompt {h} ".encode() * 40 for h in range(400)]
    prefs = [a.pick(snap, NOW, RouteRequest(r)).worker for r in reqs]
    assert prefs == [b.pick(snap, NOW, RouteRequest(r)).worker for r in reqs]  # same in every process
    assert all(60 <= c <= 140 for c in Counter(prefs).values()), Counter(prefs)
    loaded = [ws(k, run=(12 if k == prefs[0] else 0)) for k in range(4)]
    d = a.pick(loaded, NOW, RouteRequest(reqs[0]))
    assert d.worker == prefs[0] and d.reason == REASON_AFFINITY and d.preferred == prefs[0]  # blind to load
    assert a.pick(snap, NOW).reason == REASON_POLICY  # no prefix key: rotation


PREFIX_HASH = [  # (config kwargs, prompt, key blocks at block size) — prefix_hash hashes the raw prompt itself
    ({}, b"p" * 1000, (2, 128)),
    ({}, b"p" * 200, (1, 128)),  # one full block: its key
    ({"params": (("prefix_hash", "blocks", "1"),)}, b"p" * 1000, (1, 128)),
    ({"params": (("prefix_hash", "block_bytes", "64"),)}, b"p" * 1000, (2, 64)),
    ({"prefix_block_bytes": 64, "weights": (("queue", 1.0),)}, b"p" * 1000, (2, 64)),  # the older flag, no prefix term
    ({}, b"p" * 100, None),  # no full block: rotation
    ({"prefix_block_bytes": 0}, b"p" * 1000, None),  # prefix off: rotation
]


@pytest.mark.parametrize(("kw", "prompt", "key"), PREFIX_HASH)
def test_prefix_hash_picker_table(kw: dict, prompt: bytes, key: tuple[int, int] | None) -> None:  # type: ignore[type-arg]
    p = policy("prefix_hash", n=4, **{"prefix_block_bytes": 128, **kw})
    d = p.pick([ws(k) for k in range(4)], NOW, RouteRequest(prompt))
    if key is None:
        assert d.reason == REASON_POLICY and d.preferred is None
        return
    n, bb = key
    k = block_hashes(prompt, bb)[n - 1]
    assert d.reason == REASON_AFFINITY and d.worker == d.preferred == max(range(4), key=lambda w: hash((k, w)))


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
                "avg_latency_s", "avg_ttft_s", "max_queue", "memory_ratio", "latency_s", "baseline_s", "score", "why",
                "state_age_s", "lifecycle"):
        assert key in c0
    assert set(c0["terms"]) == {"queue", "memory", "latency"}  # type: ignore[index]
    assert out["weights"] == {"queue": 0.4, "memory": 0.3, "latency": 0.3}
    assert out["worker"] == 0 and out["baseline_s"] == 1.0
    assert out["candidates"][1]["lifecycle"] == "warming"  # type: ignore[index]


# ---- configuration -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"weights": (("queue", 0.5), ("memory", 0.3), ("latency", 0.3))}, "sum to 1"),
        ({"weights": (("queue", 1.2), ("memory", -0.1), ("latency", -0.1))}, "≥ 0"),
        ({"weights": (("queue", 0.5), ("queue", 0.5))}, "once"),
        ({"weights": (("queue", 0.5), ("prefix", 0.5)), "prefix_block_bytes": 0}, "prefix-block-bytes"),
        ({"prefix_block_bytes": -1}, "prefix-block-bytes"),
        ({"prefix_index_blocks": 0}, "prefix-index-blocks"),
        ({"prefix_ttl_s": 0.0}, "prefix-ttl"),
        ({"max_queue": -1}, "max_queue"),
        ({"max_queue": 0}, "max_queue"),
        ({"hard_queue_cap": -3}, "hard_queue_cap"),
        ({"baseline_window": 0}, "baseline_window"),
        ({"memory_signal": "nvml"}, "memory_signal"),
        ({"name": "fastest"}, "unknown"),
        ({"state_interval_ms": 0}, "state-interval-ms"),
        ({"state_interval_ms": 60_001}, "state-interval-ms"),
    ],
)
def test_invalid_config_refused(kw: dict, needle: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ConfigError, match=needle):
        PolicyConfig(**kw)


def test_parse_weights() -> None:
    seed = (("queue", 0.5), ("memory", 0.25), ("latency", 0.25))
    assert parse_weights("0.5,0.25,0.25") == seed  # positional: the seed's three terms
    assert parse_weights("queue=0.5, memory=0.25,latency=0.25") == seed
    assert parse_weights("queue=0.3,memory=0.2,latency=0.2,prefix=0.3")[-1] == ("prefix", 0.3)
    for bad in ("0.4,0.3", "a,b,c", "", "queue=x", "=0.5", "queue=0.5,0.5"):
        with pytest.raises(ConfigError):
            parse_weights(bad)


def test_unknown_scorer_is_refused_when_the_policy_is_built() -> None:
    with pytest.raises(ConfigError, match=r"unknown scorer 'speed'; known: (.*, )?latency, memory, (.*, )?prefix, (.*, )?queue"):
        make_policy(PolicyConfig(weights=(("queue", 0.5), ("speed", 0.5))), 2)


def test_default_weights_follow_prefix_scoring() -> None:
    assert PolicyConfig().effective_weights() == PREFIX_WEIGHTS and PolicyConfig().prefix_on
    off = PolicyConfig(prefix_block_bytes=0)
    assert off.effective_weights() == SEED_WEIGHTS == (("queue", 0.4), ("memory", 0.3), ("latency", 0.3))
    assert not off.prefix_on
    assert abs(sum(w for _, w in PREFIX_WEIGHTS) - 1.0) < 1e-9


# ---- regressions -------------------------------------------------------------------------------------------------
def test_restarted_worker_does_not_attract_the_whole_burst() -> None:
    """Regression: after `kill -9` + restart, 173 of 200 requests herded onto the fresh worker —
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


def test_burst_past_the_soft_cap_follows_the_corrected_queue() -> None:
    """Regression: with every queue past max_queue (16) every queue term was 0, so the latency term alone decided
    and the same worker won every pick of a burst inside one snapshot: the router's /debug/decisions showed a
    worker with 189 queued chosen over one with 20 (latency terms 0.605 vs 0), all 300 picks. The queue term is now
    ``1 − q/max(max_queue, longest eligible queue)``: worker 0 takes the burst until the faster worker's latency
    advantage balances the queue ratio, then they share it at that ratio — 0.4·(1 − q0/q1) = 0.3·Δlatency +
    0.3·Δmemory."""
    p = policy(n=2, baseline=2.0)
    snap = [ws(0, run=20, kv=0.0005, lat=2.4), ws(1, run=189, lat=0.79)]  # latency terms 0 and 0.605
    d = p.pick(snap, NOW)
    assert latency_terms(d) == pytest.approx([0.0, 0.605])
    assert d.worker == 0
    counts = Counter([0]) + Counter(p.pick(snap, NOW).worker for _ in range(299))
    q0, q1 = 20 + counts[0], 189 + counts[1]
    assert p.correction(0) == counts[0] and p.correction(1) == counts[1]
    balance = 1 - (0.3 * 0.605 + 0.3 * 0.0005) / 0.4  # the queue ratio where the terms even out: 0.546
    assert 150 <= counts[0] <= 170, counts  # before the fix: 0 of 300
    assert balance - 0.01 <= q0 / q1 <= balance + 0.01, (q0, q1)


def test_fresh_worker_latency_term_is_the_peers_mean() -> None:
    p = policy(n=3, baseline=2.0, latency_deadband=0.0)
    d = p.pick([ws(0, run=1, lat=1.0), ws(1, run=1, lat=1.5), ws(2)], NOW)
    assert latency_terms(d) == pytest.approx([0.5, 0.25, 0.375])
    assert d.candidates[2].score == pytest.approx(0.4 + 0.3 + 0.3 * 0.375)  # idle and sample-less: neutral


def test_ttft_latency_signal_uses_ttft_and_its_own_baseline() -> None:
    """--latency-signal ttft: the term is 1 − avg_ttft/baseline, the baseline the P95 of observed TTFTs."""
    p = make_policy(PolicyConfig(latency_signal="ttft", prefix_block_bytes=0), 2)
    for _ in range(50):
        p.observe_latency(9.0)  # E2E only (no body byte): not a TTFT sample
    assert p.baseline_s is None
    for _ in range(50):
        p.observe_latency(9.0, 0.2)
    assert p.baseline_s == 0.2
    snap = [WorkerState(k, pid=1000 + k, lifecycle=Lifecycle.READY, heartbeat_mono_ns=NOW, avg_latency_s=1.0,
                        avg_ttft_s=0.05 * (k + 1), num_running=1) for k in range(2)]
    assert latency_terms(p.pick(snap, NOW)) == pytest.approx([0.75, 0.5])
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
    terms = latency_terms(d)
    mean = (1.0 + 1.1 + 0.95 + 2.0) / 4  # 1.2625: band ±0.316 holds workers 0–2, not the half-speed worker 3
    assert terms[:3] == pytest.approx([1 - mean / 2.0] * 3)
    assert terms[3] == pytest.approx(0.0)
    with pytest.raises(ConfigError):
        PolicyConfig(latency_deadband=1.0)


def test_idle_worker_with_an_old_slow_mean_is_not_starved() -> None:
    """Regression: a worker whose last requests were slow kept that mean while idle (it only changes
    with new requests), so under light load it got no traffic at all. Idle, it now gets the peers' latency term."""
    p = policy(n=3, baseline=2.0)
    snap = [ws(0, lat=4.0), ws(1, run=1, lat=1.0), ws(2, run=1, lat=1.0)]
    d = p.pick(snap, NOW)
    assert d.worker == 0
    assert latency_terms(d) == pytest.approx([0.5, 0.5, 0.5])
    busy = p.pick([ws(0, run=1, lat=4.0, hb=NOW + 1), ws(1, run=1, lat=1.0, hb=NOW + 1),
                   ws(2, run=1, lat=1.0, hb=NOW + 1)], NOW + 1)
    assert busy.worker != 0 and latency_terms(busy)[0] == 0.0  # with work queued, its own mean counts
