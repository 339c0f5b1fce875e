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
  order), sets every candidate's ``score`` to the same weighted sum as :func:`dplb.policy.framework.set_scores`
  (Σ weight·term in scorer order), and has the prefix scorer's side effects (its query's ``depth``, the request's
  ``preferred``). tests/test_pick_lockstep.py runs both on random snapshots, requests and settings.
- Parameters are read once, when the policy is built (the scorers resolve theirs once, too).

Pass 1 computes the queue and memory terms, the latency term before the deadband (an idle worker's: its freshness)
and the prefix scorer's lowest and highest eligible match; the idle workers' aged latencies, the deadband and the
neutral fill then touch only the workers they change; pass 2
computes the prefix term and the weighted sum.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Final

from dplb.policy.decision import (
    OK,
    WHY_CANNOT_SERVE,
    WHY_EJECTED,
    WHY_EXCLUDED,
    WHY_HELD_OUT,
    WHY_OVER_CAP,
    WHY_STALLED,
    Candidate,
)
from dplb.policy.filters import state_why
from dplb.policy.framework import PickContext, RouteRequest, Scorer
from dplb.policy.prefix import PrefixIndex
from dplb.policy.scorers import (
    LatencyScorer,
    MemoryScorer,
    PrefixScorer,
    QueueScorer,
    _Query,
    age_latency,
    deadband,
    freshness,
    memory_ratio,
    queue_terms,
    settle_latency,
)
from dplb.state.shm import Lifecycle, WorkerState

_READY: Final = Lifecycle.READY


class FusedScores:
    """The terms and weighted score of the built-in scorer set (see the module docstring). ``weights``: one per
    scorer, in scorer order; ``prefix``: the prefix scorer, or None for the three seed terms."""

    __slots__ = ("band", "decay", "index", "kv", "max_queue", "prefix", "signal", "ttft", "weights")

    def __init__(self, queue: QueueScorer, memory: MemoryScorer, latency: LatencyScorer, prefix: PrefixScorer | None,
                 weights: Sequence[float]) -> None:
        self.max_queue: int = queue.cfg.max_queue
        self.signal: str = memory.signal
        self.kv: bool = memory.signal == "kv"
        self.ttft: bool = latency.cfg.latency_signal == "ttft"
        self.band: float = latency.deadband
        self.decay: float = latency.decay
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
        idle: list[int] = []  # the eligible idle workers with a sample: index, own latency, freshness
        idle_lats: list[float] = []
        fresh: list[float] = []
        sw = swl = 0.0
        now, decay = ctx.now_ns, self.decay
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
        top = mq  # the queue term's normalizer: max(max_queue, the longest eligible queue)
        for i, c in enumerate(cands):
            w = c.state
            cq = c.queue
            if cq >= mq:  # then cq/mq ≥ 1.0 (rounding is monotone): the term is 0 without the division
                qcol.append(0.0)
                if cq > top and c.why is OK:
                    top = cq
            else:
                t = 1.0 - cq / mq
                qcol.append(t if t > 0.0 else 0.0)
            r = w.kv_cache_usage if kv else memory_ratio(w, self.signal)
            mcol.append(0.0 if r > 1.0 else (1.0 if r < 0.0 else 1.0 - r))
            if timed:
                lat = w.avg_ttft_s if ttft else w.avg_latency_s
                if lat <= 0.0 or not (cq or c.why is OK):
                    lcol.append(-1.0)
                    fill = True
                elif not cq:
                    f = freshness(now, w.last_done_mono_ns, decay)
                    lcol.append(-1.0)  # set by age_latency
                    idle.append(i)
                    idle_lats.append(lat)
                    fresh.append(f)
                    sw += f
                    swl += f * lat
                else:
                    t = 1.0 - lat / b
                    lcol.append(t if t > 0.0 else 0.0)
                    if c.why is OK:
                        tix.append(i)
                        lats.append(lat)
                        sw += 1.0
                        swl += lat
            if depth is not None and c.why is OK:
                d = depth[c.worker_id]
                if d > best:
                    if best < 0:
                        lo = d
                    best, pref = d, c.worker_id
                elif d < lo:
                    lo = d
        if top > mq:  # some eligible queue is past max_queue: every term relative to the longest
            qcol = queue_terms([c.queue for c in cands], top)
        if timed:
            age_latency(lcol, idle, idle_lats, fresh, sw, swl, tix, lats, b)
            settle_latency([c.state for c in cands] if fill else (), lcol, tix, lats, b, self.band, fill)
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


#: One worker of a fast pick: ``(state, correction, queue, age_ns, why)`` (a :class:`Candidate`'s fields).
Row = tuple[WorkerState, int, int, int, str]


#: What one worker state alone decides (:meth:`FastPick.derive`): the state, its heartbeat, whether it passes the
#: state filters but freshness (registered, consistent, ready), running + waiting, the memory term, the latency
#: signal and its term (−1.0: no sample).
State = tuple[WorkerState | None, int, bool, int, float, float, float]
_NO_STATE: Final[State] = (None, 0, False, 0, 0.0, 0.0, 0.0)

#: The router's held, ejected and stalled workers (:meth:`dplb.policy.Policy.pick`'s arguments).
Verdicts = tuple[frozenset[int], frozenset[int], frozenset[int]]
#: :meth:`FastPick.first`'s result: rows, queue, memory and latency columns, lowest and highest eligible match,
#: the preferred worker, whether a restarted worker was forgotten.
First = tuple[list[Row], list[float], list[float], list[float], int, int, int, bool]


class FastPick:
    """The whole of a max-score pick over the built-in filters and scorer set, on columns: no
    :class:`Candidate` objects (:class:`~dplb.policy.decision.Decision` makes them if someone reads them).

    The policy (:meth:`dplb.policy.Policy.pick`) builds one with its own state, shared by reference:
    ``sent_at`` (per worker, the send times of its in-flight correction), ``seen`` (per worker, the heartbeat of
    its last snapshot), ``renew(state, sent)`` (a new snapshot: trims ``sent``; True when it forgot a
    restarted worker), ``stale_ns`` (:class:`~dplb.policy.filters.Fresh`), ``cap`` (``hard_queue_cap``, 0 = none). Each
    per-worker value is the same expression, in the same order, as the candidate path (the state filters in
    :meth:`dplb.policy.Policy._candidates`, the filter chain, :meth:`FusedScores.score`, the max-score picker), so
    the decision, every ``why``, column and score are equal (tests/test_pick_lockstep.py).

    Kept between picks, because a worker's state changes once a state interval and a pick comes far more often:
    what each worker state object alone decides (:meth:`derive`, keyed by the object: a :class:`WorkerState` is a
    value, :meth:`dplb.state.shm.Segment.read_all` shares an unchanged one between calls; dropped when the policy
    sees another snapshot of the worker, :meth:`forget`, or the baseline changes) and the last deadband (kept while
    the eligible timed workers and their latencies are equal). Both are the same function of the same inputs, so
    nothing a pick returns depends on what was kept.
    """

    __slots__ = ("banded", "base", "cap", "fused", "orders", "renew", "seen", "sent_at", "stale", "states", "top")

    def __init__(self, fused: FusedScores, sent_at: list[deque[int]], seen: list[int],
                 renew: Callable[[WorkerState, deque[int]], bool], stale_ns: int, cap: int) -> None:
        self.fused = fused
        self.sent_at = sent_at
        self.seen = seen
        self.renew = renew
        self.stale = stale_ns
        self.cap = cap
        #: Workers → the scan order of each rotation start (``start, …, n−1, 0, …, start−1``).
        self.orders: dict[int, list[tuple[int, ...]]] = {}
        #: Per worker id, what its last state seen alone decides (:meth:`derive`), for the baseline :attr:`base`.
        self.states: list[State] = [_NO_STATE] * len(seen)
        self.base = 1.0
        #: The last deadband's inputs (eligible timed workers, their latencies) and :func:`deadband`'s result.
        self.banded: tuple[list[int], list[float], tuple[float, list[int]]] = ([], [], (0.0, []))
        #: The last :meth:`first`'s queue-term normalizer, ``max(max_queue, the longest eligible queue)``: above
        #: ``max_queue`` the queue terms are relative and :meth:`weigh` computes the prefix headroom apart.
        self.top = fused.max_queue

    def first(self, snapshot: Sequence[WorkerState], now: int, req: RouteRequest, verdicts: Verdicts,
              inflight: Sequence[int] | None, shared: Sequence[int] | None, baseline: float | None,
              depth: list[int] | None) -> First:
        """One pass over ``snapshot`` (the arguments as :meth:`dplb.policy.Policy.pick`'s; ``verdicts``: held,
        ejected, stalled): each worker's row (:data:`Row`) with its ``why`` (the state filters, then the router's
        verdicts, the request's sets and the hard cap, in the filter chain's order), the queue, memory and latency
        columns (:meth:`FusedScores.score`'s pass 1, the deadband and the fill) and, with ``depth`` (the prompt's
        matched blocks per worker), the lowest and highest eligible match and the first eligible worker with the
        highest (−1, −1, 0 without). Last: True when a restarted worker was forgotten (``depth`` is then stale)."""
        f = self.fused
        sent_at, seen, stale, cap, states = self.sent_at, self.seen, self.stale, self.cap, self.states
        mq = f.max_queue
        check = bool(cap or verdicts[0] or verdicts[1] or verdicts[2] or req.cannot_serve or req.exclude)
        timed = baseline is not None
        b = baseline if baseline is not None else 1.0
        if b != self.base:  # the latency terms were divided by another baseline
            self.forget()
            self.base = b
            self.banded = ([], [], (0.0, []))
        n = len(snapshot)
        rows: list[Row] = []
        qcol = [0.0] * n  # a queue term is written where it is not 0
        mcol: list[float] = []
        lcol = [0.0 if timed else 1.0] * n
        tix: list[int] = []  # the eligible workers with a current sample: index, latency
        lats: list[float] = []
        idle: list[int] = []  # the eligible idle workers with a sample: index, own latency, freshness
        idle_lats: list[float] = []
        fresh: list[float] = []
        sw = swl = 0.0
        decay = f.decay
        fill = forgot = False
        lo = best = -1
        pref = 0
        top = mq  # the queue term's normalizer: max(max_queue, the longest eligible queue)
        for i, w in enumerate(snapshot):
            k = w.worker_id
            st = states[k]
            if st[0] is not w:  # a state not seen yet (a new snapshot): what it alone decides
                if w.heartbeat_mono_ns != seen[k] and self.renew(w, sent_at[k]):
                    forgot = True
                st = self.derive(w, b)
            _, hb, up, cq, m, lat, lt = st
            corr = len(sent_at[k])
            if corr and inflight is not None and inflight[k] < corr:  # in-flight counts are never negative
                corr = inflight[k]
            if shared is not None:
                corr += shared[k]
            age = now - hb
            cq += corr
            why = OK if up and age <= stale else state_why(w, age, stale)
            if check and why is OK:
                why = _verdict(k, cq, verdicts, req, cap)
            rows.append((w, corr, cq, age, why))
            if cq < mq:  # else cq/mq ≥ 1.0 (rounding is monotone): the term is 0 without the division
                t = 1.0 - cq / mq
                if t > 0.0:
                    qcol[i] = t
            elif cq > top and why is OK:
                top = cq
            mcol.append(m)
            if timed:
                if lt < 0.0 or not (cq or why is OK):
                    lcol[i] = -1.0
                    fill = True
                elif not cq:
                    fr = freshness(now, w.last_done_mono_ns, decay)
                    lcol[i] = -1.0  # set by age_latency
                    idle.append(i)
                    idle_lats.append(lat)
                    fresh.append(fr)
                    sw += fr
                    swl += fr * lat
                else:
                    lcol[i] = lt
                    if why is OK:
                        tix.append(i)
                        lats.append(lat)
                        sw += 1.0
                        swl += lat
            if depth is not None and why is OK:
                d = depth[k]
                if d > best:
                    if best < 0:
                        lo = d
                    best, pref = d, k
                elif d < lo:
                    lo = d
        self.top = top
        if top > mq:  # some eligible queue is past max_queue: every term relative to the longest (queue_terms)
            for i, r in enumerate(rows):
                t = 1.0 - r[2] / top
                qcol[i] = t if t > 0.0 else 0.0
        if idle:
            age_latency(lcol, idle, idle_lats, fresh, sw, swl, tix, lats, b)
        if fill:
            settle_latency([r[0] for r in rows], lcol, tix, lats, b, f.band, fill)
        elif timed:  # settle_latency without the fill; the deadband kept while its inputs are the same
            if tix != self.banded[0] or lats != self.banded[1]:
                self.banded = (tix, lats, deadband(tix, lats, b, f.band))
            tm, inside = self.banded[2]
            for j in inside:
                lcol[j] = tm
        return rows, qcol, mcol, lcol, lo, best, pref, forgot

    def derive(self, w: WorkerState, b: float) -> State:
        """What worker state ``w`` alone decides (:data:`State`; ``b``: the latency baseline, 1.0 without one),
        kept in :attr:`states` until the worker's state changes."""
        f = self.fused
        r = w.kv_cache_usage if f.kv else memory_ratio(w, f.signal)
        lat = w.avg_ttft_s if f.ttft else w.avg_latency_s
        lt = -1.0  # no sample: the fill's
        if not lat <= 0.0:
            t = 1.0 - lat / b
            lt = t if t > 0.0 else 0.0
        st = self.states[w.worker_id] = (
            w, w.heartbeat_mono_ns, bool(w.pid) and w.lifecycle is _READY and not w.torn,
            w.num_running + w.num_waiting, 0.0 if r > 1.0 else (1.0 if r < 0.0 else 1.0 - r), lat, lt)
        return st

    def forget(self, worker: int = -1) -> None:
        """Drop what :meth:`derive` kept of ``worker``'s state (−1: of every worker's): the policy saw another
        snapshot of it (:meth:`dplb.policy.Policy._new_snapshot`), or the baseline changed."""
        states = self.states
        if worker >= 0:
            states[worker] = _NO_STATE
        else:
            states[:] = [_NO_STATE] * len(states)

    def rotations(self, n: int) -> list[tuple[int, ...]]:
        """The scan order of ``n`` workers for each rotation start ``s`` (``s, …, n−1, 0, …, s−1``); kept in
        :attr:`orders`."""
        orders = self.orders[n] = [tuple(range(s, n)) + tuple(range(s)) for s in range(n)]
        return orders

    def weigh(self, rows: list[Row], columns: list[list[float]], order: tuple[int, ...], depth: list[int] | None,
              lo: int, span: int) -> tuple[list[float], int]:
        """Every worker's score (Σ weight·term in scorer order, as :meth:`FusedScores.score`) and the max-score
        picker's choice over ``order``: best score, then shorter queue, then first in order (−1: nobody eligible).
        With ``depth``, the prefix column (``columns[3]``, zeros) is filled in: ``(d − lo)/span`` times the queue
        headroom for a worker past the lowest match ``lo``."""
        w = self.fused.weights
        wq, wm, wl = w[0], w[1], w[2]
        qcol, mcol, lcol = columns[0], columns[1], columns[2]
        scores = [0.0] * len(rows)
        chosen = -1
        above = below = 0.0  # the best score ± 1e-12 (a better score / a tie)
        bq = 0
        if len(columns) == 3:
            for i in order:
                s = scores[i] = wq * qcol[i] + wm * mcol[i] + wl * lcol[i]
                row = rows[i]
                if row[4] is OK and (chosen < 0 or s > above or (s > below and row[2] < bq)):
                    chosen, above, below, bq = i, s + 1e-12, s - 1e-12, row[2]
            return scores, chosen
        wp = w[3]
        pcol = columns[3]
        zp = wp * 0.0  # the prefix term's share where it is 0
        if depth is None:  # no preference: every prefix term is 0
            depth, lo = [0] * len(rows), 0
        mq = self.fused.max_queue
        past = self.top > mq  # the queue terms are relative to a longer queue than max_queue
        for i in order:
            x = qcol[i]
            s = wq * x + wm * mcol[i] + wl * lcol[i]
            row = rows[i]
            h = 0.0  # the headroom 1 − queue/max_queue: the queue term where it is > 0, unless that term is relative
            if depth[i] > lo:
                h = x if not past else (1.0 - row[2] / mq if row[2] < mq else 0.0)
            if h > 0.0:
                p = pcol[i] = (depth[i] - lo) / span * h
                s += wp * p
            else:
                s += zp
            scores[i] = s
            if row[4] is OK and (chosen < 0 or s > above or (s > below and row[2] < bq)):
                chosen, above, below, bq = i, s + 1e-12, s - 1e-12, row[2]
        return scores, chosen


def prefix_span(rows: list[Row], depth: list[int]) -> tuple[int, int, int]:
    """The lowest and highest ``depth`` (matched blocks, per worker id) among the eligible ``rows`` and the first
    eligible worker with the highest (−1, −1, 0 when none is eligible): :meth:`FastPick.first`'s, again."""
    lo = best = -1
    pref = 0
    for w, _, _, _, why in rows:
        if why is OK:
            k = w.worker_id
            d = depth[k]
            if d > best:
                if best < 0:
                    lo = d
                best, pref = d, k
            elif d < lo:
                lo = d
    return lo, best, pref


def _verdict(k: int, queue: int, verdicts: Verdicts, req: RouteRequest, cap: int) -> str:
    """The ``why`` of the filters after the state filters, in chain order (:data:`dplb.policy.filters.HEALTH_FILTERS`
    then :data:`~dplb.policy.filters.REQUEST_FILTERS`) for worker ``k`` with ``queue``: the first that rejects it.
    ``verdicts``: the router's held, ejected and stalled workers."""
    if k in verdicts[0]:
        return WHY_HELD_OUT
    if k in verdicts[1]:
        return WHY_EJECTED
    if k in verdicts[2]:
        return WHY_STALLED
    if k in req.cannot_serve:
        return WHY_CANNOT_SERVE
    if k in req.exclude:
        return WHY_EXCLUDED
    if cap and queue >= cap:
        return WHY_OVER_CAP
    return OK
