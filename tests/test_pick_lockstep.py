"""The policy's fast paths against its general path, in lock step: the built-in scorer set in fewer passes
(:mod:`dplb.policy.fused`) and the rest of ``pick()``'s shortcuts must give the same decisions as each scorer's own
``score`` with the plain picker — worker, reason, preferred worker, every column and score (equal floats, NaN
included), every ``why``, the retry order, the notes, the ``/debug/decisions`` view, what the prefix index learnt —
over random snapshots, requests, prompts, router verdicts and settings."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from dplb.config import PolicyConfig
from dplb.policy import RouteRequest, make_policy
from dplb.policy.core import Policy
from dplb.state.shm import Lifecycle, WorkerState

STEP_NS = 50_000_000  # 50 ms between picks: some snapshots are stale, some drop the correction
LIFECYCLES = (Lifecycle.READY,) * 6 + (Lifecycle.DRAINING, Lifecycle.STARTING, Lifecycle.UNSET)
KV = (0.0, 0.1, 0.5, 0.9, 1.0, 1.2, -0.1, math.nan)
LATS = (0.0, 0.0, -1.0, 0.2, 0.3, 0.31, 0.5, 0.8, 1.0, 1.5, math.nan)  # 0.5 and 1.5 at deadband 0.5: on its edge


def _reference(pol: Policy) -> Policy:
    """``pol`` made to take the general path: each scorer's ``score`` and the picker's own ``pick``."""
    pol._fused = None
    pol._scan = None
    return pol


def _config(rng: random.Random) -> PolicyConfig:
    weights: Any = None
    if rng.random() < 0.5:
        names = ["queue", "memory", "latency"] + (["prefix"] if rng.random() < 0.6 else [])
        if rng.random() < 0.15:  # another order or set: both policies take the general path
            rng.shuffle(names)
            names = names[: rng.randint(1, len(names))]
        raw = [rng.choice((0.0, 0.1, 0.25, 0.3, 1.0, 2.5)) for _ in names]
        raw[0] += 0.5  # weights sum to 1
        weights = tuple((n, w / sum(raw)) for n, w in zip(names, raw, strict=True))
    prefix_on = weights is None or any(n == "prefix" for n, _ in weights)
    params: tuple[tuple[str, str, str], ...] = (
        (("prefix", "score", rng.choice(("match", "match", "cost"))),) if prefix_on else ())
    if (weights is None or any(n == "latency" for n, _ in weights)) and rng.random() < 0.3:
        params += (("latency", "half_life_s", rng.choice(("0.5", "30", "600"))),)
    return PolicyConfig(params=params,
        name=rng.choice(("dplb",) * 5 + ("least_loaded", "power_of_two", "prefix_hash", "round_robin", "random")),
        weights=weights, max_queue=rng.choice((1, 4, 16, 32)), max_queue_from_worker=rng.random() < 0.15,
        hard_queue_cap=rng.choice((0, 0, 0, 3, 8)), memory_signal=rng.choice(("kv", "kv", "gpu")),
        latency_signal=rng.choice(("e2e", "e2e", "ttft")), waiting_weight=rng.choice((1.0, 1.0, 1.0, 4.0)),
        latency_deadband=rng.choice((0.0, 0.1, 0.25, 0.25, 0.5, 0.6)), prefix_block_bytes=rng.choice((8, 16, 128)),
        prefix_index_blocks=rng.choice((40, 65536)), baseline_window=rng.choice((1, 5)))


def _snapshot(rng: random.Random, n: int, now: int, last: list[WorkerState] | None) -> list[WorkerState]:
    out = []
    for k in range(n):
        if last is not None and rng.random() < 0.5:
            out.append(last[k])  # not republished: the same heartbeat, the correction kept
            continue
        total = rng.choice((0, 80 << 30))
        out.append(WorkerState(
            k, pid=0 if rng.random() < 0.05 else 1000 + k + (rng.random() < 0.03), lifecycle=rng.choice(LIFECYCLES),
            heartbeat_mono_ns=now - rng.choice((0, 10_000_000, 300_000_000, 900_000_000)),
            num_running=rng.choice((0, 0, 1, 3, 8, 20)), num_waiting=rng.choice((0, 0, 1, 5)),
            max_num_seqs=rng.choice((0, 4, 8)), kv_cache_usage=rng.choice(KV), gpu_memory_total_bytes=total,
            gpu_memory_used_bytes=rng.randint(0, 90) << 30, avg_latency_s=rng.choice(LATS),
            avg_ttft_s=rng.choice(LATS), torn=rng.random() < 0.03,
            last_done_mono_ns=rng.choice((0, now, now - 5 * 10**9, now - 40 * 10**9, now - 10**12, now + 10**6))))
    return out


def _prompt(rng: random.Random) -> bytes | None:
    if rng.random() < 0.2:
        return None
    head = b"system prompt shared by every conversation " * rng.choice((0, 1, 3))
    return head + (b"turn %d " % rng.randint(0, 5)) * rng.randint(0, 30)


def _ids(rng: random.Random, n: int, p: float) -> frozenset[int]:
    return frozenset(k for k in range(n) if rng.random() < p)


def _same(a: Any, b: Any) -> bool:
    """Equal, with NaN equal to NaN (floats compared exactly otherwise), recursively."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _run(seed: int, picks: int) -> int:
    """Drive a fast-path policy and its general-path twin with the same inputs; returns how many picks took the
    fused scorers."""
    rng = random.Random(seed)
    cfg = _config(rng)
    n = rng.randint(1, 9)
    fast, ref = make_policy(cfg, n), _reference(make_policy(cfg, n))
    fused = 0
    for _ in range(rng.choice((0, 2, 10))):
        lat = rng.choice((0.1, 0.4, 1.0, 2.0))
        fast.observe_latency(lat, lat / 2)
        ref.observe_latency(lat, lat / 2)
    prompts = [_prompt(rng) for _ in range(6)]
    now = 10**12
    snap = None
    for _ in range(picks):
        now += STEP_NS
        snap = _snapshot(rng, n, now, snap)
        prompt = rng.choice(prompts)
        exclude, cannot = _ids(rng, n, 0.1), _ids(rng, n, 0.05)
        reqs = [RouteRequest(prompt, exclude, cannot) for _ in range(2)]
        kw: dict[str, Any] = {
            "held": _ids(rng, n, 0.1), "ejected": _ids(rng, n, 0.05), "stalled": _ids(rng, n, 0.05),
            "dry_run": rng.random() < 0.1,
            "inflight": [rng.randint(0, 3) for _ in range(n)] if rng.random() < 0.3 else None,
            "shared": [rng.randint(0, 2) for _ in range(n)] if rng.random() < 0.2 else None}
        if rng.random() < 0.6:
            kw["held"] = kw["ejected"] = kw["stalled"] = frozenset()
        da = fast.pick(snap, now, reqs[0], **kw)
        db = ref.pick(snap, now, reqs[1], **kw)
        fused += fast._fused is not None
        assert (da.worker, da.reason, da.preferred) == (db.worker, db.reason, db.preferred)
        assert _same(da.columns, db.columns)
        assert [(c.why, c.queue, c.correction) for c in da.candidates] == \
            [(c.why, c.queue, c.correction) for c in db.candidates]
        assert _same([c.score for c in da.candidates], [c.score for c in db.candidates])
        assert da.ranked() == db.ranked()
        assert _same(da.notes, db.notes)
        assert _same(da.to_dict(), db.to_dict())
        assert reqs[0].learned == reqs[1].learned
        qa, qb = reqs[0].derived.get("prefix"), reqs[1].derived.get("prefix")
        assert (qa is None) == (qb is None) and (qa is None or qa.depth == qb.depth)
    return fused


@pytest.mark.parametrize("block", range(8))
def test_fast_paths_decide_as_the_general_path(block: int) -> None:
    """8 × 40 random configurations × 60 picks = 19,200 picks in lock step; most take the fused scorers."""
    fused = sum(_run(block * 1000 + i, 60) for i in range(40))
    assert fused > 40 * 60 // 3


def test_fused_applies_only_to_the_builtin_sets() -> None:
    """The defaults (with and without prefix) take the fused scorers; a reordered set, a waiting weight or
    per-worker queue caps take the general path."""
    assert make_policy(PolicyConfig(), 4)._fused is not None
    assert make_policy(PolicyConfig(prefix_block_bytes=0), 4)._fused is not None
    assert make_policy(PolicyConfig(weights=(("memory", 0.5), ("queue", 0.4), ("latency", 0.1))), 4)._fused is None
    assert make_policy(PolicyConfig(waiting_weight=4.0), 4)._fused is None
    assert make_policy(PolicyConfig(max_queue_from_worker=True), 4)._fused is None
