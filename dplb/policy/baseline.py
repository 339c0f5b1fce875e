"""The policy's latency baseline: what the latency scorer compares a worker's recent latency with (docs/DESIGN.md §5).

Contract: :class:`LatencyBaseline` takes one sample per completed request (:meth:`LatencyBaseline.observe`) — its
E2E latency, or its time to first body byte when the configured ``latency_signal`` is ``ttft`` (a request without
one is no sample) — and once ``baseline_window`` finite, positive samples came, the baseline is their P95 by
nearest rank (the ⌈0.95·n⌉-th smallest) and frozen: later samples change nothing. Seconds throughout.
"""

from __future__ import annotations

import math


class LatencyBaseline:
    """The P95 (nearest rank) of the first ``window`` samples, then frozen (module docstring). ``ttft``: the
    samples are times to first byte (``latency_signal`` ``ttft``), else E2E latencies. :attr:`value` is the
    baseline in seconds, None until frozen."""

    def __init__(self, window: int, ttft: bool) -> None:
        self.window = window
        self.ttft = ttft
        self.value: float | None = None
        self._samples: list[float] = []

    def observe(self, seconds: float, ttft_s: float | None = None) -> float | None:
        """Feed one completed request's E2E latency ``seconds`` and its time to first body byte ``ttft_s`` (None:
        none, e.g. no body byte). Returns :attr:`value`: the baseline once frozen, else None."""
        if self.value is not None:
            return self.value
        if self.ttft:
            if ttft_s is None:
                return None
            seconds = ttft_s
        if not math.isfinite(seconds) or seconds <= 0:
            return None
        self._samples.append(seconds)
        if len(self._samples) >= self.window:
            ordered = sorted(self._samples)
            self.value = ordered[math.ceil(0.95 * len(ordered)) - 1]
            self._samples = []
        return self.value


__all__ = ["LatencyBaseline"]
