"""A DPLB worker: one data-parallel replica = an engine on a Unix socket + a collector publishing into shm.

Contract (docs/DESIGN.md §8, §3)
- Lifecycle, each transition written to the slot at once and logged: starting → warming (engine up; one request
  with ``max_tokens: 1`` is sent through the worker's own socket and timed, then, for an engine with
  ``warm_logprobs`` (vLLM), one asking for ``logprobs``, best effort: vLLM compiles its logprobs kernel with
  ``torch.compile`` at the first request that wants logprobs — 2.0 s on the tiny model on a loaded 2-core CPU
  against 0.04 s after, long enough on a busier host for the router's stall check to fail the first user's
  request) → ready (logs ``Worker K registered. State: {...}``) → draining (SIGTERM/SIGINT: model requests get 503
  ``worker_draining``, in-flight ones finish, bounded by ``drain_timeout_s``) → stopped.
- The collector thread (:mod:`dplb.worker.collector`) publishes every ``state_interval_ms`` (heartbeat written
  every tick even when nothing changed): engine scheduler state, per-request figures from :class:`RequestStats`,
  NVML memory (zeros + the NO_GPU flag without a GPU).
- The worker's own metrics (:data:`dplb.obs.metrics.WORKER_SIDE`: what the slot does not carry) and the engine's
  ``vllm:*`` metrics are served on ``metrics_host:metrics_port`` (127.0.0.1 unless ``--metrics-host``).
- ``model_load_seconds`` (engine start until the engine is up, i.e. the model load) is published with ``warming``.
- Engine progress: every tick publishes the engine's ``progress_total`` and, when it moved, ``progress_mono_ns``
  (0 while the engine cannot tell). The collector runs the router's stall check on its own slot (the routers'
  in-flight counts from their router slots, :class:`dplb.policy.stall.StallDetector`) and publishes its verdict as
  the slot's ``FLAG_STALLED`` (what ``dplb state`` shows: the router's own in-flight count to a stalled worker drops
  to 0 once it fails its requests); stalled for ``stall_restart_after_s`` (> 0) since the engine's last progress, it
  stops pinging systemd's watchdog and the worker exits 1 (logged), so ``dplb launch`` (which then kills what is
  left of its process group) or systemd restarts it. Stalled (or its requests gone without progress) with no router
  request on it, the worker probes its own engine, one 1-token request at a time, at most one per
  ``stall_after_s`` (:mod:`dplb.worker.stall_probe`): an engine that recovers lifts the stall without traffic.
- Every state interval the reconciler (:mod:`dplb.worker.reconcile`, docs/DESIGN.md §8.1) compares the engine's
  requests, the requests open on the socket and the routers' in-flight counts for this worker, aborts orphans and
  exports the figures (``dplb_worker_orphan_requests``, ``dplb_worker_orphan_aborts_total``,
  ``dplb_worker_leaked_inflight``) on the metrics port. The socket's server is the bounded one
  (:func:`dplb.runtime.serving.bounded_protocol`): each request knows its client process and its disconnect.
- The launcher died (SIGKILL, the OOM killer): the worker's parent-death SIGTERM comes when its parent is no longer
  the process that started it, and that process made the segment (``creator_pid``: ``dplb launch``). The worker then
  keeps serving while a router of the stack still publishes a live heartbeat — the router got the same signal,
  reports drain for its ``--drain-notice`` and finishes its requests — and drains after; a second SIGTERM or a
  SIGINT drains at once. On its way out such a worker removes the segment when it is the stack's last process
  (:func:`dplb.state.segments.remove_abandoned`).
- A missing segment is a :class:`dplb.errors.ShmMissingError` before anything starts (the CLI prints it).
- A segment removed or replaced at runtime (a cleanup, ``dplb segment create`` again) does not stop the worker: it
  keeps serving (and publishing into its old mapping), the collector notices at its next tick (one ``stat``), logs
  once, and re-attaches to the segment that appears at the same path, re-publishing its whole slot (pid,
  lifecycle, figures); one log line each way. The worker's KV ring moves with it, re-confirming the keys its engine
  still holds (else the routers would forget that cache until each key's next request).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import signal
import time
from dataclasses import dataclass

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dplb import __version__
from dplb.config import (
    PREFIX_BLOCK_BYTES,
    STALL_AFTER_S,
    STALL_RESTART_AFTER_S,
    check_finite,
    check_stall,
    check_state_interval_ms,
    worker_server_stop_s,
)
from dplb.errors import ConfigError, ShmError
from dplb.obs.metrics_worker import WorkerMetrics, worker_metrics
from dplb.runtime.gpu import GpuReader, visible_gpu_indices
from dplb.runtime.sd_notify import notify
from dplb.runtime.serving import bind_tcp, bind_uds, make_server, raise_fd_limit
from dplb.stack import METRICS_HOST, METRICS_PORT_BASE
from dplb.state.kv_rings import KvRingWriter
from dplb.state.segments import remove_abandoned
from dplb.state.shm import Lifecycle, Segment
from dplb.worker.collector import Collector
from dplb.worker.engines.base import TIMED_PATHS, Engine, Reconcilable, RequestStats, RequestStatsMiddleware, Scope
from dplb.worker.kv_events import ZMQ_AVAILABLE, KvEventSubscriber
from dplb.worker.kv_translate import KvTranslateMiddleware, KvTranslator
from dplb.worker.reconcile import Reconciler
from dplb.worker.stall_probe import StallProbe

log = logging.getLogger("dplb.worker")
#: Request line + headers a worker accepts (431 above): the router forwards at most 64 KiB; direct clients get more.
WORKER_MAX_HEAD_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Worker settings. ``metrics_port`` None = 30001 + worker_id; 0 = no metrics server. ``stall_after_s``: the
    router's ``--stall-after`` (0 = no stall check); ``stall_restart_after_s``: stalled this long since the last
    progress, the worker exits for a restart (0 = never). Seconds. ``kv_events``: subscribe to the engine's KV
    events and publish what it holds in the routers' keys (``prefix_block_bytes``: the routers' block size)."""

    worker_id: int
    uds: str
    shm_path: str | None = None
    state_interval_ms: int | None = None  # None: the segment's
    metrics_port: int | None = None
    metrics_host: str = METRICS_HOST
    drain_timeout_s: float = 30.0
    warmup_timeout_s: float = 900.0
    stall_after_s: float = STALL_AFTER_S
    stall_restart_after_s: float = STALL_RESTART_AFTER_S
    kv_events: bool = True
    prefix_block_bytes: int = PREFIX_BLOCK_BYTES

    def __post_init__(self) -> None:
        check_stall(self.stall_after_s, self.stall_restart_after_s if self.stall_after_s else None)
        if self.worker_id < 0:
            raise ConfigError(f"--worker-id must be ≥ 0, got {self.worker_id}")
        if not self.uds:
            raise ConfigError("--uds must name the worker's Unix socket path")
        if self.state_interval_ms is not None:
            check_state_interval_ms(self.state_interval_ms)
        if not (math.isfinite(self.drain_timeout_s) and self.drain_timeout_s >= 0):
            raise ConfigError(f"--drain-timeout must be a finite number ≥ 0 seconds, got {self.drain_timeout_s}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port must be 0 (off) or 1..65535, got {self.metrics_port}")
        check_finite(self)

    @property
    def resolved_metrics_port(self) -> int:
        """The metrics port actually used (0 = disabled)."""
        return METRICS_PORT_BASE + self.worker_id if self.metrics_port is None else self.metrics_port


class MetricsApp:
    """ASGI app for the worker's metrics port: ``GET /metrics`` = engine ``vllm:*`` text + the worker's own."""

    def __init__(self, engine: Engine, metrics: WorkerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] != "/metrics":
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b"not found\n"})
            return
        body = self.engine.metrics_text() + generate_latest(self.metrics.registry)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", CONTENT_TYPE_LATEST.encode())]})
        await send({"type": "http.response.body", "body": body})


class Worker:
    """Runs one worker until SIGTERM/SIGINT (then drains) or until the engine fails."""

    def __init__(self, cfg: WorkerConfig, engine: Engine) -> None:
        self.cfg = cfg
        self.engine = engine
        self.segment = Segment.attach(cfg.shm_path)  # raises ShmMissingError / ShmLayoutError first
        self.interval_ms = cfg.state_interval_ms or self.segment.state_interval_ms
        self.req = RequestStats()
        self.gpu = GpuReader(visible_gpu_indices())
        reconcilable: Reconcilable | None = engine if callable(getattr(engine, "requests", None)) and callable(
            getattr(engine, "abort", None)) else None  # type: ignore[assignment]
        self.reconciler = Reconciler(reconcilable, self.req, self._router_inflight, cfg.worker_id,
                                     self.interval_ms / 1000)
        self.metrics = worker_metrics(cfg.worker_id, __version__, engine.name, lambda: (
            self.req.requests_total, self.req.errors_total, self.gpu.errors_total), self.reconciler.figures)
        self.collector = Collector(self.segment.writer(cfg.worker_id), engine, self.req, self.gpu,
                                   self.interval_ms / 1000, self.metrics, cfg.stall_after_s, cfg.stall_restart_after_s,
                                   on_reattach=self._move_kv_ring)
        self.accepting = True
        self._stop = asyncio.Event()
        self._parent = os.getppid()  # the process that started this worker (dplb launch, systemd, a shell)
        self._orphan_wait: asyncio.Future[None] | None = None
        self.kv: KvTranslator | None = None
        self._kv_sub: KvEventSubscriber | None = None
        self._kv_ring: KvRingWriter | None = None
        self._kv_since = 0  # CLOCK_MONOTONIC ns since when the ring follows the engine's events (0: it does not)
        self._kv_path = ""  # the engine's KV-events socket file (removed at exit: vLLM's EngineCore leaves it)
        self._model = ""  # the served model name (asked at the warm-up)
        self._setup_kv_events()

    def _setup_kv_events(self) -> None:
        """Ask the engine to publish its KV events on ``ipc://<socket dir>/kv-events-K.sock`` and translate them
        (nothing when off, without pyzmq, or when the engine cannot; the routers then keep their sent-bytes index
        for this worker)."""
        cfg = self.cfg
        if not cfg.prefix_block_bytes:
            return
        self._kv_ring = ring = self.segment.kv_writer(cfg.worker_id)
        ring.reset(cfg.prefix_block_bytes)
        enable = getattr(self.engine, "enable_kv_events", None)
        if not cfg.kv_events or not ZMQ_AVAILABLE or enable is None:
            if cfg.kv_events and not ZMQ_AVAILABLE:
                log.warning("Worker %d: pyzmq is not installed; no KV events (the router keeps its sent-bytes "
                            "prefix index for this worker)", cfg.worker_id)
            return
        endpoint = f"ipc://{os.path.join(os.path.dirname(os.path.abspath(cfg.uds)), f'kv-events-{cfg.worker_id}.sock')}"
        if not enable(endpoint):
            return
        self._kv_path = endpoint.removeprefix("ipc://")
        self.kv = KvTranslator(ring, cfg.prefix_block_bytes)
        self._kv_sub = KvEventSubscriber(endpoint, self.kv.on_batch)

    def _private_kv_socket(self) -> None:
        """Make the engine's KV-events socket file 0600, as the worker's own (the engine binds it with its umask,
        0755 under the usual 022, and the events name what every prompt holds). Called once the engine is up:
        vLLM's EngineCore binds its publisher before it reports ready; the sim binds in ``start``."""
        if self._kv_path and os.path.exists(self._kv_path):
            try:
                os.chmod(self._kv_path, 0o600)
            except OSError as e:
                log.warning("Worker %d: could not make %s 0600: %s", self.cfg.worker_id, self._kv_path, e)

    def _move_kv_ring(self, seg: Segment) -> None:
        """The collector attached ``seg``, which replaced the segment at our path: this worker's KV ring moves into
        it, with the keys the engine still holds confirmed there (else the routers, trusting the new ring, would
        forget the engine's cache until each key's next request)."""
        old = self._kv_ring
        if old is None:
            return
        ring = seg.kv_writer(self.cfg.worker_id)
        ring.reset(self.cfg.prefix_block_bytes)
        n = self.kv.move_to(ring) if self.kv is not None else 0
        ring.enable(self._kv_since)
        self._kv_ring = ring
        old.close()
        if self._kv_since:
            log.info("Worker %d: KV ring moved to the new segment (%d held keys confirmed there)", self.cfg.worker_id,
                     n)

    def _router_inflight(self) -> dict[int, int]:
        """Each live router process's in-flight count for this worker (empty while the segment is unreadable)."""
        try:
            return self.collector.segment.router_inflight(self.cfg.worker_id)
        except (ShmError, ValueError):  # a replaced segment with fewer slots, or one closed meanwhile
            return {}

    def request_stop(self) -> None:
        """Begin draining (SIGINT; a second SIGTERM)."""
        self._stop.set()

    def on_sigterm(self) -> None:
        """SIGTERM: drain; but the first one after the process that started this worker died (the parent-death
        signal ``dplb launch`` gives its children: the launcher was SIGKILLed) drains only once no router serves on
        the segment any more (:meth:`_drain_after_routers`): the router got the same signal and keeps serving for
        its ``--drain-notice``, then finishes its requests, with this worker (docs/DESIGN.md §10). Only a worker
        whose parent made the segment (its ``creator_pid``: ``dplb launch``) does so; one started by hand whose
        shell went away drains at once, as before."""
        if self._orphan_wait is not None or self._stop.is_set() or os.getppid() == self._parent or \
                self._parent != self.segment.header.creator_pid:  # not started by the launcher that made the segment
            self._stop.set()
            return
        log.warning("Worker %d: the process that started it (pid %d) is gone; serving while a router of the stack "
                    "still does, then draining", self.cfg.worker_id, self._parent)
        self._orphan_wait = asyncio.ensure_future(self._drain_after_routers())

    async def _drain_after_routers(self) -> None:
        """Stop (drain) once no router process publishes a live heartbeat on the segment (a router leaves its slot
        as it stops; a dead or hung one is stale after ``ROUTER_STALE_S``)."""
        while not self._stop.is_set() and self._router_inflight():
            await asyncio.sleep(self.interval_ms / 1000)
        if not self._stop.is_set():
            log.info("Worker %d: no router serves any more; draining", self.cfg.worker_id)
        self._stop.set()

    def _remove_abandoned_segment(self) -> None:
        """On the way out of a worker whose launcher died: remove the segment when this is the stack's last process
        (:func:`dplb.state.segments.remove_abandoned`; it checks that the launcher made it)."""
        if os.getppid() == self._parent:
            return
        path = self.collector.segment.path
        if remove_abandoned(path, self._parent):
            log.info("Worker %d: removed the segment %s (its launcher, pid %d, is gone and no other process uses it)",
                     self.cfg.worker_id, path, self._parent)

    async def run(self) -> int:
        """Serve until stopped. Returns the process exit code."""
        k = self.cfg.worker_id
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.on_sigterm)
        loop.add_signal_handler(signal.SIGINT, self.request_stop)
        raise_fd_limit()  # one descriptor per router connection; the router keeps up to 256 pooled per worker
        self.collector.start()
        log.info("Worker %d starting (engine %s, pid %d, socket %s)", k, self.engine.name, os.getpid(), self.cfg.uds)
        servers = []
        reconcile: asyncio.Task[None] | None = None
        probe: asyncio.Task[None] | None = None
        try:
            # Metrics first: the port answers (lifecycle "starting") while a model loads for minutes.
            self.collector.set_lifecycle(Lifecycle.STARTING)
            port = self.cfg.resolved_metrics_port
            if port:
                msrv = make_server(MetricsApp(self.engine, self.metrics), graceful_s=1)
                servers.append((msrv, asyncio.create_task(
                    msrv.serve(sockets=[bind_tcp(self.cfg.metrics_host, port)]))))
            t_load = time.perf_counter()
            if not await self._start_engine_or_stop():
                log.info("Worker %d: stop requested while the engine was loading", k)
                return 0
            load_s = time.perf_counter() - t_load
            self._private_kv_socket()
            if self._kv_sub is not None and not getattr(self.engine, "kv_events_on", True):
                self._kv_sub = self.kv = None  # the engine cannot give the requests' token ids after all
            if self._kv_sub is not None and self._kv_ring is not None:
                self._kv_sub.start()
                self._kv_since = time.monotonic_ns()
                self._kv_ring.enable(self._kv_since)
                log.info("Worker %d: following the engine's KV events on %s", k, self._kv_sub.endpoint)
            if self.engine.app is not None:
                inner = self.engine.app if self.kv is None else KvTranslateMiddleware(self.engine.app, self.kv,
                                                                                       TIMED_PATHS)
                app = RequestStatsMiddleware(inner, self.req, lambda: self.accepting)
                srv = make_server(app, graceful_s=self.cfg.drain_timeout_s, max_head_bytes=WORKER_MAX_HEAD_BYTES)
                servers.append((srv, asyncio.create_task(srv.serve(sockets=[bind_uds(self.cfg.uds)]))))
                reconcile = asyncio.create_task(self.reconciler.run(), name=f"dplb-reconcile-{k}")
            self.collector.set_lifecycle(Lifecycle.WARMING, model_load_seconds=load_s)
            log.info("Worker %d warming up (engine loaded in %.1f s)", k, load_s)
            if not self._stop.is_set():
                warm = await self._warmup()
                self.collector.set_lifecycle(Lifecycle.READY, warmup_seconds=warm)
                self.req.counting_first = True
                log.info("Worker %d registered. State: %s", k, json.dumps(self.collector.state.to_dict()))
                notify(f"READY=1\nSTATUS=worker {k} ready (warm-up {warm:.2f} s)")
                probe = self._start_stall_probe()
            failed = await self._wait_stop_or_failure()
            if failed:
                log.error("Worker %d: %s; exiting so the supervisor restarts it", k, failed)
                return 1
            await self._drain()
            return 0
        except Exception as e:
            log.error("Worker %d failed: %s", k, e)
            return 1
        finally:
            for task in (reconcile, probe):
                if task is not None:
                    task.cancel()
            for srv, task in servers:
                srv.should_exit = True
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(task, timeout=worker_server_stop_s(self.cfg.drain_timeout_s))
            with contextlib.suppress(Exception):
                await self.engine.shutdown()
            if self._kv_sub is not None:
                self._kv_sub.stop()
            if self._kv_path:
                with contextlib.suppress(OSError):
                    os.unlink(self._kv_path)
            if self._kv_ring is not None:
                self._kv_ring.enable(0)
                self._kv_ring.close()
            self.collector.set_lifecycle(Lifecycle.STOPPED)
            self.collector.stop()
            log.info("Worker %d stopped", k)
            self._remove_abandoned_segment()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.cfg.uds)
            self.gpu.close()
            self.collector.segment.close()

    async def _start_engine_or_stop(self) -> bool:
        """Load the engine, unless SIGTERM/SIGINT comes first (then cancel the load and return False): a worker
        must stop promptly even in the middle of a minutes-long model load (systemd's TimeoutStopSec)."""
        start = asyncio.ensure_future(self.engine.start())
        stop = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({start, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if start.done():
            start.result()  # raises the engine's own error
            return True
        start.cancel()
        with contextlib.suppress(BaseException):
            await start
        return False

    async def _wait_stop_or_failure(self) -> str | None:
        """Wait for SIGTERM/SIGINT (returns None) or for the engine to report a fatal error (returns it)."""
        failure = getattr(self.engine, "failure", None)
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), 1.0)
            msg = (failure() if failure is not None else None) or self.collector.stall_failure
            if msg:
                return str(msg)
        return None

    def _start_stall_probe(self) -> asyncio.Task[None] | None:
        """Start the stalled engine's own probe (module docstring); None without a stall check or a socket app."""
        cfg = self.cfg
        if not cfg.stall_after_s or self.engine.app is None or not self._model:
            return None
        p = StallProbe(cfg.worker_id, cfg.uds, self._model, self.collector, cfg.stall_after_s, self.interval_ms / 1000)
        return asyncio.create_task(p.run(), name=f"dplb-stall-probe-{cfg.worker_id}")

    async def _warmup(self) -> float:
        """Send one ``max_tokens: 1`` completion through our own socket, then one with ``logprobs`` when the engine
        has ``warm_logprobs`` (module docstring); return their duration in seconds. Raises RuntimeError when the
        first is not answered 200."""
        transport = httpx.AsyncHTTPTransport(uds=self.cfg.uds)
        async with httpx.AsyncClient(transport=transport, base_url="http://worker",
                                     timeout=self.cfg.warmup_timeout_s) as client:
            models = (await client.get("/v1/models")).json()
            model = self._model = models["data"][0]["id"]
            t0 = time.perf_counter()
            r = await client.post("/v1/completions", json={"model": model, "prompt": "warm up", "max_tokens": 1})
            if r.status_code != 200:
                raise RuntimeError(f"warm-up request failed with HTTP {r.status_code}: {r.text[:300]}")
            if getattr(self.engine, "warm_logprobs", False):
                lp = await client.post("/v1/completions", json={"model": model, "prompt": "warm up",
                                                                 "max_tokens": 1, "logprobs": 1})
                if lp.status_code != 200:  # e.g. --max-logprobs 0: then no request can ask for them either
                    log.info("Worker %d: the logprobs warm-up request was refused (HTTP %d: %s)",
                             self.cfg.worker_id, lp.status_code, lp.text[:200])
            took = time.perf_counter() - t0
        return took

    async def _drain(self) -> None:
        """Refuse new model requests, wait for in-flight ones (bounded), then let the servers stop."""
        k = self.cfg.worker_id
        self.accepting = False
        notify("STOPPING=1")
        self.collector.set_lifecycle(Lifecycle.DRAINING)
        log.info("Worker %d draining: %d request(s) in flight, up to %.0f s", k, self.req.inflight,
                 self.cfg.drain_timeout_s)
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        while self.req.inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.req.inflight:
            log.warning("Worker %d: drain timeout with %d request(s) still in flight; they will be cut", k,
                        self.req.inflight)
