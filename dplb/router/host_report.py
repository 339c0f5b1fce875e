"""The host load report: one figure set per DPLB host, for the balancer in front of many hosts.

Contract
- :class:`HostReporter` computes a :class:`HostReport` every state interval (:meth:`HostReporter.run`, a
  background task of the router process) from the state segment and the router's own state; every fleet-facing
  answer reads that one report: the Model Server Protocol families on ``/metrics``
  (:mod:`dplb.obs.metrics_host`), the HAProxy agent-check port (:mod:`dplb.router.agent`) and the ORCA response
  header (:mod:`dplb.router.orca`).
- Figures, over the workers that are routable right now (:meth:`dplb.router.state.RouterState.routable_workers`):

  - ``waiting``: the workers' published waiting requests plus ``router_pending``, the requests the router (every
    router process on the segment) has sent to a worker that the worker's last snapshot does not count yet
    (``max(0, in-flight − running − waiting)`` per worker).
  - ``running``: the workers' running requests.
  - ``kv_usage``: used ÷ total KV blocks, each worker weighted by its published ``kv_total_blocks``; the plain mean
    of the workers' fractions when no worker published its block count.
  - ``capacity``: the sum of the workers' ``max_num_seqs`` (the policy's ``max_queue`` for a worker that does not
    publish one): how many requests the host runs at once.
  - ``load`` = (running + waiting) ÷ capacity: 1 means every batch slot of every routable worker is taken; above 1
    requests queue.
  - ``utilization`` = min(1, max(load, kv_usage)): **a host is full when nothing more would start at once**, either
    because every batch slot is taken or because the KV cache is (vLLM then preempts). 1 while the host drains or
    has no routable worker.
  - ``pressure`` = max(load, kv_usage), not capped (at least 1 while the host drains or is down): what the ORCA
    report sends as ``application_utilization``, which may exceed 1 above the host's soft limit (xds
    ``orca_load_report.proto``). Envoy weights a host by qps ÷ utilization; capped at 1, every saturated host
    would be weighted by its throughput alone and a backlog would never drain faster than it built.
  - ``agent_weight`` = 100 ÷ (1 + load), at least 1: the share of service a new request would get under processor
    sharing of a host already holding ``load`` batches' worth of requests (Kleinrock, *Queueing Systems* vol. 2,
    §4.4: a processor-sharing server with n jobs gives each 1/n of its rate). Unlike ``1 − utilization`` it keeps
    ranking hosts that are all saturated.
  - ``rps``: requests the workers completed per second (their ``requests_total``), over the last
    :data:`RATE_WINDOW_S` seconds; a worker that restarted (new pid) counts from its new total.
  - ``routable``/``draining``/``workers``: worker ids routable, worker ids whose lifecycle is DRAINING, slot count.
  - ``models``/``adapters``: the names the workers serve (``/v1/models``); adapters are the served names other than
    the segment's model name (vLLM lists loaded LoRA adapters beside the base model).
  - ``max_loras``: the routable workers' published ``max_loras`` summed (vLLM ``--max-loras`` per worker: how many
    adapters the host holds in its batches at once, each worker holding its own); 0 when none publishes one.
- ``picker_waiting``/``picker_kv_usage``: what the Model Server Protocol families the Endpoint Picker scores by
  say (``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``; :mod:`dplb.obs.metrics_host`): ``waiting`` and
  ``kv_usage`` while ``up``; while the host drains or is down, saturated, as the ORCA report's utilization ≥ 1
  and the agent's ``drain``/``down`` say it to the other balancers (an empty queue and cache would make the host the
  picker's *best* endpoint until kubelet's readiness probe removes the pod). The values come from llm-d-router's
  scorers and saturation filter (``kv-cache-utilization-scorer``: score 1 − KV usage; ``queue-scorer``: min-max
  normalised waiting, the longest queue scores 0; ``utilization-detector``: an endpoint stays a candidate only with
  waiting < ``queueDepthThreshold`` × (1 + headroom) and KV usage < ``kvCacheUtilThreshold`` × (1 + headroom)):
  KV usage 1 — the scorer's lowest score, and out of the filter at every threshold ≤ 1 ÷ (1 + headroom), the
  defaults (0.8, 0) included; waiting ≥ :data:`PICKER_QUEUE_PER_WORKER` × workers — the detector's default
  ``queueDepthThreshold`` (5 per engine) for each worker slot, the threshold the shipped
  ``endpoint-picker-config.yaml`` sets (5 × 8 workers), so the host is at the threshold (out of the filter without
  headroom) and scores like a stale endpoint (1, the detector's "100% saturated") in the pool's average instead of
  dragging it up with a huge figure.
- ``state``: ``drain`` once :meth:`HostReporter.begin_drain` was called (SIGUSR1 of the router, or SIGTERM, after
  which the router serves ``--drain-notice`` seconds more: :meth:`HostReporter.drain_notice`), else
  ``down`` with a reason when no worker is routable (naming the stalled workers: a stalled worker is never
  routable here, :mod:`dplb.router.state`), else ``up``. Without a segment the router serves on its own
  in-flight counts (:mod:`dplb.router.state`): ``up`` while a worker socket exists (running = the router's
  in-flight requests, capacity = ``max_queue`` per worker), ``down`` otherwise. Draining is one-way.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import asdict, dataclass, field

from dplb.router.models import ServedModels
from dplb.router.state import RouterState
from dplb.state.shm import Lifecycle, WorkerState

log = logging.getLogger("dplb.router")
RATE_WINDOW_S = 5.0  # seconds of completions the request rate is measured over
#: Waiting requests per worker slot a draining or down host reports to the Endpoint Picker (module docstring):
#: llm-d-router's utilization-detector default queueDepthThreshold (per engine).
PICKER_QUEUE_PER_WORKER = 5
STATE_UP, STATE_DRAIN, STATE_DOWN = "up", "drain", "down"


@dataclass(frozen=True, slots=True)
class HostReport:
    """One host's load (module docstring for each figure). Units: requests, fractions 0–1, requests per second,
    blocks, tokens per block; ``time_unix``: when it was computed (wall-clock seconds)."""

    time_unix: float = 0.0
    state: str = STATE_DOWN
    reason: str = "not computed yet"
    waiting: int = 0
    router_pending: int = 0
    running: int = 0
    capacity: int = 0
    load: float = 0.0
    utilization: float = 1.0
    pressure: float = 1.0
    agent_weight: int = 1
    kv_usage: float = 0.0
    kv_used_blocks: int = 0
    kv_total_blocks: int = 0
    kv_block_size: int = 0
    rps: float = 0.0
    workers: int = 0
    routable: tuple[int, ...] = ()
    draining: tuple[int, ...] = ()
    models: tuple[str, ...] = ()
    adapters: tuple[str, ...] = field(default=())
    max_loras: int = 0
    picker_waiting: int = 0
    picker_kv_usage: float = 1.0

    def to_dict(self) -> dict[str, object]:
        """JSON-friendly dict."""
        d = asdict(self)
        for k in ("routable", "draining", "models", "adapters"):
            d[k] = list(d[k])
        return d


def kv_figures(ws: list[WorkerState]) -> tuple[float, int, int, int]:
    """(usage 0–1, used blocks, total blocks, block size) over ``ws``: block-weighted when blocks are published,
    else the mean fraction (0 for no worker). Block size: the largest published (vLLM uses one per model)."""
    total = sum(w.kv_total_blocks for w in ws)
    bs = max((w.kv_block_size for w in ws), default=0)
    if total > 0:
        used = sum(round(min(1.0, max(0.0, w.kv_cache_usage)) * w.kv_total_blocks) for w in ws)
        return used / total, used, total, bs
    if not ws:
        return 0.0, 0, 0, bs
    return sum(min(1.0, max(0.0, w.kv_cache_usage)) for w in ws) / len(ws), 0, 0, bs


def picker_view(state: str, waiting: int, kv_usage: float, workers: int) -> tuple[int, float]:
    """(``picker_waiting``, ``picker_kv_usage``): the figures themselves while ``state`` is up, else saturated
    (module docstring): at least :data:`PICKER_QUEUE_PER_WORKER` × ``workers`` waiting, and KV usage 1."""
    if state == STATE_UP:
        return waiting, kv_usage
    return max(waiting, PICKER_QUEUE_PER_WORKER * max(1, workers)), 1.0


class _Rate:
    """Completions per second from the workers' ``requests_total`` counters (restart-safe by pid)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._last: dict[int, tuple[int, int]] = {}  # worker → (pid, requests_total)
        self._done = 0  # completions counted so far (monotonic)
        self._points: collections.deque[tuple[float, int]] = collections.deque()

    def update(self, snap: list[WorkerState], now_s: float) -> float:
        for w in snap:
            if w.pid == 0 or w.torn:
                continue
            pid, total = self._last.get(w.worker_id, (0, 0))
            if pid == w.pid and w.requests_total >= total:
                self._done += w.requests_total - total
            elif pid != 0:
                self._done += w.requests_total  # restarted: its new counter started at 0
            self._last[w.worker_id] = (w.pid, w.requests_total)
        pts = self._points
        pts.append((now_s, self._done))
        while len(pts) > 2 and now_s - pts[1][0] >= self.window_s:
            pts.popleft()
        t0, d0 = pts[0]
        return (self._done - d0) / (now_s - t0) if now_s > t0 else 0.0


class HostReporter:
    """Computes and holds this router's :class:`HostReport` (module docstring). Single event loop."""

    def __init__(self, state: RouterState, models: ServedModels) -> None:
        self.state = state
        self.models = models
        self.draining = False
        self.drain_reason = ""
        self._drain_since = 0.0
        self._rate = _Rate(RATE_WINDOW_S)
        self.report = HostReport(workers=state.num_workers)
        self.refresh()

    def begin_drain(self, reason: str = "draining") -> None:
        """Report ``drain`` (utilization 1, readiness false) from now on, and recompute at once."""
        if not self.draining:
            self.draining, self.drain_reason = True, reason
            self._drain_since = time.monotonic()
            log.info("host draining (%s): reporting drain to the front balancer", reason)
        self.refresh()

    async def drain_notice(self, notice_s: float) -> None:
        """Report ``drain`` and return once ``notice_s`` seconds have passed since the drain began (at once when
        it began that long ago, e.g. a SIGUSR1 from ``dplb launch`` followed by its SIGTERM)."""
        self.begin_drain("stopping")
        left = notice_s - (time.monotonic() - self._drain_since)
        if left > 0:
            log.info("serving %.1f s more while the front balancer moves new requests away", left)
            await asyncio.sleep(left)

    def interval_s(self) -> float:
        """The state interval the report is recomputed at, seconds (the segment's, else the policy's)."""
        seg = self.state.segment
        ms = seg.state_interval_ms if seg is not None else self.state.cfg.policy.state_interval_ms
        return ms / 1000.0

    async def run(self) -> None:
        """Recompute every state interval until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s())
            self.refresh()

    def refresh(self) -> HostReport:
        """Compute the report now from the segment and the router's state; store it in :attr:`report`."""
        st = self.state
        snap = st.snapshot()
        now = time.time()
        rps = self._rate.update(snap, time.monotonic()) if snap is not None else 0.0
        routable = st.routable_workers() if snap is not None else []
        names = self.models.names()
        base = st.segment.header.model if st.segment is not None else ""
        common = {"time_unix": now, "workers": st.num_workers, "rps": rps, "models": tuple(names),
                  "adapters": tuple(n for n in names if base and n != base)}
        if snap is None:
            self.report = self._without_segment(common)
            return self.report
        self.report = self._from_snapshot(snap, routable, common)
        return self.report

    def _without_segment(self, common: dict[str, object]) -> HostReport:
        """No segment: the router serves on its own in-flight counts to the workers whose socket exists (its
        fallback), so the host is up while one does; load = in-flight over ``max_queue`` per such worker."""
        st = self.state
        socks = st.routable_workers()
        inflight = st.inflight_all()
        running = sum(inflight[k] for k in socks)
        capacity = len(socks) * st.cfg.policy.max_queue
        load = running / capacity if capacity > 0 else 0.0
        if self.draining:
            state, reason, util = STATE_DRAIN, self.drain_reason, 1.0
        elif not socks:
            state, reason, util = STATE_DOWN, "state segment missing and no worker socket", 1.0
        else:
            state, reason, util = STATE_UP, "state segment missing: routing on in-flight counts", min(1.0, load)
        pw, pkv = picker_view(state, 0, 0.0, st.num_workers)
        return HostReport(**common, state=state, reason=reason, running=running,  # type: ignore[arg-type]
                          capacity=capacity, load=load, utilization=util,
                          pressure=load if state == STATE_UP else max(1.0, load),
                          agent_weight=max(1, min(100, round(100 / (1 + load)))), routable=tuple(socks),
                          picker_waiting=pw, picker_kv_usage=pkv)

    def _from_snapshot(self, snap: list[WorkerState], routable: list[int], common: dict[str, object]) -> HostReport:
        inflight = self.state.inflight_all()
        ws = [snap[k] for k in routable]
        running = sum(w.num_running for w in ws)
        engine_waiting = sum(w.num_waiting for w in ws)
        pending = sum(max(0, inflight[w.worker_id] - w.num_running - w.num_waiting) for w in ws)
        default_cap = self.state.cfg.policy.max_queue
        capacity = sum(w.max_num_seqs or default_cap for w in ws)
        kv, used, total, bs = kv_figures(ws)
        waiting = engine_waiting + pending
        load = (running + waiting) / capacity if capacity > 0 else 0.0
        draining = tuple(w.worker_id for w in snap if w.lifecycle == Lifecycle.DRAINING)
        if self.draining:
            state, reason, util = STATE_DRAIN, self.drain_reason, 1.0
        elif not ws:
            stalled = self.state.stalled_workers()
            state, util = STATE_DOWN, 1.0
            reason = "no routable worker" + (f" (engine stalled: {stalled_list(stalled)})" if stalled else "")
        else:
            state, reason, util = STATE_UP, "", min(1.0, max(load, kv))
        weight = max(1, min(100, round(100 / (1 + load))))
        pw, pkv = picker_view(state, waiting, kv, self.state.num_workers)
        return HostReport(**common, state=state, reason=reason, waiting=waiting,  # type: ignore[arg-type]
                          router_pending=pending, running=running, capacity=capacity, load=load,
                          utilization=util, pressure=max(load, kv) if state == STATE_UP else max(1.0, load, kv),
                          agent_weight=weight, kv_usage=kv, kv_used_blocks=used,
                          kv_total_blocks=total, kv_block_size=bs, routable=tuple(routable), draining=draining,
                          max_loras=sum(w.max_loras for w in ws), picker_waiting=pw, picker_kv_usage=pkv)


def stalled_list(workers: list[int]) -> str:
    """``worker 0`` / ``workers 0 2`` / ``8 workers`` (more than 4): the stalled workers named in a reason (the
    agent's, at most 64 characters and no comma: HAProxy splits the agent's words at commas, and ``/ready``'s)."""
    if len(workers) > 4:
        return f"{len(workers)} workers"
    return ("worker " if len(workers) == 1 else "workers ") + " ".join(map(str, workers))


__all__ = ["PICKER_QUEUE_PER_WORKER", "RATE_WINDOW_S", "STATE_DOWN", "STATE_DRAIN", "STATE_UP", "HostReport",
           "HostReporter", "kv_figures", "picker_view", "stalled_list"]
