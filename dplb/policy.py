"""Routing policies: turn a shm snapshot into a :class:`Decision` (DESIGN §3). The load balancer's core.

Contract
- :meth:`Policy.pick` is synchronous and does no I/O, no awaits and no locking. Its only side effects are on the
  policy's own small state (rotation index, RNG, the optimistic in-flight correction). Given the same inputs and
  the same state it returns the same decision.
- Every decision (:class:`dplb.decision.Decision`) carries, for every worker, its inputs, each term, its score and
  why it was or was not eligible, plus the chosen worker and the reason. Traces, ``/debug/decisions`` and metrics
  publish exactly that.
- Eligible = registered, not torn, heartbeat younger than 3 × state interval, lifecycle ``ready``, and (with a
  hard cap) queue below the cap. Stale, draining, starting/warming and stopped workers are never picked.

The seed score (seed article; DESIGN §3), higher is better, each term clamped to [0, 1]::

    score = 0.4·(1 − queue/max_queue) + 0.3·(1 − memory_used/memory_total) + 0.3·(1 − avg_latency/baseline)

- ``queue`` = num_waiting + num_running from shm + the optimistic in-flight correction: requests this router sent
  to the worker that its last published snapshot may not count yet — those sent after that snapshot's heartbeat
  minus half a state interval. A request sent just before a snapshot is often still in a socket or being parsed
  when the worker counts its queue; forgetting it then made bursts of 64 split up to 20/14/15/15 (and once 2:1) in
  the burst-herd benchmark. vLLM's own DP client keeps a similar correction (``vllm/v1/engine/core_client.py``,
  DPLBAsyncMPClient); without one a burst inside one 200 ms window herds onto one worker.
- memory: KV-cache usage (default) or NVML used/total (``memory_signal="gpu"``; a worker with no GPU gives 0).
- ``baseline`` = P95 (nearest-rank: the ⌈0.95·n⌉-th smallest) of the first ``baseline_window`` (50) completed
  request latencies fed to :meth:`Policy.observe_latency`; then frozen. Until it exists the latency term is 1 for
  every worker; a worker with no latency sample yet (just started or restarted; the warm-up request does not count)
  or with nothing queued (idle: its mean is old news and would never change without new requests, so a once-slow
  worker would starve) gets the mean latency term of its peers — neutral, so a fresh worker does not attract a
  whole burst and an idle one is not shunned.

Ties: the shorter queue wins (this still separates workers once every queue is past ``max_queue``, where the clamped
queue term is 0 for all), then rotation: the scan starts one worker later on every pick.
Prefix affinity (dplb policy): a 64-bit hash of the prompt prefix; the worker that first served a prefix is remembered
(bounded LRU) and wins later requests with that prefix while its score ≥ best − ``affinity_margin`` (see
:class:`ScorePolicy`). The ``prefix_hash`` policy is pure affinity by rendezvous (highest-random-weight) hashing
(Thaler & Ravishankar, 1998), blind to load.

Other policies behind the same interface: ``round_robin``, ``random``, ``least_loaded`` (vLLM DP: minimum of
4·waiting + running, the correction counted as waiting), ``power_of_two`` (two random eligible workers, the
shorter queue wins), ``prefix_hash`` (pure prefix affinity, blind to load: the hit-rate reference).
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import ClassVar, Final

from dplb.config import PolicyConfig
from dplb.decision import (
    _CORR,
    _QUEUE,
    _SCORE,
    _STATE,
    _TL,
    _TM,
    _TQ,
    _WHY,
    OK,
    REASON_AFFINITY,
    REASON_ALL_OVER_CAP,
    REASON_NO_WORKERS,
    REASON_NONE_ROUTABLE,
    REASON_POLICY,
    REASON_SCORE,
    WHY_DRAINING,
    WHY_EXCLUDED,
    WHY_NOT_READY,
    WHY_OVER_CAP,
    WHY_STALE,
    WHY_TORN,
    WHY_UNREGISTERED,
    Decision,
    _Row,
)
from dplb.shm import STALE_INTERVALS, Lifecycle, WorkerState

#: Prompt prefixes whose worker the dplb policy remembers (LRU; ~100 bytes each, so ~1.6 MB at most).
AFFINITY_PREFIXES: Final = 16384

_READY = Lifecycle.READY
_DRAINING = Lifecycle.DRAINING



class Policy:
    """Base policy: eligibility, the in-flight correction, the latency baseline and tie rotation.

    Subclasses implement :meth:`_choose`. Build one with :func:`make_policy`.
    """

    name: ClassVar[str] = "base"

    def __init__(self, cfg: PolicyConfig, num_workers: int) -> None:
        self.cfg = cfg
        self.num_workers = num_workers
        self._stale_ns = STALE_INTERVALS * cfg.state_interval_ms * 1_000_000
        # Send times (CLOCK_MONOTONIC ns) of the requests each worker's published queue may not count yet.
        self._sent_at: list[deque[int]] = [deque() for _ in range(num_workers)]
        self._grace_ns = cfg.state_interval_ms * 1_000_000 // 2
        self._seen_hb = [0] * num_workers
        self._rot = 0
        self._rng = random.Random(cfg.seed)
        self._latencies: list[float] = []
        self.baseline_s: float | None = None

    # ---- feedback ------------------------------------------------------------------------------------------
    def observe_latency(self, seconds: float, ttft_s: float | None = None) -> None:
        """Feed one completed request's E2E latency and time to first body byte (seconds; TTFT of a stream).
        After ``baseline_window`` of them the baseline is frozen at the P95 (nearest rank) of the configured
        ``latency_signal``."""
        if self.cfg.latency_signal == "ttft":
            if ttft_s is None:
                return
            seconds = ttft_s
        if self.baseline_s is not None or not math.isfinite(seconds) or seconds <= 0:
            return
        self._latencies.append(seconds)
        if len(self._latencies) >= self.cfg.baseline_window:
            ordered = sorted(self._latencies)
            self.baseline_s = ordered[math.ceil(0.95 * len(ordered)) - 1]
            self._latencies = []

    def correction(self, worker_id: int) -> int:
        """Requests sent to ``worker_id`` since its last published snapshot."""
        return len(self._sent_at[worker_id])

    # ---- picking -------------------------------------------------------------------------------------------
    def pick(
        self, snapshot: Sequence[WorkerState], now_mono_ns: int, prefix_hash: int | None = None,
        exclude: frozenset[int] | set[int] = frozenset(), dry_run: bool = False,
    ) -> Decision:
        """Choose a worker for one request.

        ``snapshot``: one :class:`WorkerState` per worker (ids 0..n−1), as read from shm just now.
        ``now_mono_ns``: CLOCK_MONOTONIC ns (staleness). ``prefix_hash``: 64-bit hash of the prompt prefix, or
        None. ``exclude``: workers not to pick (a failed connect on the first choice).
        Returns a :class:`Decision`; ``worker`` is None when nobody is eligible (``reason`` says why). The chosen
        worker's in-flight correction is incremented. ``dry_run=True`` evaluates without choosing for real (no
        rotation, no correction): what a metrics scrape uses.
        """
        n = len(snapshot)
        rows: list[_Row] = [None] * n  # type: ignore[list-item]  # filled below, in id order
        eligible: list[_Row] = []  # in rotated order, so ties go to a different worker each pick
        any_registered = any_ready = False
        cfg = self.cfg
        cap = cfg.hard_queue_cap
        wq, wm, wl = cfg.weights
        kv_signal = cfg.memory_signal == "kv"
        ttft_signal = cfg.latency_signal == "ttft"
        ww1 = cfg.waiting_weight - 1.0
        mq_default = cfg.max_queue
        mq_worker = cfg.max_queue_from_worker
        base = self.baseline_s
        no_lat = False
        stale_ns = self._stale_ns
        sent_at = self._sent_at
        grace_ns = self._grace_ns
        seen = self._seen_hb
        start = self._rot % n if n else 0
        if not dry_run:
            self._rot += 1
        for i in range(n):
            w = snapshot[(start + i) % n]
            k = w.worker_id
            hb = w.heartbeat_mono_ns
            q = sent_at[k]
            if hb != seen[k]:
                seen[k] = hb
                cutoff = hb - grace_ns
                while q and q[0] < cutoff:
                    q.popleft()
            corr = len(q)
            queue = w.num_running + w.num_waiting + corr
            age_ns = now_mono_ns - hb
            if w.pid == 0:
                why = WHY_UNREGISTERED
            elif w.torn:
                why = WHY_TORN
            elif age_ns > stale_ns:
                why = WHY_STALE
            elif w.lifecycle != _READY:
                why = WHY_DRAINING if w.lifecycle == _DRAINING else WHY_NOT_READY
            else:
                any_ready = True
                why = WHY_EXCLUDED if k in exclude else (WHY_OVER_CAP if cap and queue >= cap else OK)
            if w.pid:
                any_registered = True
            # Seed terms, each clamped to [0, 1].
            mq = w.max_num_seqs if mq_worker and w.max_num_seqs > 0 else mq_default
            qt: float = queue
            if ww1 > 0.0:  # requests that will wait for a batch slot weigh more (see PolicyConfig.waiting_weight)
                if w.num_waiting > 0:
                    qt += ww1 * (w.num_waiting + corr)
                elif w.max_num_seqs > 0 and w.num_running + corr > w.max_num_seqs:
                    qt += ww1 * (w.num_running + corr - w.max_num_seqs)
            tq = 1.0 - qt / mq
            tq = 0.0 if tq < 0.0 else tq
            if kv_signal:
                mr = w.kv_cache_usage
            else:
                total = w.gpu_memory_total_bytes
                mr = w.gpu_memory_used_bytes / total if total > 0 else 0.0
            tm = 1.0 - mr
            tm = 0.0 if tm < 0.0 else (1.0 if tm > 1.0 else tm)
            lat = w.avg_ttft_s if ttft_signal else w.avg_latency_s
            if base is None:
                tl = 1.0
            elif lat <= 0.0 or queue == 0:
                # No latency sample yet, or idle: an idle worker's mean is of requests that finished before and it
                # only changes when it gets new ones, so a once-slow worker would starve. Filled with the peers'
                # mean below.
                tl = -1.0
                no_lat = True
            else:
                tl = 1.0 - lat / base
                tl = 0.0 if tl < 0.0 else tl
            row = (w, why, corr, queue, age_ns, mq, mr, tq, tm, tl, wq * tq + wm * tm + wl * tl)
            rows[k] = row
            if why is OK:
                eligible.append(row)
        if base is not None and cfg.latency_deadband > 0.0 and len(eligible) > 1:
            eligible = self._deadband(rows, eligible, base, ttft_signal)
        if no_lat:
            eligible = self._neutral_latency(rows, eligible)
        if not eligible:
            if not any_registered:
                reason = REASON_NO_WORKERS
            elif any_ready and cap and any(r[_WHY] is WHY_OVER_CAP for r in rows):
                reason = REASON_ALL_OVER_CAP
            else:
                reason = REASON_NONE_ROUTABLE
            return Decision(self.name, None, reason, rows, base)
        if dry_run:
            return Decision(self.name, None, REASON_SCORE, rows, base)
        chosen, reason, preferred = self._choose(eligible, prefix_hash)
        sent_at[chosen].append(now_mono_ns)
        return Decision(self.name, chosen, reason, rows, base, preferred)

    def _neutral_latency(self, rows: list[_Row], eligible: list[_Row]) -> list[_Row]:
        """Give workers without a latency sample (just started or restarted) the mean latency term of the
        workers that have one, so a fresh worker is neither favoured nor penalised: a term of 1 would make it win
        every pick while its peers are loaded, and herd a burst onto it. Returns the rebuilt eligible list."""
        have = [r[_TL] for r in rows if r[_TL] >= 0.0 and r[_STATE].pid]
        neutral = sum(have) / len(have) if have else 1.0
        for i, r in enumerate(rows):
            if r[_TL] < 0.0:
                rows[i] = self._with_latency_term(r, neutral)
        return [rows[r[_STATE].worker_id] for r in eligible]

    def _with_latency_term(self, r: _Row, tl: float) -> _Row:
        """``r`` with its latency term replaced by ``tl`` and its score recomputed."""
        wq, wm, wl = self.cfg.weights
        return (*r[:_TL], tl, wq * r[_TQ] + wm * r[_TM] + wl * tl)

    def _deadband(self, rows: list[_Row], eligible: list[_Row], base: float, ttft: bool) -> list[_Row]:
        """Give every eligible worker whose mean latency is within ``latency_deadband`` (a fraction) of the
        eligible workers' mean the latency term of that mean: between equal workers the mean of 10 requests
        differs by noise (output lengths, batch luck), which would otherwise outweigh a difference of one queued
        request; a really slower worker (beyond the band) keeps its own term. Returns the rebuilt eligible list."""
        lats = [(r[_STATE].avg_ttft_s if ttft else r[_STATE].avg_latency_s) if r[_TL] >= 0.0 else 0.0
                for r in eligible]
        have = [x for x in lats if x > 0.0]
        if len(have) < 2:
            return eligible
        mean = sum(have) / len(have)
        band = self.cfg.latency_deadband * mean
        tl = 1.0 - mean / base
        tl = 0.0 if tl < 0.0 else tl
        for r, lat in zip(eligible, lats, strict=True):
            if lat > 0.0 and abs(lat - mean) <= band:
                rows[r[_STATE].worker_id] = self._with_latency_term(r, tl)
        return [rows[r[_STATE].worker_id] for r in eligible]

    def _choose(self, eligible: list[_Row], prefix_hash: int | None) -> tuple[int, str, int | None]:
        """Pick among ``eligible`` rows (rotated order). Returns (worker id, reason, affinity-preferred id)."""
        raise NotImplementedError

    def pick_without_state(self, inflight: Sequence[int], exclude: frozenset[int] | set[int] = frozenset()) -> int:
        """Fallback when the shm segment is gone: least router-side in-flight, ties rotating. Returns a worker id.

        ``inflight``: the router's own in-flight count per worker id. Every worker not in ``exclude`` is a
        candidate (there is no lifecycle to filter on); raises ``LookupError`` if all are excluded.
        """
        n = len(inflight)
        start = self._rot % n if n else 0
        self._rot += 1
        best = -1
        for i in range(n):
            k = (start + i) % n
            if k in exclude:
                continue
            if best < 0 or inflight[k] < inflight[best]:
                best = k
        if best < 0:
            raise LookupError("no worker left to try")
        return best


def rendezvous_weight(prefix_hash: int, worker_id: int) -> int:
    """Highest-random-weight hash of (prefix, worker).

    CPython's tuple hash (xxHash-based mixing since 3.8) of two ints; int hashing is not salted, so the weight
    is the same in every process and run.
    """
    return hash((prefix_hash, worker_id))


class ScorePolicy(Policy):
    """The DPLB default: best seed score, ties rotating, with prefix affinity inside a margin.

    Affinity remembers, for each recent prompt prefix, the worker that first served it (where its KV blocks are
    cached): an LRU of :data:`AFFINITY_PREFIXES` prefix hashes → worker id, so memory is bounded whatever the
    number of prefixes. A prefix seen for the first time goes to the best score (load decides where a new prefix
    lives, so prefixes spread by load instead of by hash); later requests with it go back to its worker while that
    worker's score is within ``affinity_margin`` of the best. A request whose prefix is unique (no shared system
    prompt) therefore never trades load for affinity. If the remembered worker is not eligible (stopped, draining,
    restarted), the prefix moves to the best-scored worker.
    """

    name = "dplb"

    def __init__(self, cfg: PolicyConfig, num_workers: int) -> None:
        super().__init__(cfg, num_workers)
        self._owner: OrderedDict[int, int] = OrderedDict()

    def _choose(self, eligible: list[_Row], prefix_hash: int | None) -> tuple[int, str, int | None]:
        best = eligible[0]
        best_score = best[_SCORE]
        for r in eligible:
            s = r[_SCORE]
            # Equal scores (e.g. every queue past max_queue, where the clamped term no longer tells them apart):
            # the shorter queue wins, then rotation.
            if s > best_score + 1e-12 or (s > best_score - 1e-12 and r[_QUEUE] < best[_QUEUE]):
                best, best_score = r, s
        best_id = best[_STATE].worker_id
        if prefix_hash is None or self.cfg.affinity_margin <= 0.0:
            return best_id, REASON_SCORE, None
        owners = self._owner
        owner = owners.get(prefix_hash)
        if owner is not None:
            owners.move_to_end(prefix_hash)
            for r in eligible:
                if r[_STATE].worker_id == owner:
                    if r[_SCORE] >= best_score - self.cfg.affinity_margin:
                        return owner, REASON_AFFINITY, owner
                    return best_id, REASON_SCORE, owner
        owners[prefix_hash] = best_id  # new prefix, or its worker is gone: it now lives where load sends it
        if len(owners) > AFFINITY_PREFIXES:
            owners.popitem(last=False)
        return best_id, REASON_SCORE, best_id


class RoundRobinPolicy(Policy):
    """Next eligible worker in id order (what a Kubernetes Service or Nginx does)."""

    name = "round_robin"

    def __init__(self, cfg: PolicyConfig, num_workers: int) -> None:
        super().__init__(cfg, num_workers)
        self._next = 0

    def _choose(self, eligible: list[_Row], prefix_hash: int | None) -> tuple[int, str, int | None]:
        ids = sorted(r[_STATE].worker_id for r in eligible)
        nxt = self._next % self.num_workers
        k = next((i for i in ids if i >= nxt), ids[0])
        self._next = k + 1
        return k, REASON_POLICY, None


class RandomPolicy(Policy):
    """Uniformly random eligible worker (seeded)."""

    name = "random"

    def _choose(self, eligible: list[_Row], prefix_hash: int | None) -> tuple[int, str, int | None]:
        return self._rng.choice(sorted(r[_STATE].worker_id for r in eligible)), REASON_POLICY, None


class LeastLoadedPolicy(Policy):
    """vLLM DP's rule: minimum 4·waiting + running (router correction counted as waiting), ties rotating."""

    name = "least_loaded"

    def _choose(self, eligible: list[_Row], prefix_hash: int | None) -> tuple[int, str, int | None]:
        best = min(eligible, key=lambda r: 4 * (r[_STATE].num_waiting + r[_CORR]) + r[_STATE].num_running)
        return best[_STATE].worker_id, REASON_POLICY, None


class PowerOfTwoPolicy(Policy):
    """Two distinct random eligible workers; the shorter queue wins (first sampled on a tie)."""

    name = "power_of_two"

    def _choose(self, eligible: list[_Row], prefix_hash: int | None) -> tuple[int, str, int | None]:
        if len(eligible) == 1:
            return eligible[0][_STATE].worker_id, REASON_POLICY, None
        ordered = sorted(eligible, key=lambda r: r[_STATE].worker_id)
        a, b = self._rng.sample(ordered, 2)
        return (b if b[_QUEUE] < a[_QUEUE] else a)[_STATE].worker_id, REASON_POLICY, None


class PrefixHashPolicy(Policy):
    """Pure prefix affinity, blind to load: the rendezvous-preferred worker of the prompt prefix (what a consistent
    hash on the prompt does, e.g. Nginx ``hash … consistent``). The reference for the best prefix-cache hit rate in
    ``dplb bench compare``; requests without a prefix key go to the next worker in rotation."""

    name = "prefix_hash"

    def _choose(self, eligible: list[_Row], prefix_hash: int | None) -> tuple[int, str, int | None]:
        if prefix_hash is None:
            return eligible[0][_STATE].worker_id, REASON_POLICY, None
        pid = max(eligible, key=lambda r: hash((prefix_hash, r[_STATE].worker_id)))[_STATE].worker_id
        return pid, REASON_AFFINITY, pid


_POLICIES: dict[str, type[Policy]] = {
    p.name: p
    for p in (ScorePolicy, RoundRobinPolicy, RandomPolicy, LeastLoadedPolicy, PowerOfTwoPolicy, PrefixHashPolicy)
}


def make_policy(cfg: PolicyConfig, num_workers: int) -> Policy:
    """Build the policy named by ``cfg.name`` for ``num_workers`` workers (ids 0..n−1)."""
    return _POLICIES[cfg.name](cfg, num_workers)
