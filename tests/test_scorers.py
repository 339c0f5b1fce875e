"""The built-in scorers, table-driven (inputs → term, 0–1), plus the prefix scorer's spill and forgetting."""

from __future__ import annotations

from collections import Counter

import pytest

from dplb.config import PolicyConfig
from dplb.policy import PickContext, RouteRequest, make_policy
from dplb.policy.decision import Candidate
from dplb.policy.prefix import block_hashes
from dplb.policy.scorers import LatencyScorer, MemoryScorer, PrefixScorer, QueueScorer
from dplb.state.shm import Lifecycle, WorkerState

NOW = 10**12
GiB = 1 << 30


def cand(k: int = 0, *, run: int = 0, wait: int = 0, corr: int = 0, kv: float = 0.0, lat: float = 0.0,
         ttft: float = 0.0, used: int = 0, total: int = 0, max_seqs: int = 0, why: str = "ok") -> Candidate:
    w = WorkerState(k, pid=100 + k, lifecycle=Lifecycle.READY, heartbeat_mono_ns=NOW, num_running=run,
                    num_waiting=wait, kv_cache_usage=kv, avg_latency_s=lat, avg_ttft_s=ttft,
                    gpu_memory_used_bytes=used, gpu_memory_total_bytes=total, max_num_seqs=max_seqs)
    c = Candidate(w, corr, run + wait + corr, 0)
    c.why = why
    return c


def ctx(baseline: float | None = None, blocks: list[int] | None = None) -> PickContext:
    return PickContext(NOW, RouteRequest(blocks), baseline)


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
    # no sample, or idle: the mean term of the peers that have one
    ({"latency_deadband": 0.0}, 2.0, [{"run": 1, "lat": 1.0}, {"run": 1, "lat": 1.5}, {}], [0.5, 0.25, 0.375]),
    ({"latency_deadband": 0.0}, 2.0, [{"lat": 4.0}, {"run": 1, "lat": 1.0}], [0.5, 0.5]),
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
    assert got == {"latency_s": 0.05, "latency_signal": "ttft", "baseline_s": 0.2}


# ---- prefix -----------------------------------------------------------------------------------------------------
def chat(system: str, *turns: str) -> list[int]:
    body = '[{"role":"system","content":"' + system + '"}'
    body += "".join(f',{{"role":"user","content":"{t}"}}' for t in turns)
    return block_hashes((body + "]").encode(), 128)


SYSTEM = "You are a helpful assistant. " * 40  # ~1.2 KB: 9 blocks
HISTORY = chat(SYSTEM, "turn one " * 60)  # system + a 540-byte turn
NEXT = chat(SYSTEM, "turn one " * 60, "turn two " * 60)


def primed(n: int = 3, **cfg: object) -> PrefixScorer:
    s = PrefixScorer(PolicyConfig(**cfg), n)  # type: ignore[arg-type]
    for k in range(n):
        s.index.record(chat(SYSTEM, f"other {k} " * 60), k, NOW)  # every worker has the system prompt
    s.index.record(HISTORY, 1, NOW)  # worker 1 has this conversation's history
    return s


PREFIX = [  # (queue per worker, why per worker, blocks, want terms)
    # the system prompt cancels out: only worker 1's history counts; term = (match − min)/(1 − min)
    ([0, 0, 0], ["ok"] * 3, NEXT, "history"),
    # a worker's advantage shrinks with its queue (headroom): 8 of 16 queued halves it
    ([0, 8, 0], ["ok"] * 3, NEXT, "half"),
    ([0, 16, 0], ["ok"] * 3, NEXT, "zero"),
    # nobody has more than the others: no preference
    ([0, 0, 0], ["ok"] * 3, chat(SYSTEM, "fresh " * 60), "none"),
    ([0, 0, 0], ["ok"] * 3, [], "none"),  # no prefix key
]


@pytest.mark.parametrize(("queues", "whys", "blocks", "want"), PREFIX)
def test_prefix_scorer(queues: list[int], whys: list[str], blocks: list[int], want: str) -> None:
    s = primed()
    cs = [cand(k, run=q, why=w) for k, (q, w) in enumerate(zip(queues, whys, strict=True))]
    c = ctx(blocks=blocks)
    terms = s.score(cs, c)
    n = len(NEXT)
    lo = 9  # the system prompt's blocks, which everyone has
    full = (len(HISTORY) - lo) / (n - lo)
    expect = {"history": [0.0, full, 0.0], "half": [0.0, full / 2, 0.0], "zero": [0.0, 0.0, 0.0],
              "none": [0.0, 0.0, 0.0]}[want]
    assert terms == pytest.approx(expect)
    if want in ("history", "half", "zero"):
        assert c.request.preferred == 1
        assert s.inputs(cs[1], c) == {"prefix_blocks": n, "prefix_matched_blocks": len(HISTORY),
                                      "prefix_match": len(HISTORY) / n}
        assert s.inputs(cs[0], c)["prefix_matched_blocks"] == lo


def test_ineligible_workers_do_not_set_the_floor_or_the_preference() -> None:
    s = primed()
    cs = [cand(0), cand(1, why="draining"), cand(2)]
    c = ctx(blocks=NEXT)
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
    s.index.record(HISTORY, 0, NOW)
    assert s.index.match(HISTORY, NOW + 9 * 10**9)[0] == len(HISTORY)
    assert s.index.match(HISTORY, NOW + 11 * 10**9) == [0, 0]
