"""Eligibility filters: the one definition of "may this worker take this request" (docs/DESIGN.md §5; staleness: §3.3).

Contract: :data:`HEALTH_FILTERS` (about the worker: registered, consistent slot, fresh heartbeat, lifecycle
``ready``, not held out by the router's heartbeat hysteresis, not ejected by its passive health check, not stalled:
requests outstanding and no engine progress, :mod:`dplb.policy.stall`) then
:data:`REQUEST_FILTERS` (about this request: serves its model, not already tried, under the hard queue cap).
The policy runs both (:func:`apply_filters`); ``/ready``, ``dplb_worker_up`` and ``dplb state`` ask
:func:`routable`, which runs the health filters on the same :class:`~dplb.policy.decision.Candidate` objects, so the
four can never disagree. Each filter sets the first ``why`` that rejects a candidate (values in
:mod:`dplb.policy.decision`). :func:`panic_set` reads the same candidates for panic routing (docs/DESIGN.md §5.1):
the workers the router would route among while no worker is routable.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
from typing import ClassVar

from dplb.config import PolicyConfig
from dplb.native import mypyc_attr
from dplb.policy.decision import (
    OK,
    WHY_CANNOT_SERVE,
    WHY_DRAINING,
    WHY_EJECTED,
    WHY_EXCLUDED,
    WHY_HELD_OUT,
    WHY_NOT_READY,
    WHY_OVER_CAP,
    WHY_STALE,
    WHY_STALLED,
    WHY_TORN,
    WHY_UNREGISTERED,
    Candidate,
)
from dplb.policy.framework import Filter, PickContext, RouteRequest
from dplb.state.shm import STALE_INTERVALS, Lifecycle, WorkerState

_READY = Lifecycle.READY
_DRAINING = Lifecycle.DRAINING


# Subclassed by plugins (not compiled): allowed (dplb.native).
@mypyc_attr(allow_interpreted_subclasses=True)
class Registered(Filter):
    """The worker wrote its slot at least once (pid ≠ 0)."""

    reasons = (WHY_UNREGISTERED,)

    def apply(self, cands: list[Candidate], ctx: PickContext) -> None:
        for c in cands:
            if c.state.pid == 0 and c.why is OK:
                c.why = WHY_UNREGISTERED


# Subclassed by plugins (not compiled): allowed (dplb.native).
@mypyc_attr(allow_interpreted_subclasses=True)
class Consistent(Filter):
    """The slot read was not torn (seqlock retries exhausted)."""

    reasons = (WHY_TORN,)

    def apply(self, cands: list[Candidate], ctx: PickContext) -> None:
        for c in cands:
            if c.state.torn and c.why is OK:
                c.why = WHY_TORN


# Subclassed by plugins (not compiled): allowed (dplb.native).
@mypyc_attr(allow_interpreted_subclasses=True)
class Fresh(Filter):
    """Heartbeat younger than ``STALE_INTERVALS`` (3) × the state interval."""

    reasons = (WHY_STALE,)

    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__(cfg)
        self.stale_ns = STALE_INTERVALS * cfg.state_interval_ms * 1_000_000

    def apply(self, cands: list[Candidate], ctx: PickContext) -> None:
        lim = self.stale_ns
        for c in cands:
            if c.age_ns > lim and c.why is OK:
                c.why = WHY_STALE


# Subclassed by plugins (not compiled): allowed (dplb.native).
@mypyc_attr(allow_interpreted_subclasses=True)
class Ready(Filter):
    """Lifecycle ``ready`` (not starting, warming, draining or stopped)."""

    reasons = (WHY_DRAINING, WHY_NOT_READY)

    def apply(self, cands: list[Candidate], ctx: PickContext) -> None:
        for c in cands:
            if c.state.lifecycle is not _READY and c.why is OK:
                c.why = WHY_DRAINING if c.state.lifecycle == _DRAINING else WHY_NOT_READY


# Subclassed by plugins (not compiled): allowed (dplb.native).
@mypyc_attr(allow_interpreted_subclasses=True)
class _NotIn(Filter):
    """Rejects candidates whose worker id is in a set of ids the context carries: ``ids(ctx)``, a getter of that
    :class:`PickContext` attribute (a C call, not a method)."""

    ids: ClassVar[attrgetter[frozenset[int]]]

    def apply(self, cands: list[Candidate], ctx: PickContext) -> None:
        ids = self.ids(ctx)
        if ids:
            why = self.reasons[0]
            for c in cands:
                if c.worker_id in ids and c.why is OK:
                    c.why = why


# Subclassed by plugins (not compiled): allowed (dplb.native).
@mypyc_attr(allow_interpreted_subclasses=True)
class NotHeldOut(_NotIn):
    """Not on heartbeat probation (the router's hysteresis: once stale, fresh again for 5 intervals first). The one
    filter panic routing lifts when nobody else can take the request (docs/DESIGN.md §5.1)."""

    reasons = (WHY_HELD_OUT,)

    ids = attrgetter("held")


# Subclassed by plugins (not compiled): allowed (dplb.native).
@mypyc_attr(allow_interpreted_subclasses=True)
class NotEjected(_NotIn):
    """Not ejected by the router (refused a connection, or failed 3 responses in a row: a few seconds out)."""

    reasons = (WHY_EJECTED,)

    ids = attrgetter("ejected")


# Subclassed by plugins (not compiled): allowed (dplb.native).
@mypyc_attr(allow_interpreted_subclasses=True)
class NotStalled(_NotIn):
    """Not stalled (requests outstanding, no engine progress for ``--stall-after``; :mod:`dplb.policy.stall`)."""

    reasons = (WHY_STALLED,)

    ids = attrgetter("stalled")


# Subclassed by plugins (not compiled): allowed (dplb.native).
@mypyc_attr(allow_interpreted_subclasses=True)
class NotTried(_NotIn):
    """Not already tried for this request (a retry goes to another worker)."""

    reasons = (WHY_EXCLUDED,)
    health = False

    ids = attrgetter("request.exclude")


# Subclassed by plugins (not compiled): allowed (dplb.native).
@mypyc_attr(allow_interpreted_subclasses=True)
class CanServe(_NotIn):
    """Serves the request's model (and holds the response it names, if any): :mod:`dplb.router.models`."""

    reasons = (WHY_CANNOT_SERVE,)
    health = False

    ids = attrgetter("request.cannot_serve")


# Subclassed by plugins (not compiled): allowed (dplb.native).
@mypyc_attr(allow_interpreted_subclasses=True)
class UnderHardCap(Filter):
    """Queue (with the in-flight correction) below ``hard_queue_cap`` (0 = no cap)."""

    reasons = (WHY_OVER_CAP,)
    health = False

    def apply(self, cands: list[Candidate], ctx: PickContext) -> None:
        cap = self.cfg.hard_queue_cap
        if cap:
            for c in cands:
                if c.queue >= cap and c.why is OK:
                    c.why = WHY_OVER_CAP


HEALTH_FILTERS: tuple[type[Filter], ...] = (Registered, Consistent, Fresh, Ready, NotHeldOut, NotEjected,
                                             NotStalled)
REQUEST_FILTERS: tuple[type[Filter], ...] = (CanServe, NotTried, UnderHardCap)


def state_why(w: WorkerState, age_ns: int, stale_ns: int) -> str:
    """The ``why`` the state filters (:class:`Registered`, :class:`Consistent`, :class:`Fresh`, :class:`Ready`, in
    that order) give worker ``w`` with heartbeat age ``age_ns`` and :attr:`Fresh.stale_ns` ``stale_ns``: the first
    rejection, or ``ok``. The policy applies them this way, one test per worker (:mod:`dplb.policy.core`)."""
    if w.pid == 0:
        return WHY_UNREGISTERED
    if w.torn:
        return WHY_TORN
    if age_ns > stale_ns:
        return WHY_STALE
    if w.lifecycle is not _READY:
        return WHY_DRAINING if w.lifecycle == _DRAINING else WHY_NOT_READY
    return OK


def build_filters(cfg: PolicyConfig, health_only: bool = False) -> list[Filter]:
    """The filter chain for ``cfg``, health filters first."""
    classes = HEALTH_FILTERS if health_only else HEALTH_FILTERS + REQUEST_FILTERS
    return [cls(cfg) for cls in classes]


def apply_filters(filters: Sequence[Filter], cands: list[Candidate], ctx: PickContext) -> None:
    """Run ``filters`` in order; each candidate keeps the first rejection."""
    for f in filters:
        f.apply(cands, ctx)


def routable(
    snapshot: Sequence[WorkerState], now_ns: int, cfg: PolicyConfig, held: frozenset[int] = frozenset(),
    ejected: frozenset[int] = frozenset(), stalled: frozenset[int] = frozenset(),
) -> list[Candidate]:
    """Every worker of ``snapshot`` with its health verdict (``why``; ``ok`` = routable), in snapshot order.

    The same health filters as the policy, without request-level ones: what ``/ready``, ``dplb_worker_up`` and
    ``dplb state`` show. ``held``/``ejected``/``stalled``: the router's own verdicts (empty outside the router).
    """
    cands = [Candidate(w, 0, w.num_running + w.num_waiting, now_ns - w.heartbeat_mono_ns) for w in snapshot]
    apply_filters(build_filters(cfg, health_only=True), cands, PickContext(now_ns, RouteRequest(), None, held,
                                                                           ejected, stalled))
    return cands


def panic_set(cands: Sequence[Candidate], ejected: frozenset[int] = frozenset(),
              stalled: frozenset[int] = frozenset()) -> frozenset[int]:
    """The workers panic routing routes among (docs/DESIGN.md §5.1), from :func:`routable`'s candidates with the
    router's ``ejected`` and ``stalled`` sets: none while some candidate is routable (``ok``); else each one whose
    only rejection is the heartbeat probation: ``held_out`` (the state filters come first, so it is registered,
    consistent, fresh and ready) and neither ejected nor stalled (the filters after it, whose ``why`` it hides)."""
    if any(c.why is OK for c in cands):
        return frozenset()
    return frozenset(c.worker_id for c in cands
                     if c.why == WHY_HELD_OUT and c.worker_id not in ejected and c.worker_id not in stalled)
