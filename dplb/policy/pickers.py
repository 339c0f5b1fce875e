"""The built-in pickers: how a worker is chosen among the eligible candidates (docs/DESIGN.md §5).

Every picker gets the eligible candidates in rotated order (the scan starts one worker later on every pick, so
"first among equals" rotates) and returns ``(candidate, reason)``.

- ``max_score`` (policy ``dplb``): best score; equal scores (e.g. every queue past ``max_queue``, where the clamped
  queue term no longer tells them apart) go to the shorter queue, then to rotation.
- ``round_robin``: next eligible worker in id order (a Kubernetes Service, Nginx).
- ``random``: uniformly random (seeded).
- ``least_loaded``: vLLM DP's rule, minimum ``4·waiting + running`` with the router's correction counted as waiting.
- ``power_of_two``: two distinct random eligible workers, the shorter queue wins (Mitzenmacher 2001).
- ``prefix_hash``: pure prefix affinity, blind to load: the rendezvous (highest-random-weight, Thaler &
  Ravishankar 1998) worker of the prompt's first ``blocks`` (:data:`AFFINITY_BLOCKS`) chained blocks of
  ``block_bytes`` (``--prefix-block-bytes``; 0 = no key), which it hashes itself from the raw prompt in its
  ``prepare`` hook — what a consistent hash on the prompt does. The hit-rate reference of ``dplb bench compare``.

Parameters (``--scorer-param NAME.PARAM=VALUE``): ``random.seed`` and ``power_of_two.seed`` (``--seed``),
``prefix_hash.block_bytes`` and ``prefix_hash.blocks``. Table tests: tests/test_policy.py.
"""

from __future__ import annotations

import random

from dplb.config import MAX_PREFIX_BLOCK_BYTES, PolicyConfig
from dplb.native import mypyc_attr
from dplb.policy.decision import OK, REASON_AFFINITY, REASON_POLICY, REASON_SCORE, Candidate
from dplb.policy.framework import Param, PickContext, Picker, RouteRequest
from dplb.policy.prefix import block_hashes

#: Blocks of the prompt that form ``prefix_hash``'s key (2 × 128 bytes: the 256-byte key of DPLB v1).
AFFINITY_BLOCKS = 2


# Subclassed by plugins (not compiled): allowed (dplb.native).
@mypyc_attr(allow_interpreted_subclasses=True)
class MaxScore(Picker):
    """Best score, then shorter queue, then rotation."""

    name = "max_score"

    def pick(self, eligible: list[Candidate], ctx: PickContext) -> tuple[Candidate, str]:
        best = self.scan(eligible)
        assert best is not None  # ``eligible`` is never empty
        return best, REASON_SCORE

    def scan(self, rotated: list[Candidate]) -> Candidate | None:
        """:meth:`pick` over the eligible ones of ``rotated`` (every candidate, in rotated order) without a list of
        them: the same candidate. None when none is eligible."""
        best: Candidate | None = None
        bs = 0.0
        bq = 0
        for c in rotated:
            if c.why is OK:
                s = c.score
                if best is None or s > bs + 1e-12 or (s > bs - 1e-12 and c.queue < bq):
                    best, bs, bq = c, s, c.queue
        return best


# Subclassed by plugins (not compiled): allowed (dplb.native).
@mypyc_attr(allow_interpreted_subclasses=True)
class RoundRobin(Picker):
    """Next eligible worker in id order."""

    name = "round_robin"

    def __init__(self, cfg: PolicyConfig, num_workers: int) -> None:
        super().__init__(cfg, num_workers)
        self._next = 0

    def pick(self, eligible: list[Candidate], ctx: PickContext) -> tuple[Candidate, str]:
        nxt = self._next % self.num_workers
        ordered = sorted(eligible, key=lambda c: c.worker_id)
        c = next((c for c in ordered if c.worker_id >= nxt), ordered[0])
        self._next = c.worker_id + 1
        return c, REASON_POLICY


# Subclassed by plugins (not compiled): allowed (dplb.native).
@mypyc_attr(allow_interpreted_subclasses=True)
class _Seeded(Picker):
    """A picker with its own RNG seeded by its ``seed`` parameter (``--seed``; deterministic runs)."""

    parameters = (Param("seed", int, field="seed", help="RNG seed (--seed)"),)

    def __init__(self, cfg: PolicyConfig, num_workers: int) -> None:
        super().__init__(cfg, num_workers)
        self._rng = random.Random(self.params["seed"])


# Subclassed by plugins (not compiled): allowed (dplb.native).
@mypyc_attr(allow_interpreted_subclasses=True)
class Random(_Seeded):
    """Uniformly random eligible worker."""

    name = "random"

    def pick(self, eligible: list[Candidate], ctx: PickContext) -> tuple[Candidate, str]:
        return self._rng.choice(sorted(eligible, key=lambda c: c.worker_id)), REASON_POLICY


# Subclassed by plugins (not compiled): allowed (dplb.native).
@mypyc_attr(allow_interpreted_subclasses=True)
class LeastLoaded(Picker):
    """Minimum ``4·(waiting + correction) + running`` (vLLM DP), first in rotation on a tie."""

    name = "least_loaded"

    def pick(self, eligible: list[Candidate], ctx: PickContext) -> tuple[Candidate, str]:
        return min(eligible, key=lambda c: 4 * (c.state.num_waiting + c.correction) + c.state.num_running), \
            REASON_POLICY


# Subclassed by plugins (not compiled): allowed (dplb.native).
@mypyc_attr(allow_interpreted_subclasses=True)
class PowerOfTwo(_Seeded):
    """Two distinct random eligible workers; the shorter queue wins (the first sampled on a tie)."""

    name = "power_of_two"

    def pick(self, eligible: list[Candidate], ctx: PickContext) -> tuple[Candidate, str]:
        if len(eligible) == 1:
            return eligible[0], REASON_POLICY
        a, b = self._rng.sample(sorted(eligible, key=lambda c: c.worker_id), 2)
        return (b if b.queue < a.queue else a), REASON_POLICY


# Subclassed by plugins (not compiled): allowed (dplb.native).
@mypyc_attr(allow_interpreted_subclasses=True)
class PrefixHash(Picker):
    """Rendezvous worker of the prompt's first blocks; without a prefix key, the first in rotation."""

    name = "prefix_hash"
    parameters = (
        Param("block_bytes", int, field="prefix_block_bytes", check=lambda v: 0 <= v <= MAX_PREFIX_BLOCK_BYTES,
              expect=f"0..{MAX_PREFIX_BLOCK_BYTES} bytes (0: no key, rotation)",
              help="prompt block size (--prefix-block-bytes)"),
        Param("blocks", int, default=AFFINITY_BLOCKS, check=lambda v: v >= 1, expect="≥ 1",
              help="leading blocks that form the key"),
    )

    def __init__(self, cfg: PolicyConfig, num_workers: int) -> None:
        super().__init__(cfg, num_workers)
        self.block_bytes: int = self.params["block_bytes"]
        self.blocks: int = self.params["blocks"]

    def prepare(self, request: RouteRequest) -> None:
        keys = block_hashes(request.prompt, self.block_bytes, self.blocks)
        if keys:
            request.derived["prefix_hash"] = keys[-1]  # chained: the last key covers every leading block

    def pick(self, eligible: list[Candidate], ctx: PickContext) -> tuple[Candidate, str]:
        key = ctx.request.derived.get("prefix_hash")
        if key is None:
            return eligible[0], REASON_POLICY
        # CPython's tuple hash of two ints: ints are not salted, so the same worker in every process and run.
        c = max(eligible, key=lambda c: hash((key, c.worker_id)))
        ctx.request.preferred = c.worker_id
        return c, REASON_AFFINITY

