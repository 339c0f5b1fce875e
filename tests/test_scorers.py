"""The built-in scorers, table-driven (inputs → term, 0–1), their [0, 1] guarantee (they are marked ``bounded``),
their parameters, plus the prefix scorer's hashing, spill, forgetting, sharing and reporting."""

from __future__ import annotations

import math
import random
from collections import Counter

import msgspec
import pytest

from dplb.config import PolicyConfig
from dplb.errors import ConfigError
from dplb.policy import PickContext, RouteRequest, make_policy
from dplb.policy.decision import Candidate
from dplb.policy.framework import Scorer
from dplb.policy.prefix import ENTRY_BYTES, MAX_PREFIX_BLOCKS, block_hashes
from dplb.policy.scorers import LatencyScorer, MemoryScorer, PrefixScorer, QueueScorer
from dplb.state.shm import Lifecycle, WorkerState

NOW = 10**12
GiB = 1 << 30


def cand(k: int = 0, *, run: int = 0, wait: int = 0, corr: int = 0, kv: float = 0.0, lat: float = 0.0,
         ttft: float = 0.0, used: int = 0, total: int = 0, max_seqs: int = 0, why: str = "ok",
         age: float | None = None) -> Candidate:
    """A ready candidate; ``age``: seconds since its last latency sample (None: the worker did not say)."""
    w = WorkerState(k, pid=100 + k, lifecycle=Lifecycle.READY, heartbeat_mono_ns=NOW, num_running=run,
                    num_waiting=wait, kv_cache_usage=kv, avg_latency_s=lat, avg_ttft_s=ttft,
                    gpu_memory_used_bytes=used, gpu_memory_total_bytes=total, max_num_seqs=max_seqs,
                    last_done_mono_ns=0 if age is None else NOW - int(age * 1e9))
    c = Candidate(w, corr, run + wait + corr, 0)
    c.why = why
    return c


def ctx(baseline: float | None = None, prompt: bytes | None = None, scorer: Scorer | None = None) -> PickContext:
    """A pick context for a request with ``prompt``, prepared by ``scorer`` (as the policy does once per request)."""
    req = RouteRequest(prompt)
    if scorer is not None and prompt is not None:
        scorer.prepare(req)
    return PickContext(NOW, req, baseline)


# ---- queue ------------------------------------------------------------------------------------------------------
QUEUE = [  # (config kwargs, candidate kwargs, term)
    ({}, {}, 1.0),
    ({}, {"run": 2, "wait": 2}, 0.75),  # 4 of 16
    ({}, {"run": 1, "corr": 3}, 0.75),  # the in-flight correction counts
    ({}, {"run": 30}, 0.0),  # past the soft cap: clamped
    ({"max_queue": 8}, {"run": 2}, 0.75),
    ({"max_queue_from_worker": True}, {"run": 64, "max_seqs": 256}, 0.75),
    ({"max_queue_from_worker": True}, {"run": 4}, 0.75),  # no max_num_seqs published: max_queue
    ({"waiting_weight": 4.0}, {"run": 2, "wait": 2}, 1 - (4 + 3 * 2) / 16),  # vLLM DP's 4·waiting + running
    ({"waiting_weight": 4.0}, {"run": 8, "corr": 2, "max_seqs": 8}, 1 - (10 + 3 * 2) / 16),  # sent beyond free slots
]


@pytest.mark.parametrize(("cfg", "kw", "want"), QUEUE)
def test_queue_scorer(cfg: dict, kw: dict, want: float) -> None:  # type: ignore[type-arg]
    s = QueueScorer(PolicyConfig(**cfg), 1)
    assert s.score([cand(**kw)], ctx()) == pytest.approx([want])


DEEP = [  # (config kwargs, candidate kwargs per worker, terms): past max_queue the terms stay ordered by queue
    ({}, [{"run": 4}, {"run": 8}], [0.75, 0.5]),  # every queue below the cap: 1 − queue/16, as before
    ({}, [{"run": 20}, {"run": 189}], [1 - 20 / 189, 0.0]),  # both past 16 (before: 0, 0)
    ({}, [{"run": 207}, {"run": 339}], [1 - 207 / 339, 0.0]),  # (before: 0, 0)
    ({}, [{"run": 8}, {"run": 32}], [0.75, 0.0]),  # one past the cap: relative to the longest
    ({}, [{"run": 30}, {"run": 30}], [0.0, 0.0]),  # equal: tied (the picker rotates)
    # the in-flight correction keeps moving the terms inside one snapshot, past the cap too
    ({}, [{"run": 20, "corr": 100}, {"run": 100}], [0.0, 1 - 100 / 120]),
    ({}, [{"run": 20, "corr": 100}, {"run": 100, "corr": 21}], [1 - 120 / 121, 0.0]),
    # an ineligible worker's queue sets no normalizer (its term is clamped at 0)
    ({}, [{"run": 20}, {"run": 189}, {"run": 500, "why": "stale"}], [1 - 20 / 189, 0.0, 0.0]),
    # per-worker caps: each queue over its own cap, relative to the fullest eligible worker
    ({"max_queue_from_worker": True}, [{"run": 64, "max_seqs": 256}, {"run": 8, "max_seqs": 16}], [0.75, 0.5]),
    ({"max_queue_from_worker": True}, [{"run": 512, "max_seqs": 256}, {"run": 64, "max_seqs": 16}],
     [1 - 2.0 / 4.0, 0.0]),
    ({"waiting_weight": 4.0}, [{"run": 16, "wait": 4}, {"run": 16, "wait": 14}],  # 4·waiting + running: 32, 72
     [1 - (32 / 16) / (72 / 16), 0.0]),
]


@pytest.mark.parametrize(("cfg", "kws", "want"), DEEP)
def test_queue_term_orders_workers_past_max_queue(cfg: dict, kws: list, want: list) -> None:  # type: ignore[type-arg]
    s = QueueScorer(PolicyConfig(**cfg), len(kws))
    assert s.score([cand(k, **kw) for k, kw in enumerate(kws)], ctx()) == pytest.approx(want)


# ---- memory -----------------------------------------------------------------------------------------------------
MEMORY = [
    ("kv", {"kv": 0.0}, 1.0),
    ("kv", {"kv": 0.9}, 0.1),
    ("kv", {"kv": 1.2}, 0.0),  # clamped
    ("gpu", {"used": 72 * GiB, "total": 80 * GiB, "kv": 0.0}, 0.1),  # NVML ratio, KV ignored
    ("gpu", {"used": 0, "total": 0}, 1.0),  # no GPU: neutral
]


@pytest.mark.parametrize(("signal", "kw", "want"), MEMORY)
def test_memory_scorer(signal: str, kw: dict, want: float) -> None:  # type: ignore[type-arg]
    s = MemoryScorer(PolicyConfig(memory_signal=signal), 1)  # type: ignore[arg-type]
    c = cand(**kw)
    assert s.score([c], ctx()) == pytest.approx([want])
    ratio = kw["kv"] if signal == "kv" else (kw["used"] / kw["total"] if kw["total"] else 0.0)
    assert s.inputs(c, ctx())["memory_ratio"] == pytest.approx(ratio)


# ---- latency ----------------------------------------------------------------------------------------------------
LATENCY = [  # (config kwargs, baseline, candidates kwargs, terms)
    ({}, None, [{"run": 1, "lat": 9.0}], [1.0]),  # no baseline yet: neutral
    ({"latency_deadband": 0.0}, 2.0, [{"run": 1, "lat": 1.0}], [0.5]),
    ({"latency_deadband": 0.0}, 2.0, [{"run": 1, "lat": 5.0}], [0.0]),  # clamped
    # no sample: the mean term of the peers that have one
    ({"latency_deadband": 0.0}, 2.0, [{"run": 1, "lat": 1.0}, {"run": 1, "lat": 1.5}, {}], [0.5, 0.25, 0.375]),
    # idle, age unknown (freshness 0): the eligible workers' freshness-weighted mean latency, here the busy one's
    ({"latency_deadband": 0.0}, 2.0, [{"lat": 4.0}, {"run": 1, "lat": 1.0}], [0.5, 0.5]),
    # idle and recent: its own figure (a slow worker that just served stays slow at light load)
    ({"latency_deadband": 0.0}, 10.0, [{"lat": 5.0, "age": 0.0}, {"lat": 0.5, "age": 0.0}], [0.5, 0.95]),
    ({}, 10.0, [{"lat": 5.0, "age": 1.0}, {"lat": 0.5, "age": 0.5}, {"lat": 0.5, "age": 0.2}],
     [1 - (2**(-1 / 30) * 5 + (1 - 2**(-1 / 30)) * ((2**(-1 / 30) * 5 + 2**(-0.5 / 30) * 0.5 + 2**(-0.2 / 30) * 0.5)
                                                  / (2**(-1 / 30) + 2**(-0.5 / 30) + 2**(-0.2 / 30)))) / 10,
      pytest.approx(0.95, abs=0.01), pytest.approx(0.95, abs=0.01)]),
    # one half-life old (30 s): f = 0.5, ref = (0.5·5 + 1·0.5)/1.5 = 2 → 0.5·5 + 0.5·2 = 3.5
    ({"latency_deadband": 0.0}, 10.0, [{"lat": 5.0, "age": 30.0}, {"lat": 0.5, "age": 0.0}], [0.65, 0.95]),
    # long ago: its figure no longer counts, it scores as the fleet does (and gets traffic again)
    ({"latency_deadband": 0.0}, 10.0, [{"lat": 5.0, "age": 3000.0}, {"lat": 0.5, "age": 0.0}], [0.95, 0.95]),
    # a fresh slow figure beside two aged fast ones: the plain mean (0.4) is the reference, not the weighted one
    # (0.7, which put the fast ones in the deadband at the mean's term, past the baseline: a tie at 0 for all)
    ({}, 0.55, [{"lat": 1.0, "age": 0.0}, {"lat": 0.1, "age": 60.0}, {"lat": 0.1, "age": 60.0}],
     [0.0, 1 - (0.25 * 0.1 + 0.75 * 0.4) / 0.55, 1 - (0.25 * 0.1 + 0.75 * 0.4) / 0.55]),
    # every idle worker's age unknown: the plain mean for all (a tie, as before any figure)
    ({"latency_deadband": 0.0}, 10.0, [{"lat": 5.0}, {"lat": 0.5}], [0.725, 0.725]),
    # an idle ineligible worker is not aged: the neutral fill
    ({"latency_deadband": 0.0}, 10.0, [{"lat": 5.0, "age": 0.0, "why": "stale"}, {"lat": 0.5, "age": 0.0}],
     [0.95, 0.95]),
    ({"latency_deadband": 0.0, "params": (("latency", "half_life_s", "1"),)}, 10.0,
     [{"lat": 5.0, "age": 30.0}, {"lat": 0.5, "age": 0.0}], [pytest.approx(0.95, abs=1e-6), 0.95]),
    # deadband: within 25 % of the mean → the mean's term; a worker 2× slower keeps its own
    ({}, 2.0, [{"run": 1, "lat": 1.0}, {"run": 1, "lat": 1.1}, {"run": 1, "lat": 0.95}, {"run": 1, "lat": 2.0}],
     [1 - 1.2625 / 2] * 3 + [0.0]),
    ({"latency_signal": "ttft", "latency_deadband": 0.0}, 0.2, [{"run": 1, "lat": 9.0, "ttft": 0.05}], [0.75]),
]


@pytest.mark.parametrize(("cfg", "base", "cands", "want"), LATENCY)
def test_latency_scorer(cfg: dict, base: float | None, cands: list, want: list) -> None:  # type: ignore[type-arg]
    s = LatencyScorer(PolicyConfig(**cfg), len(cands))
    cs = [cand(k, **kw) for k, kw in enumerate(cands)]
    assert s.score(cs, ctx(base)) == pytest.approx(want)


def test_latency_inputs_report_the_signal_the_score_uses() -> None:
    """Regression: with --latency-signal ttft the exported latency was the E2E mean."""
    s = LatencyScorer(PolicyConfig(latency_signal="ttft"), 1)
    got = s.inputs(cand(run=1, lat=9.0, ttft=0.05), ctx(0.2))
    assert got == {"latency_s": 0.05, "latency_signal": "ttft", "baseline_s": 0.2, "latency_age_s": None,
                   "latency_freshness": 1.0}
    idle = s.inputs(cand(lat=9.0, ttft=0.05, age=30.0), ctx(0.2))
    assert idle["latency_age_s"] == pytest.approx(30.0) and idle["latency_freshness"] == pytest.approx(0.5)


# ---- prefix -----------------------------------------------------------------------------------------------------
def chat(system: str, *turns: str) -> bytes:
    """The raw ``messages`` JSON of a chat, as a client sends it (what the router hands the policy)."""
    body = '[{"role":"system","content":"' + system + '"}'
    body += "".join(f',{{"role":"user","content":"{t}"}}' for t in turns)
    return (body + "]").encode()


def keys(prompt: bytes) -> list[int]:
    return block_hashes(prompt, 128)


SYSTEM = "You are a helpful assistant. " * 40  # ~1.2 KB: 9 blocks
HISTORY = chat(SYSTEM, "turn one " * 60)  # system + a 540-byte turn
NEXT = chat(SYSTEM, "turn one " * 60, "turn two " * 60)


def primed(n: int = 3, **cfg: object) -> PrefixScorer:
    s = PrefixScorer(PolicyConfig(**cfg), n)  # type: ignore[arg-type]
    for k in range(n):
        s.index.record(keys(chat(SYSTEM, f"other {k} " * 60)), k, NOW)  # every worker has the system prompt
    s.index.record(keys(HISTORY), 1, NOW)  # worker 1 has this conversation's history
    return s


PREFIX = [  # (queue per worker, why per worker, prompt, want terms)
    # the system prompt cancels out: only worker 1's history counts; term = (match − min)/(1 − min)
    ([0, 0, 0], ["ok"] * 3, NEXT, "history"),
    # a worker's advantage shrinks with its queue (headroom): 8 of 16 queued halves it
    ([0, 8, 0], ["ok"] * 3, NEXT, "half"),
    ([0, 16, 0], ["ok"] * 3, NEXT, "zero"),
    # nobody has more than the others: no preference
    ([0, 0, 0], ["ok"] * 3, chat(SYSTEM, "fresh " * 60), "none"),
    ([0, 0, 0], ["ok"] * 3, b"", "none"),  # no prefix key
    ([0, 0, 0], ["ok"] * 3, NEXT[:127], "none"),  # shorter than one block: no prefix key
    ([0, 0, 0], ["ok"] * 3, None, "none"),  # no prompt at all
]


@pytest.mark.parametrize(("queues", "whys", "prompt", "want"), PREFIX)
def test_prefix_scorer(queues: list[int], whys: list[str], prompt: bytes | None, want: str) -> None:
    s = primed()
    cs = [cand(k, run=q, why=w) for k, (q, w) in enumerate(zip(queues, whys, strict=True))]
    c = ctx(prompt=prompt, scorer=s)
    terms = s.score(cs, c)
    n = len(keys(NEXT))
    lo = 9  # the system prompt's blocks, which everyone has
    h = len(keys(HISTORY))
    full = (h - lo) / (n - lo)
    expect = {"history": [0.0, full, 0.0], "half": [0.0, full / 2, 0.0], "zero": [0.0, 0.0, 0.0],
              "none": [0.0, 0.0, 0.0]}[want]
    assert terms == pytest.approx(expect)
    if want in ("history", "half", "zero"):
        assert c.request.preferred == 1
        assert s.inputs(cs[1], c) == {"prefix_blocks": n, "prefix_matched_blocks": h, "prefix_match": h / n,
                                      "prefix_confirmed_blocks": 0, "prefix_engine_events": False}
        assert s.inputs(cs[0], c)["prefix_matched_blocks"] == lo


COST = [  # (queue per worker, why per worker, prompt, want terms): --scorer-param prefix.score=cost
    # Dynamo's cost (n − matched) + queue·n; the lowest eligible cost → 1, the highest → 0
    ([0, 0, 0], ["ok"] * 3, NEXT, lambda n, lo, h: [0.0, 1.0, 0.0]),
    # one queued request costs the whole prompt: more than worker 1's history saves, so it is now the worst
    ([0, 1, 0], ["ok"] * 3, NEXT, lambda n, lo, h: [1.0, 0.0, 1.0]),
    # in between: worker 2's cost n − lo against worker 0's 3n − lo (hi) and worker 1's n − h (lo)
    ([2, 0, 0], ["ok"] * 3, NEXT, lambda n, lo, h: [0.0, 1.0, 2 * n / (2 * n - lo + h)]),
    # the spill rule kept: the best worker's term times its headroom 1 − 2/16
    ([4, 2, 4], ["ok"] * 3, NEXT, lambda n, lo, h: [0.0, 1 - 2 / 16, 0.0]),
    # an ineligible worker neither sets the highest cost nor gets a term beyond it
    ([9, 0, 0], ["stale", "ok", "ok"], NEXT, lambda n, lo, h: [0.0, 1.0, 0.0]),
    # nobody matches more than the rest: no prefix preference, whatever the queues (the queue term decides)
    ([0, 3, 0], ["ok"] * 3, chat(SYSTEM, "fresh " * 60), lambda n, lo, h: [0.0, 0.0, 0.0]),
    ([0, 0, 0], ["ok"] * 3, None, lambda n, lo, h: [0.0, 0.0, 0.0]),
]


@pytest.mark.parametrize(("queues", "whys", "prompt", "want"), COST)
def test_prefix_cost_score(queues: list[int], whys: list[str], prompt: bytes | None, want: object) -> None:
    s = primed(params=(("prefix", "score", "cost"),))
    cs = [cand(k, run=q, why=w) for k, (q, w) in enumerate(zip(queues, whys, strict=True))]
    c = ctx(prompt=prompt, scorer=s)
    n, lo, h = len(keys(NEXT)), 9, len(keys(HISTORY))
    assert s.score(cs, c) == pytest.approx(want(n, lo, h))  # type: ignore[operator]
    if prompt == NEXT:
        assert c.request.preferred == 1  # the outcome (hit/spill) is still judged against the longest match


def test_cost_score_is_off_by_default() -> None:
    """The default score is ``match``: with one queued request on worker 1 it still prefers its history."""
    s = primed()
    cs = [cand(0), cand(1, run=1), cand(2)]
    terms = s.score(cs, ctx(prompt=NEXT, scorer=s))
    assert terms[1] > 0.0 and terms[0] == terms[2] == 0.0


def test_ineligible_workers_do_not_set_the_floor_or_the_preference() -> None:
    s = primed()
    cs = [cand(0), cand(1, why="draining"), cand(2)]
    c = ctx(prompt=NEXT, scorer=s)
    assert s.score(cs, c) == [0.0, 0.0, 0.0] and c.request.preferred is None


def test_hot_prefix_spills() -> None:
    """One hot prefix (every request the same long prompt) on 4 workers whose published queue is what was sent:
    the first worker keeps it while its prefix advantage beats the queue difference, then it spills, and once every
    worker has it load alone decides. With the default weights (queue 0.3, prefix 0.3) a full match keeps winning
    against an idle worker while ``(0.3 + 0.3)·(1 − q/16) > 0.3``, i.e. up to 8 queued requests."""
    p = make_policy(PolicyConfig(), 4)
    hot = chat(SYSTEM * 4, "summarise the document")
    queue = [0, 0, 0, 0]
    order = []
    for i in range(40):
        t = NOW + i * 10**9  # each snapshot a second later: it counts every request sent before it
        snap = [WorkerState(k, pid=100 + k, lifecycle=Lifecycle.READY, heartbeat_mono_ns=t, num_running=queue[k])
                for k in range(4)]
        d = p.pick(snap, t, RouteRequest(hot))
        assert d.worker is not None
        queue[d.worker] += 1
        order.append(d.worker)
    first = order[0]
    assert order[:8] == [first] * 8  # kept while its advantage beats the queue difference: 16·0.3/0.6 = 8
    assert max(queue) - min(queue) <= 8, queue  # spilled, never piled up
    assert set(order) == {0, 1, 2, 3}
    assert Counter(order)[first] <= 17


def test_restarted_worker_is_forgotten() -> None:
    """A worker that published a new pid lost its cache: the policy drops its index entries."""
    p = make_policy(PolicyConfig(), 2)
    snap = [WorkerState(k, pid=100 + k, lifecycle=Lifecycle.READY, heartbeat_mono_ns=NOW) for k in range(2)]
    first = p.pick(snap, NOW, RouteRequest(NEXT)).worker
    assert first is not None
    assert p.pick(snap, NOW, RouteRequest(NEXT)).prefix_outcome() == "hit"
    restarted = [WorkerState(k, pid=(999 if k == first else 100 + k), lifecycle=Lifecycle.READY,
                             heartbeat_mono_ns=NOW + 1) for k in range(2)]
    d = p.pick(restarted, NOW + 1, RouteRequest(NEXT))
    assert d.preferred is None and d.prefix_outcome() == "miss"


def test_entries_age_out() -> None:
    s = PrefixScorer(PolicyConfig(prefix_ttl_s=10.0), 2)
    s.index.record(keys(HISTORY), 0, NOW)
    assert s.index.match(keys(HISTORY), NOW + 9 * 10**9)[0] == len(keys(HISTORY))
    assert s.index.match(keys(HISTORY), NOW + 11 * 10**9) == [0, 0]


# ---- the prefix scorer owns the prefix: hashing, learning, sharing, reporting --------------------------------------
PREPARE = [  # (config kwargs, params, prompt, want block keys)
    ({}, (), NEXT, block_hashes(NEXT, 128)),
    ({}, (), msgspec.Raw(NEXT), block_hashes(NEXT, 128)),  # the router's msgspec.Raw, hashed without decoding
    ({}, (), memoryview(NEXT), block_hashes(NEXT, 128)),
    ({"prefix_block_bytes": 64}, (), NEXT, block_hashes(NEXT, 64)),  # the older flag is the parameter's default
    ({}, (("prefix", "block_bytes", "256"),), NEXT, block_hashes(NEXT, 256)),  # --scorer-param overrides it
    ({"prefix_block_bytes": 64}, (("prefix", "block_bytes", "256"),), NEXT, block_hashes(NEXT, 256)),
    ({}, (("prefix", "max_blocks", "3"),), msgspec.Raw(NEXT), block_hashes(NEXT, 128)[:3]),
    ({}, (), b"x" * 128 * (MAX_PREFIX_BLOCKS + 5), block_hashes(b"x" * 128 * MAX_PREFIX_BLOCKS, 128)),
    ({}, (), NEXT[:127], None),  # no full block: nothing derived, the term is 0
]


@pytest.mark.parametrize(("cfg", "params", "prompt", "want"), PREPARE)
def test_prefix_scorer_hashes_the_raw_prompt(cfg: dict, params: tuple, prompt: object, want: list | None) -> None:  # type: ignore[type-arg]
    s = PrefixScorer(PolicyConfig(params=params, **cfg), 2)
    req = RouteRequest(prompt)
    s.prepare(req)
    q = req.derived.get("prefix")
    assert (q.blocks if q is not None else None) == want
    if want:
        assert all(k < 2**42 for k in want)  # what the router slots' rings carry


def test_prefix_scorer_learns_reports_and_shares() -> None:
    """A routed request: its blocks are recorded for the chosen worker and handed to the other router processes
    (``learned``), the outcome is noted for the metrics, the index size is in ``stats()``; a peer's raw ring
    entries applied with ``absorb`` make another process prefer the same worker."""
    p, peer = make_policy(PolicyConfig(), 2), make_policy(PolicyConfig(), 2)
    snap = [WorkerState(k, pid=100 + k, lifecycle=Lifecycle.READY, heartbeat_mono_ns=NOW) for k in range(2)]
    first = RouteRequest(NEXT)
    d = p.pick(snap, NOW, first)
    assert d.worker is not None and first.learned == keys(NEXT)
    assert d.notes == {"prefix_outcome": "miss", "prefix_blocks": len(keys(NEXT)), "prefix_hit_blocks": 0,
                       "prefix_hit_bytes": 0}
    again = RouteRequest(NEXT)
    d2 = p.pick(snap, NOW + 1, again)
    assert d2.worker == d.worker and d2.prefix_outcome() == "hit" and again.learned == []  # nothing new to tell
    assert d2.notes is not None and d2.notes["prefix_hit_blocks"] == len(keys(NEXT))
    assert p.plugin_stats()["prefix"] == {"index_blocks": len(keys(NEXT)), "index_capacity_blocks": 65536,
                                          "index_bytes": len(keys(NEXT)) * ENTRY_BYTES}
    assert p.shares and peer.shares
    peer.absorb({d.worker: first.learned, 7: [1, 2]}, NOW)  # a worker id this policy does not have: ignored
    d3 = peer.pick(snap, NOW + 2, RouteRequest(NEXT))
    assert d3.worker == d.worker and d3.preferred == d.worker and d3.prefix_outcome() == "hit"
    assert p.pick(snap, NOW + 3).notes is None  # no prompt: nothing noted


def test_a_dry_run_notes_and_learns_nothing() -> None:
    p = make_policy(PolicyConfig(), 2)
    snap = [WorkerState(k, pid=100 + k, lifecycle=Lifecycle.READY, heartbeat_mono_ns=NOW) for k in range(2)]
    req = RouteRequest(NEXT)
    d = p.pick(snap, NOW, req, dry_run=True)
    assert d.notes is None and req.learned is None and p.plugin_stats()["prefix"]["index_blocks"] == 0


# ---- parameters ---------------------------------------------------------------------------------------------------
PARAMS = [  # (scorer, params, attribute read back, want) — each parameter typed, defaulted and overridable
    (QueueScorer, (), "waiting_weight", 1.0),
    (QueueScorer, (("queue", "waiting_weight", "4"),), "waiting_weight", 4.0),
    (MemoryScorer, (("memory", "signal", "gpu"),), "signal", "gpu"),
    (LatencyScorer, (("latency", "deadband", "0.1"),), "deadband", 0.1),
    (PrefixScorer, (), "ttl_s", 300.0),
    (PrefixScorer, (("prefix", "ttl_s", "5"),), "ttl_s", 5.0),
    (PrefixScorer, (("prefix", "index_blocks", "10"),), "index_blocks", 10),
    (PrefixScorer, (), "score", "match"),
    (PrefixScorer, (("prefix", "score", "cost"),), "score", "cost"),
    (PrefixScorer, (("queue", "waiting_weight", "4"),), "block_bytes", 128),  # another plugin's: not ours
]


@pytest.mark.parametrize(("cls", "params", "name", "want"), PARAMS)
def test_scorer_parameters(cls: type[Scorer], params: tuple, name: str, want: object) -> None:  # type: ignore[type-arg]
    s = cls(PolicyConfig(params=params), 2)
    assert s.params[name] == want and type(s.params[name]) is type(want)


def test_parameters_change_the_terms() -> None:
    c = cand(run=2, wait=2)
    assert QueueScorer(PolicyConfig(params=(("queue", "waiting_weight", "4"),)), 1).score([c], ctx()) == \
        pytest.approx([1 - (4 + 3 * 2) / 16])
    m = cand(kv=0.5, used=72 * GiB, total=80 * GiB)
    assert MemoryScorer(PolicyConfig(params=(("memory", "signal", "gpu"),)), 1).score([m], ctx()) == \
        pytest.approx([0.1])
    assert PrefixScorer(PolicyConfig(params=(("prefix", "index_blocks", "10"),)), 1).index.capacity == 10


BAD_PARAMS = [  # (params, words of the one-line error)
    ((("prefix", "block_bytes", "big"),), "--scorer-param prefix.block_bytes=big: prefix.block_bytes must be an "
                                          "integer, 1..65536 bytes"),
    ((("prefix", "block_bytes", "0"),), "must be an integer, 1..65536"),
    ((("prefix", "block_bytes", "70000"),), "must be an integer, 1..65536"),
    ((("prefix", "ttl_s", "nan"),), "prefix.ttl_s must be a finite number, > 0 seconds"),
    ((("prefix", "ttl_s", "-1"),), "prefix.ttl_s must be a finite number, > 0 seconds"),
    ((("prefix", "max_blocks", "2000"),), "1..1024 blocks"),
    ((("memory", "signal", "nvml"),), "memory.signal must be one of kv, gpu"),
    ((("prefix", "score", "dynamo"),), "prefix.score must be one of match, cost"),
    ((("latency", "deadband", "1.5"),), "a fraction in [0, 1)"),
    ((("prefix", "size", "1"),), "prefix has no parameter 'size'; its parameters: block_bytes (an integer"),
]


@pytest.mark.parametrize(("params", "needle"), BAD_PARAMS)
def test_bad_parameters_are_refused_in_one_line(params: tuple, needle: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ConfigError) as e:
        make_policy(PolicyConfig(params=params), 2)
    assert needle in str(e.value) and "\n" not in str(e.value)


# ---- the [0, 1] guarantee of the built-ins (why they are marked bounded) -----------------------------------------
def test_builtin_scorers_stay_in_the_unit_interval() -> None:
    """Random snapshots far outside the usual ranges (queues past the cap, KV usage > 1, latencies 100× the
    baseline, a primed prefix index): every built-in term stays in [0, 1], so skipping the clamp is safe."""
    rng = random.Random(7)
    n = 6
    scorers = [cls(PolicyConfig(), n) for cls in (QueueScorer, MemoryScorer, LatencyScorer, PrefixScorer)]
    scorers.append(PrefixScorer(PolicyConfig(params=(("prefix", "score", "cost"),)), n))
    assert all(s.bounded for s in scorers)
    prefix = scorers[-2]
    for k in range(n):
        history = keys(chat(SYSTEM, "turn one " * rng.randint(0, 60)))
        for p in scorers[-2:]:
            p.index.record(history, k, NOW)  # type: ignore[attr-defined]
    for _ in range(300):
        cs = [cand(k, run=rng.randint(0, 40), wait=rng.randint(0, 40), corr=rng.randint(0, 5),
                   kv=rng.uniform(-0.5, 1.5), lat=rng.choice([0.0, rng.uniform(0, 200)]),
                   used=rng.randint(0, 100) * GiB, total=rng.choice([0, 80 * GiB]), max_seqs=rng.choice([0, 8]),
                   why=rng.choice(["ok", "ok", "stale"])) for k in range(n)]
        c = ctx(rng.choice([None, 0.5, 2.0]), chat(SYSTEM, "turn one " * rng.randint(0, 60)), prefix)
        for s in scorers:
            terms = s.score(cs, c)
            assert len(terms) == n and all(0.0 <= t <= 1.0 and not math.isnan(t) for t in terms), (s.name, terms)
