"""The host's CPUs as the kernel reports them: which ones this process may use, their topology, a process's affinity.

Contract
- :func:`allowed_cpus`: the CPUs this process may run on (``sched_getaffinity``: what ``taskset``, a container's
  cpuset or systemd's ``CPUAffinity=`` left it), sorted. Placement plans never go outside this set.
- :func:`cpu_topology`: for each given CPU its NUMA node and physical core (SMT siblings share a core), read from
  sysfs (``/sys/devices/system/{cpu,node}``); a CPU whose files are missing is its own core on node 0, so a host
  without sysfs still gets a plan.
- :func:`process_cpus`: a live process's affinity (``None`` when it cannot be read: gone, or another pid namespace).
- :func:`format_cpu_list` / :func:`parse_cpu_list`: the kernel's list syntax (``0-3,8``), as in ``taskset -c``,
  ``/proc/<pid>/status`` ``Cpus_allowed_list``, systemd's ``CPUAffinity=`` and vLLM's ``VLLM_CPU_OMP_THREADS_BIND``.
Nothing here changes an affinity; the launcher does that for its children (:mod:`dplb.ops.placement`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from dplb.errors import ConfigError

SYS_CPU = "/sys/devices/system/cpu"
SYS_NODE = "/sys/devices/system/node"


@dataclass(frozen=True, slots=True)
class CpuInfo:
    """One logical CPU: its id, NUMA node, and physical core as ``(package, core_id)`` (SMT siblings share it)."""

    cpu: int
    node: int = 0
    core: tuple[int, int] = (0, -1)


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on, sorted (all of ``os.cpu_count()`` where affinity is not supported)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def process_cpus(pid: int) -> list[int] | None:
    """The affinity of process ``pid``, sorted; None when it cannot be read (no such process, not permitted)."""
    try:
        return sorted(os.sched_getaffinity(pid))
    except (AttributeError, OSError):
        return None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def cpu_topology(cpus: Iterable[int], sys_cpu: str = SYS_CPU, sys_node: str = SYS_NODE) -> list[CpuInfo]:
    """NUMA node and physical core of each CPU in ``cpus`` (sysfs under ``sys_cpu``/``sys_node``; tests pass a
    fake tree). A CPU without topology files is its own core (``core_id`` = its id) on node 0."""
    node_of: dict[int, int] = {}
    try:
        names = os.listdir(sys_node)
    except OSError:
        names = []
    for name in names:
        if name.startswith("node") and name[4:].isdigit():
            text = _read(os.path.join(sys_node, name, "cpulist"))
            if text:
                for c in parse_cpu_list(text):
                    node_of[c] = int(name[4:])
    out = []
    for c in cpus:
        top = os.path.join(sys_cpu, f"cpu{c}", "topology")
        core, pkg = _read(os.path.join(top, "core_id")), _read(os.path.join(top, "physical_package_id"))
        core_key = (int(pkg), int(core)) if core is not None and pkg is not None else (0, -1 - c)
        out.append(CpuInfo(c, node_of.get(c, 0), core_key))
    return out


def format_cpu_list(cpus: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 8]`` → ``"0-3,8"`` (sorted, ranges collapsed; ``""`` for none)."""
    s = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and s[j + 1] == s[j] + 1:
            j += 1
        parts.append(str(s[i]) if i == j else f"{s[i]}-{s[j]}")
        i = j + 1
    return ",".join(parts)


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,8"`` → ``[0, 1, 2, 3, 8]`` (sorted, duplicates dropped). Raises :class:`ConfigError` on anything that
    is not a comma-separated list of CPU ids and ``A-B`` ranges with A ≤ B, or on an empty list."""
    out: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise ConfigError(f"{text!r} is not a CPU list (like 0-3,8)") from None
        if a < 0 or b < a:
            raise ConfigError(f"{text!r} is not a CPU list (like 0-3,8): {part.strip()!r} is not a range A-B with "
                              "0 ≤ A ≤ B")
        out.update(range(a, b + 1))
    return sorted(out)
