"""One worker's published state as the router and the policy see it: :class:`WorkerState` (a decoded slot of the
state segment), its :class:`Lifecycle`, its flag bits and the staleness rule (docs/DESIGN.md §3).

Contract: a plain value type with no I/O: the byte layout of the slot, the seqlock and the mapping are
:mod:`dplb.state.shm`'s (which re-exports everything here, so ``from dplb.state.shm import WorkerState`` keeps
working). Units: seconds, bytes, fractions 0–1, ns timestamps. A slot is stale when torn, never written, or its
heartbeat is older than ``STALE_INTERVALS × state_interval_ms``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Final

STALE_INTERVALS: Final = 3

FLAG_NO_GPU: Final = 0x01
FLAG_GPU_BUSY: Final = 0x02
FLAG_STALLED: Final = 0x04
#: The slot's previous process (another pid) had published ``STOPPED`` when this one claimed it: it left by itself.
FLAG_PREV_STOPPED: Final = 0x08


class Lifecycle(enum.IntEnum):
    """Worker lifecycle as published in its slot (docs/DESIGN.md §8)."""

    UNSET = 0
    STARTING = 1
    WARMING = 2
    READY = 3
    DRAINING = 4
    STOPPED = 5


@dataclass(slots=True)
class WorkerState:
    """One worker's published state (a decoded slot). Units: seconds, bytes, fractions 0–1, ns timestamps;
    ``kv_total_blocks`` in blocks and ``kv_block_size`` in tokens per block (0 = the engine did not say);
    ``progress_total``: a monotone count of engine progress (tokens, prefill, iterations) and ``progress_mono_ns``
    the CLOCK_MONOTONIC ns at which it last moved (0 = never published);
    ``max_loras``: LoRA adapters one batch holds (0 = LoRA off or unknown; at most 65535);
    ``last_done_mono_ns``: CLOCK_MONOTONIC ns of the last latency sample (0 = none yet)."""

    worker_id: int
    pid: int = 0
    lifecycle: Lifecycle = Lifecycle.UNSET
    flags: int = 0
    heartbeat_mono_ns: int = 0
    heartbeat_unix_ns: int = 0
    num_running: int = 0
    num_waiting: int = 0
    max_num_seqs: int = 0
    last_prompt_tokens: int = 0
    kv_cache_usage: float = 0.0
    gpu_memory_used_bytes: int = 0
    gpu_memory_total_bytes: int = 0
    avg_latency_s: float = 0.0
    avg_ttft_s: float = 0.0
    requests_total: int = 0
    errors_total: int = 0
    cuda_oom_total: int = 0
    warmup_seconds: float = 0.0
    first_request_seconds: float = 0.0
    started_unix_ns: int = 0
    model_load_seconds: float = 0.0
    kv_total_blocks: int = 0
    kv_block_size: int = 0
    progress_total: int = 0
    progress_mono_ns: int = 0
    max_loras: int = 0
    last_done_mono_ns: int = 0
    seq: int = 0
    torn: bool = False

    @property
    def registered(self) -> bool:
        """True once the worker has written its slot at least once."""
        return self.pid != 0

    @property
    def no_gpu(self) -> bool:
        """True when the worker has no NVML GPU (memory fields are 0)."""
        return bool(self.flags & FLAG_NO_GPU)

    def age_s(self, now_mono_ns: int | None = None) -> float:
        """Seconds since the last heartbeat (``inf`` if never written)."""
        if self.heartbeat_mono_ns == 0:
            return float("inf")
        now = time.monotonic_ns() if now_mono_ns is None else now_mono_ns
        return max(0.0, (now - self.heartbeat_mono_ns) / 1e9)

    def is_stale(self, state_interval_ms: int, now_mono_ns: int | None = None) -> bool:
        """True when torn, never written, or the heartbeat is older than 3 × ``state_interval_ms``."""
        if self.torn or self.heartbeat_mono_ns == 0:
            return True
        now = time.monotonic_ns() if now_mono_ns is None else now_mono_ns
        return now - self.heartbeat_mono_ns > STALE_INTERVALS * state_interval_ms * 1_000_000

    def to_dict(self) -> dict[str, object]:
        """JSON-friendly dict (lifecycle by name)."""
        out: dict[str, object] = {name: getattr(self, name) for name in _FIELD_NAMES}
        out["lifecycle"] = self.lifecycle.name.lower()
        out["no_gpu"] = self.no_gpu
        return out


_FIELD_NAMES = [f for f in WorkerState.__dataclass_fields__ if f not in ("seq", "torn")]

__all__ = ["FLAG_GPU_BUSY", "FLAG_NO_GPU", "FLAG_PREV_STOPPED", "FLAG_STALLED", "STALE_INTERVALS", "Lifecycle",
           "WorkerState"]
