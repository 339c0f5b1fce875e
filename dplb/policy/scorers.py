"""The built-in scorers: queue, memory, latency (the seed's three terms) and prefix match (docs/DESIGN.md §5).

Each returns one value in [0, 1] per candidate, higher is better (so each is marked ``bounded``: the framework
skips its clamp); the policy adds them up with the configured weights (seed article: ``0.4·queue + 0.3·memory +
0.3·latency``). Each declares its parameters (``--scorer-param NAME.PARAM=VALUE``; the older flags are their
defaults). Table-driven tests: tests/test_scorers.py.

- ``queue``: ``1 − queue/max(max_queue, top)`` with ``queue`` = running + waiting + the router's in-flight correction
  (requests it sent that the worker's snapshot may not count yet; without it a burst inside one 200 ms state
  interval herds onto one worker — vLLM's DP client keeps the same correction, ``vllm/v1/engine/core_client.py``)
  and ``top`` the longest such queue among this pick's eligible candidates. Within ``max_queue`` this is the seed's
  term; past it the term is relative to the longest queue, so it orders the workers by corrected queue at any depth.
  (Clamped at 0 instead, every term was 0 once each worker had ``max_queue`` queued — 16; vLLM runs 256 at once —
  and the latency/memory terms, constant within a snapshot, sent a whole burst to one worker: 10/290 of 300.) A
  worker ahead by ``Δ`` on the other weighted terms now takes picks until ``w_queue·(1 − q/top) = Δ``: its queue
  leads by at most the ratio ``1 − Δ/w_queue`` (seed weights, a full latency gap: 4×), a tilt, not a herd.
  ``waiting_weight`` > 1 counts requests that must wait for a batch slot that many times (vLLM DP: 4); with it or
  per-worker caps the term is ``1 − f/max(1, top_f)`` on each worker's fullness ``f = queue/cap``. The other clamps
  cannot herd: saturated workers tie on them and the queue term decides. ``memory`` clamps at a real bound (a full
  KV cache); ``latency`` at 0 past the baseline, kept absolute because at depth a recent E2E mostly re-measures the
  queue already counted, 10 requests late; ``prefix`` keeps its headroom ``1 − queue/max_queue``: 0 for every
  worker past ``max_queue`` (a worker that full spills), shrinking with the corrected queue below it.
- ``memory``: ``1 − KV-cache usage`` (default; vLLM pre-allocates ~90 % of GPU memory, so NVML "used" is flat) or
  ``1 − NVML used/total`` (``memory_signal="gpu"``; no GPU → 1).
- ``latency``: ``1 − latency/baseline``; ``latency`` is the worker's mean E2E (or TTFT) of its last 10 requests,
  ``baseline`` the P95 of the first ``baseline_window`` requests (1 for everyone until then). A busy worker (queue
  > 0) is scored by its own mean. An idle worker's mean would never change without new requests, so it is trusted
  while it is recent and blends toward the fleet's as it ages: its effective latency is ``f·own + (1 − f)·ref`` with
  freshness ``f = 2^(−age/half_life_s)`` (``age``: since its last latency sample, the slot's ``last_done_mono_ns``;
  ``f`` = 0 when unknown) and ``ref`` the lower of the eligible workers' freshness-weighted mean latency
  ``Σ f_i·lat_i / Σ f_i`` (busy ones with ``f`` = 1) and their plain mean. The weighted mean lets a slow figure
  that aged out stop counting (with the plain one a 10× slower worker converges to a reference its fast, fresh
  peers never reach, and starves); the plain mean keeps one fresh slow figure from dragging its idle peers' aged
  ones up to its own (all past the baseline, clamped to 0: a tie the slow worker wins in turn). So a worker that served
  a slow request seconds ago scores worse than its fast peers and is left alone at light load (where every worker
  is idle at each pick), while one slow for a burst long ago converges to the fleet's figure, ties within the
  deadband and gets a request again — a probe that refreshes its figure (recovered: each fast probe lowers its
  10-request mean and it climbs back; still slow: it is left alone for a few more half-lives). ``half_life_s``
  defaults to 30 s, Envoy's default ``base_ejection_time`` for an outlier (Envoy docs, "Outlier detection"):
  among three workers, a 10× slower one enters the default deadband (0.25) after 5.0 half-lives (2.5 min), a 3×
  slower one after 2.8 (computed from the rule above), so at light load a still-slow worker gets about one probe
  per 2.5 min (tests/test_slow_worker.py holds both behaviours with real sim workers). The prefix term does not
  yield to a slower holder (scorers are independent terms; docs/DESIGN.md §5).
  A worker with no sample gets the mean term of the others (the neutral fill); workers within ``latency_deadband``
  of the eligible workers' mean (effective latencies) share that mean's term (equal workers differ by noise, which
  would outweigh one queued request).
- ``prefix``: how much of the prompt's *distinguishing* prefix the worker has cached, discounted by its queue headroom.
  It owns the prefix end to end: its ``prepare`` hook cuts the request's raw prompt bytes into chained block keys
  (:func:`dplb.policy.prefix.block_hashes`, ``block_bytes``, at most ``max_blocks``), it keeps the index, records each
  routed request's blocks for its worker (and hands the new keys to the other router processes in ``request.learned``),
  applies theirs (``absorb``), and reports the routed outcome in its ``notes``
  (:data:`~dplb.policy.decision.NOTE_PREFIX_OUTCOME` …) and the index size in ``stats()``. From the prefix index
  (:class:`dplb.policy.prefix.PrefixIndex`): ``prefix_match`` = matched leading blocks ÷ blocks, per worker. The term is
  ``(match − min_match)/(1 − min_match) · max(0, 1 − queue/max_queue)`` with ``min_match`` the lowest match among the
  eligible workers: a system prompt every worker has cached cancels out, so a conversation's next turn is pulled to the
  worker holding its history (with a plain ratio, turn 2 of a chat with a 600-word system prompt differs by ~0.1 between
  workers, less than one queued request). The headroom factor is the spill rule (a queue-aware weight, like SGLang's
  balance thresholds but continuous): a worker's prefix advantage shrinks as it fills, so a hot prefix spills to a
  second worker instead of queueing. With the default weights (queue 0.3, prefix 0.3, max_queue 16) a full-match worker
  keeps winning against an idle one while ``(0.3 + 0.3)·(1 − q/16) > 0.3``, i.e. up to 8 queued requests; see
  tests/test_scorers.py::test_hot_prefix_spills.
  ``score="cost"`` (``--scorer-param prefix.score=cost``; default ``match``, above) uses NVIDIA Dynamo's KV-router cost
  instead of the match ratio (docs.nvidia.com/dynamo, Router → "Routing Concepts", "Cost Calculation": cost =
  ``overlap_score_weight`` · prefill blocks + decode blocks, the lowest cost wins; weight 1 here, Dynamo's default):
  ``cost = (blocks − matched) + queue · blocks`` in prompt blocks, i.e. the uncached prompt blocks this worker must
  prefill plus its active blocks, approximated as its queue (the same ``queue`` as above) times this prompt's blocks
  (the router knows no other request's length). Mapped to [0, 1], higher better, among the eligible workers:
  ``(max_cost − cost)/(max_cost − min_cost)``, times the same headroom factor (the spill rule kept), and 0 for all
  when nobody matches more than the rest (the queue term carries load alone then) or the costs tie. One queued
  request weighs as much as the whole prompt uncached, so this term leans to load far more than ``match``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

from dplb.config import MAX_PREFIX_BLOCK_BYTES, PolicyConfig
from dplb.native import mypyc_attr
from dplb.policy.decision import (
    NOTE_PREFIX_BLOCKS,
    NOTE_PREFIX_HIT_BLOCKS,
    NOTE_PREFIX_HIT_BYTES,
    NOTE_PREFIX_OUTCOME,
    OK,
    PREFIX_HIT,
    PREFIX_MISS,
    PREFIX_SPILL,
    STAT_INDEX_BLOCKS,
    STAT_INDEX_BYTES,
    STAT_INDEX_CAPACITY,
    Candidate,
)
from dplb.policy.framework import Param, PickContext, RouteRequest, Scorer, max_queue_of
from dplb.policy.prefix import ENTRY_BYTES, MAX_PREFIX_BLOCKS, SPECULATIVE_TTL_S, PrefixIndex, block_hashes
from dplb.state.shm import WorkerState


def queue_terms(queues: Sequence[int], top: int) -> list[float]:
    """The plain queue terms ``1 − queue/top``, clamped at 0, one per queue (requests, corrected); ``top`` (> 0):
    ``max(max_queue, the longest eligible queue)`` (module docstring). Shared by :class:`QueueScorer` and
    :mod:`dplb.policy.fused`, so both compute the same floats."""
    out = []
    for q in queues:
        t = 1.0 - q / top
        out.append(t if t > 0.0 else 0.0)
    return out


# Subclassed by plugins (not compiled): allowed (dplb.native).
@mypyc_attr(allow_interpreted_subclasses=True)
class QueueScorer(Scorer):
    """``1 − queue/max(max_queue, the longest eligible queue)``, clamped to [0, 1] (see the module docstring)."""

    name = "queue"
    bounded = True
    parameters = (Param("waiting_weight", float, field="waiting_weight", check=lambda v: v >= 1.0, expect="≥ 1",
                        help="a request waiting for a batch slot counts this many times (--waiting-weight)"),)

    def __init__(self, cfg: PolicyConfig, num_workers: int) -> None:
        super().__init__(cfg, num_workers)
        self.waiting_weight: float = self.params["waiting_weight"]

    def score(self, cands: list[Candidate], ctx: PickContext) -> list[float]:
        cfg = self.cfg
        ww1 = self.waiting_weight - 1.0
        if ww1 <= 0.0 and not cfg.max_queue_from_worker:  # the default: one cap, every request counts once
            top = cfg.max_queue  # the normalizer: max(max_queue, the longest eligible queue)
            for c in cands:
                if c.why is OK and c.queue > top:
                    top = c.queue
            return queue_terms([c.queue for c in cands], top)
        fulls = []  # each worker's queue over its own cap
        top_full = 1.0
        for c in cands:
            w = c.state
            q = float(c.queue)
            if ww1 > 0.0:  # requests that will wait for a batch slot weigh more (PolicyConfig.waiting_weight)
                if w.num_waiting > 0:
                    q += ww1 * (w.num_waiting + c.correction)
                elif w.max_num_seqs > 0 and w.num_running + c.correction > w.max_num_seqs:
                    q += ww1 * (w.num_running + c.correction - w.max_num_seqs)
            f = q / max_queue_of(w, cfg)
            fulls.append(f)
            if c.why is OK and f > top_full:
                top_full = f
        out = []
        for f in fulls:
            t = 1.0 - f / top_full
            out.append(t if t > 0.0 else 0.0)
        return out

    def inputs(self, c: Candidate, ctx: PickContext) -> dict[str, Any]:
        return {"max_queue": max_queue_of(c.state, self.cfg)}


def memory_ratio(w: WorkerState, signal: str) -> float:
    """The memory input of worker state ``w``: KV-cache usage (``signal="kv"``) or NVML used/total (``"gpu"``; 0
    without a GPU), ratio 0–1."""
    if signal == "kv":
        return w.kv_cache_usage
    total = w.gpu_memory_total_bytes
    return w.gpu_memory_used_bytes / total if total > 0 else 0.0


# Subclassed by plugins (not compiled): allowed (dplb.native).
@mypyc_attr(allow_interpreted_subclasses=True)
class MemoryScorer(Scorer):
    """``1 − memory ratio``, clamped to [0, 1]."""

    name = "memory"
    bounded = True
    parameters = (Param("signal", str, field="memory_signal", choices=("kv", "gpu"),
                        help="KV-cache usage or NVML used/total (--memory-signal)"),)

    def __init__(self, cfg: PolicyConfig, num_workers: int) -> None:
        super().__init__(cfg, num_workers)
        self.signal: str = self.params["signal"]

    def score(self, cands: list[Candidate], ctx: PickContext) -> list[float]:
        kv = self.signal == "kv"  # the common case without a call per candidate
        out = []
        for c in cands:
            r = c.state.kv_cache_usage if kv else memory_ratio(c.state, self.signal)
            out.append(0.0 if r > 1.0 else (1.0 if r < 0.0 else 1.0 - r))
        return out

    def inputs(self, c: Candidate, ctx: PickContext) -> dict[str, Any]:
        return {"memory_ratio": memory_ratio(c.state, self.signal)}


def deadband(timed: list[int], lats: list[float], base: float, band: float) -> tuple[float, list[int]]:
    """The latency term's deadband (module docstring): the term of the mean of ``lats`` (the eligible workers with a
    current sample, ``timed`` their indices, latencies in seconds; ``base``: the baseline, seconds) and the indices
    whose latency is within ``band`` (a fraction) of that mean, who get it. ``(0.0, [])`` when ``band`` is 0 or
    fewer than two workers are timed. Used by :func:`settle_latency` and, unchanged inputs kept, by
    :class:`dplb.policy.fused.FastPick`."""
    inside: list[int] = []
    if not (band > 0.0 and len(timed) > 1):
        return 0.0, inside
    mean = sum(lats) / len(lats)
    tm = 1.0 - mean / base
    tm = tm if tm > 0.0 else 0.0
    lim = band * mean
    neg = -lim
    for j, lat in enumerate(lats):  # timed[j] is the worker of lats[j] (no zip: its keyword costs more)
        d = lat - mean
        if neg <= d and d <= lim:  # |lat − mean| ≤ lim without a call (nor a chained comparison)
            inside.append(timed[j])
    return tm, inside


#: Default half-life of an idle worker's latency figure, seconds (module docstring: Envoy's default outlier
#: ``base_ejection_time``, 30 s).
LATENCY_HALF_LIFE_S: Final = 30.0


def decay_per_ns(half_life_s: float) -> float:
    """The freshness exponent per nanosecond for ``half_life_s`` (seconds, > 0): ``−ln 2 / (half_life_s·1e9)``, so
    ``exp(decay·age_ns) = 2^(−age/half_life)``."""
    return -math.log(2.0) / (half_life_s * 1e9)


def freshness(now_ns: int, done_ns: int, decay: float) -> float:
    """How much an idle worker's own latency figure still counts, in [0, 1]: ``exp(decay·(now_ns − done_ns))``
    (``decay`` from :func:`decay_per_ns`; ns CLOCK_MONOTONIC), 1 for a sample taken at or after ``now_ns``, 0 when
    ``done_ns`` is 0 (the worker did not say when: an older worker build)."""
    if done_ns <= 0:
        return 0.0
    age = now_ns - done_ns
    return math.exp(decay * age) if age > 0 else 1.0


def age_latency(terms: list[float], idle: list[int], idle_lats: list[float], fresh: list[float], sw: float,
                swl: float, timed: list[int], lats: list[float], base: float) -> None:
    """The idle workers' effective latencies (module docstring), in place: for each eligible idle worker with a
    sample (``idle``: indices into ``terms``, ``idle_lats`` its own mean in seconds, ``fresh`` its freshness) the
    term of ``f·own + (1 − f)·ref`` goes into ``terms`` and the worker, with that latency, joins ``timed``/``lats``
    (the deadband's inputs). ``timed``/``lats`` hold the eligible busy workers on entry. ``sw``/``swl``: Σ f and
    Σ f·latency over every eligible worker with a sample, busy ones with f = 1, in candidate order; ``ref`` is the
    lower of ``swl/sw`` and the plain mean of those latencies (module docstring); ``base``: the baseline, seconds.
    Shared by :class:`LatencyScorer` and :mod:`dplb.policy.fused`."""
    if not idle:
        return
    ref = (sum(lats, 0.0) + sum(idle_lats, 0.0)) / (len(lats) + len(idle))
    if sw > 0.0 and swl / sw < ref:
        ref = swl / sw
    for j, i in enumerate(idle):
        f = fresh[j]
        eff = f * idle_lats[j] + (1.0 - f) * ref
        t = 1.0 - eff / base
        terms[i] = t if t > 0.0 else 0.0
        timed.append(i)
        lats.append(eff)


def settle_latency(states: Sequence[WorkerState], terms: list[float], timed: list[int], lats: list[float],
                   base: float, band: float, fill: bool) -> list[float]:
    """The latency term's deadband and neutral fill (module docstring), in place on ``terms`` (one per candidate;
    −1 marks a worker without a current sample) and returned. ``states``: the candidates' worker states, in the
    same order (read only when ``fill``); ``timed``/``lats``: the eligible workers with a sample (indices into
    ``terms``) and their latencies, seconds; ``base``: the baseline, seconds; ``band``: the deadband fraction;
    ``fill``: some term is −1. Shared by :class:`LatencyScorer` and the fused passes (:mod:`dplb.policy.fused`),
    so both compute the same floats."""
    tm, inside = deadband(timed, lats, base, band)
    for i in inside:
        terms[i] = tm
    if fill:  # every other term is ≥ 0
        have = [t for w, t in zip(states, terms, strict=True) if t >= 0.0 and w.pid]
        neutral = sum(have) / len(have) if have else 1.0
        for j, t in enumerate(terms):
            if t < 0.0:
                terms[j] = neutral
    return terms


# Subclassed by plugins (not compiled): allowed (dplb.native).
@mypyc_attr(allow_interpreted_subclasses=True)
class LatencyScorer(Scorer):
    """``1 − latency/baseline`` with aged idle figures, neutral fill and a deadband (see the module docstring)."""

    name = "latency"
    bounded = True
    parameters = (Param("deadband", float, field="latency_deadband", check=lambda v: 0.0 <= v < 1.0,
                        expect="a fraction in [0, 1)", help="latencies this close to the mean count as equal "
                        "(--latency-deadband)"),
                  Param("half_life_s", float, default=LATENCY_HALF_LIFE_S, check=lambda v: v > 0.0,
                        expect="> 0 seconds", help="an idle worker's own latency figure counts half after this "
                        "long, and blends toward the fleet's"))

    def __init__(self, cfg: PolicyConfig, num_workers: int) -> None:
        super().__init__(cfg, num_workers)
        self.deadband: float = self.params["deadband"]
        self.decay: float = decay_per_ns(self.params["half_life_s"])

    def signal(self, c: Candidate) -> float:
        """The latency this scorer uses for ``c``: mean E2E or mean TTFT of its last 10 requests, seconds."""
        return c.state.avg_ttft_s if self.cfg.latency_signal == "ttft" else c.state.avg_latency_s

    def score(self, cands: list[Candidate], ctx: PickContext) -> list[float]:
        base = ctx.baseline_s
        if base is None:
            return [1.0] * len(cands)
        ttft = self.cfg.latency_signal == "ttft"
        now, decay = ctx.now_ns, self.decay
        out: list[float] = []
        timed: list[int] = []  # indices of the eligible workers with a current sample (the deadband's mean)
        lats: list[float] = []  # their latencies
        idle: list[int] = []  # the eligible idle workers with a sample: index, own latency, freshness
        idle_lats: list[float] = []
        fresh: list[float] = []
        sw = swl = 0.0
        fill = False  # some worker has no sample yet (or is idle and ineligible): the peers' mean below
        for i, c in enumerate(cands):
            lat = c.state.avg_ttft_s if ttft else c.state.avg_latency_s
            if lat <= 0.0 or not (c.queue or c.why is OK):
                out.append(-1.0)
                fill = True
            elif not c.queue:
                f = freshness(now, c.state.last_done_mono_ns, decay)
                out.append(-1.0)  # set by age_latency
                idle.append(i)
                idle_lats.append(lat)
                fresh.append(f)
                sw += f
                swl += f * lat
            else:
                t = 1.0 - lat / base
                out.append(t if t > 0.0 else 0.0)
                if c.why is OK:
                    timed.append(i)
                    lats.append(lat)
                    sw += 1.0
                    swl += lat
        age_latency(out, idle, idle_lats, fresh, sw, swl, timed, lats, base)
        return settle_latency([c.state for c in cands] if fill else (), out, timed, lats, base, self.deadband, fill)

    def inputs(self, c: Candidate, ctx: PickContext) -> dict[str, Any]:
        done = c.state.last_done_mono_ns
        return {"latency_s": self.signal(c), "latency_signal": self.cfg.latency_signal, "baseline_s": ctx.baseline_s,
                "latency_age_s": (ctx.now_ns - done) / 1e9 if done > 0 else None,
                "latency_freshness": 1.0 if c.queue else freshness(ctx.now_ns, done, self.decay)}


class _Query:
    """The prefix scorer's view of one request: its block keys and, once scored, each worker's matched depth."""

    __slots__ = ("blocks", "confirmed", "depth")

    def __init__(self, blocks: list[int]) -> None:
        self.blocks = blocks
        self.depth: list[int] | None = None
        self.confirmed: list[int] | None = None  # engine-confirmed depths, computed for views only


# Subclassed by code mypyc does not compile (tests, the bench oracle): allowed (dplb.native).
@mypyc_attr(allow_interpreted_subclasses=True)
class PrefixScorer(Scorer):
    """Prefix-cache affinity from the router's prefix index (see the module docstring). Owns the hashing and the
    index: records each routed request's blocks for its worker, applies the other router processes' entries and
    forgets a restarted worker."""

    name = "prefix"
    bounded = True
    parameters = (
        Param("block_bytes", int, field="prefix_block_bytes", check=lambda v: 1 <= v <= MAX_PREFIX_BLOCK_BYTES,
              expect=f"1..{MAX_PREFIX_BLOCK_BYTES} bytes", help="prompt block size (--prefix-block-bytes)"),
        Param("index_blocks", int, field="prefix_index_blocks", check=lambda v: v > 0, expect="> 0 blocks",
              help=f"prefix index capacity, ~{round(ENTRY_BYTES, -1)} bytes a block (--prefix-index-blocks)"),
        Param("ttl_s", float, field="prefix_ttl_s", check=lambda v: v > 0, expect="> 0 seconds",
              help="forget a block not sent for this long (--prefix-ttl)"),
        Param("max_blocks", int, default=MAX_PREFIX_BLOCKS, check=lambda v: 1 <= v <= MAX_PREFIX_BLOCKS,
              expect=f"1..{MAX_PREFIX_BLOCKS} blocks", help="most blocks hashed per prompt"),
        Param("truth", str, default="events", choices=("events", "sent"),
              help="events: follow what each event-fed worker's engine holds (its KV ring), the sent-bytes index "
                   "for the others; sent: the sent-bytes index for every worker"),
        Param("speculative_ttl_s", float, default=SPECULATIVE_TTL_S, check=lambda v: v > 0, expect="> 0 seconds",
              help="an event-fed worker counts a block it was sent but has not confirmed for this long"),
        Param("score", str, default="match", choices=("match", "cost"),
              help="match: the distinguishing matched share of the prompt; cost: NVIDIA Dynamo's KV-router cost "
                   "(uncached prompt blocks + queue × prompt blocks, lower is better)"),
    )

    def __init__(self, cfg: PolicyConfig, num_workers: int) -> None:
        super().__init__(cfg, num_workers)
        p = self.params
        self.block_bytes: int = p["block_bytes"]
        self.max_blocks: int = p["max_blocks"]
        self.index = PrefixIndex(p["index_blocks"], p["ttl_s"], num_workers, p["speculative_ttl_s"])
        self.follow_engines = p["truth"] == "events"
        self.cost = p["score"] == "cost"

    def prepare(self, request: RouteRequest) -> None:
        blocks = block_hashes(request.prompt, self.block_bytes, self.max_blocks)
        if blocks:
            request.derived["prefix"] = _Query(blocks)

    def score(self, cands: list[Candidate], ctx: PickContext) -> list[float]:
        req = ctx.request
        q = req.derived.get("prefix")
        if q is None:
            return [0.0] * len(cands)
        blocks = q.blocks
        depth = q.depth = self.index.match(blocks, ctx.now_ns)
        lo = best = -1  # the lowest and highest match among the eligible, and the first eligible with the highest
        pref = 0
        for c in cands:
            if c.why is OK:
                d = depth[c.worker_id]
                if d > best:
                    if best < 0:
                        lo = d
                    best, pref = d, c.worker_id
                elif d < lo:
                    lo = d
        if best == lo:  # nobody eligible, or nobody has more than the rest: no preference
            return [0.0] * len(cands)
        req.preferred = pref
        span = len(blocks) - lo
        cfg = self.cfg
        mq = 0 if cfg.max_queue_from_worker else cfg.max_queue
        if self.cost:
            return self._cost_terms(cands, depth, len(blocks), mq)
        out = []
        for c in cands:
            d = depth[c.worker_id]
            if d <= lo:
                out.append(0.0)
                continue
            head = 1.0 - c.queue / (mq or max_queue_of(c.state, cfg))
            out.append((d - lo) / span * head if head > 0.0 else 0.0)
        return out

    def _cost_terms(self, cands: list[Candidate], depth: list[int], n: int, mq: int) -> list[float]:
        """The ``score="cost"`` terms (module docstring): Dynamo's cost ``(n − matched) + queue·n`` in blocks for a
        prompt of ``n`` blocks, scaled so the eligible workers' lowest cost is 1 and their highest 0, times the
        headroom ``1 − queue/max_queue`` (``mq``: the cap, 0 = each worker's own); all 0 when the costs tie."""
        costs = [n - depth[c.worker_id] + c.queue * n for c in cands]
        elig = [k for c, k in zip(cands, costs, strict=True) if c.why is OK]
        hi, lo = max(elig), min(elig)
        if hi == lo:
            return [0.0] * len(cands)
        cfg = self.cfg
        out = []
        for c, k in zip(cands, costs, strict=True):
            head = 1.0 - c.queue / (mq or max_queue_of(c.state, cfg))
            t = (hi - k) / (hi - lo) * head if head > 0.0 and k < hi else 0.0
            out.append(1.0 if t > 1.0 else t)  # an ineligible worker may cost less than the eligible ones
        return out

    def inputs(self, c: Candidate, ctx: PickContext) -> dict[str, Any]:
        q = ctx.request.derived.get("prefix")
        n = len(q.blocks) if q is not None else 0
        d = q.depth[c.worker_id] if q is not None and q.depth is not None else 0
        if q is not None and q.confirmed is None:
            q.confirmed = self.index.confirmed(q.blocks)
        conf = q.confirmed[c.worker_id] if q is not None and q.confirmed is not None else 0
        return {"prefix_blocks": n, "prefix_matched_blocks": d, "prefix_match": d / n if n else 0.0,
                "prefix_confirmed_blocks": conf, "prefix_engine_events": bool(self.index.events >> c.worker_id & 1)}

    def on_pick(self, request: RouteRequest, worker: int, now_ns: int) -> None:
        """Record the request's blocks for ``worker`` (``request.learned``: the keys the index learnt)."""
        q = request.derived.get("prefix")
        if q is not None:
            request.learned = self.index.record(q.blocks, worker, now_ns)

    def notes(self, request: RouteRequest, worker: int) -> dict[str, Any] | None:
        """The routed outcome: hit (the longest match got it), spill (another worker did) or miss (no worker had
        more than the rest), the prompt's blocks and the blocks the index says ``worker`` has."""
        q = request.derived.get("prefix")
        if q is None or q.depth is None:
            return None
        depth, pref = q.depth, request.preferred
        outcome = PREFIX_MISS if pref is None else PREFIX_HIT if depth[worker] >= depth[pref] else PREFIX_SPILL
        return {NOTE_PREFIX_OUTCOME: outcome, NOTE_PREFIX_BLOCKS: len(q.blocks), NOTE_PREFIX_HIT_BLOCKS: depth[worker],
                NOTE_PREFIX_HIT_BYTES: depth[worker] * self.block_bytes}

    def forget_worker(self, worker: int) -> None:
        self.index.forget_worker(worker)

    def absorb(self, entries: Mapping[int, Sequence[int]], now_ns: int) -> None:
        record = self.index.record
        for worker, keys in entries.items():
            if 0 <= worker < self.num_workers:
                record(keys, worker, now_ns)

    def absorb_engine(self, entries: Mapping[int, Sequence[int]] | None, events_mask: int, now_ns: int) -> None:
        if not self.follow_engines:
            return
        idx = self.index
        idx.events = events_mask
        if entries:
            for worker, raw in entries.items():
                if 0 <= worker < self.num_workers:
                    idx.apply_engine(worker, raw, now_ns)

    def stats(self) -> dict[str, float]:
        idx = self.index
        return {STAT_INDEX_BLOCKS: len(idx), STAT_INDEX_CAPACITY: idx.capacity, STAT_INDEX_BYTES: idx.approx_bytes}
