"""Typed configuration, validated once at start-up and passed down (never re-read on the hot path).

Contract: every ``*Config`` is a frozen dataclass whose ``__post_init__`` refuses bad values with
:class:`dplb.errors.ConfigError` and a message naming the option and the accepted range. Defaults are the values of
DESIGN §3/§4 and the seed article.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal

from dplb.errors import ConfigError

ENV_RUN_DIR = "DPLB_RUN_DIR"


def default_run_dir() -> str:
    """Where worker sockets live: ``$DPLB_RUN_DIR``, else ``$XDG_RUNTIME_DIR/dplb``, else ``/tmp/dplb-<uid>``.
    (Under systemd ``RuntimeDirectory=dplb`` gives ``/run/dplb`` through ``DPLB_RUN_DIR``.)"""
    if os.environ.get(ENV_RUN_DIR):
        return os.environ[ENV_RUN_DIR]
    if os.environ.get("XDG_RUNTIME_DIR"):
        return os.path.join(os.environ["XDG_RUNTIME_DIR"], "dplb")
    return f"/tmp/dplb-{os.getuid()}"


POLICIES = ("dplb", "round_robin", "random", "least_loaded", "power_of_two", "prefix_hash")
MemorySignal = Literal["kv", "gpu"]
LatencySignal = Literal["e2e", "ttft"]


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """Scoring policy configuration (DESIGN §3).

    - ``weights``: (queue, memory, latency) weights of the seed score, each ≥ 0, summing to 1 (±1e-6).
      Seed article: 0.4 / 0.3 / 0.3.
    - ``max_queue``: soft queue cap, requests (> 0); the queue term is ``1 − queue/max_queue`` clamped to [0, 1].
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
    - ``affinity_margin``: prefix affinity keeps the preferred worker while its score is within this margin of the
      best (score units 0–1; 0.2 = 8 queued requests at ``max_queue`` 16); 0 disables affinity. 0.2 from the
      ``shared-prefix`` benchmark sweep (benchmarks/README.md): prefix-cache hit rate 0.78 at 0.1, 0.84 at 0.15,
      0.88 at 0.2 with the same P99 E2E; 0.3 raised P99 by 13 %.
    - ``state_interval_ms``: publish interval; slots older than 3× are stale.
    - ``seed``: RNG seed of the ``random`` and ``power_of_two`` policies (deterministic runs).
    """

    name: str = "dplb"
    weights: tuple[float, float, float] = (0.4, 0.3, 0.3)
    max_queue: int = 16
    max_queue_from_worker: bool = False
    hard_queue_cap: int = 0
    baseline_window: int = 50
    memory_signal: MemorySignal = "kv"
    latency_signal: LatencySignal = "e2e"
    waiting_weight: float = 1.0
    latency_deadband: float = 0.25
    affinity_margin: float = 0.2
    state_interval_ms: int = 200
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ConfigError(f"policy '{self.name}' is unknown; choose one of {', '.join(POLICIES)}")
        if len(self.weights) != 3:
            raise ConfigError(f"weights must be three numbers (queue, memory, latency), got {self.weights!r}")
        if any(not math.isfinite(w) or w < 0 for w in self.weights):
            raise ConfigError(f"weights must be finite and ≥ 0, got {self.weights!r}")
        if abs(sum(self.weights) - 1.0) > 1e-6:
            raise ConfigError(
                f"weights must sum to 1 (queue + memory + latency), got {self.weights!r} = {sum(self.weights):g}; "
                "the seed values are 0.4,0.3,0.3"
            )
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
        if not 0.0 <= self.affinity_margin <= 1.0:
            raise ConfigError(f"affinity_margin must be within 0..1 (score units), got {self.affinity_margin}")
        if self.state_interval_ms <= 0:
            raise ConfigError(f"state_interval_ms must be > 0, got {self.state_interval_ms}")


def parse_weights(text: str) -> tuple[float, float, float]:
    """Parse ``"0.4,0.3,0.3"`` into a weights tuple. Raises :class:`ConfigError` on anything else."""
    try:
        parts = tuple(float(p) for p in text.split(","))
    except ValueError as e:
        raise ConfigError(f"weights must be three comma-separated numbers like 0.4,0.3,0.3, got {text!r}") from e
    if len(parts) != 3:
        raise ConfigError(f"weights must be three comma-separated numbers like 0.4,0.3,0.3, got {text!r}")
    return parts[0], parts[1], parts[2]


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Router settings (DESIGN §4). Times in seconds, sizes in bytes.

    - ``connect_timeout_s``: connecting to a worker's socket; ``first_byte_timeout_s``: waiting for the response
      head (generous: long prefills are normal); ``idle_timeout_s``: silence between two body chunks.
    - ``max_body_bytes``: larger request bodies get 413 (decided from Content-Length before reading when given).
    - ``retry_after_s``: the ``Retry-After`` of the router's own 503s.
    - ``affinity_prefix_bytes``: how many leading bytes of ``messages``/``prompt`` form the prefix-affinity key.
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
    """

    policy: PolicyConfig
    run_dir: str
    num_workers: int | None = None
    shm_path: str | None = None
    host: str = "0.0.0.0"
    port: int = 30000
    api_key: str | None = None
    public_paths: tuple[str, ...] = ("/health", "/ready", "/metrics")
    max_body_bytes: int = 32 * 1024 * 1024
    connect_timeout_s: float = 5.0
    first_byte_timeout_s: float = 600.0
    idle_timeout_s: float = 120.0
    retry_after_s: int = 1
    affinity_prefix_bytes: int = 256
    debug_ring: int = 256
    shm_check_interval_s: float = 0.5
    access_log: bool = False
    models_refresh_s: float = 5.0
    cors_allowed_origins: tuple[str, ...] = ()
    sse_keepalive_s: float = 0.0
    allow_runtime_lora: bool = False
    response_ids: int = 65536

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be 0..65535, got {self.port}")
        if self.num_workers is not None and self.num_workers <= 0:
            raise ConfigError(f"--num-workers must be > 0, got {self.num_workers}")
        for name in ("connect_timeout_s", "first_byte_timeout_s", "idle_timeout_s", "shm_check_interval_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.max_body_bytes <= 0:
            raise ConfigError(f"--max-body-bytes must be > 0, got {self.max_body_bytes}")
        if self.affinity_prefix_bytes < 0 or self.debug_ring <= 0 or self.retry_after_s < 0:
            raise ConfigError("affinity_prefix_bytes ≥ 0, debug_ring > 0 and retry_after_s ≥ 0 are required")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("--api-key must not be empty")
        if not (math.isfinite(self.models_refresh_s) and self.models_refresh_s > 0):
            raise ConfigError(f"--models-refresh must be > 0 seconds, got {self.models_refresh_s}")
        if not (math.isfinite(self.sse_keepalive_s) and self.sse_keepalive_s >= 0):
            raise ConfigError(f"--sse-keepalive must be ≥ 0 seconds (0 = off), got {self.sse_keepalive_s}")
        if self.response_ids <= 0:
            raise ConfigError(f"response_ids must be > 0, got {self.response_ids}")
        bad = [o for o in self.cors_allowed_origins if not o or o != o.strip() or "," in o]
        if bad:
            raise ConfigError(f"--cors-allowed-origins: {bad!r} are not origins (e.g. https://app.example.com or *)")

    def socket_path(self, worker_id: int) -> str:
        """Worker ``worker_id``'s Unix socket: ``<run_dir>/worker-<id>.sock``."""
        return f"{self.run_dir}/worker-{worker_id}.sock"
