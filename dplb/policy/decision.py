"""Routing decisions as data: the closed sets of eligibility and reason values, and :class:`Decision` /
:class:`Candidate`, the record of one pick (docs/DESIGN.md §5, §9).

Contract: :mod:`dplb.policy` builds decisions; traces, ``/debug/decisions`` and metrics read them, and loop over
``Decision.term_names`` / ``Candidate.terms`` generically, so a new scorer shows up everywhere without edits there
(like vLLM's ``StatLoggerBase.record()``: decisions are data, loggers consume them). Building the JSON view of a
decision (:meth:`Decision.to_dict`) asks each scorer what it read (``Scorer.inputs``) — only when someone looks.
Units: requests, fractions 0–1, bytes, seconds.
"""

from __future__ import annotations

import math
from typing import Any, Final

from dplb.state.shm import Lifecycle, WorkerState

# Eligibility ("why") values: a closed set. The first group is about the worker's health (decides /ready,
# dplb_worker_up, dplb state); the second about one request.
OK: Final = "ok"
WHY_UNREGISTERED: Final = "unregistered"
WHY_TORN: Final = "torn"
WHY_STALE: Final = "stale"
WHY_DRAINING: Final = "draining"
WHY_NOT_READY: Final = "not_ready"
WHY_HELD_OUT: Final = "held_out"  # heartbeat hysteresis: fresh again, on probation (panic routing may let it in, §5.1)
WHY_EJECTED: Final = "ejected"  # refused a connection / failed responses in a row
WHY_STALLED: Final = "stalled"  # requests outstanding and no engine progress for --stall-after (dplb.policy.stall)
WHY_EXCLUDED: Final = "excluded"  # failed this request already (retry goes elsewhere)
WHY_CANNOT_SERVE: Final = "cannot_serve"  # does not serve the request's model, or another worker holds its response
WHY_OVER_CAP: Final = "over_cap"
HEALTH_WHYS: Final = frozenset({WHY_UNREGISTERED, WHY_TORN, WHY_STALE, WHY_DRAINING, WHY_NOT_READY, WHY_HELD_OUT,
                         WHY_EJECTED, WHY_STALLED})
WHYS: Final = (OK, *sorted(HEALTH_WHYS), WHY_CANNOT_SERVE, WHY_EXCLUDED, WHY_OVER_CAP)

# Decision reasons: a closed set (metric label values).
REASON_SCORE: Final = "score"
REASON_AFFINITY: Final = "affinity"  # prefix_hash: the prefix's rendezvous worker
REASON_POLICY: Final = "policy"  # round_robin / random / least_loaded / power_of_two made the choice
REASON_FALLBACK: Final = "fallback"  # shm missing: router's own in-flight counts
#: Panic routing (docs/DESIGN.md §5.1): no worker could take the request, so it went to one of the workers held out
#: only by the heartbeat hysteresis (on probation: fresh again, ready), chosen by the profile as usual.
REASON_PANIC: Final = "panic"
REASON_NO_WORKERS: Final = "no_workers"
REASON_NONE_ROUTABLE: Final = "none_routable"
REASON_ALL_OVER_CAP: Final = "all_over_cap"
#: The reasons of a decision that chose a worker, then of one that did not (``worker`` None).
ROUTED_REASONS: Final = (REASON_SCORE, REASON_AFFINITY, REASON_POLICY, REASON_FALLBACK, REASON_PANIC)
UNROUTED_REASONS: Final = (REASON_NO_WORKERS, REASON_NONE_ROUTABLE, REASON_ALL_OVER_CAP)
DECISION_REASONS: Final = ROUTED_REASONS + UNROUTED_REASONS
# Prefix outcome of a routed decision (dplb_prefix_routed_total): the longest-match worker got it, another one did
# (spill: load won), or no worker had any block of the prompt.
PREFIX_HIT: Final = "hit"
PREFIX_SPILL: Final = "spill"
PREFIX_MISS: Final = "miss"
PREFIX_OUTCOMES: Final = (PREFIX_HIT, PREFIX_SPILL, PREFIX_MISS)
# Notes a scorer gives about a routed request (Scorer.notes, via Decision.notes; read by name by
# dplb.obs.metrics_router): the prefix scorer's outcome (one of PREFIX_OUTCOMES), the prompt's blocks, and the blocks
# the index says the chosen worker has.
NOTE_PREFIX_OUTCOME: Final = "prefix_outcome"
NOTE_PREFIX_BLOCKS: Final = "prefix_blocks"
NOTE_PREFIX_HIT_BLOCKS: Final = "prefix_hit_blocks"
#: Prompt bytes the prefix index predicted the chosen worker has cached (hit blocks × block bytes); the router
#: tells the worker (request header ``x-dplb-prefix-predicted``), which compares it with its engine's cached tokens.
NOTE_PREFIX_HIT_BYTES: Final = "prefix_hit_bytes"
PREFIX_PREDICTED_HEADER: Final = b"x-dplb-prefix-predicted"
# Stats a plugin reports about its own state (Plugin.stats(); read by name by dplb.obs.metrics_scrape): the prefix
# index's entries, capacity (blocks) and estimated memory (bytes).
STAT_INDEX_BLOCKS: Final = "index_blocks"
STAT_INDEX_CAPACITY: Final = "index_capacity_blocks"
STAT_INDEX_BYTES: Final = "index_bytes"
_UNASKED: Final[Any] = object()  # Decision.notes not asked yet


class Candidate:
    """One worker as the policy saw it in one decision. Units: requests, ns, fractions 0–1.

    ``state``: the :class:`WorkerState` read from shm; ``correction``: requests this router sent that the snapshot
    may not count yet; ``queue`` = running + waiting + correction; ``age_ns``: heartbeat age; ``why``: ``ok`` or
    the first filter that rejected it; ``score`` = Σ weight·term (every worker is scored, eligible or not, for
    visibility; its terms are in :meth:`Decision.terms`).
    """

    __slots__ = ("age_ns", "correction", "queue", "score", "state", "why", "worker_id")

    def __init__(self, state: WorkerState, correction: int, queue: int, age_ns: int) -> None:
        self.state = state
        self.worker_id = state.worker_id
        self.correction = correction
        self.queue = queue
        self.age_ns = age_ns
        self.why = OK
        self.score = 0.0

    @property
    def eligible(self) -> bool:
        """True when no filter rejected it."""
        return self.why == OK

    @property
    def routable(self) -> bool:
        """True when no health filter rejected it (a request-level rejection like ``over_cap`` still counts as
        routable: the worker is up)."""
        return self.why not in HEALTH_WHYS

    @property
    def age_s(self) -> float:
        """Heartbeat age in seconds (inf if never written)."""
        return self.age_ns / 1e9 if self.state.heartbeat_mono_ns else math.inf


#: True when ``object.__new__(Candidate)`` may make a candidate (plain Python: CPython allows it when the class keeps
#: ``object``'s allocator; a class compiled by mypyc has its own and refuses it). The policy's hot loop then sets the
#: slots itself: a class call costs ~600 instructions more a candidate in CPython 3.11.
PLAIN_NEW: Final[bool] = Candidate.__new__ is object.__new__


class Decision:
    """The outcome of one :meth:`dplb.policy.Policy.pick`: ``worker`` (id or None), ``reason`` and every candidate
    (``candidates``, in worker-id order: candidate k is worker k). ``term_names``/``weights``: the scorers;
    ``columns[j][k]``: scorer j's term for worker k. ``preferred``: the worker with the longest prefix match
    (None: no match / no prefix scorer).
    ``scorers`` and ``ctx`` are kept for the lazy JSON view, ``noters`` (the scorers with a ``notes`` hook) for
    the lazy :attr:`notes`.

    ``candidates`` may instead be None with ``rows``: one ``(state, correction, queue, age_ns, why)`` tuple per
    worker and ``scores`` (the policy's fast path, :meth:`dplb.policy.Policy.pick`); the :class:`Candidate` objects
    are then made the first time :attr:`candidates` is read, with the same values."""

    __slots__ = ("_cands", "_notes", "_rows", "_scores", "baseline_s", "columns", "ctx", "noters", "policy",
                 "preferred", "reason", "resent", "scorers", "term_names", "weights", "worker")

    def __init__(
        self, policy: str, worker: int | None, reason: str, candidates: list[Candidate] | None,
        baseline_s: float | None, term_names: tuple[str, ...] = (), weights: tuple[float, ...] = (),
        preferred: int | None = None, scorers: tuple[Any, ...] = (), ctx: Any = None,
        columns: list[list[float]] | None = None, noters: tuple[Any, ...] = (),
        rows: list[tuple[WorkerState, int, int, int, str]] | None = None, scores: list[float] | None = None,
    ) -> None:
        self.policy = policy
        self.worker = worker
        self.reason = reason
        self._cands = candidates
        self._rows = rows
        self._scores = scores
        self.baseline_s = baseline_s
        self.term_names = term_names
        self.weights = weights
        self.preferred = preferred
        self.scorers = scorers
        self.ctx = ctx
        self.columns = columns or []
        self.noters = noters
        self._notes: Any = _UNASKED
        #: Set by the router when the request was sent again to ``worker`` on a new connection (the pooled one ended
        #: before any response byte): how that one ended (:data:`dplb.errors.RESEND_REASONS`); None otherwise.
        self.resent: str | None = None

    @property
    def candidates(self) -> list[Candidate]:
        """Every candidate, in worker-id order (made from ``rows`` and ``scores`` the first time it is read)."""
        cands = self._cands
        if cands is None:
            cands = self._cands = make_candidates(self._rows or [], self._scores or [])
        return cands

    def chosen_age_s(self) -> float | None:
        """Age of the chosen worker's state in seconds (None when nobody was chosen or without shm)."""
        k = self.worker
        rows = self._rows
        if rows is not None and self._cands is None:  # without making the candidates
            return None if k is None or k >= len(rows) else rows[k][3] / 1e9
        cands = self.candidates
        if k is None or k >= len(cands):
            return None
        return cands[k].age_ns / 1e9

    def ranked(self) -> list[int]:
        """Eligible worker ids, best score first (then shorter queue, then id) — the retry order."""
        el = [c for c in self.candidates if c.why == OK]
        el.sort(key=lambda c: (-c.score, c.queue, c.worker_id))
        return [c.worker_id for c in el]

    def terms(self, c: Candidate) -> dict[str, float]:
        """``{scorer name: term}`` of candidate ``c``."""
        k = c.worker_id
        return {name: col[k] for name, col in zip(self.term_names, self.columns, strict=False)}

    @property
    def notes(self) -> dict[str, Any] | None:
        """What the scorers observed about the routed request (their ``notes`` hooks, asked the first time: note
        name → value), or None (not routed, or nothing to say)."""
        out = self._notes
        if out is not _UNASKED:
            return out
        if self.worker is not None:
            for s in self.noters:
                got = s.notes(self.ctx.request, self.worker)
                if got:
                    out = got if out is _UNASKED else {**out, **got}
        out = self._notes = None if out is _UNASKED else out
        return out

    def prefix_outcome(self) -> str | None:
        """:data:`PREFIX_HIT` / :data:`PREFIX_SPILL` / :data:`PREFIX_MISS` for a routed request with a prefix key
        (the prefix scorer's :data:`NOTE_PREFIX_OUTCOME`); None otherwise."""
        notes = self.notes
        return notes.get(NOTE_PREFIX_OUTCOME) if notes else None

    def candidate_dict(self, c: Candidate) -> dict[str, object]:
        """JSON-friendly view of one candidate: health (``held_out``: the router's heartbeat hysteresis held it out
        at this decision), shm inputs, every scorer's inputs and terms, score."""
        w = c.state
        out: dict[str, object] = {
            "worker": w.worker_id, "eligible": c.eligible, "why": c.why,
            "lifecycle": Lifecycle(w.lifecycle).name.lower(), "state_age_s": _finite(c.age_s),
            "num_running": w.num_running, "num_waiting": w.num_waiting, "correction": c.correction,
            "queue": c.queue, "kv_cache_usage": w.kv_cache_usage, "gpu_memory_used_bytes": w.gpu_memory_used_bytes,
            "gpu_memory_total_bytes": w.gpu_memory_total_bytes, "avg_latency_s": w.avg_latency_s,
            "avg_ttft_s": w.avg_ttft_s,
        }
        if self.ctx is not None:
            # On heartbeat probation at this decision: its why is held_out, or ok in a panic decision (let in).
            out["held_out"] = c.worker_id in self.ctx.held
            for s in self.scorers:
                out.update(s.inputs(c, self.ctx))
        out["terms"] = self.terms(c)
        out["score"] = c.score
        return out

    def to_dict(self) -> dict[str, object]:
        """JSON-friendly view (``/debug/decisions``)."""
        return {
            "policy": self.policy, "worker": self.worker, "reason": self.reason, "preferred": self.preferred,
            "prefix_outcome": self.prefix_outcome(), "baseline_s": self.baseline_s, "resent": self.resent,
            "weights": dict(zip(self.term_names, self.weights, strict=False)),
            "candidates": [self.candidate_dict(c) for c in self.candidates],
        }


def routed(policy: str, worker: int, reason: str, rows: list[tuple[WorkerState, int, int, int, str]],
           scores: list[float], baseline_s: float | None, term_names: tuple[str, ...], weights: tuple[float, ...],
           preferred: int | None, scorers: tuple[Any, ...], ctx: Any, columns: list[list[float]],
           noters: tuple[Any, ...]) -> Decision:
    """``Decision(policy, worker, reason, None, baseline_s, …, rows=rows, scores=scores)``: the same decision,
    without the class call where the class allows it (:data:`PLAIN_NEW`: plain Python)."""
    if not _PLAIN_DECISION:
        return Decision(policy, worker, reason, None, baseline_s, term_names, weights, preferred, scorers, ctx,
                        columns, noters, rows, scores)
    d: Decision = _new(Decision)
    d.policy = policy
    d.worker = worker
    d.reason = reason
    d._cands = None
    d._rows = rows
    d._scores = scores
    d.baseline_s = baseline_s
    d.term_names = term_names
    d.weights = weights
    d.preferred = preferred
    d.scorers = scorers
    d.ctx = ctx
    d.columns = columns
    d.noters = noters
    d._notes = _UNASKED
    d.resent = None
    return d


def make_candidates(rows: list[tuple[WorkerState, int, int, int, str]], scores: list[float]) -> list[Candidate]:
    """The :class:`Candidate` of each ``(state, correction, queue, age_ns, why)`` row, with its score."""
    out = []
    for (w, corr, queue, age, why), score in zip(rows, scores, strict=True):
        c = Candidate(w, corr, queue, age)
        c.why = why
        c.score = score
        out.append(c)
    return out


_PLAIN_DECISION: Final[bool] = Decision.__new__ is object.__new__
_new: Final[Any] = object.__new__


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
