"""The policy: a shm snapshot + one request → a :class:`~dplb.policy.decision.Decision` (docs/DESIGN.md §5).
The load balancer's core.

Contract
- :meth:`Policy.pick` is synchronous and does no I/O, no awaits and no locking. Its side effects are on the
  policy's own small state: tie rotation, the optimistic in-flight correction, the pickers' RNG, the prefix index
  (``on_pick`` hooks). Given the same inputs and state it returns the same decision.
- A request's prompt is prepared once (:meth:`Policy.prepare`: the plugins' ``prepare`` hooks derive what they
  need from the raw bytes, e.g. the prefix scorer's block keys), before its first pick.
- A pick: build one :class:`~dplb.policy.decision.Candidate` per worker (queue = running + waiting + correction)
  → run the filters (:mod:`dplb.policy.filters`) → run every weighted scorer (:mod:`dplb.policy.scorers`; the
  terms of a scorer not marked ``bounded`` are clamped into [0, 1]; score = Σ weight·term) → the profile's picker
  (:mod:`dplb.policy.pickers`) chooses among the eligible → ``on_pick`` hooks. A policy name is a *profile*: a
  picker over the same filters and scorers (:data:`PROFILES`). The max-score profile over the built-in filters and
  scorers computes the same on columns, without a candidate object (:class:`~dplb.policy.fused.FastPick`; the
  decision makes its candidates when they are read).
- Panic routing (docs/DESIGN.md §5.1, ``PolicyConfig.panic_routing``, on by default): when a pick finds nobody
  eligible and some worker was rejected only for the router's heartbeat probation (``held``), it picks again
  without ``held`` and marks the decision ``panic``; stale, not-ready, ejected and stalled workers stay out. The
  normal pick does not change: this runs only where it would have answered nobody.
- What the other router processes learnt (their rings' raw entries) is applied by :meth:`Policy.absorb`, to the
  one scorer that shares what it learns (``absorb`` hook; the prefix scorer).
- In-flight correction: requests this router sent to a worker that its last published snapshot may not count yet —
  those sent after that snapshot's heartbeat minus half a state interval. A request sent just before a snapshot is
  often still in a socket or being parsed when the worker counts its queue; forgetting it then made bursts of 64
  split up to 20/14/15/15 in the burst-herd benchmark. It is capped by the router's own in-flight count for the
  worker: short requests that already completed within the interval are in no queue (counting them made a
  conversation's quick next turn spill away from the worker holding its history). Other router processes on the
  same segment publish theirs in their router slots (:mod:`dplb.state.router_slots`); the router adds them (``shared``).
- Latency baseline: the completed requests fed to :meth:`Policy.observe_latency` make it
  (:class:`~dplb.policy.baseline.LatencyBaseline`: P95 of the first ``baseline_window``, then frozen).
- A worker whose pid changed (restarted) is forgotten by every scorer that learns (the prefix index).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from dplb.config import PolicyConfig
from dplb.errors import ConfigError
from dplb.policy.baseline import LatencyBaseline
from dplb.policy.decision import (
    OK,
    PLAIN_NEW,
    REASON_ALL_OVER_CAP,
    REASON_NO_WORKERS,
    REASON_NONE_ROUTABLE,
    REASON_PANIC,
    REASON_SCORE,
    WHY_HELD_OUT,
    WHY_OVER_CAP,
    Candidate,
    Decision,
    make_candidates,
    routed,
)
from dplb.policy.filters import (
    CanServe,
    Consistent,
    Fresh,
    NotEjected,
    NotHeldOut,
    NotStalled,
    NotTried,
    Ready,
    Registered,
    UnderHardCap,
    build_filters,
    state_why,
)
from dplb.policy.framework import (
    PICKERS,
    PickContext,
    Plugin,
    PluginView,
    RouteRequest,
    Scorer,
    build_scorers,
    clamp_unit,
    plugin_pick,
    plugin_scores,
    set_scores,
)
from dplb.policy.framework import plugin_stats as normalised_stats
from dplb.policy.fused import FastPick, FusedScores, prefix_span
from dplb.policy.pickers import MaxScore
from dplb.policy.plugins import BUILT_IN, PROFILES, validate
from dplb.policy.scorers import _Query
from dplb.state.shm import Lifecycle, WorkerState

_NO_REQUEST: Final = RouteRequest()
#: ``object.__new__``, called only where :data:`~dplb.policy.decision.PLAIN_NEW` says the class allows it.
_new: Callable[[type], Any] = object.__new__
_PLAIN_CTX: Final[bool] = PickContext.__new__ is object.__new__
_READY: Final = Lifecycle.READY
#: The filters about the worker's published state, in chain order: fused into the candidate loop.
_STATE_FILTERS: Final = (Registered, Consistent, Fresh, Ready)
#: Filters that reject only the ids of a set the context carries: nothing to do while every set is empty.
_ID_FILTERS: Final = (NotHeldOut, NotEjected, NotStalled, CanServe, NotTried)
#: The rest of the built-in chain, in order: what :class:`~dplb.policy.fused.FastPick` applies itself.
_CHAIN: Final = (*_ID_FILTERS, UnderHardCap)


class Policy:
    """One profile (filters → weighted scorers → picker) with the router-side state a pick needs.

    Build one with :func:`make_policy`. ``name`` is the profile (``cfg.name``).
    """

    def __init__(self, cfg: PolicyConfig, num_workers: int) -> None:
        if cfg.name not in PROFILES:
            raise ConfigError(f"policy '{cfg.name}' is unknown; choose one of {', '.join(PROFILES)}")
        validate(cfg)
        self.cfg = cfg
        self.name = cfg.name
        self.num_workers = num_workers
        self.filters = build_filters(cfg)
        # The built-in state filters are applied while the candidates are built (see _candidates); the rest run
        # as a chain, skipped when each of them would find nothing to do (no id set to test, no hard cap).
        fused = tuple(type(f) for f in self.filters[: len(_STATE_FILTERS)]) == _STATE_FILTERS
        self._stale_ns: int = self.filters[_STATE_FILTERS.index(Fresh)].stale_ns if fused else -1  # type: ignore[attr-defined]
        self._filters = tuple(self.filters[len(_STATE_FILTERS):] if fused else self.filters)
        self._idle_unless_ids = all(type(f) in _ID_FILTERS or (type(f) is UnderHardCap and not cfg.hard_queue_cap)
                                    for f in self._filters)
        self.weighted = build_scorers(cfg, num_workers)
        self.scorers = tuple(s for s, _ in self.weighted)
        self.term_names = tuple(s.name for s in self.scorers)
        self.weights = tuple(w for _, w in self.weighted)
        self.picker = PICKERS[PROFILES[cfg.name]](cfg, num_workers)
        self.plugins: tuple[Plugin, ...] = (*self.scorers, self.picker)
        self._learners = [s for s in self.scorers if type(s).forget_worker is not Scorer.forget_worker]
        self._pickers_hooks = [s for s in self.scorers if type(s).on_pick is not Scorer.on_pick]
        self._preparers = [p for p in self.plugins if type(p).prepare is not Plugin.prepare]
        #: What the views (decisions' notes and inputs) call: the built-in scorers themselves, plugins' normalised.
        self._viewed = tuple(s if type(s) in BUILT_IN else PluginView(s) for s in self.scorers)
        self._noters = tuple(v for v, s in zip(self._viewed, self.scorers, strict=True)
                             if type(s).notes is not Scorer.notes)
        self._unbounded = tuple(j for j, s in enumerate(self.scorers) if not s.bounded)
        #: The scorers (by index) and picker whose results the framework normalises: not built-in classes.
        self._foreign = tuple(j for j, s in enumerate(self.scorers) if type(s) not in BUILT_IN)
        self._foreign_picker = type(self.picker) not in BUILT_IN
        #: The built-in scorer set in two passes (None: another set, each scorer's ``score``; dplb.policy.fused).
        self._fused = FusedScores.of(self.scorers, self.weights)
        #: The picker when it is the plain max-score one: pick() lets it scan the rotated candidates (no list of the
        #: eligible between); None: the picker's ``pick`` on that list.
        self._scan = self.picker if type(self.picker) is MaxScore else None
        sharers = [s for s in self.scorers if type(s).absorb is not Scorer.absorb]
        if len(sharers) > 1:
            raise ConfigError(f"scorers {', '.join(s.name for s in sharers)} all share what they learn with the other "
                              "router processes; the router slots' rings carry one kind of key, so weight only one")
        self._sharer = sharers[0] if sharers else None
        # Send times (CLOCK_MONOTONIC ns) of the requests each worker's published queue may not count yet.
        self._sent_at: list[deque[int]] = [deque() for _ in range(num_workers)]
        self._seen_hb = [0] * num_workers
        #: The max-score pick over the built-in filters and scorer set on columns (None: another configuration).
        self._fast = FastPick(self._fused, self._sent_at, self._seen_hb, self._new_snapshot, self._stale_ns,
                              cfg.hard_queue_cap) \
            if self._fused is not None and self._scan is not None and fused and \
            tuple(type(f) for f in self._filters) == _CHAIN else None
        self._truth = [s for s in self.scorers if type(s).absorb_engine is not Scorer.absorb_engine]
        #: True when a scorer follows the workers' KV rings (the router then drains them before each pick).
        self.follows_engines = bool(self._truth)
        #: The block size (bytes) of the keys the engine-following scorer expects in the KV rings (0: any).
        self.truth_block_bytes: int = getattr(self._truth[0], "block_bytes", 0) if self._truth else 0
        #: True when a scorer learns from the other router processes (the router then drains their rings).
        self.shares = self._sharer is not None
        self.grace_ns = cfg.state_interval_ms * 1_000_000 // 2
        self._seen_pid = [0] * num_workers
        self._rot = 0
        self._baseline = LatencyBaseline(cfg.baseline_window, cfg.latency_signal == "ttft")
        #: The latency baseline, seconds (None until it is frozen: :class:`LatencyBaseline`); read by every pick.
        self.baseline_s: float | None = None

    def scorer(self, name: str) -> Scorer | None:
        """The configured scorer called ``name``, or None."""
        return next((s for s in self.scorers if s.name == name), None)

    def plugin_stats(self) -> dict[str, dict[str, float]]:
        """``{plugin name: its stats()}`` for every configured scorer and the picker that reports any."""
        return {p.name: st for p in self.plugins
                if (st := p.stats() if type(p) in BUILT_IN else normalised_stats(p))}

    def plugin_params(self) -> dict[str, dict[str, Any]]:
        """``{plugin name: {parameter: value in force}}`` for every configured scorer and the picker."""
        return {p.name: dict(p.params) for p in self.plugins if p.params}

    # ---- requests ------------------------------------------------------------------------------------------
    def prepare(self, request: RouteRequest) -> None:
        """Run the plugins' ``prepare`` hooks on ``request`` (once; nothing when it has no prompt). :meth:`pick`
        does it when nobody did; the router does it before timing its decision (hashing is not the pick)."""
        if request.prepared:
            return
        request.prepared = True
        if request.prompt is not None:
            for p in self._preparers:
                p.prepare(request)

    def absorb(self, entries: Mapping[int, Sequence[int]], now_ns: int) -> None:
        """Apply the other router processes' ring entries (worker id → keys,
        :meth:`dplb.state.router_slots.RouterSlots.drain_prefix`) to the scorer that shares what it learns."""
        if entries and self._sharer is not None:
            self._sharer.absorb(entries, now_ns)

    def absorb_engine(self, entries: Mapping[int, Sequence[int]] | None, events_mask: int, now_ns: int) -> None:
        """Apply the workers' KV-ring entries (worker id → raw entries, :meth:`dplb.state.kv_rings.KvRingReader.drain`;
        None: nothing new) and which workers publish them to the scorers that follow the engines."""
        for s in self._truth:
            s.absorb_engine(entries, events_mask, now_ns)

    # ---- feedback ------------------------------------------------------------------------------------------
    def observe_latency(self, seconds: float, ttft_s: float | None = None) -> None:
        """Feed one completed request's E2E latency and time to first body byte (seconds; TTFT of a stream) to the
        baseline (:class:`LatencyBaseline`): after ``baseline_window`` of them :attr:`baseline_s` is frozen at the
        P95 (nearest rank) of the configured ``latency_signal``."""
        if self.baseline_s is None:  # (frozen after the first baseline_window requests: the common case)
            self.baseline_s = self._baseline.observe(seconds, ttft_s)

    def correction(self, worker_id: int) -> int:
        """Requests this router sent to ``worker_id`` since its last published snapshot (minus the grace)."""
        return len(self._sent_at[worker_id])

    # ---- picking -------------------------------------------------------------------------------------------
    def pick(
        self, snapshot: Sequence[WorkerState], now_mono_ns: int, request: RouteRequest | None = None, *,
        held: frozenset[int] = frozenset(), ejected: frozenset[int] = frozenset(), dry_run: bool = False,
        inflight: Sequence[int] | None = None, shared: Sequence[int] | None = None,
        stalled: frozenset[int] = frozenset(),
    ) -> Decision:
        """Choose a worker for one request.

        ``snapshot``: one :class:`WorkerState` per worker (ids 0..n−1), as read from shm just now. ``now_mono_ns``:
        CLOCK_MONOTONIC ns (staleness). ``request``: the request's prompt and the workers it must not go to (None: no
        prompt, nothing excluded); prepared first if nobody did (:meth:`prepare`). ``held``/``ejected``/``stalled``:
        the router's heartbeat hysteresis, passive-health and stall verdicts. ``inflight``: the router's own open
        requests per worker; the correction never exceeds it (a request that already completed is in no queue).
        ``shared``: the other router processes' correction per worker
        (:meth:`dplb.state.router_slots.RouterSlots.peer_correction`), added. Returns a :class:`Decision`; ``worker``
        is None when nobody is eligible (``reason`` says why) — unless panic routing let a worker on probation in
        (reason ``panic``, module docstring). The chosen worker's in-flight correction is incremented
        and the scorers' ``on_pick`` hooks run. ``dry_run=True`` evaluates without choosing (no rotation, no
        correction, no hooks): what a metrics scrape uses.
        """
        req = _NO_REQUEST if request is None else request
        if req.prompt is not None and not req.prepared:
            self.prepare(req)
        ctx: PickContext
        if _PLAIN_CTX:  # PickContext(now_mono_ns, req, ...) without the class call
            ctx = _new(PickContext)
            ctx.now_ns = now_mono_ns
            ctx.request = req
            ctx.baseline_s = self.baseline_s
            ctx.held = held
            ctx.ejected = ejected
            ctx.stalled = stalled
        else:
            ctx = PickContext(now_mono_ns, req, self.baseline_s, held, ejected, stalled)
        fast = self._fast
        if fast is None or dry_run or self._fused is None or self._scan is None:
            return self._pick_candidates(snapshot, ctx, dry_run, inflight, shared)
        # The max-score pick over the built-in filters and scorers on columns (dplb.policy.fused.FastPick): the
        # same decision; the candidates are made only when someone reads them.
        index = fast.fused.index
        q: _Query | None = req.derived.get("prefix") if index is not None else None
        depth = None
        if q is not None:
            assert index is not None
            depth = q.depth = index.match(q.blocks, now_mono_ns)
        rows, qcol, mcol, lcol, lo, best, pref, forgot = fast.first(snapshot, now_mono_ns, req, (held, ejected,
                                                                    stalled), inflight, shared, self.baseline_s, depth)
        if forgot and q is not None:  # a restarted worker's blocks are gone: match again
            assert index is not None
            depth = q.depth = index.match(q.blocks, now_mono_ns)
            lo, best, pref = prefix_span(rows, depth)
        columns = [qcol, mcol, lcol]
        span = 0
        if fast.fused.prefix is not None:
            columns.append([0.0] * len(rows))
            if q is not None and best != lo:
                req.preferred = pref
                span = len(q.blocks) - lo
            else:
                depth = None  # no preference: every prefix term is 0
        n = len(rows)
        orders = fast.orders.get(n) or fast.rotations(n)
        scores, i = fast.weigh(rows, columns, orders[self._rot % n] if n else (), depth, lo, span)
        self._rot += 1
        if i < 0:
            return self._nobody(make_candidates(rows, scores), ctx, columns, snapshot, inflight, shared)
        k = rows[i][0].worker_id
        self._sent_at[k].append(now_mono_ns)
        for s in self._pickers_hooks:
            s.on_pick(req, k, now_mono_ns)
        return routed(self.name, k, REASON_SCORE, rows, scores, self.baseline_s, self.term_names, self.weights,
                      req.preferred, self._viewed, ctx, columns, self._noters)

    def _pick_candidates(self, snapshot: Sequence[WorkerState], ctx: PickContext, dry_run: bool,
                         inflight: Sequence[int] | None, shared: Sequence[int] | None) -> Decision:
        """:meth:`pick` on :class:`Candidate` objects: any profile, filter chain and scorer set, and dry runs."""
        now_mono_ns, req = ctx.now_ns, ctx.request
        held, ejected, stalled = ctx.held, ctx.ejected, ctx.stalled
        cands = self._candidates(snapshot, now_mono_ns, inflight, shared)
        if not self._idle_unless_ids or held or ejected or stalled or req.exclude or req.cannot_serve:
            for f in self._filters:
                f.apply(cands, ctx)
        fused = self._fused
        columns = fused.score(cands, ctx) if fused is not None else self._score(cands, ctx)
        n = len(cands)
        start = self._rot % n if n else 0
        if not dry_run:
            self._rot += 1
        # Rotated: the scan starts one worker later on every pick ("first among equals" rotates).
        rotated = cands[start:] + cands[:start] if start else cands
        scan = self._scan
        if scan is not None and not dry_run:  # the max-score picker over the rotated candidates, no list between
            best = scan.scan(rotated)
            if best is None:
                return self._nobody(cands, ctx, columns, snapshot, inflight, shared)
            chosen, reason = best, REASON_SCORE
        else:
            eligible = []
            for c in rotated:
                if c.why is OK:
                    eligible.append(c)
            if not eligible:
                return self._nobody(cands, ctx, columns, snapshot, inflight, shared, dry_run)
            if dry_run:
                return Decision(self.name, None, REASON_SCORE, cands, self.baseline_s, self.term_names, self.weights,
                                None, self._viewed, ctx, columns)
            chosen, reason = plugin_pick(self.picker, eligible, ctx) if self._foreign_picker \
                else self.picker.pick(eligible, ctx)
        k = chosen.worker_id
        self._sent_at[k].append(now_mono_ns)
        for s in self._pickers_hooks:
            s.on_pick(req, k, now_mono_ns)
        return Decision(self.name, k, reason, cands, self.baseline_s, self.term_names, self.weights, req.preferred,
                        self._viewed, ctx, columns, self._noters)

    def _nobody(self, cands: list[Candidate], ctx: PickContext, columns: list[list[float]],
                snapshot: Sequence[WorkerState], inflight: Sequence[int] | None, shared: Sequence[int] | None,
                dry_run: bool = False) -> Decision:
        """The decision when no candidate is eligible: panic routing (:meth:`_panic`) when it applies, else
        ``worker`` None with the reason why. The other arguments are :meth:`pick`'s, for the panic pick."""
        if ctx.held and not dry_run and self.cfg.panic_routing:
            for c in cands:
                if c.why == WHY_HELD_OUT:
                    d = self._panic(snapshot, ctx, inflight, shared)
                    if d is not None:
                        return d
                    break
        if not any(c.state.pid for c in cands):
            reason = REASON_NO_WORKERS
        elif self.cfg.hard_queue_cap and any(c.why is WHY_OVER_CAP for c in cands):
            reason = REASON_ALL_OVER_CAP
        else:
            reason = REASON_NONE_ROUTABLE
        return Decision(self.name, None, reason, cands, self.baseline_s, self.term_names, self.weights, None,
                        self._viewed, ctx, columns)

    def _panic(self, snapshot: Sequence[WorkerState], ctx: PickContext, inflight: Sequence[int] | None,
               shared: Sequence[int] | None) -> Decision | None:
        """Panic routing (docs/DESIGN.md §5.1; Envoy's panic threshold, narrowed): nobody was eligible and some
        worker was rejected for heartbeat probation, so pick again as if the router held nobody out — every other
        filter still applies (stale, not ready, ejected, stalled, the request's own) and the profile scores and
        chooses as usual. Returns that decision with reason ``panic`` (its context keeps the held set for the view:
        ``held_out`` in ``/debug/decisions``), or None when it found nobody either. Runs only once the normal pick
        found nobody: the hot path pays nothing for it."""
        self._rot -= 1  # the pick that found nobody took no turn: ties keep rotating one worker per request
        d = self.pick(snapshot, ctx.now_ns, ctx.request, ejected=ctx.ejected, stalled=ctx.stalled,
                      inflight=inflight, shared=shared)
        if d.worker is None:
            return None
        d.reason = REASON_PANIC
        d.ctx.held = ctx.held
        return d

    def _score(self, cands: list[Candidate], ctx: PickContext) -> list[list[float]]:
        """The general path: each scorer's ``score`` (a plugin's normalised: :func:`plugin_scores`; clamped unless
        ``bounded``), then :func:`set_scores`.
        Returns the columns."""
        columns = []
        foreign = self._foreign
        for j, s in enumerate(self.scorers):
            columns.append(plugin_scores(s, cands, ctx) if j in foreign else s.score(cands, ctx))
        for j in self._unbounded:  # the framework's guarantee: every term in [0, 1]
            columns[j] = clamp_unit(columns[j])
        set_scores(cands, columns, self.weights)
        return columns

    def _candidates(self, snapshot: Sequence[WorkerState], now_ns: int, inflight: Sequence[int] | None,
                    shared: Sequence[int] | None) -> list[Candidate]:
        """One :class:`Candidate` per worker of ``snapshot`` (queue = running + waiting + correction; see
        :meth:`pick` for ``inflight`` and ``shared``); a worker's new snapshot first drops what it now counts.
        The built-in state filters (registered, consistent, fresh, ready: :data:`_STATE_FILTERS`) are applied here,
        in their order, one test per worker instead of a pass each (:func:`state_why` for the rejected).
        The candidates are made without a class call where the class allows it (:data:`PLAIN_NEW`: plain Python),
        else by their constructor (a class compiled by mypyc)."""
        sent_at = self._sent_at
        seen = self._seen_hb
        stale = self._stale_ns  # -1: the state filters run in the chain (``_filters``), not here
        fused = stale >= 0
        cands: list[Candidate] = []
        plain = PLAIN_NEW
        for w in snapshot:
            k = w.worker_id
            hb = w.heartbeat_mono_ns
            if hb != seen[k]:
                self._new_snapshot(w, sent_at[k])
            corr = len(sent_at[k])
            if corr and inflight is not None and inflight[k] < corr:  # in-flight counts are never negative
                corr = inflight[k]
            if shared is not None:
                corr += shared[k]
            age = now_ns - hb
            why = OK if not fused or (w.pid and age <= stale and w.lifecycle is _READY and not w.torn) \
                else state_why(w, age, stale)
            c: Candidate
            if plain:  # Candidate(...) without the class call
                c = _new(Candidate)
                c.state = w
                c.worker_id = k
                c.correction = corr
                c.queue = w.num_running + w.num_waiting + corr
                c.age_ns = age
                c.score = 0.0
                c.why = why
            else:
                c = Candidate(w, corr, w.num_running + w.num_waiting + corr, age)
                c.why = why
            cands.append(c)  # its score is set once every scorer ran
        return cands

    def _new_snapshot(self, w: WorkerState, q: deque[int]) -> bool:
        """Worker ``w`` published a new snapshot: drop the correction entries it counts now (sent before its
        heartbeat minus half an interval); a new pid (restart) voids what scorers learnt about the old process.
        Returns True when a scorer forgot the worker."""
        k = w.worker_id
        hb = self._seen_hb[k] = w.heartbeat_mono_ns
        if self._fast is not None:
            self._fast.forget(k)
        forgot = False
        if w.pid != self._seen_pid[k]:
            if self._seen_pid[k]:
                for s in self._learners:
                    s.forget_worker(k)
                    forgot = True
            self._seen_pid[k] = w.pid
        cutoff = hb - self.grace_ns
        while q and q[0] < cutoff:
            q.popleft()
        return forgot

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


def make_policy(cfg: PolicyConfig, num_workers: int) -> Policy:
    """Build the policy profile named by ``cfg.name`` for ``num_workers`` workers (ids 0..n−1).
    Raises :class:`ConfigError` for an unknown profile or scorer name, or a bad plugin parameter."""
    return Policy(cfg, num_workers)
