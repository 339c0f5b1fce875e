"""Routing decisions as data: the closed sets of eligibility and reason values, and :class:`Decision` /
:class:`Candidate`, the record of one pick (DESIGN §3, §7).

Contract: :mod:`dplb.policy` builds decisions; traces, ``/debug/decisions`` and metrics read them. A
:class:`Decision` holds the hot loop's raw rows (plain tuples, indexed by the ``_STATE`` … ``_SCORE`` constants)
and builds its :class:`Candidate` objects only when someone looks, so an uninspected decision costs nothing extra.
Units: requests, fractions 0–1, bytes, seconds.
"""

from __future__ import annotations

import math
from typing import Final

from dplb.shm import Lifecycle, WorkerState

# Eligibility ("why") values: a closed set.
OK = "ok"
WHY_UNREGISTERED = "unregistered"
WHY_TORN = "torn"
WHY_STALE = "stale"
WHY_DRAINING = "draining"
WHY_NOT_READY = "not_ready"
WHY_OVER_CAP = "over_cap"
WHY_EXCLUDED = "excluded"

# Decision reasons: a closed set (metric label values).
REASON_SCORE = "score"
REASON_AFFINITY = "affinity"
REASON_POLICY = "policy"  # round_robin / random / least_loaded / power_of_two made the choice
REASON_FALLBACK = "fallback"  # shm missing: router's own in-flight counts
REASON_NO_WORKERS = "no_workers"
REASON_NONE_ROUTABLE = "none_routable"
REASON_ALL_OVER_CAP = "all_over_cap"
DECISION_REASONS = (
    REASON_SCORE, REASON_AFFINITY, REASON_POLICY, REASON_FALLBACK, REASON_NO_WORKERS, REASON_NONE_ROUTABLE,
    REASON_ALL_OVER_CAP,
)
TERMS = ("queue", "memory", "latency")


class Candidate:
    """One worker as the policy saw it in one decision. Units: requests, fractions 0–1, bytes, seconds.

    ``state`` is the :class:`WorkerState` read from shm; ``queue`` = running + waiting + ``correction``;
    ``term_*`` and ``score`` are the seed terms (computed for every worker, eligible or not, for visibility).
    """

    __slots__ = (
        "age_s", "correction", "eligible", "max_queue", "memory_ratio", "queue", "score", "state",
        "term_latency", "term_memory", "term_queue", "why",
    )

    def __init__(
        self, state: WorkerState, why: str, correction: int, queue: int, age_s: float, max_queue: int,
        memory_ratio: float, term_queue: float, term_memory: float, term_latency: float, score: float,
    ) -> None:
        self.state = state
        self.why = why
        self.eligible = why is OK
        self.correction = correction
        self.queue = queue
        self.age_s = age_s
        self.max_queue = max_queue
        self.memory_ratio = memory_ratio
        self.term_queue = term_queue
        self.term_memory = term_memory
        self.term_latency = term_latency
        self.score = score

    @property
    def worker_id(self) -> int:
        """Worker id (slot index)."""
        return self.state.worker_id

    @property
    def num_running(self) -> int:
        """Engine running requests, from shm."""
        return self.state.num_running

    @property
    def num_waiting(self) -> int:
        """Engine waiting requests, from shm."""
        return self.state.num_waiting

    def to_dict(self) -> dict[str, object]:
        """JSON-friendly view (for ``/debug/decisions`` and trace events)."""
        w = self.state
        return {
            "worker": w.worker_id, "eligible": self.eligible, "why": self.why,
            "lifecycle": Lifecycle(w.lifecycle).name.lower(), "state_age_s": _finite(self.age_s),
            "num_running": w.num_running, "num_waiting": w.num_waiting, "correction": self.correction,
            "queue": self.queue, "max_queue": self.max_queue, "kv_cache_usage": w.kv_cache_usage,
            "gpu_memory_used_bytes": w.gpu_memory_used_bytes,
            "gpu_memory_total_bytes": w.gpu_memory_total_bytes, "memory_ratio": self.memory_ratio,
            "avg_latency_s": w.avg_latency_s, "term_queue": self.term_queue, "term_memory": self.term_memory,
            "term_latency": self.term_latency, "score": self.score,
        }


# One candidate as computed in the hot loop: a plain tuple (cheap to build); Decision.candidates wraps them.
_Row = tuple[WorkerState, str, int, int, int, int, float, float, float, float, float]
_STATE: Final = 0
_WHY: Final = 1
_CORR: Final = 2
_QUEUE: Final = 3
_AGE_NS: Final = 4
_MAXQ: Final = 5
_MEM: Final = 6
_TQ: Final = 7
_TM: Final = 8
_TL: Final = 9
_SCORE: Final = 10


class Decision:
    """The outcome of one :meth:`dplb.policy.Policy.pick`: ``worker`` (id or None), ``reason`` and every candidate.

    ``candidates`` (a list of :class:`Candidate`, in worker-id order) is built lazily from the raw rows the
    hot loop produced, so a decision nobody inspects costs nothing extra.
    """

    __slots__ = ("_cands", "_rows", "baseline_s", "policy", "preferred", "reason", "worker")

    def __init__(
        self, policy: str, worker: int | None, reason: str, rows: list[_Row], baseline_s: float | None,
        preferred: int | None = None,
    ) -> None:
        self.policy = policy
        self.worker = worker
        self.reason = reason
        self._rows = rows
        self._cands: list[Candidate] | None = None
        self.baseline_s = baseline_s
        self.preferred = preferred

    @property
    def candidates(self) -> list[Candidate]:
        """Every worker as the policy saw it, in worker-id order."""
        if self._cands is None:
            self._cands = [
                Candidate(r[0], r[1], r[2], r[3], r[4] / 1e9 if r[0].heartbeat_mono_ns else math.inf, r[5],
                          r[6], r[7], r[8], r[9], r[10])
                for r in self._rows
            ]
        return self._cands

    def chosen_age_s(self) -> float | None:
        """Age of the chosen worker's state in seconds (None when nobody was chosen or without shm)."""
        if self.worker is None or self.worker >= len(self._rows):
            return None
        return self._rows[self.worker][_AGE_NS] / 1e9

    def ranked(self) -> list[int]:
        """Eligible worker ids, best score first (then shorter queue, then id) — the retry order."""
        el = [r for r in self._rows if r[_WHY] is OK]
        el.sort(key=lambda r: (-r[_SCORE], r[_QUEUE], r[_STATE].worker_id))
        return [r[_STATE].worker_id for r in el]

    def to_dict(self) -> dict[str, object]:
        """JSON-friendly view."""
        return {
            "policy": self.policy, "worker": self.worker, "reason": self.reason, "preferred": self.preferred,
            "baseline_s": self.baseline_s, "candidates": [c.to_dict() for c in self.candidates],
        }


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
