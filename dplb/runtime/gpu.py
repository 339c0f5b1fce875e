"""GPU discovery and memory readings through NVML (nvidia-ml-py, imported as ``pynvml``).

Contract: nothing here raises because a GPU is missing. :func:`discover_gpus` returns ``[]`` on a host without
NVML; :class:`GpuReader` reports zeros with ``available=False`` (the worker sets the shm NO_GPU flag and logs one
line). NVML errors after a successful init are counted (``errors_total``) and give the last good reading.
:func:`gpu_cpu_affinity` reads each GPU's CPU affinity (the CPUs of its NUMA node) for the worker placement
(:mod:`dplb.ops.placement`); it takes the NVML module as a parameter, the seam the tests use on a host without GPUs.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("dplb.gpu")


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """One GPU as NVML sees it: index (NVML/PCI order), name, total memory in bytes."""

    index: int
    name: str
    memory_total_bytes: int


def _nvml():
    import pynvml  # nvidia-ml-py

    pynvml.nvmlInit()
    return pynvml


def discover_gpus() -> list[GpuInfo]:
    """Every GPU NVML can see, in NVML index order; ``[]`` when NVML or the driver is absent."""
    try:
        nv = _nvml()
    except Exception as e:  # no driver / library: a CPU host
        log.debug("NVML unavailable: %s", e)
        return []
    try:
        out = []
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            name = nv.nvmlDeviceGetName(h)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            out.append(GpuInfo(i, name.decode() if isinstance(name, bytes) else str(name), int(mem.total)))
        return out
    finally:
        nv.nvmlShutdown()


def cpus_from_mask(words: list[int], word_bits: int = 64) -> list[int]:
    """CPU ids set in an NVML CPU-set bitmask (``words[i]`` bit ``b`` = CPU ``i * word_bits + b``), sorted."""
    return [i * word_bits + b for i, w in enumerate(words) for b in range(word_bits) if (int(w) >> b) & 1]


def gpu_cpu_affinity(indices: list[int], ncpus: int | None = None, nvml: object = None) -> dict[int, list[int]]:
    """The CPUs near each GPU in ``indices`` (NVML ``nvmlDeviceGetCpuAffinityWithinScope`` with the NUMA-node scope;
    ``nvmlDeviceGetCpuAffinity``, the ideal affinity, where the driver lacks it). ``ncpus`` sizes the bitmask
    (default ``os.cpu_count()``); ``nvml``: the ``pynvml`` module (default: imported and initialised here; tests pass
    a stand-in). Returns ``{index: [cpu, ...]}``, leaving out a GPU NVML gives no CPUs for; ``{}`` without NVML.
    Never raises because NVML is missing or fails."""
    own = nvml is None
    try:
        nv: Any = _nvml() if own else nvml
    except Exception as e:  # no driver / library: a CPU host
        log.debug("NVML unavailable: %s", e)
        return {}
    words = ((ncpus or os.cpu_count() or 1) + 63) // 64
    out: dict[int, list[int]] = {}
    try:
        for i in indices:
            try:
                h = nv.nvmlDeviceGetHandleByIndex(i)
                try:
                    mask = nv.nvmlDeviceGetCpuAffinityWithinScope(h, words, getattr(nv, "NVML_AFFINITY_SCOPE_NODE", 0))
                except Exception:  # older drivers: the ideal affinity (same node on the usual servers)
                    mask = nv.nvmlDeviceGetCpuAffinity(h, words)
                cpus = cpus_from_mask(list(mask))
            except Exception as e:
                log.warning("NVML gives no CPU affinity for GPU %d (%s); it is placed like a CPU worker", i, e)
                continue
            if cpus:
                out[i] = cpus
        return out
    finally:
        if own:
            with contextlib.suppress(Exception):
                nv.nvmlShutdown()


def visible_gpu_indices(env: dict[str, str] | None = None) -> list[int] | None:
    """GPU indices from ``CUDA_VISIBLE_DEVICES`` (integers only), or None when unset/empty or not numeric."""
    raw = (env if env is not None else os.environ).get("CUDA_VISIBLE_DEVICES", "").strip()
    if not raw:
        return None
    try:
        return [int(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        return None


class GpuReader:
    """Reads memory used/total (bytes, summed) and busy-ness for one worker's GPUs, every collector tick.

    ``indices``: NVML indices (the launcher sets ``CUDA_VISIBLE_DEVICES`` to them, with
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so CUDA and NVML agree). None = every visible GPU.
    """

    def __init__(self, indices: list[int] | None) -> None:
        self.available = False
        self.errors_total = 0
        self._handles: list[object] = []
        self._last = (0, 0, False)
        try:
            self._nv = _nvml()
            count = self._nv.nvmlDeviceGetCount()
            wanted = indices if indices is not None else list(range(count))
            self._handles = [self._nv.nvmlDeviceGetHandleByIndex(i) for i in wanted if 0 <= i < count]
            self.available = bool(self._handles)
        except Exception as e:
            self._nv = None
            log.info("no NVIDIA GPU visible (%s): GPU memory is reported as 0 with the no_gpu flag", e)

    def read(self) -> tuple[int, int, bool]:
        """(memory used bytes, memory total bytes, busy) summed over the worker's GPUs; zeros without a GPU."""
        if not self.available or self._nv is None:
            return 0, 0, False
        try:
            used = total = 0
            busy = False
            for h in self._handles:
                m = self._nv.nvmlDeviceGetMemoryInfo(h)
                used += int(m.used)
                total += int(m.total)
                busy = busy or self._nv.nvmlDeviceGetUtilizationRates(h).gpu > 0
            self._last = (used, total, busy)
        except Exception as e:
            self.errors_total += 1
            if self.errors_total == 1 or self.errors_total % 100 == 0:
                log.warning("NVML read failed (%s); keeping the last reading (errors so far: %d)", e,
                            self.errors_total)
        return self._last

    def close(self) -> None:
        """Shut NVML down. Idempotent."""
        if self._nv is not None:
            with contextlib.suppress(Exception):
                self._nv.nvmlShutdown()
            self._nv = None
            self.available = False
