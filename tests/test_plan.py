"""GPU planning table (pure function)."""

from __future__ import annotations

import pytest

from dplb.errors import ConfigError
from dplb.ops.plan import CPU_DEFAULT_WORKERS, cuda_visible_devices, plan_gpus


@pytest.mark.parametrize(
    ("gpus", "workers", "tp", "want"),
    [
        ([0, 1, 2, 3], 2, 2, [[0, 1], [2, 3]]),
        ([0, 1, 2, 3], 4, 1, [[0], [1], [2], [3]]),
        ([0, 1, 2, 3], None, 1, [[0], [1], [2], [3]]),
        ([0, 1, 2, 3], None, 2, [[0, 1], [2, 3]]),
        ([0, 1, 2, 3, 4, 5, 6, 7], 2, 4, [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ([2, 3], 1, 2, [[2, 3]]),  # CUDA_VISIBLE_DEVICES=2,3
        ([5], None, 1, [[5]]),
        ([], None, 1, [[]] * CPU_DEFAULT_WORKERS),
        ([], 4, 1, [[], [], [], []]),
    ],
)
def test_plans(gpus: list[int], workers: int | None, tp: int, want: list[list[int]]) -> None:
    assert plan_gpus(gpus, workers, tp) == want


@pytest.mark.parametrize(
    ("gpus", "workers", "tp", "needles"),
    [
        ([0, 1, 2], 2, 1, ["--num-workers 2 × --tensor-parallel-size 1 = 2", "3 GPU(s)", "--num-workers 3"]),
        ([0, 1, 2], None, 2, ["3 % 2 = 1", "[1, 3]"]),
        ([0, 1, 2, 3], 3, 1, ["= 3 GPU(s), but 4", "--num-workers 4"]),
        ([0, 1, 2, 3], 2, 4, ["= 8 GPU(s), but 4", "--num-workers 1"]),
        ([0, 1, 2, 3], 0, 1, ["--num-workers must be 1..64, got 0"]),
        ([], 65, 1, ["--num-workers must be 1..64, got 65"]),  # the segment has 64 slots
        ([0, 1], 1, 0, ["--tensor-parallel-size must be ≥ 1"]),
        ([0, 0], 2, 1, ["duplicates"]),
    ],
)
def test_refused_plans_give_arithmetic_and_fix(gpus: list[int], workers: int | None, tp: int,
                                                needles: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        plan_gpus(gpus, workers, tp)
    for n in needles:
        assert n in str(e.value), str(e.value)


def test_cuda_visible_devices() -> None:
    assert cuda_visible_devices([2, 3]) == "2,3"
    assert cuda_visible_devices([]) == ""
