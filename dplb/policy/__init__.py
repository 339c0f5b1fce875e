"""Routing policies (docs/DESIGN.md §5): a small framework of filters, weighted scorers and pickers.

- :mod:`dplb.policy.framework`: the extension points (:class:`Filter`, :class:`Scorer`, :class:`Picker`), the
  per-request :class:`RouteRequest` and per-pick :class:`PickContext`, and the registries.
- :mod:`dplb.policy.filters`: eligibility (one definition for the policy, ``/ready``, ``dplb_worker_up`` and
  ``dplb state``).
- :mod:`dplb.policy.scorers`: queue, memory, latency, prefix.
- :mod:`dplb.policy.pickers`: max_score, round_robin, random, least_loaded, power_of_two, prefix_hash.
- :mod:`dplb.policy.core`: :class:`Policy` (a profile + the in-flight correction) and :func:`make_policy`.
- :mod:`dplb.policy.baseline`: the latency baseline (P95 of the first requests, then frozen).
"""

from dplb.policy.core import PROFILES, Policy, make_policy
from dplb.policy.filters import panic_set, routable
from dplb.policy.framework import (
    Filter,
    PickContext,
    Picker,
    RouteRequest,
    Scorer,
    register_picker,
    register_scorer,
)

__all__ = [
    "PROFILES", "Filter", "PickContext", "Picker", "Policy", "RouteRequest", "Scorer", "make_policy", "panic_set",
    "register_picker", "register_scorer", "routable",
]
