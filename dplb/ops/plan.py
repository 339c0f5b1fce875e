"""GPU planning: split the visible GPUs into N data-parallel workers of T GPUs each (docs/DESIGN.md §10).
Pure functions.

Rules
- With GPUs: ``num_workers × tensor_parallel_size`` must equal the number of GPUs; workers get consecutive groups
  (4 GPUs, 2 workers → [0, 1] and [2, 3]). ``num_workers`` defaults to ``gpus // tp``.
- Without GPUs: every worker runs on the CPU (empty group); ``num_workers`` defaults to :data:`CPU_DEFAULT_WORKERS`
  and TP must be 1 for the sim engine (vLLM on CPU handles its own threads).
- At most :data:`dplb.state.layout.MAX_WORKERS` (64) workers: the segment has that many slots.
- A plan that does not fit is refused with :class:`dplb.errors.ConfigError` giving the arithmetic and the fix.
"""

from __future__ import annotations

from dplb.errors import ConfigError
from dplb.state.layout import MAX_WORKERS

CPU_DEFAULT_WORKERS = 2


def plan_gpus(gpus: list[int], num_workers: int | None, tensor_parallel_size: int = 1) -> list[list[int]]:
    """Group ``gpus`` (indices, in order) into workers. Returns one GPU list per worker.

    Raises :class:`ConfigError` when ``num_workers × tensor_parallel_size ≠ len(gpus)``, a value is < 1 or
    ``num_workers`` is over :data:`MAX_WORKERS`.
    """
    tp = tensor_parallel_size
    if tp < 1:
        raise ConfigError(f"--tensor-parallel-size must be ≥ 1, got {tp}")
    if num_workers is not None and not 1 <= num_workers <= MAX_WORKERS:
        raise ConfigError(f"--num-workers must be 1..{MAX_WORKERS}, got {num_workers}")
    if len(set(gpus)) != len(gpus):
        raise ConfigError(f"GPU list {gpus} has duplicates")
    if not gpus:
        n = num_workers or CPU_DEFAULT_WORKERS
        return [[] for _ in range(n)]
    g = len(gpus)
    if num_workers is None:
        if g % tp:
            raise ConfigError(
                f"{g} GPU(s) cannot be split into groups of --tensor-parallel-size {tp} ({g} % {tp} = {g % tp}); "
                f"use a TP size that divides {g} ({_divisors(g)}) or set CUDA_VISIBLE_DEVICES to a multiple of {tp} "
                "GPUs")
        num_workers = g // tp
    need = num_workers * tp
    if need != g:
        hint = (f"use --num-workers {g // tp}" if g % tp == 0 else
                f"use a --tensor-parallel-size that divides {g} ({_divisors(g)})")
        raise ConfigError(
            f"--num-workers {num_workers} × --tensor-parallel-size {tp} = {need} GPU(s), but {g} GPU(s) are "
            f"visible ({gpus}); every GPU must belong to exactly one worker. Fix: {hint}, or restrict the GPUs with "
            f"CUDA_VISIBLE_DEVICES to {need} of them.")
    return [gpus[i * tp:(i + 1) * tp] for i in range(num_workers)]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def cuda_visible_devices(group: list[int]) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` value for one worker's group ("" for a CPU worker)."""
    return ",".join(str(i) for i in group)
