"""The built-in scorers: queue, memory, latency (the seed's three terms) and prefix match (docs/DESIGN.md §5).

Each returns one value in [0, 1] per candidate, higher is better; the policy adds them up with the configured
weights (seed article: ``0.4·queue + 0.3·memory + 0.3·latency``). Table-driven tests: tests/test_scorers.py.

- ``queue``: ``1 − queue/max_queue`` with ``queue`` = running + waiting + the router's in-flight correction
  (requests it sent that the worker's snapshot may not count yet; without it a burst inside one 200 ms state
  interval herds onto one worker — vLLM's DP client keeps the same correction, ``vllm/v1/engine/core_client.py``).
  ``waiting_weight`` > 1 counts requests that must wait for a batch slot that many times (vLLM DP: 4).
- ``memory``: ``1 − KV-cache usage`` (default; vLLM pre-allocates ~90 % of GPU memory, so NVML "used" is flat) or
  ``1 − NVML used/total`` (``memory_signal="gpu"``; no GPU → 1).
- ``latency``: ``1 − latency/baseline``; ``latency`` is the worker's mean E2E (or TTFT) of its last 10 requests,
  ``baseline`` the P95 of the first ``baseline_window`` requests (1 for everyone until then). A worker with no
  sample, or idle (its mean is old news that would never change without new requests — a once-slow worker would
  starve), gets the mean term of its peers; workers within ``latency_deadband`` of the eligible workers' mean share
  that mean's term (equal workers differ by noise, which would outweigh one queued request).
- ``prefix``: how much of the prompt's *distinguishing* prefix the worker has cached, discounted by its queue
  headroom. From the prefix index (:class:`dplb.policy.prefix.PrefixIndex`): ``prefix_match`` = matched leading blocks ÷
  blocks, per worker. The term is ``(match − min_match)/(1 − min_match) · max(0, 1 − queue/max_queue)`` with
  ``min_match`` the lowest match among the eligible workers: a system prompt every worker has cached cancels out,
  so a conversation's next turn is pulled to the worker holding its history (with a plain ratio, turn 2 of a chat
  with a 600-word system prompt differs by ~0.1 between workers, less than one queued request). The headroom
  factor is the spill rule (a queue-aware weight, like SGLang's balance thresholds but continuous): a worker's
  prefix advantage shrinks as it fills, so a hot prefix spills to a second worker instead of queueing. With the
  default weights (queue 0.3, prefix 0.3, max_queue 16) a full-match worker keeps winning against an idle one while
  ``(0.3 + 0.3)·(1 − q/16) > 0.3``, i.e. up to 8 queued requests; see tests/test_scorers.py::test_hot_prefix_spills.
"""

from __future__ import annotations

from typing import Any

from dplb.config import PolicyConfig
from dplb.policy.decision import OK, Candidate
from dplb.policy.framework import PickContext, RouteRequest, Scorer, max_queue_of
from dplb.policy.prefix import PrefixIndex


class QueueScorer(Scorer):
    """``1 − queue/max_queue``, clamped to [0, 1] (see the module docstring)."""

    name = "queue"

    def score(self, cands: list[Candidate], ctx: PickContext) -> list[float]:
        cfg = self.cfg
        ww1 = cfg.waiting_weight - 1.0
        out = []
        for c in cands:
            w = c.state
            q: float = c.queue
            if ww1 > 0.0:  # requests that will wait for a batch slot weigh more (PolicyConfig.waiting_weight)
                if w.num_waiting > 0:
                    q += ww1 * (w.num_waiting + c.correction)
                elif w.max_num_seqs > 0 and w.num_running + c.correction > w.max_num_seqs:
                    q += ww1 * (w.num_running + c.correction - w.max_num_seqs)
            t = 1.0 - q / max_queue_of(w, cfg)
            out.append(t if t > 0.0 else 0.0)
        return out

    def inputs(self, c: Candidate, ctx: PickContext) -> dict[str, Any]:
        return {"max_queue": max_queue_of(c.state, self.cfg)}


def memory_ratio(c: Candidate, signal: str) -> float:
    """The memory input of candidate ``c``: KV-cache usage (``signal="kv"``) or NVML used/total (``"gpu"``; 0
    without a GPU), ratio 0–1."""
    w = c.state
    if signal == "kv":
        return w.kv_cache_usage
    total = w.gpu_memory_total_bytes
    return w.gpu_memory_used_bytes / total if total > 0 else 0.0


class MemoryScorer(Scorer):
    """``1 − memory ratio``, clamped to [0, 1]."""

    name = "memory"

    def score(self, cands: list[Candidate], ctx: PickContext) -> list[float]:
        sig = self.cfg.memory_signal
        # The common case (kv) without a call per candidate.
        ratios = [c.state.kv_cache_usage for c in cands] if sig == "kv" else [memory_ratio(c, sig) for c in cands]
        return [0.0 if r > 1.0 else (1.0 if r < 0.0 else 1.0 - r) for r in ratios]

    def inputs(self, c: Candidate, ctx: PickContext) -> dict[str, Any]:
        return {"memory_ratio": memory_ratio(c, self.cfg.memory_signal)}


class LatencyScorer(Scorer):
    """``1 − latency/baseline`` with neutral fill and a deadband (see the module docstring)."""

    name = "latency"

    def signal(self, c: Candidate) -> float:
        """The latency this scorer uses for ``c``: mean E2E or mean TTFT of its last 10 requests, seconds."""
        return c.state.avg_ttft_s if self.cfg.latency_signal == "ttft" else c.state.avg_latency_s

    def score(self, cands: list[Candidate], ctx: PickContext) -> list[float]:
        base = ctx.baseline_s
        if base is None:
            return [1.0] * len(cands)
        ttft = self.cfg.latency_signal == "ttft"
        out = []
        missing = False
        el_sum, el_n = 0.0, 0  # eligible workers with a current sample: their mean latency (deadband)
        for c in cands:
            w = c.state
            lat = w.avg_ttft_s if ttft else w.avg_latency_s
            if lat <= 0.0 or c.queue == 0:
                out.append(-1.0)  # no sample yet, or idle: the peers' mean below
                missing = True
                continue
            t = 1.0 - lat / base
            out.append(t if t > 0.0 else 0.0)
            if c.why is OK:
                el_sum += lat
                el_n += 1
        band = self.cfg.latency_deadband
        if band > 0.0 and el_n > 1:
            mean = el_sum / el_n
            tm = 1.0 - mean / base
            tm = tm if tm > 0.0 else 0.0
            lim = band * mean
            for i, c in enumerate(cands):
                if out[i] >= 0.0 and c.why is OK:
                    w = c.state
                    if abs((w.avg_ttft_s if ttft else w.avg_latency_s) - mean) <= lim:
                        out[i] = tm
        if missing:
            have = [t for c, t in zip(cands, out, strict=True) if t >= 0.0 and c.state.pid]
            neutral = sum(have) / len(have) if have else 1.0
            out = [neutral if t < 0.0 else t for t in out]
        return out

    def inputs(self, c: Candidate, ctx: PickContext) -> dict[str, Any]:
        return {"latency_s": self.signal(c), "latency_signal": self.cfg.latency_signal, "baseline_s": ctx.baseline_s}


class PrefixScorer(Scorer):
    """Prefix-cache affinity from the router's prefix index (see the module docstring). Owns the index: records
    each routed request's blocks for its worker and forgets a restarted worker."""

    name = "prefix"

    def __init__(self, cfg: PolicyConfig, num_workers: int) -> None:
        super().__init__(cfg, num_workers)
        self.index = PrefixIndex(cfg.prefix_index_blocks, cfg.prefix_ttl_s, num_workers)

    def score(self, cands: list[Candidate], ctx: PickContext) -> list[float]:
        req = ctx.request
        blocks = req.blocks
        if not blocks:
            return [0.0] * len(cands)
        depth = req.prefix_depth = self.index.match(blocks, ctx.now_ns)
        el = [depth[c.worker_id] for c in cands if c.why is OK]
        if not el:
            return [0.0] * len(cands)
        lo, best = min(el), max(el)
        if best == lo:  # nobody has more than the rest: no preference
            return [0.0] * len(cands)
        req.preferred = next(c.worker_id for c in cands if c.why is OK and depth[c.worker_id] == best)
        span = len(blocks) - lo
        cfg = self.cfg
        out = []
        for c in cands:
            d = depth[c.worker_id]
            if d <= lo:
                out.append(0.0)
                continue
            head = 1.0 - c.queue / max_queue_of(c.state, cfg)
            out.append((d - lo) / span * head if head > 0.0 else 0.0)
        return out

    def inputs(self, c: Candidate, ctx: PickContext) -> dict[str, Any]:
        req = ctx.request
        n = len(req.blocks)
        d = req.prefix_depth[c.worker_id] if req.prefix_depth is not None else 0
        return {"prefix_blocks": n, "prefix_matched_blocks": d, "prefix_match": d / n if n else 0.0}

    def on_pick(self, request: RouteRequest, worker: int, now_ns: int) -> None:
        if request.blocks:
            request.learned = self.index.record(request.blocks, worker, now_ns)

    def forget_worker(self, worker: int) -> None:
        self.index.forget_worker(worker)

