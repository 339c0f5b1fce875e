"""The ``prefix_oracle`` scorer: the upper bound of prefix-cache routing on a sim cluster (``dplb bench compare``'s
``cache-pressure`` scenario), loaded into the router with ``--policy-plugin dplb.bench.oracle``.

Contract
- Bench only: it knows exactly what every sim engine holds, which no production router can. It subscribes to every
  sim worker's KV events itself (``ipc://$DPLB_RUN_DIR/kv-events-K.sock``, the endpoints the workers make) and keeps
  each engine's set of cached block hashes; for a chat request it renders and tokenizes the prompt exactly as the
  sim does (:mod:`dplb.worker.engines.sim.prompts`) and counts, per worker, the leading blocks its engine holds
  (at most ``⌊(T−1)/block_size⌋``, what an engine can hit). No lag, no speculation, no bytes-to-tokens mapping.
- The term is the prefix scorer's formula over those depths (``(d − min)/(n − min) · headroom``), so the oracle
  differs from ``prefix`` only in what it knows. Its notes report the predicted bytes (``depth·block_size·B/T``)
  like ``prefix``, so the workers' prediction-error counters measure it too (≈ 0 by construction, up to event lag).
- Costs ~O(prompt) per request in the router (JSON decode + whitespace tokenizing): fine for a benchmark, not a
  production design.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from dplb.config import PolicyConfig
from dplb.policy.decision import NOTE_PREFIX_BLOCKS, NOTE_PREFIX_HIT_BLOCKS, NOTE_PREFIX_HIT_BYTES, OK, Candidate
from dplb.policy.framework import PickContext, RouteRequest, max_queue_of, register_scorer
from dplb.policy.scorers import PrefixScorer
from dplb.worker.engines.sim.prompts import block_hashes, render_chat, tokenize
from dplb.worker.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KvEventSubscriber


class _Engine:
    """One sim engine's cached block hashes, fed by its KV events (on the subscriber's thread)."""

    def __init__(self) -> None:
        self.held: set[Any] = set()
        self.block_size = 0
        self._lock = threading.Lock()

    def on_batch(self, batch: EventBatch, gap: bool) -> None:
        with self._lock:
            for e in batch.events:
                if isinstance(e, BlockStored):
                    self.block_size = e.block_size
                    self.held.update(e.block_hashes)
                elif isinstance(e, BlockRemoved):
                    self.held.difference_update(e.block_hashes)
                elif isinstance(e, AllBlocksCleared):
                    self.held.clear()


class OracleScorer(PrefixScorer):
    """Prefix affinity from what each sim engine really holds (module docstring)."""

    name = "prefix_oracle"

    def __init__(self, cfg: PolicyConfig, num_workers: int) -> None:
        super().__init__(cfg, num_workers)
        run_dir = os.environ.get("DPLB_RUN_DIR", "")
        self.engines = [_Engine() for _ in range(num_workers)]
        self._subs = [KvEventSubscriber(f"ipc://{os.path.join(run_dir, f'kv-events-{k}.sock')}", e.on_batch)
                      for k, e in enumerate(self.engines)] if run_dir else []
        for s in self._subs:
            s.start()

    def prepare(self, request: RouteRequest) -> None:
        raw = request.prompt
        if raw is None:
            return
        try:
            ids = tokenize(render_chat(msgspec.json.decode(bytes(raw))))
        except (msgspec.DecodeError, ValueError, TypeError, KeyError):
            return
        bs = next((e.block_size for e in self.engines if e.block_size), 16)
        request.derived["oracle"] = (block_hashes(ids, bs)[: max(0, (len(ids) - 1) // bs)], bs, len(ids),
                                     len(bytes(raw)))

    def score(self, cands: list[Candidate], ctx: PickContext) -> list[float]:
        o = ctx.request.derived.get("oracle")
        if o is None:
            return [0.0] * len(cands)
        hashes = o[0]
        depth = []
        for e in self.engines:
            d, held = 0, e.held
            for h in hashes:
                if h not in held:
                    break
                d += 1
            depth.append(d)
        ctx.request.derived["oracle_depth"] = depth
        el = [depth[c.worker_id] for c in cands if c.why is OK]
        if not el or max(el) == min(el):
            return [0.0] * len(cands)
        lo, best = min(el), max(el)
        for c in cands:
            if depth[c.worker_id] == best and c.why is OK:
                ctx.request.preferred = c.worker_id
                break
        span = len(hashes) - lo
        mq = 0 if self.cfg.max_queue_from_worker else self.cfg.max_queue
        out = []
        for c in cands:
            d = depth[c.worker_id]
            head = 1.0 - c.queue / (mq or max_queue_of(c.state, self.cfg))
            out.append((d - lo) / span * head if d > lo and head > 0.0 else 0.0)
        return out

    def inputs(self, c: Candidate, ctx: PickContext) -> dict[str, Any]:
        depth = ctx.request.derived.get("oracle_depth")
        return {"oracle_matched_blocks": depth[c.worker_id] if depth else 0}

    def on_pick(self, request: RouteRequest, worker: int, now_ns: int) -> None:
        """Nothing to learn: the engines say what they hold."""

    def notes(self, request: RouteRequest, worker: int) -> dict[str, Any] | None:
        o, depth = request.derived.get("oracle"), request.derived.get("oracle_depth")
        if o is None or depth is None:
            return None
        hashes, bs, n_tok, n_bytes = o
        return {NOTE_PREFIX_BLOCKS: len(hashes), NOTE_PREFIX_HIT_BLOCKS: depth[worker],
                NOTE_PREFIX_HIT_BYTES: round(depth[worker] * bs * n_bytes / n_tok)}

    def absorb(self, entries: Mapping[int, Sequence[int]], now_ns: int) -> None:
        """Nothing to share with the other router processes."""

    def absorb_engine(self, entries: Mapping[int, Sequence[int]] | None, events_mask: int, now_ns: int) -> None:
        """The oracle reads the engines itself."""


register_scorer(OracleScorer)
