"""The policy framework: one small interface per extension point, and a registry for each (docs/DESIGN.md §5).

Modelled on the Gateway API Inference Extension's scheduler (``pkg/epp/scheduling/framework/plugins.go``,
``plugins/registry.go``): a pick runs **filters** (eligibility), then weighted **scorers** (each 0–1 per candidate),
then one **picker**. Plugins work on the whole candidate list at once (one call per plugin per pick, not per
worker), which keeps ``pick()`` for 8 workers near 15 µs in CPython.

Contract of each extension point
- :class:`Filter`: ``apply(cands, ctx)`` sets ``c.why`` to one of its ``reasons`` on every still-eligible
  candidate it rejects; never un-rejects. ``health = True`` for filters about the worker itself (registered, fresh,
  ready, …): those decide ``/ready``, ``dplb_worker_up`` and ``dplb state``; the others (retry exclusion, hard cap)
  are about one request.
- :class:`Scorer`: ``score(cands, ctx)`` returns one float in [0, 1] per candidate (same order; higher is better).
  Every candidate is scored, eligible or not (visibility); scorers that compare workers (latency deadband, prefix
  match) look only at the eligible ones. ``inputs(c, ctx)`` names what the scorer read, for ``/debug/decisions``
  and traces (not called on the hot path). Optional hooks: ``on_pick(request, worker, now_ns)`` after a worker is
  chosen for real, ``forget_worker(worker)`` when a worker restarted.
- :class:`Picker`: ``pick(eligible, ctx)`` chooses among the eligible candidates (given in rotated order, so
  "first" rotates) and returns ``(candidate, reason)``.

Adding a scorer: a class with ``name`` and ``score`` in one file, plus one line ``register_scorer(MyScorer)``; then
``--weights queue=0.3,…,my=0.1`` uses it, and metrics, traces and ``/debug/decisions`` show its term by name
(tests/test_policy_framework.py registers a toy scorer).
"""

from __future__ import annotations

from typing import Any, ClassVar

from dplb.config import PolicyConfig
from dplb.errors import ConfigError
from dplb.policy.decision import Candidate
from dplb.state.shm import WorkerState


class RouteRequest:
    """What the policy knows about one request (one object instead of a parameter list, like uvicorn's
    ``RequestResponseCycle``).

    ``blocks``: the prompt's chained block keys (:func:`dplb.policy.prefix.block_hashes`; empty = no prefix key);
    ``cannot_serve``: worker ids that cannot serve it (they do not serve its model, or it names a response another
    worker holds: :mod:`dplb.router.models`); ``exclude``: worker ids already tried (a failed connect). The prefix
    scorer fills ``prefix_depth`` (matched leading blocks per worker id) and ``preferred`` (the longest match), and
    after the pick ``learned``: the block keys the index learnt from it (for the other router processes).
    """

    __slots__ = ("blocks", "cannot_serve", "exclude", "learned", "preferred", "prefix_depth")

    def __init__(self, blocks: list[int] | None = None, exclude: frozenset[int] = frozenset(),
                 cannot_serve: frozenset[int] = frozenset()) -> None:
        self.blocks = blocks or []
        self.exclude = exclude
        self.cannot_serve = cannot_serve
        self.prefix_depth: list[int] | None = None
        self.preferred: int | None = None
        self.learned: list[int] | None = None


class PickContext:
    """The inputs one pick shares across plugins: ``now_ns`` (CLOCK_MONOTONIC), the request, the frozen latency
    baseline (seconds, None until frozen), and the router's own health verdicts: ``held`` (heartbeat hysteresis)
    and ``ejected`` (refused connections, passive health check) worker ids."""

    __slots__ = ("baseline_s", "ejected", "held", "now_ns", "request")

    def __init__(self, now_ns: int, request: RouteRequest, baseline_s: float | None,
                 held: frozenset[int] = frozenset(), ejected: frozenset[int] = frozenset()) -> None:
        self.now_ns = now_ns
        self.request = request
        self.baseline_s = baseline_s
        self.held = held
        self.ejected = ejected


class Filter:
    """Eligibility rule. ``reasons``: the ``why`` values it sets (the first is the usual one)."""

    reasons: ClassVar[tuple[str, ...]] = ()
    health: ClassVar[bool] = True

    def __init__(self, cfg: PolicyConfig) -> None:
        self.cfg = cfg

    def apply(self, cands: list[Candidate], ctx: PickContext) -> None:
        raise NotImplementedError


class Scorer:
    """One score term, 0–1 per candidate, higher is better."""

    name: ClassVar[str] = ""

    def __init__(self, cfg: PolicyConfig, num_workers: int) -> None:
        self.cfg = cfg
        self.num_workers = num_workers

    def score(self, cands: list[Candidate], ctx: PickContext) -> list[float]:
        raise NotImplementedError

    def inputs(self, c: Candidate, ctx: PickContext) -> dict[str, Any]:
        """What this scorer read for candidate ``c`` (for views; default: nothing beyond the term)."""
        return {}

    def on_pick(self, request: RouteRequest, worker: int, now_ns: int) -> None:
        """``worker`` was chosen for ``request`` (not called for dry runs)."""

    def forget_worker(self, worker: int) -> None:
        """``worker`` restarted (new pid): drop what was learnt about it."""


class Picker:
    """Chooses among eligible candidates (rotated order)."""

    name: ClassVar[str] = ""

    def __init__(self, cfg: PolicyConfig, num_workers: int) -> None:
        self.cfg = cfg
        self.num_workers = num_workers

    def pick(self, eligible: list[Candidate], ctx: PickContext) -> tuple[Candidate, str]:
        raise NotImplementedError


# ---- registries ---------------------------------------------------------------------------------------------------
SCORERS: dict[str, type[Scorer]] = {}
PICKERS: dict[str, type[Picker]] = {}


def register_scorer(cls: type[Scorer]) -> type[Scorer]:
    """Make ``cls`` available to ``--weights NAME=W`` under ``cls.name`` (usable as a decorator).
    Raises ValueError for an empty or already taken name."""
    _register(SCORERS, cls, "scorer")
    return cls


def register_picker(cls: type[Picker]) -> type[Picker]:
    """Make ``cls`` available to policy profiles under ``cls.name``. Raises ValueError for a taken name."""
    _register(PICKERS, cls, "picker")
    return cls


def _register(table: dict[str, Any], cls: Any, kind: str) -> None:
    if not cls.name or not cls.name.isidentifier():
        raise ValueError(f"a {kind} needs a name that is an identifier, got {cls.name!r}")
    if table.get(cls.name, cls) is not cls:
        raise ValueError(f"{kind} name {cls.name!r} is already registered by {table[cls.name].__qualname__}")
    table[cls.name] = cls


def build_scorers(cfg: PolicyConfig, num_workers: int) -> list[tuple[Scorer, float]]:
    """The configured scorers with their weights, in ``cfg.weights`` order. Raises :class:`ConfigError` for a
    scorer name nobody registered."""
    out = []
    for name, w in cfg.effective_weights():
        cls = SCORERS.get(name)
        if cls is None:
            raise ConfigError(f"--weights names an unknown scorer {name!r}; known: {', '.join(sorted(SCORERS))}")
        out.append((cls(cfg, num_workers), w))
    return out


def max_queue_of(w: WorkerState, cfg: PolicyConfig) -> int:
    """Soft queue cap for worker ``w``: its published ``max_num_seqs`` with ``max_queue_from_worker``, else
    ``cfg.max_queue`` (requests)."""
    return w.max_num_seqs if cfg.max_queue_from_worker and w.max_num_seqs > 0 else cfg.max_queue

