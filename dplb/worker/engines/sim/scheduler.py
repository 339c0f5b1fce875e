"""Core of the sim engine: configuration and a vLLM-like continuous-batching scheduler (the queue, admission and the
step loop); the scheduler updates the engine's ``vllm:*`` Prometheus metrics
(:mod:`dplb.worker.engines.sim.vllm_metrics`). What a prompt is (tokens, chat rendering, block hashes)
and the prefix cache the scheduler consults at admission live in :mod:`dplb.worker.engines.sim.prompts`; the HTTP
side in :mod:`dplb.worker.engines.sim.engine`.

Contract
- :class:`SimScheduler` runs one asyncio task (created lazily on the event loop of the first :meth:`submit`) that
  executes *steps*. Up to ``max_num_seqs`` sequences run; the rest wait. The head of the queue is
  admitted when a running slot is free **and** its KV blocks fit: a sequence reserves
  ``ceil((prompt_tokens + max_tokens) / block_size)`` blocks at admission and releases them when it finishes or is
  aborted. Admission stops at the first sequence that does not fit (head-of-line, like vLLM's FCFS policy).
- ``scheduling_policy`` (vLLM ``--scheduling-policy``): ``fcfs`` keeps the waiting queue in arrival order;
  ``priority`` orders it by (the request's ``priority``, arrival), lower first, as vLLM V1's
  ``PriorityRequestQueue``. Like vLLM V1, a full batch (``max_num_seqs`` running) preempts nothing: a waiting
  request of any priority waits for a running one to end. Under KV pressure vLLM V1 preempts the running request
  with the largest (priority, arrival) when a running request cannot get its next block; the sim reserves a
  sequence's blocks at admission, so that moment is admission here: when the head does not fit and the least
  urgent running sequence is strictly less urgent than it, that one is preempted (recompute: its blocks freed, back
  to the waiting queue in its place, its generated tokens kept and prefilled again with its prompt when it is
  admitted again; ``vllm:num_preemptions_total``). Under ``fcfs`` the sim preempts nothing.
- Timing model: one step lasts ::

      step_s = (decode_step_s + decode_step_s_per_seq * num_running
                + prefill_s_per_token * uncached_prompt_tokens_admitted_this_step) / speed

  slept with ``asyncio.sleep`` against a deadline taken at the start of the step (no busy loop; the task awaits an
  ``asyncio.Event`` when there is no work). Every running sequence gets one output token per step, so a request's
  first token arrives at the end of the step that admitted it (prefill and first token in one step, like vLLM) and
  latency grows with the batch size.
- Prefix cache: the prompt's full blocks are hashed as a chain (block *i*'s hash covers its tokens and block *i−1*'s
  hash, like vLLM's block hashing) and kept in an LRU of ``prefix_cache_blocks`` entries (a chain's tail evicted
  first, lazily: :class:`~dplb.worker.engines.sim.prompts.PrefixCache`). At admission the leading cached blocks
  (within ``prompt_tokens − 1`` tokens, as vLLM always recomputes the last prompt token) are hits and cost no
  prefill; then the prompt's blocks are inserted. With a ``publisher`` (the worker enabled KV events), the cache's
  changes of each admission step are published as one batch of vLLM KV events (BlockStored / BlockRemoved /
  AllBlocksCleared, :mod:`dplb.worker.kv_events`).
- Sequences, not HTTP requests, are the scheduling unit (an ``n=2`` request is two sequences, as vLLM V1 fans out
  parallel sampling); ``vllm:*`` request metrics therefore count sequences. All times are seconds.
- Thread safety: everything runs on the serving event loop; :meth:`SimScheduler.num_running` & co. are plain reads
  that a collector thread may call at any time.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from dataclasses import dataclass, fields
from typing import Any

from dplb.errors import ConfigError
from dplb.worker.engines.sim.prompts import PrefixCache
from dplb.worker.engines.sim.vllm_metrics import SimMetrics

#: Output vocabulary: every generated token is one of these words.
WORDS = (
    "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "model", "token", "batch", "cache", "prefix",
    "worker", "router", "queue", "latency", "memory", "kernel", "tensor", "shard", "block", "stream", "request",
    "reply", "signal", "metric", "trace", "alpha", "beta", "gamma", "delta", "river", "mountain", "forest", "ocean",
    "light", "shadow", "paper", "stone", "green", "blue", "red", "silver", "gold", "small", "large", "fast", "slow",
    "and", "or", "but", "with", "from", "into", "over", "under", "near", "far", "today", "tomorrow", "again", "yes",
)


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Knobs of the sim engine; validated on construction (raises :class:`~dplb.errors.ConfigError`). Each knob's
    entry below (``name``: its first sentence) is its ``--sim-*`` flag's help (:func:`dplb.worker.engines.knob_help`).

    Serving and model shape
    - ``model``: served model name (``/v1/models``, responses, the ``model_name`` metric label);
      ``lora_adapters``: LoRA adapters served besides it, ``name`` or ``name=path``, comma-separated;
      ``max_loras``: adapters one batch can hold (vLLM ``--max-loras``, default 1 as there), reported
      (the slot's ``max_loras``, ``max_lora`` of ``vllm:lora_requests_info``); the sim does not limit batches by it.
    - ``max_num_seqs``: most sequences running at once (continuous batching slots).
    - ``kv_blocks``: KV cache capacity in blocks; ``block_size``: tokens per block. ``kv_blocks * block_size`` must
      hold one ``max_model_len`` sequence (vLLM refuses to start otherwise).
    - ``prefix_cache_blocks``: LRU capacity of the prefix cache, in blocks (0 disables it).
    - ``default_max_tokens``: output tokens when a request gives no ``max_tokens``; ``max_model_len``: most
      prompt + output tokens of one sequence.
    - ``seed``: seeds the deterministic output text.
    - ``scheduling_policy``: ``fcfs`` or ``priority`` (vLLM ``--scheduling-policy``; module docstring).

    Timing (seconds; every time is divided by ``speed``)
    - ``speed``: per-worker speed factor dividing every time (0.5 = half as fast).
    - ``prefill_s_per_token``: prefill cost of one uncached prompt token.
    - ``decode_step_s``: base time of one decode step; ``decode_step_s_per_seq``: extra step time per running
      sequence.

    Faults (0 = off)
    - ``warmup_delay_s``: :meth:`SimEngine.start` sleeps this long (a slow cold start).
    - ``crash_after``: after N completed requests the process exits with ``os._exit(1)``.
    - ``hang_after``: after N completed requests nothing is answered any more (requests, health, metrics over HTTP);
      in-flight streams stop mid-way; the socket keeps accepting connections.
    - ``stall_after``: after N completed requests the engine makes no progress (no step, no token) for
      ``stall_for_s`` seconds (0 = for good), while HTTP, ``/health``, metrics and the worker's collector carry on
      and new requests are accepted and queued: vLLM with a stopped or deadlocked EngineCore.
    - ``stall_for_s``: how long a ``stall_after`` stall lasts, seconds (0 = for good).
    - ``engine_death_after``: after N completed requests the engine dies under its live HTTP server, as vLLM's
      does when its EngineCore process is killed (a CUDA error, an Xid, the OOM killer). Every request in flight
      ends at once with vLLM's own in-band error: a stream gets ``data: {"error": {"message": "EngineCore
      encountered an issue. …", "type": "InternalServerError", "param": null, "code": 500}}`` and ``data: [DONE]``,
      then a clean end; any other request HTTP 500 with that error, as does every later model request; the worker
      then exits 1 for its supervisor to restart it (``dplb.worker.engines.sim.engine.SimEngine.failure``).
    - ``oom_after``: the Nth and every later model request fails with HTTP 500 "CUDA out of memory".
    - ``max_inflight_503``: with more than N model requests in flight, answer 503 ``server_overloaded`` at once.
    - ``chunk_delay_s``: extra delay after each streamed token chunk.
    - ``first_request_delay_s``: the second model request (the first after the worker's warm-up one) waits this
      long before it is scheduled: a cold first request (CUDA graphs, cold caches); drills DPLBWorkerColdStartSlow.
    - ``lose_aborts``: a client disconnect does not abort the request (a lost abort): it keeps running, unread,
      until its ``max_tokens``; an abort from the worker's reconciler still works.
    - ``ignore_aborts``: no abort works, neither a disconnect's nor the reconciler's: an orphan keeps running until
      its ``max_tokens`` (drills DPLBInflightMismatch). Shutdown still aborts everything.
    - ``close_after_response_s``: the connection of each model request from another process stops being read once
      its response is complete and is closed this many seconds later, a request that came meanwhile unread (reset):
      a server whose short keep-alive timeout fires as the next request arrives (DPLB's worker server only).

    KV events (published when the worker asks, :meth:`SimEngine.enable_kv_events`)
    - ``kv_events_map``: each event a map ``{"type": …}`` (vLLM ≥ 0.24); False: a positional array led by its tag
      (vLLM ≤ 0.23).
    """

    model: str = "dplb-sim"
    lora_adapters: str = ""
    max_loras: int = 1
    max_num_seqs: int = 16
    speed: float = 1.0
    prefill_s_per_token: float = 0.0002
    decode_step_s: float = 0.02
    decode_step_s_per_seq: float = 0.002
    kv_blocks: int = 2048
    block_size: int = 16
    prefix_cache_blocks: int = 1024
    default_max_tokens: int = 64
    max_model_len: int = 8192
    seed: int = 0
    scheduling_policy: str = "fcfs"
    warmup_delay_s: float = 0.0
    crash_after: int = 0
    hang_after: int = 0
    stall_after: int = 0
    stall_for_s: float = 0.0
    engine_death_after: int = 0
    oom_after: int = 0
    first_request_delay_s: float = 0.0
    max_inflight_503: int = 0
    chunk_delay_s: float = 0.0
    lose_aborts: bool = False
    ignore_aborts: bool = False
    close_after_response_s: float = 0.0
    kv_events_map: bool = True

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(f.default, bool | str):
                continue
            if isinstance(f.default, int) and (isinstance(v, bool) or not isinstance(v, int)):
                raise ConfigError(f"sim engine: {f.name} must be an integer, got {v!r}")
            if isinstance(f.default, float) and (isinstance(v, bool) or not isinstance(v, int | float)
                                                 or not math.isfinite(v)):
                raise ConfigError(f"sim engine: {f.name} must be a finite number, got {v!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ConfigError(f"sim engine: scheduling_policy must be fcfs or priority (vLLM's --scheduling-policy), "
                              f"got {self.scheduling_policy!r}")
        if not isinstance(self.model, str) or not self.model.strip():
            raise ConfigError(f"sim engine: model must be a non-empty name, got {self.model!r}")
        minimum = {"max_num_seqs": 1, "max_loras": 1, "kv_blocks": 1, "block_size": 1, "default_max_tokens": 1,
                   "max_model_len": 2}
        for name, lo in minimum.items():
            if getattr(self, name) < lo:
                raise ConfigError(f"sim engine: {name} must be at least {lo}, got {getattr(self, name)}")
        for name in ("prefix_cache_blocks", "crash_after", "hang_after", "stall_after", "stall_for_s",
                     "engine_death_after", "oom_after",
                     "max_inflight_503", "prefill_s_per_token", "decode_step_s_per_seq", "warmup_delay_s",
                     "chunk_delay_s", "first_request_delay_s", "close_after_response_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"sim engine: {name} must be >= 0 (0 turns it off), got {getattr(self, name)}")
        for name in ("speed", "decode_step_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"sim engine: {name} must be > 0, got {getattr(self, name)}")
        if self.kv_blocks * self.block_size < self.max_model_len:
            raise ConfigError(
                f"sim engine: the KV cache ({self.kv_blocks} blocks x {self.block_size} tokens = "
                f"{self.kv_blocks * self.block_size} tokens) cannot hold one max_model_len={self.max_model_len} "
                "sequence; raise kv_blocks or lower max_model_len (vLLM refuses to start in this case too)")


WAITING, RUNNING, FINISHED, ABORTED = range(4)


class Seq:
    """One sequence (one choice of one prompt). Times are ``loop.time()`` seconds; 0.0 = not yet."""

    __slots__ = ("block_hashes", "blocks", "cached_tokens", "generated", "ids", "index", "max_tokens",
                 "prompt_tokens", "req", "state", "t_arrival", "t_first", "t_last", "t_scheduled")

    def __init__(self, req: SimRequest, index: int, prompt_tokens: int, hashes: list[int], max_tokens: int,
                 block_size: int, ids: list[int] | None = None) -> None:
        self.req = req
        self.ids = ids  # the prompt's token ids (the KV events' BlockStored carries them), or None
        self.index = index
        self.prompt_tokens = prompt_tokens
        self.block_hashes = hashes
        self.max_tokens = max_tokens
        self.blocks = -(-(prompt_tokens + max_tokens) // block_size)
        self.cached_tokens = 0
        self.generated = 0
        self.state = WAITING
        self.t_arrival = self.t_scheduled = self.t_first = self.t_last = 0.0


class SimRequest:
    """One HTTP request: its sequences, and an event the scheduler sets on progress (every token when
    ``stream``, else only when the request is done) and on abort. ``id``: the engine's own id (unique in this
    process, set by :meth:`SimScheduler.submit`); ``owner``: what :meth:`SimEngine.requests` reports it serves (the
    worker's open HTTP request, or None for work without a client, such as a background response); ``priority``:
    vLLM's request priority (lower runs first under the ``priority`` policy)."""

    __slots__ = ("aborted", "done", "event", "id", "owner", "priority", "seqs", "stream", "t0", "unfinished")

    def __init__(self, stream: bool, owner: Any = None, priority: int = 0) -> None:
        self.stream = stream
        self.owner = owner
        self.priority = priority
        self.id = ""
        self.t0 = 0.0
        self.seqs: list[Seq] = []
        self.event = asyncio.Event()
        self.unfinished = 0
        self.done = False
        self.aborted = False

    def add_seq(self, index: int, prompt_tokens: int, hashes: list[int], max_tokens: int, block_size: int,
                ids: list[int] | None = None) -> Seq:
        """Append a sequence (choice ``index``; ``ids``: its prompt's token ids) to the request."""
        seq = Seq(self, index, prompt_tokens, hashes, max_tokens, block_size, ids)
        self.seqs.append(seq)
        self.unfinished += 1
        return seq


class SimScheduler:
    """Continuous-batching scheduler (see the module docstring for the model). Counters are plain attributes:
    ``prefix_cache_queries_total`` / ``prefix_cache_hits_total`` (tokens), ``generation_tokens_total``,
    ``progress_total`` (steps finished + tokens generated + prompt tokens admitted: the engine progress a worker
    publishes; it stands still while the scheduler is frozen)."""

    def __init__(self, config: SimConfig) -> None:
        self.cfg = config
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.used_blocks = 0
        self.prefix_cache = PrefixCache(config.prefix_cache_blocks)
        #: Where the prefix cache's KV events go after each admission (set by the engine's start when the worker
        #: enabled them): anything with ``send(events)``, e.g. :class:`dplb.worker.kv_events.KvEventPublisher`.
        self.publisher: Any = None
        self.prefix_cache_queries_total = 0
        self.prefix_cache_hits_total = 0
        self.generation_tokens_total = 0
        self.progress_total = 0
        self.metrics = SimMetrics(self, config.model)
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._frozen = False
        self.live: dict[str, SimRequest] = {}  # engine id → request, from submit until it finishes or is aborted
        self._ids = 0

    # --- cheap reads (any thread) ---
    @property
    def num_running(self) -> int:
        """Sequences in the running batch."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Sequences waiting for admission."""
        return len(self.waiting)

    @property
    def kv_cache_usage(self) -> float:
        """Reserved KV blocks / ``kv_blocks``, 0–1."""
        return self.used_blocks / self.cfg.kv_blocks

    # --- control (serving loop) ---
    def submit(self, req: SimRequest) -> None:
        """Queue every sequence of ``req`` (FIFO) and wake the step task, starting it on this loop if needed."""
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._loop is not loop:
            self._loop = loop
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._run(), name="dplb-sim-scheduler")
        now = loop.time()
        self._ids += 1
        req.id, req.t0 = f"sim-{self._ids}", now
        self.live[req.id] = req
        for seq in req.seqs:
            seq.t_arrival = now
            self._enqueue(seq)
        assert self._wake is not None
        self._wake.set()

    def abort(self, req: SimRequest, client: bool = True) -> bool:
        """Remove ``req``'s sequences at once and free their blocks. Returns False if it was already done/aborted,
        or when the abort is lost: a ``client`` abort (a disconnect) under ``lose_aborts``, any abort under
        ``ignore_aborts`` (the fault knobs)."""
        if req.done or req.aborted or self.cfg.ignore_aborts or (client and self.cfg.lose_aborts):
            return False
        return self.abort_now(req)

    def abort_now(self, req: SimRequest) -> bool:
        """Abort ``req`` whatever the fault knobs say (shutdown). Returns False if it was already done/aborted."""
        if req.done or req.aborted:
            return False
        req.aborted = True
        self.live.pop(req.id, None)
        for seq in req.seqs:
            if seq.state == WAITING:
                self.waiting.remove(seq)
            elif seq.state == RUNNING:
                self.running.remove(seq)
                self.used_blocks -= seq.blocks
            else:
                continue
            seq.state = ABORTED
            self.metrics.success_abort.inc()
        req.event.set()
        return True

    def freeze(self) -> None:
        """Stop stepping (hang and stall faults): running and waiting sequences make no progress until
        :meth:`thaw`; submissions and aborts still work."""
        self._frozen = True

    def thaw(self) -> None:
        """Resume stepping after :meth:`freeze` (call on the serving loop)."""
        self._frozen = False
        if self._wake is not None:
            self._wake.set()

    def stop(self) -> None:
        """Cancel the step task (call on its loop). Queued requests are left for the caller to abort."""
        if self._task is not None:
            self._task.cancel()
            self._task = None

    # --- the step loop ---
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        cfg = self.cfg
        wake = self._wake
        assert wake is not None
        while True:
            if self._frozen:  # until thaw() (or a submission) wakes the task again
                wake.clear()
                await wake.wait()
                continue
            if not self.running and not self.waiting:
                wake.clear()
                await wake.wait()
                continue
            t0 = loop.time()
            uncached = self._admit(t0)
            if not self.running:  # cannot happen with a valid config (one sequence always fits); never spin
                wake.clear()
                await wake.wait()
                continue
            step_s = (cfg.decode_step_s + cfg.decode_step_s_per_seq * len(self.running)
                      + cfg.prefill_s_per_token * uncached) / cfg.speed
            await asyncio.sleep(max(0.0, t0 + step_s - loop.time()))
            if not self._frozen:
                self._emit(loop.time())

    @staticmethod
    def _urgency(seq: Seq) -> tuple[int, float]:
        """The priority policy's order key: (priority, arrival), lower first (vLLM V1's ``Request.__lt__``)."""
        return seq.req.priority, seq.t_arrival

    def _enqueue(self, seq: Seq, preempted: bool = False) -> None:
        """Put ``seq`` in the waiting queue: FCFS appends (a preempted one goes first, as vLLM prepends it),
        the priority policy inserts it in (priority, arrival) order (after its equals)."""
        if self.cfg.scheduling_policy != "priority":
            if preempted:
                self.waiting.appendleft(seq)
            else:
                self.waiting.append(seq)
            return
        key = self._urgency(seq)
        i = len(self.waiting)
        while i > 0 and self._urgency(self.waiting[i - 1]) > key:
            i -= 1
        self.waiting.insert(i, seq)

    def _preempt_for(self, head: Seq) -> bool:
        """Priority policy, KV pressure: preempt the least urgent running sequence when it is strictly less urgent
        than ``head`` (module docstring); False when there is none to preempt."""
        if self.cfg.scheduling_policy != "priority" or not self.running:
            return False
        victim = max(self.running, key=self._urgency)
        if self._urgency(victim) <= self._urgency(head):
            return False
        self.running.remove(victim)
        self.used_blocks -= victim.blocks
        victim.state = WAITING
        self.metrics.preemptions.inc()
        self._enqueue(victim, preempted=True)
        return True

    def _admit(self, now: float) -> int:
        """Admit waiting sequences that fit; returns their uncached prompt tokens (the prefill work of this step;
        a preempted sequence's generated tokens are prefilled again)."""
        cfg, m = self.cfg, self.metrics
        uncached = 0
        while self.waiting and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            if self.used_blocks + seq.blocks > cfg.kv_blocks:
                if self._preempt_for(seq):
                    continue
                break
            self.waiting.popleft()
            self.used_blocks += seq.blocks
            seq.state = RUNNING
            seq.t_scheduled = now
            self.running.append(seq)
            hit_blocks = self.prefix_cache.match(seq.block_hashes, (seq.prompt_tokens - 1) // cfg.block_size)
            seq.cached_tokens = hit_blocks * cfg.block_size
            self.prefix_cache.insert(seq.block_hashes, seq.ids, cfg.block_size)
            uncached += seq.prompt_tokens - seq.cached_tokens + seq.generated
            if seq.generated:  # resumed after a preemption: counted when it was first admitted
                continue
            self.prefix_cache_queries_total += seq.prompt_tokens
            self.prefix_cache_hits_total += seq.cached_tokens
            m.prefix_queries.inc(seq.prompt_tokens)
            m.prefix_hits.inc(seq.cached_tokens)
            m.prompt_tokens.inc(seq.prompt_tokens)
            m.queue_time.observe(now - seq.t_arrival)
        self.flush_events()
        return uncached

    def flush_events(self) -> None:
        """Publish the prefix cache's KV events recorded since the last flush (one batch, like one vLLM step)."""
        if self.publisher is not None:
            events = self.prefix_cache.take_events()
            if events:
                self.publisher.send(events)

    def _emit(self, now: float) -> None:
        """One output token for every running sequence; finish those that reached ``max_tokens``."""
        m = self.metrics
        still: list[Seq] = []
        for seq in self.running:
            seq.generated += 1
            if seq.generated == 1:
                seq.t_first = now
                m.ttft.observe(now - seq.t_arrival)
            else:
                m.itl.observe(now - seq.t_last)
            seq.t_last = now
            req = seq.req
            if req.stream:
                req.event.set()
            if seq.generated >= seq.max_tokens:
                seq.state = FINISHED
                self.used_blocks -= seq.blocks
                m.e2e.observe(now - seq.t_arrival)
                m.success_length.inc()
                req.unfinished -= 1
                if req.unfinished == 0:
                    req.done = True
                    self.live.pop(req.id, None)
                    req.event.set()
            else:
                still.append(seq)
        n = len(self.running)
        self.progress_total += 1 + n + sum(s.prompt_tokens for s in self.running if s.generated == 1)
        self.generation_tokens_total += n
        m.generation_tokens.inc(n)
        self.running = still
