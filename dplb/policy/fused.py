"""The built-in scorer set in two passes over the candidates instead of seven (docs/DESIGN.md §5).

Contract
- :meth:`FusedScores.of` returns a :class:`FusedScores` when the configured scorers are exactly the built-in
  ``queue, memory, latency`` or ``queue, memory, latency, prefix`` (the defaults, :data:`dplb.config.SEED_WEIGHTS`
  and :data:`~dplb.config.PREFIX_WEIGHTS`), of exactly these classes (not subclasses), in that order, with the
  queue term's plain form (``waiting_weight`` 1, ``max_queue_from_worker`` off) and the prefix term's match form
  (not ``score="cost"``); None otherwise, and the policy
  then runs each scorer's own ``score`` (the general path, any scorer set).
- :meth:`FusedScores.score` returns the same columns as the scorers' ``score`` methods (equal floats: every term
  is computed by the same expression in the same order, and each sum by ``sum()`` over the same values in the same
  order), sets every candidate's ``score`` to the same weighted sum as :func:`dplb.policy.core.set_scores`
  (Σ weight·term in scorer order), and has the prefix scorer's side effects (its query's ``depth``, the request's
  ``preferred``). tests/test_pick_lockstep.py runs both on random snapshots, requests and settings.
- Parameters are read once, when the policy is built (the scorers resolve theirs once, too).

Pass 1 computes the queue and memory terms, the latency term before the deadband and the prefix scorer's lowest
and highest eligible match; the deadband and the neutral fill then touch only the workers they change; pass 2
computes the prefix term and the weighted sum.
"""

from __future__ import annotations

from collections.abc import Sequence

from dplb.policy.decision import OK, Candidate
from dplb.policy.framework import PickContext, Scorer
from dplb.policy.prefix import PrefixIndex
from dplb.policy.scorers import (
    LatencyScorer,
    MemoryScorer,
    PrefixScorer,
    QueueScorer,
    _Query,
    memory_ratio,
    settle_latency,
)


class FusedScores:
    """The terms and weighted score of the built-in scorer set (see the module docstring). ``weights``: one per
    scorer, in scorer order; ``prefix``: the prefix scorer, or None for the three seed terms."""

    __slots__ = ("band", "index", "kv", "max_queue", "prefix", "signal", "ttft", "weights")

    def __init__(self, queue: QueueScorer, memory: MemoryScorer, latency: LatencyScorer, prefix: PrefixScorer | None,
                 weights: Sequence[float]) -> None:
        self.max_queue: int = queue.cfg.max_queue
        self.signal: str = memory.signal
        self.kv: bool = memory.signal == "kv"
        self.ttft: bool = latency.cfg.latency_signal == "ttft"
        self.band: float = latency.deadband
        self.prefix = prefix
        self.index: PrefixIndex | None = prefix.index if prefix is not None else None
        self.weights: tuple[float, ...] = tuple(weights)

    @staticmethod
    def of(scorers: Sequence[Scorer], weights: Sequence[float]) -> FusedScores | None:
        """The fused form of ``scorers`` (with their ``weights``), or None when it does not apply."""
        kinds = tuple(type(s) for s in scorers)
        if kinds not in ((QueueScorer, MemoryScorer, LatencyScorer), (QueueScorer, MemoryScorer, LatencyScorer,
                                                                       PrefixScorer)):
            return None
        q, m, lat = scorers[0], scorers[1], scorers[2]
        assert isinstance(q, QueueScorer) and isinstance(m, MemoryScorer) and isinstance(lat, LatencyScorer)
        if q.waiting_weight > 1.0 or q.cfg.max_queue_from_worker:
            return None
        p = scorers[3] if len(scorers) == 4 else None
        assert p is None or isinstance(p, PrefixScorer)
        if p is not None and p.cost:  # the cost form of the prefix term has only the general path
            return None
        return FusedScores(q, m, lat, p, weights)

    def score(self, cands: list[Candidate], ctx: PickContext) -> list[list[float]]:
        """The columns (one list of terms per scorer, candidate order); sets each candidate's ``score``."""
        mq = self.max_queue
        kv = self.kv
        ttft = self.ttft
        base = ctx.baseline_s
        timed = base is not None
        b = base if base is not None else 1.0
        qcol: list[float] = []
        mcol: list[float] = []
        lcol: list[float] = []
        tix: list[int] = []  # the latency scorer's eligible workers with a current sample: index, latency
        lats: list[float] = []
        fill = False
        # The prefix scorer's query: depth per worker, and the lowest/highest eligible match.
        req = ctx.request
        q: _Query | None = req.derived.get("prefix") if self.index is not None else None
        depth: list[int] | None = None
        lo = best = -1
        pref = 0
        if q is not None:
            assert self.index is not None
            depth = q.depth = self.index.match(q.blocks, ctx.now_ns)
        for i, c in enumerate(cands):
            w = c.state
            cq = c.queue
            t = 1.0 - cq / mq
            qcol.append(t if t > 0.0 else 0.0)
            r = w.kv_cache_usage if kv else memory_ratio(c, self.signal)
            mcol.append(0.0 if r > 1.0 else (1.0 if r < 0.0 else 1.0 - r))
            if timed:
                lat = w.avg_ttft_s if ttft else w.avg_latency_s
                if lat <= 0.0 or not cq:
                    lcol.append(-1.0)
                    fill = True
                else:
                    t = 1.0 - lat / b
                    lcol.append(t if t > 0.0 else 0.0)
                    if c.why is OK:
                        tix.append(i)
                        lats.append(lat)
            if depth is not None and c.why is OK:
                d = depth[c.worker_id]
                if d > best:
                    if best < 0:
                        lo = d
                    best, pref = d, c.worker_id
                elif d < lo:
                    lo = d
        if timed:
            settle_latency(cands, lcol, tix, lats, b, self.band, fill)
        else:
            lcol = [1.0] * len(cands)
        wq, wm, wl = self.weights[0], self.weights[1], self.weights[2]
        if self.prefix is None:
            for c, x, y, z in zip(cands, qcol, mcol, lcol, strict=True):
                c.score = wq * x + wm * y + wl * z
            return [qcol, mcol, lcol]
        wp = self.weights[3]
        if depth is None or best == lo:
            for c, x, y, z in zip(cands, qcol, mcol, lcol, strict=True):
                c.score = wq * x + wm * y + wl * z + wp * 0.0
            return [qcol, mcol, lcol, [0.0] * len(cands)]
        assert q is not None
        req.preferred = pref
        span = len(q.blocks) - lo
        pcol: list[float] = []
        for c, x, y, z in zip(cands, qcol, mcol, lcol, strict=True):
            d = depth[c.worker_id]
            if d <= lo:
                p = 0.0
            else:
                head = 1.0 - c.queue / mq
                p = (d - lo) / span * head if head > 0.0 else 0.0
            pcol.append(p)
            c.score = wq * x + wm * y + wl * z + wp * p
        return [qcol, mcol, lcol, pcol]
