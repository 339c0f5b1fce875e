"""Typed configuration, validated once at start-up and passed down (never re-read on the hot path).

Contract: every ``*Config`` is a frozen dataclass whose ``__post_init__`` refuses bad values with
:class:`dplb.errors.ConfigError` and a message naming the option and the accepted range. Defaults are the values of
docs/DESIGN.md §5 and §4, and the seed article.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Literal

from dplb.errors import ConfigError
from dplb.http_values import check_bearer_token, check_origins

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # every dplb process's log lines


#: Most router processes one ``dplb router`` runs (the segment has 16 router slots; this leaves room for more
#: routers and for a replacement process registering before its dead predecessor's slot is reclaimed).
MAX_ROUTER_PROCESSES = 8


def default_router_processes(cpus: int | None = None) -> int:
    """Router processes ``dplb launch`` starts by default: one per 8 CPU cores, 1..:data:`MAX_ROUTER_PROCESSES`
    (2 cores → 1, 16 → 2, 64 → 8). One process streams up to ~75k tokens/s at ~13 µs of CPU per token
    (bench_capacity.py); the other 7 of every 8 cores are left to the workers (each vLLM worker keeps an API server
    and an engine core busy) and their tokenizers."""
    n = cpus if cpus is not None else (os.cpu_count() or 1)
    return max(1, min(MAX_ROUTER_PROCESSES, n // 8))


#: ``--stall-after``: a worker with requests outstanding whose engine made no progress this long is stalled (out of
#: rotation, its requests failed fast; docs/DESIGN.md §6). Measured (tests/test_stall.py, tests/test_vllm_stall.py
#: print it): a healthy busy engine's progress moved at every 200 ms publish (largest gap 0.21 s over ~400 moves of
#: the sim at 20 req/s, 0.20 s for vLLM CPU with the tiny model at concurrency 4); a chunked-prefill step counts as
#: progress, so a long prompt adds one step's time, not the whole prefill's. 5 s is ~25x that, and a stalled worker
#: was out of rotation 5.0-5.3 s after its last progress (vLLM, SIGSTOP of the EngineCore), under the 10 s target.
STALL_AFTER_S = 5.0
#: ``--stall-restart-after``: a worker stalled this long since its last progress exits so that its supervisor (dplb
#: launch, systemd) restarts it, and stops pinging systemd's watchdog. Long enough for a transient stall (a slow
#: NCCL collective, a GPU reset) to clear; 0 = never.
STALL_RESTART_AFTER_S = 120.0
#: ``--router-restart-after`` (``dplb router --restart-after``): a router process whose heartbeat in its router slot
#: (refreshed by its monitor every ≤ 0.5 s) is this old while it lives — stopped, its event loop blocked — is killed
#: and restarted: a router group's child by the group's parent (:mod:`dplb.router.supervisor`), a single-process
#: router by ``dplb launch`` (:mod:`dplb.ops.watchdog`). The router unit's ``WatchdogSec``
#: (deploy/systemd/dplb-router.service), so that a frozen router is replaced as soon under the launcher as under
#: systemd; 30× the monitor's step, so a loaded box's late ticks never trip it. 0 = never.
ROUTER_RESTART_AFTER_S = 15.0
#: The shortest ``--router-restart-after`` other than 0: twice the router monitor's longest step (0.5 s), so a
#: healthy router's heartbeat is never judged frozen between two ticks.
MIN_ROUTER_RESTART_AFTER_S = 1.0


def worker_server_stop_s(drain_timeout_s: float) -> float:
    """How long a stopping worker waits for its HTTP servers once its drain (``--drain-timeout``) is over."""
    return max(5.0, drain_timeout_s)


def check_stall(stall_after_s: float, stall_restart_after_s: float | None = None) -> None:
    """Refuse bad stall settings (``--stall-after`` ≥ 0, 0 = off; ``--stall-restart-after`` 0 = off or more than
    ``--stall-after``). Raises :class:`ConfigError` naming the flag."""
    if not (math.isfinite(stall_after_s) and 0 <= stall_after_s <= 3600):
        raise ConfigError(f"--stall-after must be 0 (off) or up to 3600 seconds, got {stall_after_s}")
    r = stall_restart_after_s
    if r is not None and not (math.isfinite(r) and (r == 0 or (stall_after_s > 0 and stall_after_s < r <= 86400))):
        raise ConfigError(f"--stall-restart-after must be 0 (off) or more than --stall-after ({stall_after_s:g} s, "
                          f"which must be on) and up to 86400 seconds, got {r}")


def check_router_restart_after(limit_s: float) -> None:
    """Refuse a bad ``--router-restart-after``: 0 (off) or :data:`MIN_ROUTER_RESTART_AFTER_S`..86400 seconds.
    Raises :class:`ConfigError` naming the flag."""
    if not (math.isfinite(limit_s) and (limit_s == 0 or MIN_ROUTER_RESTART_AFTER_S <= limit_s <= 86400)):
        raise ConfigError(f"--restart-after (dplb launch: --router-restart-after) must be 0 (off) or "
                          f"{MIN_ROUTER_RESTART_AFTER_S:g}..86400 seconds (a router's heartbeat is refreshed every "
                          f"0.5 s), got {limit_s:g}")


def check_finite(cfg: object) -> None:
    """Refuse a ``float`` field of the dataclass ``cfg`` that is NaN or infinite (every one is a duration, a rate, a
    fraction or a weight): the backstop under each field's own range check, so a new field cannot let one through.
    Raises :class:`ConfigError` naming the field."""
    for f in dataclasses.fields(cfg):  # type: ignore[arg-type]
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{f.name} must be a finite number, got {value}")


#: ``--header-timeout``: a request head (request line and headers) must be complete this many seconds after its
#: first byte (a new connection's first head: after the accept), else 408 and close — a slowloris client that trickles
#: a head holds a connection and its buffers otherwise. nginx's client_header_timeout is 60 s and Apache's
#: mod_reqtimeout allows 20-40 s; a real client sends its head in one write (one round trip), so 30 s leaves a very
#: slow link 100x its need and halves what an idle attacker holds against nginx's default.
HEADER_TIMEOUT_S = 30.0
#: ``--body-timeout``: while a request body is incomplete, the longest silence between two reads, seconds (nginx's
#: client_body_timeout, whose default this is: 60 s); not counted while the router is not reading (its app has not
#: read the body yet, or a 100-continue not sent yet).
BODY_TIMEOUT_S = 60.0


def check_read_timeouts(header_s: float, body_s: float) -> None:
    """Refuse bad client read timeouts: each finite, > 0 and at most 3600 s. Raises :class:`ConfigError` naming
    the flag."""
    for flag, value in (("--header-timeout", header_s), ("--body-timeout", body_s)):
        if not (math.isfinite(value) and 0 < value <= 3600):
            raise ConfigError(f"{flag} must be > 0 and at most 3600 seconds, got {value}")


POLICIES = ("dplb", "round_robin", "random", "least_loaded", "power_of_two", "prefix_hash")
MemorySignal = Literal["kv", "gpu"]
LatencySignal = Literal["e2e", "ttft"]
Weights = tuple[tuple[str, float], ...]
#: ``((plugin, parameter, value as written), …)``: ``--scorer-param PLUGIN.PARAM=VALUE`` flags, in order.
PluginParams = tuple[tuple[str, str, str], ...]
#: Largest prefix block (bytes of the prompt): ``--prefix-block-bytes`` and the prefix plugins' ``block_bytes``.
MAX_PREFIX_BLOCK_BYTES = 65536
#: The prefix index's block size, bytes of the prompt (routers' --prefix-block-bytes; the workers translate their
#: engines' KV events into keys of this size).
PREFIX_BLOCK_BYTES = 128
#: Longest state publish interval, ms (``--state-interval-ms``): a slot is stale after 3 intervals, so one minute
#: already means three minutes before a dead worker leaves rotation; the segment header stores it as a uint32.
MAX_STATE_INTERVAL_MS = 60_000


def check_state_interval_ms(ms: int) -> int:
    """``ms`` when it is a publish interval in 1..:data:`MAX_STATE_INTERVAL_MS`; raises :class:`ConfigError`
    naming ``--state-interval-ms`` otherwise."""
    if not 1 <= ms <= MAX_STATE_INTERVAL_MS:
        raise ConfigError(f"--state-interval-ms must be 1..{MAX_STATE_INTERVAL_MS} ms, got {ms}")
    return ms

#: The seed article's weights (prefix scoring off).
SEED_WEIGHTS: Weights = (("queue", 0.4), ("memory", 0.3), ("latency", 0.3))
#: Default with prefix scoring on (``prefix_block_bytes`` > 0): the seed's 4:3:3 between the load terms, scaled to
#: leave 0.3 for the prefix term. Chosen by the sweeps in benchmarks/README.md ("Prefix weight"): at full size in
#: shared-prefix it had the best hit rate (0.89 vs 0.82) and P99 (0.86×) against queue=0.4,…,prefix=0.2, and it was
#: within one run's noise of it in the multi-turn, heterogeneous, homogeneous and burst-herd runs.
PREFIX_WEIGHTS: Weights = (("queue", 0.3), ("memory", 0.2), ("latency", 0.2), ("prefix", 0.3))


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """Scoring policy configuration (docs/DESIGN.md §5).

    - ``weights``: ``((scorer name, weight), …)``, each weight ≥ 0, summing to 1 (±1e-6); names are checked against
      the scorer registry when the policy is built. None (default): :data:`PREFIX_WEIGHTS` when prefix scoring is
      on, else the seed's :data:`SEED_WEIGHTS` (0.4 / 0.3 / 0.3).
    - ``max_queue``: soft queue cap, requests (> 0); the queue term is ``1 − queue/max(max_queue, the longest
      eligible queue)`` (dplb/policy/scorers.py).
      ``max_queue_from_worker=True`` uses each worker's published ``max_num_seqs`` instead (when it is > 0).
    - ``hard_queue_cap``: a worker whose queue is ≥ this is not eligible (0 = no hard cap). When every ready
      worker is over it the router answers 503 with ``Retry-After``.
    - ``baseline_window``: the latency baseline is the P95 of the first ``baseline_window`` completed requests.
    - ``memory_signal``: ``"kv"`` (KV-cache usage, default: vLLM pre-allocates ~90 % of GPU memory so NVML "used"
      is flat) or ``"gpu"`` (NVML used/total as in the seed).
    - ``waiting_weight``: in the queue term, each request that will *wait* for a batch slot counts this many times
      (requests the worker reports waiting, plus router-sent requests beyond its free ``max_num_seqs`` slots): a
      waiting request waits for a whole running request to finish, a running one only shares decode steps. 4, as
      vLLM's DP balancer (4·waiting + running); 1 = the seed's plain ``running + waiting``. Evidence in
      benchmarks/README.md.
    - ``latency_deadband``: workers whose mean latency is within this fraction of the eligible workers' mean all get
      the mean's latency term (equal workers differ by noise only); 0 = off. Evidence in benchmarks/README.md.
    - ``latency_signal``: ``"e2e"`` (seed: mean E2E latency of the worker's last 10 requests against the P95 E2E of
      the first ``baseline_window`` requests) or ``"ttft"`` (the same with time to first token).
    - ``prefix_block_bytes``: prefix-cache routing block size, bytes of the prompt (0 = no prefix scoring). 128:
      ~32 tokens, two vLLM blocks of 16; 64-byte blocks cost twice the hashing (benchmarks/bench_pick.py).
    - ``prefix_index_blocks``: capacity of the prefix index (LRU), blocks; memory ≈ 190 bytes a block
      (``dplb.policy.prefix.ENTRY_BYTES``, measured by tests/test_prefix.py; 65,536 ≈ 12 MB, covering 8 MiB of
      distinct prompt text ≈ 2M tokens across all workers).
    - ``prefix_ttl_s``: a block not sent to a worker for this long is forgotten, seconds.
    - ``state_interval_ms``: publish interval; slots older than 3× are stale.
    - ``seed``: RNG seed of the ``random`` and ``power_of_two`` policies (deterministic runs).
    - ``panic_routing``: when no worker is eligible for a request and some are held out only by the router's
      heartbeat hysteresis (fresh again, ready, on probation), route among those instead of answering 503 (Envoy's
      panic threshold, narrowed: docs/DESIGN.md §5.1). False (``--no-panic-routing``): probation always holds.
    - ``plugins``: modules imported before the policy is built (user scorers/pickers; see
      :mod:`dplb.policy.plugins`).
    - ``params``: per-plugin parameters, ``((plugin, parameter, value text), …)`` (``--scorer-param
      prefix.block_bytes=64``, repeatable). Checked here for shape (identifiers, each set once); each plugin declares
      its parameters with type, default and accepted values (:class:`dplb.policy.framework.Param`), and
      :func:`dplb.policy.plugins.validate` checks names and values once at start-up. The flags above that belong to
      one plugin (``prefix_*``, ``latency_deadband``, ``waiting_weight``, ``memory_signal``, ``seed``) are that
      plugin's parameters' defaults; a ``params`` entry overrides them.
    """

    name: str = "dplb"
    weights: Weights | None = None
    max_queue: int = 16
    max_queue_from_worker: bool = False
    hard_queue_cap: int = 0
    baseline_window: int = 50
    memory_signal: MemorySignal = "kv"
    latency_signal: LatencySignal = "e2e"
    waiting_weight: float = 1.0
    latency_deadband: float = 0.25
    prefix_block_bytes: int = PREFIX_BLOCK_BYTES
    prefix_index_blocks: int = 65536
    prefix_ttl_s: float = 300.0
    state_interval_ms: int = 200
    seed: int = 0
    plugins: tuple[str, ...] = ()
    params: PluginParams = ()
    panic_routing: bool = True

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ConfigError(f"policy '{self.name}' is unknown; choose one of {', '.join(POLICIES)}")
        if self.weights is not None:
            ws = self.weights
            names = [n for n, _ in ws]
            if not ws or len(set(names)) != len(names):
                raise ConfigError(f"weights must name each scorer once, got {format_weights(ws)!r}")
            if any(not math.isfinite(w) or w < 0 for _, w in ws):
                raise ConfigError(f"weights must be finite and ≥ 0, got {format_weights(ws)!r}")
            if abs(sum(w for _, w in ws) - 1.0) > 1e-6:
                raise ConfigError(
                    f"weights must sum to 1, got {format_weights(ws)} = {sum(w for _, w in ws):g}; the seed values "
                    "are queue=0.4,memory=0.3,latency=0.3")
            if "prefix" in names and self.prefix_block_bytes == 0:
                raise ConfigError("weights give the prefix scorer a weight but --prefix-block-bytes is 0 (prefix "
                                  "scoring off); drop prefix=… or set a block size")
        if self.max_queue <= 0:
            raise ConfigError(f"max_queue must be a positive number of requests, got {self.max_queue}")
        if self.hard_queue_cap < 0:
            raise ConfigError(f"hard_queue_cap must be ≥ 0 (0 disables it), got {self.hard_queue_cap}")
        if self.baseline_window <= 0:
            raise ConfigError(f"baseline_window must be a positive number of requests, got {self.baseline_window}")
        if not (math.isfinite(self.waiting_weight) and self.waiting_weight >= 1.0):
            raise ConfigError(f"waiting_weight must be a number ≥ 1 (1 = the seed's plain queue), got "
                              f"{self.waiting_weight}")
        if not (math.isfinite(self.latency_deadband) and 0.0 <= self.latency_deadband < 1.0):
            raise ConfigError(f"latency_deadband must be a fraction in [0, 1), got {self.latency_deadband}")
        if self.latency_signal not in ("e2e", "ttft"):
            raise ConfigError(f"latency_signal must be 'e2e' or 'ttft', got {self.latency_signal!r}")
        if self.memory_signal not in ("kv", "gpu"):
            raise ConfigError(f"memory_signal must be 'kv' or 'gpu', got {self.memory_signal!r}")
        if not 0 <= self.prefix_block_bytes <= MAX_PREFIX_BLOCK_BYTES:
            raise ConfigError(f"--prefix-block-bytes must be 0 (off) or a block size up to {MAX_PREFIX_BLOCK_BYTES} "
                              f"bytes, got {self.prefix_block_bytes}")
        if self.prefix_index_blocks <= 0:
            raise ConfigError(f"--prefix-index-blocks must be > 0, got {self.prefix_index_blocks}")
        if not (math.isfinite(self.prefix_ttl_s) and self.prefix_ttl_s > 0):
            raise ConfigError(f"--prefix-ttl must be > 0 seconds, got {self.prefix_ttl_s}")
        check_state_interval_ms(self.state_interval_ms)
        seen: set[tuple[str, str]] = set()
        for entry in self.params:
            if len(entry) != 3 or not all(isinstance(x, str) for x in entry):
                raise ConfigError(f"params entries are (plugin, parameter, value) strings, got {entry!r}")
            plugin, param, value = entry
            if not (plugin.isidentifier() and param.isidentifier()):
                raise ConfigError(f"--scorer-param {plugin}.{param}={value}: plugin and parameter must be names "
                                  "like prefix.block_bytes")
            if (plugin, param) in seen:
                raise ConfigError(f"--scorer-param {plugin}.{param} is given twice")
            seen.add((plugin, param))
        check_finite(self)

    def effective_weights(self) -> Weights:
        """The weights in force: ``weights``, else the default for prefix scoring on/off."""
        if self.weights is not None:
            return self.weights
        return PREFIX_WEIGHTS if self.prefix_block_bytes else SEED_WEIGHTS

    @property
    def prefix_on(self) -> bool:
        """True when the prefix scorer is weighted (the router then hashes prompts into blocks)."""
        return any(n == "prefix" and w > 0 for n, w in self.effective_weights())


def format_weights(weights: Weights) -> str:
    """``"queue=0.4,memory=0.3,latency=0.3"``."""
    return ",".join(f"{n}={w:g}" for n, w in weights)


def split_list(text: str, what: str, *, allow_empty: bool = False) -> list[str]:
    """The items of a comma-separated list, each stripped of spaces: ``"a, b"`` → ``["a", "b"]``.

    Every comma-separated command-line or query value goes through here, so they all refuse the same sloppiness:
    an empty item (``"a,"``, ``",a"``, ``"a,,b"``, ``" , "``) raises :class:`ConfigError` naming ``what`` (e.g.
    ``"--weights"``) and the text. ``""`` (only spaces) is ``[]`` when ``allow_empty``, else an error too.
    """
    if not text.strip():
        if allow_empty:
            return []
        raise ConfigError(f"{what} must not be empty")
    items = [t.strip() for t in text.split(",")]
    if not all(items):
        raise ConfigError(f"{what} {text!r} has an empty item (a stray comma?); separate items with one comma")
    return items


def parse_weights(text: str) -> Weights:
    """Parse ``"queue=0.4,memory=0.3,latency=0.3"`` (any registered scorer names) or the seed's positional
    ``"0.4,0.3,0.3"`` (queue, memory, latency). Raises :class:`ConfigError` on anything else, an empty item (a
    trailing comma) included (:func:`split_list`)."""
    hint = "like queue=0.4,memory=0.3,latency=0.3 (or 0.4,0.3,0.3)"
    if not text.strip():
        raise ConfigError(f"weights must not be empty; {hint}")
    parts = split_list(text, "--weights")
    try:
        if parts and all("=" not in p for p in parts):
            if len(parts) != 3:
                raise ConfigError(f"positional weights are three numbers (queue, memory, latency); use name=weight "
                                  f"pairs {hint}, got {text!r}")
            return tuple(zip(("queue", "memory", "latency"), (float(p) for p in parts), strict=True))
        out = []
        for p in parts:
            name, sep, val = p.partition("=")
            if not sep or not name.strip():
                raise ConfigError(f"weights must be name=weight pairs {hint}, got {text!r}")
            out.append((name.strip(), float(val)))
    except ValueError as e:
        raise ConfigError(f"weights must be numbers, {hint}; got {text!r}") from e
    if not out:
        raise ConfigError(f"weights must not be empty; {hint}")
    return tuple(out)


def parse_param(text: str) -> tuple[str, str, str]:
    """Parse one ``--scorer-param`` value, ``"PLUGIN.PARAM=VALUE"`` → ``(plugin, param, value text)`` (whitespace
    around the parts stripped; the value is typed by the plugin's declaration later). Raises :class:`ConfigError`
    for anything else."""
    key, sep, value = text.partition("=")
    plugin, dot, param = key.strip().partition(".")
    plugin, param, value = plugin.strip(), param.strip(), value.strip()
    if not sep or not dot or not plugin.isidentifier() or not param.isidentifier() or not value:
        raise ConfigError(f"--scorer-param must be PLUGIN.PARAM=VALUE like prefix.block_bytes=128, got {text!r}")
    return plugin, param, value


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Router settings (docs/DESIGN.md §4, §6). Times in seconds, sizes in bytes.

    - ``connect_timeout_s``: connecting to a worker's socket; ``first_byte_timeout_s``: waiting for the response
      head (generous: long prefills are normal); ``idle_timeout_s``: silence between two body chunks.
    - ``max_body_bytes``: larger request bodies get 413 (decided from Content-Length before reading when given).
    - ``retry_after_s``: the ``Retry-After`` of the router's own 503s.
    - ``debug_ring``: how many decisions ``/debug/decisions`` keeps.
    - ``api_key``: when set, proxied and ``/v1/models`` requests need ``Authorization: Bearer <key>``;
      ``public_paths`` are exempt.
    - ``models_refresh_s``: how often each ready worker's ``/v1/models`` is asked again (model/LoRA-aware routing;
      a worker that becomes ready or restarts is asked at once).
    - ``cors_allowed_origins``: origins answered with CORS headers and preflights (empty = CORS off; ``*`` = any).
    - ``sse_keepalive_s``: on an SSE response, send ``: keep-alive`` comments after this many seconds without a
      worker byte (0 = off); ``--idle-timeout`` still bounds the worker's silence.
    - ``allow_runtime_lora``: serve ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (fan-out).
    - ``response_ids``: how many ``/v1/responses`` ids the router remembers (id → worker, LRU).
    - ``processes``: router processes sharing ``port`` (``SO_REUSEPORT``) under one supervising parent;
      ``process_index``: which one this process is (0..processes−1; set by the parent). With more than one, each
      also listens on :meth:`process_socket` so a sibling can merge its metrics and decisions into one answer.

    - Fleet (:mod:`dplb.router.host_report`): ``agent_port``: the HAProxy agent-check port (None = off; bound on
      ``host``, by process 0 of a group); ``orca``: ``off`` | ``asked`` (when the request sends
      ``endpoint-load-metrics-format``) | ``always`` — the ORCA ``endpoint-load-metrics`` response header;
      ``drain_notice_s``: after SIGTERM (or SIGUSR1) the host reports ``drain`` and keeps serving this long before it
      stops accepting, so the front balancer moves new requests away first (≥ its check interval × its fall count).
    - ``resume_streams``: a chat or completions SSE stream (n = 1) whose worker dies or stalls mid-stream is
      re-issued to another worker with what the client already received as the continuation and stitched into the
      same stream (:mod:`dplb.router.resume`, docs/DESIGN.md §14); off: such a stream ends with an error event.
    - ``stall_after_s``: a worker with requests outstanding and no engine progress for this long is stalled
      (:data:`STALL_AFTER_S`; 0 = no stall check; :mod:`dplb.policy.stall`).
    - ``direct_relay``: serve the common proxied request from the protocols' callbacks, without an ASGI task
      (:mod:`dplb.router.direct`; the same behaviour, less CPU); off: every request takes the ASGI path.
    - Client edge (:mod:`dplb.runtime.protocol`): ``header_timeout_s`` (:data:`HEADER_TIMEOUT_S`) and
      ``body_timeout_s`` (:data:`BODY_TIMEOUT_S`): a client too slow with its request head / silent mid-body gets
      408 ``request_timeout`` and the connection is closed; ``serve_half_closed``: a complete request whose client
      shut its sending side (``shutdown(SHUT_WR)``) is answered, then the connection closed (off: that EOF is the
      client leaving, and its request is aborted at once, as nginx's ``proxy_ignore_client_abort off``).
    - ``restart_after_s``: a group's child (``processes`` > 1) whose router-slot heartbeat is this old while it lives
      is SIGKILLed and restarted by the group's parent (:data:`ROUTER_RESTART_AFTER_S`; 0 = off, the parent's
      ``/health`` probes alone judge it); ``dplb launch`` judges a single-process router by the same value, and a
      group by its children (:func:`dplb.ops.watchdog.kill_if_group_unserved`).

    - Tenants (docs/DESIGN.md §15): ``tenants_file``: the TOML file of :mod:`dplb.tenants` (None = one tenant,
      ``default``, holding ``api_key``); with it, requests that find no worker with room wait in the router's fair
      queue: at most ``queue_max`` of them, each at most ``queue_timeout_s`` seconds; ``engine_priority``: write the
      tenant's priority class rank into the body's ``priority`` field (vLLM ``--scheduling-policy priority``).

    Handed from process to process as JSON (:meth:`to_json` / :meth:`from_json`), validated again on the way in.
    """

    policy: PolicyConfig
    run_dir: str
    num_workers: int | None = None
    shm_path: str | None = None
    host: str = "0.0.0.0"
    port: int = 30000
    api_key: str | None = None
    public_paths: tuple[str, ...] = ("/health", "/ready", "/metrics", "/metrics/host")
    max_body_bytes: int = 32 * 1024 * 1024
    connect_timeout_s: float = 5.0
    first_byte_timeout_s: float = 600.0
    idle_timeout_s: float = 120.0
    retry_after_s: int = 1
    debug_ring: int = 256
    shm_check_interval_s: float = 0.5
    access_log: bool = False
    models_refresh_s: float = 5.0
    cors_allowed_origins: tuple[str, ...] = ()
    sse_keepalive_s: float = 0.0
    allow_runtime_lora: bool = False
    response_ids: int = 65536
    processes: int = 1
    process_index: int = 0
    agent_port: int | None = None
    orca: str = "asked"
    drain_notice_s: float = 0.0
    resume_streams: bool = False
    direct_relay: bool = True
    stall_after_s: float = STALL_AFTER_S
    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    serve_half_closed: bool = False
    restart_after_s: float = ROUTER_RESTART_AFTER_S

    tenants_file: str | None = None
    queue_max: int = 1024
    queue_timeout_s: float = 30.0
    engine_priority: bool = False

    def __post_init__(self) -> None:
        check_stall(self.stall_after_s)
        check_read_timeouts(self.header_timeout_s, self.body_timeout_s)
        if self.queue_max <= 0:
            raise ConfigError(f"--queue-max must be > 0 requests, got {self.queue_max}")
        if not (math.isfinite(self.queue_timeout_s) and self.queue_timeout_s > 0):
            raise ConfigError(f"--queue-timeout must be > 0 seconds, got {self.queue_timeout_s}")
        if self.engine_priority and self.tenants_file is None:
            raise ConfigError("--engine-priority needs --tenants (the priority classes are in the tenants file)")
        if not 1 <= self.port <= 65535:
            raise ConfigError(f"--port must be 1..65535, got {self.port}")
        if not 1 <= self.processes <= MAX_ROUTER_PROCESSES:
            raise ConfigError(f"--processes (dplb launch: --router-processes) must be 1..{MAX_ROUTER_PROCESSES}, "
                              f"got {self.processes}")
        if not 0 <= self.process_index < self.processes:
            raise ConfigError(f"process_index must be 0..{self.processes - 1}, got {self.process_index}")
        if self.num_workers is not None and self.num_workers <= 0:
            raise ConfigError(f"--num-workers must be > 0, got {self.num_workers}")
        for name, flag in (("connect_timeout_s", "--connect-timeout"), ("first_byte_timeout_s", "--first-byte-timeout"),
                           ("idle_timeout_s", "--idle-timeout"), ("shm_check_interval_s", "shm_check_interval_s")):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ConfigError(f"{flag} must be a finite number > 0 seconds, got {getattr(self, name)}")
        if self.max_body_bytes <= 0:
            raise ConfigError(f"--max-body-bytes must be > 0, got {self.max_body_bytes}")
        if self.debug_ring <= 0 or self.retry_after_s < 0:
            raise ConfigError("debug_ring > 0 and retry_after_s ≥ 0 are required")
        if self.api_key is not None:
            check_bearer_token(self.api_key, "--api-key (or DPLB_API_KEY)")
        if not (math.isfinite(self.models_refresh_s) and self.models_refresh_s > 0):
            raise ConfigError(f"--models-refresh must be > 0 seconds, got {self.models_refresh_s}")
        if not (math.isfinite(self.sse_keepalive_s) and self.sse_keepalive_s >= 0):
            raise ConfigError(f"--sse-keepalive must be ≥ 0 seconds (0 = off), got {self.sse_keepalive_s}")
        if self.agent_port is not None and not 1 <= self.agent_port <= 65535:
            raise ConfigError(f"--agent-port must be 1..65535, got {self.agent_port}")
        if self.orca not in ("off", "asked", "always"):
            raise ConfigError(f"--orca must be off, asked or always, got {self.orca!r}")
        if not (math.isfinite(self.drain_notice_s) and 0 <= self.drain_notice_s <= 3600):
            raise ConfigError(f"--drain-notice must be 0..3600 seconds, got {self.drain_notice_s}")
        check_router_restart_after(self.restart_after_s)
        if self.response_ids <= 0:
            raise ConfigError(f"response_ids must be > 0, got {self.response_ids}")
        check_origins(self.cors_allowed_origins, "--cors-allowed-origins")
        check_finite(self)

    def socket_path(self, worker_id: int) -> str:
        """Worker ``worker_id``'s Unix socket: ``<run_dir>/worker-<id>.sock``."""
        return f"{self.run_dir}/worker-{worker_id}.sock"

    def process_socket(self, index: int) -> str:
        """Router process ``index``'s private Unix socket (metrics and decisions of that process alone):
        ``<run_dir>/router-<port>.<index>.sock``."""
        return f"{self.run_dir}/router-{self.port}.{index}.sock"

    def to_json(self) -> bytes:
        """This configuration as JSON (the API key left out: it travels in ``$DPLB_API_KEY``, never in a file)."""
        import msgspec

        return msgspec.json.encode(dataclasses.replace(self, api_key=None))

    @classmethod
    def from_json(cls, data: bytes, api_key: str | None = None) -> RouterConfig:
        """Decode and validate :meth:`to_json`'s output. Raises :class:`ConfigError` naming the bad field."""
        import msgspec

        try:
            cfg = msgspec.json.decode(data, type=cls)
        except msgspec.ValidationError as e:
            raise ConfigError(f"router configuration: {e}") from None
        return dataclasses.replace(cfg, api_key=api_key) if api_key else cfg
