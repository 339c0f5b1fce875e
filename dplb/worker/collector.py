"""The worker's state publisher: one thread writes the worker's slot in the state segment every state interval.

Contract (docs/DESIGN.md §3, §8)
- :class:`Collector` publishes every ``interval_s`` (heartbeat written every tick even when nothing changed): the
  engine's scheduler state, per-request figures from :class:`dplb.worker.engines.base.RequestStats`, NVML memory
  (zeros + the NO_GPU flag without a GPU), the engine's progress. Lifecycle changes from the main thread go through
  :meth:`Collector.set_lifecycle` and are published at once; one lock keeps the slot single-writer.
- It runs the router's stall check on its own slot (:class:`dplb.policy.stall.StallDetector`) and publishes the
  verdict as ``FLAG_STALLED``; stalled ``stall_restart_after_s`` (> 0) since the last progress, it sets
  :attr:`Collector.stall_failure` and stops pinging systemd's watchdog. :attr:`Collector.probe_due` says when the
  worker's own probe is due (:mod:`dplb.worker.stall_probe`): no router request on it, and stalled, or its last
  requests left without progress (:meth:`dplb.policy.stall.StallDetector.suspect`: a router failed them first).
  The probe in flight (:attr:`Collector.own_probes`) counts as an outstanding request in this check, so a probe
  that gets no progress for ``stall_after_s`` makes the worker stalled.
- A segment removed or replaced at the path: it keeps publishing into its old mapping, notices at its next tick
  (one ``stat``), logs once, re-attaches to the segment that appears there, re-publishes the whole slot and calls
  ``on_reattach(new segment)`` (the worker moves its KV ring).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from dplb.errors import ShmError, ShmMissingError
from dplb.obs.metrics_worker import WorkerMetrics
from dplb.policy.stall import StallDetector
from dplb.runtime.gpu import GpuReader
from dplb.runtime.sd_notify import Watchdog
from dplb.state.router_slots import ROUTER_STALE_S, read_router_slots
from dplb.state.shm import (
    FLAG_GPU_BUSY,
    FLAG_NO_GPU,
    FLAG_PREV_STOPPED,
    FLAG_STALLED,
    Lifecycle,
    Segment,
    SlotWriter,
    WorkerState,
)
from dplb.worker.engines.base import Engine, RequestStats

log = logging.getLogger("dplb.worker")


class Collector:
    """Publishes the worker's state into its shm slot every interval, on its own thread.

    Lifecycle changes from the main thread go through :meth:`set_lifecycle`, which publishes at once; a lock
    keeps the slot single-writer.
    """

    def __init__(self, writer: SlotWriter, engine: Engine, req: RequestStats, gpu: GpuReader,
                 interval_s: float, metrics: WorkerMetrics, stall_after_s: float = 0.0,
                 stall_restart_after_s: float = 0.0, on_reattach: Callable[[Segment], None] | None = None) -> None:
        self.writer = writer
        self._on_reattach = on_reattach  # runs (collector thread, lock held) once a replacing segment is attached
        self.engine = engine
        self.req = req
        self.gpu = gpu
        self.interval_s = interval_s
        self.metrics = metrics
        self._prev = _predecessor_stopped(writer)  # FLAG_PREV_STOPPED or 0, for this process's life
        self.state = WorkerState(writer.worker_id, pid=os.getpid(), lifecycle=Lifecycle.STARTING,
                                 started_unix_ns=time.time_ns(),
                                 flags=(0 if gpu.available else FLAG_NO_GPU) | self._prev)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"dplb-collector-{writer.worker_id}", daemon=True)
        self._wid = str(writer.worker_id)
        self._last_oom = 0
        self._watchdog = Watchdog()
        self._detached = False  # the segment file was removed/replaced; publishing waits for a new one
        self._attach_error = ""
        self._restart_after_s = stall_restart_after_s
        self._stall = StallDetector(writer.segment.num_workers, stall_after_s) if stall_after_s > 0 else None
        #: Set (a message) once the engine has been stalled ``stall_restart_after_s``: the worker exits.
        self.stall_failure: str | None = None
        #: No router request outstanding at the last tick, and stalled or suspect: only a probe of the worker's own
        #: can show that its engine works (:mod:`dplb.worker.stall_probe`).
        self.probe_due = False
        #: The worker's own probe requests in flight (set by :mod:`dplb.worker.stall_probe`).
        self.own_probes = 0

    @property
    def segment(self) -> Segment:
        """The segment currently written (it changes when a recreated segment is re-attached)."""
        return self.writer.segment

    def start(self) -> None:
        """Publish once now, then every interval."""
        self.tick()
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (after one last publish by the caller)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def set_lifecycle(self, lc: Lifecycle, **fields: float) -> None:
        """Change lifecycle (and e.g. ``warmup_seconds``) and publish immediately."""
        with self._lock:
            self.state.lifecycle = lc
            for k, v in fields.items():
                setattr(self.state, k, v)
        self.tick()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception:  # never let the heartbeat die silently
                log.exception("collector tick failed")

    def tick(self) -> None:
        """Read engine, request and GPU figures and publish them with a fresh heartbeat."""
        t0 = time.perf_counter()
        es = self.engine.stats()
        lat, ttfb = self.req.averages()
        used, total, busy = self.gpu.read()
        with self._lock:
            s = self.state
            s.num_running, s.num_waiting = es.num_running, es.num_waiting
            s.kv_cache_usage, s.max_num_seqs = es.kv_cache_usage, es.max_num_seqs
            s.last_prompt_tokens = es.last_prompt_tokens
            s.kv_total_blocks, s.kv_block_size = es.kv_total_blocks, es.kv_block_size
            s.max_loras = es.max_loras
            s.gpu_memory_used_bytes, s.gpu_memory_total_bytes = used, total
            s.flags = (FLAG_NO_GPU if not self.gpu.available else 0) | (FLAG_GPU_BUSY if busy else 0) | self._prev
            s.avg_latency_s, s.avg_ttft_s = lat, ttfb
            s.last_done_mono_ns = self.req.last_done_mono_ns
            s.requests_total, s.errors_total = self.req.requests_total, self.req.errors_total
            s.first_request_seconds = self.req.first_request_seconds
            if es.cuda_oom_total > self._last_oom:
                log.error(
                    "worker %s: CUDA out of memory reported by the engine (total %d). Lower "
                    "--gpu-memory-utilization (e.g. 0.95 → 0.85), reduce --max-num-seqs/--max-model-len, or use "
                    "more tensor parallelism (--tensor-parallel-size).", self._wid, es.cuda_oom_total)
                self._last_oom = es.cuda_oom_total
            s.cuda_oom_total = es.cuda_oom_total
            now = time.monotonic_ns()
            if not es.progress_known:
                s.progress_mono_ns = 0  # the router's stall check skips an engine that cannot tell
            elif es.progress_total != s.progress_total or not s.progress_mono_ns:
                s.progress_total, s.progress_mono_ns = es.progress_total, now
            self._follow_segment()
            self._check_stall(now)
            self.writer.publish_now(s)
        if self.stall_failure is None:
            self._watchdog.maybe_ping()  # systemd: the heartbeat thread is alive and the engine is not stalled
        self.metrics.collector_tick.labels(self._wid).observe(time.perf_counter() - t0)

    def _check_stall(self, now: int) -> None:
        """The router's stall check on this worker's slot (caller holds the lock, before publishing): sets the
        slot's ``FLAG_STALLED`` while stalled, and :attr:`stall_failure` once the engine has been stalled
        ``stall_restart_after_s`` (> 0) since its last progress."""
        st = self._stall
        if st is None:
            return
        if self.stall_failure is not None:
            self.state.flags |= FLAG_STALLED
            return
        k = self.writer.worker_id
        seg = self.writer.segment
        outstanding = [0] * seg.num_workers
        for r in read_router_slots(seg._mm, seg.num_workers):
            age = r["heartbeat_age_s"]
            if age is not None and age < ROUTER_STALE_S:
                outstanding[k] += r["inflight"][k]
        routers = outstanding[k]
        outstanding[k] += self.own_probes
        st.observe([self.state], outstanding, now)
        stalled_s = st.no_progress_s(k, now)
        if stalled_s:
            self.state.flags |= FLAG_STALLED
        self.probe_due = not routers and (bool(stalled_s) or st.suspect(k))
        if stalled_s and self._restart_after_s and stalled_s > self._restart_after_s:
            self.stall_failure = (f"engine made no progress for {stalled_s:.0f} s with requests in flight (stalled "
                                  f"longer than --stall-restart-after {self._restart_after_s:g} s); withholding the "
                                  "systemd watchdog and exiting for a restart")

    def _follow_segment(self) -> bool:
        """Switch to a segment that replaced ours at the same path (caller holds the lock); one ``stat`` per tick.
        Until one appears the worker keeps publishing into its old mapping: a router that has not noticed the
        removal yet still reads it, and would otherwise see every heartbeat go stale and stop routing.
        Returns True when the writer points at the segment file now at the path."""
        seg = self.writer.segment
        if not self._detached:
            if seg.still_present():
                return True
            self._detached = True
            log.warning("Worker %s: state segment %s was removed or replaced; serving continues, and the state is "
                        "published into it again once a segment exists at that path (dplb segment create / dplb "
                        "launch)", self._wid, seg.path)
        try:
            new = Segment.attach(seg.path)
        except ShmError as e:
            self._attach_failed(e)
            return False
        try:
            writer = new.writer(self.writer.worker_id)
        except ShmError as e:  # the new segment has too few slots for this worker id
            new.close()
            self._attach_failed(e)
            return False
        self.writer, self._detached, self._attach_error = writer, False, ""
        if self._on_reattach is not None:
            self._on_reattach(new)
        seg.close()
        log.info("Worker %s re-attached to state segment %s; slot re-published (pid %d, %s)", self._wid, new.path,
                 self.state.pid, self.state.lifecycle.name.lower())
        return True

    def _attach_failed(self, e: ShmError) -> None:
        msg = str(e)
        if msg != self._attach_error:  # once per distinct problem; "missing" is the expected wait, not an error
            self._attach_error = msg
            if not isinstance(e, ShmMissingError):
                log.error("Worker %s: cannot re-attach the state segment: %s", self._wid, e)


def _predecessor_stopped(writer: SlotWriter) -> int:
    """``FLAG_PREV_STOPPED`` when the slot this worker is about to claim was last written by another process that
    had published ``stopped`` (it left by itself: an engine death, a stall restart, a stop), else 0. The router counts
    the replacement's reason from it (``dplb_worker_restarts_total``), since the old ``stopped`` may stand in the
    slot for less than one of its monitor steps before this process overwrites it. A torn or unreadable slot: 0."""
    try:
        old = writer.segment.read(writer.worker_id)
    except (OSError, ValueError):
        return 0
    gone = old.pid and old.pid != os.getpid() and not old.torn and old.lifecycle == Lifecycle.STOPPED
    return FLAG_PREV_STOPPED if gone else 0
