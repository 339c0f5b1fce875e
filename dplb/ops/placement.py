"""Worker placement: which CPUs each worker and the router run on (``dplb launch``; docs/DESIGN.md §10).

Why: two vLLM CPU engines on one core starve each other (vLLM's auto-binding puts every engine's OpenMP threads on
the first NUMA node's cores, and its model runner busy-waits), and the router keeps sending to the frozen one.
Placement gives every worker its own cores; the router keeps cores of its own where the host has enough.

Contract
- ``--worker-cpus``: ``auto`` (the default for the vLLM engine), ``off`` (the default for the sim engine: it sleeps
  between simulated steps and burns no CPU, so pinning would only crowd it; nothing is pinned and the environment
  is passed on untouched), or one CPU list per worker separated by ``|`` (``0-3|4-7``: disjoint, within the CPUs
  this process may use). ``--router-cpus``: ``auto`` (the CPUs placement kept for the router), ``off``, or a list.
- ``auto`` on a CPU host (:func:`plan_placement`): CPUs are grouped into physical cores (SMT siblings together) and
  NUMA nodes; workers are spread over the nodes in order (each worker's cores on one node). The router gets the
  cores of nodes without a worker and, up to ``router_cores`` (one per router process), cores taken one at a time
  from the node with the most cores per worker, only while every worker there still gets one; the rest of each
  node is split into equal contiguous shares, and a remainder goes to the router too. Each vLLM CPU worker's
  ``VLLM_CPU_OMP_THREADS_BIND`` is one CPU per core of its share but the last core, which is kept for its API
  server and engine core (vLLM's own auto-binding keeps one the same way); a one-core share is all OpenMP.
- ``auto`` on a GPU host: a worker's home is the CPUs NVML reports near its GPUs (their NUMA node: the
  intersection over its group); workers with the same home split it as above. No OpenMP list (vLLM's CUDA
  platform does not read it).
- Too few cores: a vLLM CPU plan with fewer cores than workers on a node is refused (:class:`ConfigError` naming
  ``--num-workers`` and ``--worker-cpus off``): sharing is what made them starve. Elsewhere (GPU homes, the sim
  with ``--worker-cpus auto``) the workers of that node share its CPUs, said in the notes. A host with exactly one
  core per worker (2 cores, 2 workers) pins one core to each and leaves the router unpinned.
- Children are pinned with ``sched_setaffinity`` before ``exec`` (:meth:`Placement.preexec`), so the engine's
  processes and threads inherit the set; systemd units get it as ``CPUAffinity=``/``AllowedCPUs=`` drop-ins.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass

from dplb.errors import ConfigError
from dplb.runtime.cpus import CpuInfo, allowed_cpus, cpu_topology, format_cpu_list, parse_cpu_list

AUTO, OFF = "auto", "off"
OMP_ENV = "VLLM_CPU_OMP_THREADS_BIND"
Cpus = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Placement:
    """A placement plan: ``workers[k]`` = worker k's CPUs, ``omp[k]`` = its OpenMP CPUs (``VLLM_CPU_OMP_THREADS_BIND``)
    and ``router`` = the router's CPUs; an empty tuple means not pinned / not set. ``notes``: one-line remarks
    (what was shared or left unpinned, and why)."""

    workers: tuple[Cpus, ...]
    omp: tuple[Cpus, ...]
    router: Cpus = ()
    notes: tuple[str, ...] = ()

    def worker_env(self, k: int) -> dict[str, str]:
        """Environment worker ``k`` needs on top of the launcher's (the OpenMP binding of a vLLM CPU worker)."""
        return {OMP_ENV: format_cpu_list(self.omp[k])} if self.omp[k] else {}

    def describe(self) -> list[str]:
        """The plan for the launch banner: one line of workers and router, then the notes."""
        def one(k: int) -> str:
            if not self.workers[k]:
                return f"worker {k}: any"
            omp = f" (OpenMP {format_cpu_list(self.omp[k])})" if self.omp[k] and self.omp[k] != self.workers[k] else ""
            return f"worker {k}: {format_cpu_list(self.workers[k])}{omp}"
        router = format_cpu_list(self.router) if self.router else "any"
        if not self.router and not any(self.workers):
            return ["not pinned (--worker-cpus auto gives each worker its own cores)", *self.notes]
        return [", ".join(one(k) for k in range(len(self.workers))) + f"; router: {router}", *self.notes]


def preexec(cpus: Cpus, then: Callable[[], None]) -> Callable[[], None]:
    """A ``preexec_fn`` that runs ``then`` and, when ``cpus`` is not empty, pins the child to ``cpus`` before
    ``exec`` (every process and thread it starts inherits the set)."""
    if not cpus:
        return then

    def run() -> None:
        then()
        os.sched_setaffinity(0, cpus)
    return run


def _units(topology: list[CpuInfo]) -> dict[int, list[Cpus]]:
    """Physical cores (tuples of SMT siblings) per NUMA node, in node and core order."""
    cores: dict[tuple[int, tuple[int, int]], list[int]] = {}
    for c in topology:
        cores.setdefault((c.node, c.core), []).append(c.cpu)
    by_node: dict[int, list[Cpus]] = {}
    for (node, _), cpus in sorted(cores.items(), key=lambda kv: (kv[0][0], min(kv[1]))):
        by_node.setdefault(node, []).append(tuple(sorted(cpus)))
    return by_node


def _pools(topology: list[CpuInfo], num_workers: int,
           homes: list[Cpus] | None) -> tuple[list[tuple[list[Cpus], list[int]]], list[Cpus]]:
    """(pools, spare): each pool is (its cores, the workers placed in it); spare cores belong to no pool."""
    by_node = _units(topology)
    if homes is None:  # CPU host: workers spread over the NUMA nodes in order
        nodes = list(by_node)
        n = len(nodes)
        pools = [(by_node[node], [k for k in range(num_workers) if k * n // num_workers == j] if num_workers >= n
                  else ([j] if j < num_workers else [])) for j, node in enumerate(nodes)]
        return [p for p in pools if p[1]], [u for p in pools if not p[1] for u in p[0]]
    units = [u for node in by_node.values() for u in node]
    claimed: set[Cpus] = set()
    keyed: dict[Cpus, tuple[list[Cpus], list[int]]] = {}
    for k, home in enumerate(homes):
        if home not in keyed:
            mine = [u for u in units if u not in claimed and set(u) & set(home)]
            claimed.update(mine)
            keyed[home] = (mine, [])
        keyed[home][1].append(k)
    return list(keyed.values()), [u for u in units if u not in claimed]


def plan_placement(topology: list[CpuInfo], num_workers: int, *, router_cores: int = 1,
                   homes: list[Cpus] | None = None, strict: bool = False, omp: bool = False) -> Placement:
    """Place ``num_workers`` workers on the CPUs in ``topology`` (the allowed ones), as the module docstring says.

    ``homes``: per worker the CPUs it should run near (GPU hosts), None on a CPU host. ``strict``: refuse a plan
    in which workers would share a core (vLLM CPU workers). ``omp``: compute each worker's OpenMP list.
    Raises :class:`ConfigError` (strict and too few cores). Pure: the host is read by :func:`host_placement`.
    """
    if not topology:
        raise ConfigError("no CPU is available to this process; cannot place workers (pass --worker-cpus off)")
    pools, spare = _pools(topology, num_workers, homes)
    router: list[Cpus] = list(spare)  # cores of nodes without a worker
    notes: list[str] = []
    for _ in range(router_cores - len(router)):  # the pool with the most cores per worker gives one
        best = max(pools, key=lambda p: len(p[0]) / len(p[1]))
        if len(best[0]) <= len(best[1]):
            break
        router.append(best[0].pop())
    workers: list[list[Cpus]] = [[] for _ in range(num_workers)]
    for units, ks in pools:
        per = len(units) // len(ks)
        if not units:
            notes.append(f"workers {', '.join(map(str, ks))} not pinned: the CPUs near their GPUs went to others")
            continue
        if per == 0:
            have = format_cpu_list(c for u in units for c in u)
            if strict:
                raise ConfigError(
                    f"{len(ks)} vLLM CPU workers need a core each, but {len(units)} core(s) are available (CPUs "
                    f"{have}): pass --num-workers {len(units)}, or --worker-cpus off to let them share (they then "
                    "starve each other)")
            notes.append(f"workers {', '.join(map(str, ks))} share CPUs {have}: fewer cores than workers")
            for k in ks:
                workers[k] = list(units)
            continue
        for i, k in enumerate(ks):
            workers[k] = units[i * per:(i + 1) * per]
        router += units[len(ks) * per:]
    if not router:
        n = sum(len(p[0]) for p in pools)
        notes.append(f"router not pinned: {n} core(s), none left after one per worker")
    omp_lists = [_omp(w) if omp else () for w in workers]
    return Placement(tuple(tuple(sorted(c for u in w for c in u)) for w in workers), tuple(omp_lists),
                     tuple(sorted(c for u in router for c in u)), tuple(notes))


def _omp(units: list[Cpus]) -> Cpus:
    """One CPU per core, the last core kept for the API server and the engine core when there are two or more."""
    return tuple(u[0] for u in (units[:-1] if len(units) > 1 else units))


def parse_worker_cpus(text: str, num_workers: int, allowed: list[int]) -> list[Cpus]:
    """``--worker-cpus 0-3|4-7`` → one CPU tuple per worker. Raises :class:`ConfigError` when the count differs
    from ``num_workers``, a CPU is outside ``allowed`` or two workers share one."""
    parts = text.split("|")
    if len(parts) != num_workers:
        raise ConfigError(f"--worker-cpus {text!r} gives {len(parts)} CPU list(s) for {num_workers} worker(s); give "
                          "one per worker separated by '|', e.g. 0-3|4-7 (or auto, or off)")
    lists = [tuple(_within(p, allowed, "--worker-cpus")) for p in parts]
    seen: dict[int, int] = {}
    for k, cpus in enumerate(lists):
        for c in cpus:
            if c in seen:
                raise ConfigError(f"--worker-cpus {text!r}: workers {seen[c]} and {k} share CPU {c}; the lists must "
                                  "be disjoint (--worker-cpus off lets workers share)")
            seen[c] = k
    return lists


def _within(text: str, allowed: list[int], flag: str) -> list[int]:
    try:
        cpus = parse_cpu_list(text)
    except ConfigError as e:
        raise ConfigError(f"{flag}: {e}") from None
    outside = sorted(set(cpus) - set(allowed))
    if outside:
        raise ConfigError(f"{flag}: CPU(s) {format_cpu_list(outside)} not available to this process (allowed: "
                          f"{format_cpu_list(allowed)})")
    return cpus


def resolve(worker_spec: str | None, router_spec: str | None, *, engine: str, gpu_groups: list[list[int]],
            topology: list[CpuInfo], gpu_affinity: dict[int, list[int]], router_cores: int) -> Placement:
    """The placement for these flags and host facts (pure; see the module docstring for the rules).

    ``worker_spec``/``router_spec``: the flag values (None = the default); ``gpu_groups``: the GPU plan (one list
    per worker, empty on CPU); ``topology``: the allowed CPUs; ``gpu_affinity``: NVML's CPUs per GPU index.
    Raises :class:`ConfigError` with a one-line message for a bad value or an impossible plan."""
    n = len(gpu_groups)
    spec = worker_spec if worker_spec is not None else (AUTO if engine == "vllm" else OFF)
    allowed = [c.cpu for c in topology]
    cpu_vllm = engine == "vllm" and not any(gpu_groups)
    if spec == OFF:
        plan = Placement(tuple(() for _ in range(n)), tuple(() for _ in range(n)))
    elif spec == AUTO:
        homes = None if not any(gpu_groups) else [_home(g, gpu_affinity, allowed) for g in gpu_groups]
        plan = plan_placement(topology, n, router_cores=router_cores, homes=homes, strict=cpu_vllm, omp=cpu_vllm)
    else:
        lists = parse_worker_cpus(spec, n, allowed)
        rest = tuple(c for c in allowed if not any(c in w for w in lists))
        by_cpu = {c.cpu: c for c in topology}
        omp = [_omp([u for node in _units([by_cpu[c] for c in w]).values() for u in node]) if cpu_vllm else ()
               for w in lists]
        plan = Placement(tuple(lists), tuple(omp), rest)
    if router_spec in (None, AUTO):
        return plan
    router = () if router_spec == OFF else tuple(_within(router_spec, allowed, "--router-cpus"))
    return Placement(plan.workers, plan.omp, router, plan.notes)


def _home(group: list[int], affinity: dict[int, list[int]], allowed: list[int]) -> Cpus:
    """A GPU worker's home CPUs: those near all of its GPUs, within ``allowed`` (all allowed when NVML says
    nothing usable)."""
    near = set(allowed)
    for g in group:
        near &= set(affinity.get(g, allowed))
    return tuple(sorted(near)) or tuple(allowed)


def host_placement(args: argparse.Namespace, gpu_groups: list[list[int]], engine: str) -> Placement:
    """:func:`resolve` with this host's facts: the allowed CPUs and their topology (:mod:`dplb.runtime.cpus`) and,
    with GPUs and ``auto``, NVML's affinity (:func:`dplb.runtime.gpu.gpu_cpu_affinity`)."""
    topology = cpu_topology(allowed_cpus())
    spec = getattr(args, "worker_cpus", None)
    affinity: dict[int, list[int]] = {}
    if any(gpu_groups) and spec in (None, AUTO):
        from dplb.runtime.gpu import gpu_cpu_affinity

        affinity = gpu_cpu_affinity(sorted({g for grp in gpu_groups for g in grp}))
    return resolve(spec, getattr(args, "router_cpus", None), engine=engine, gpu_groups=gpu_groups,
                   topology=topology, gpu_affinity=affinity, router_cores=getattr(args, "router_processes", 1) or 1)


def add_placement_args(p: argparse.ArgumentParser) -> None:
    """``--worker-cpus`` and ``--router-cpus`` on ``dplb launch``."""
    p.add_argument("--worker-cpus", metavar="auto|off|LIST|LIST…",
                   help="CPUs per worker: auto (default with --model: a disjoint core set each, near its GPU's NUMA "
                   "node on GPU hosts), off (default for the sim engine: not pinned), or one list per worker, "
                   "e.g. 0-3|4-7")
    p.add_argument("--router-cpus", metavar="auto|off|LIST",
                   help="CPUs of the router: auto (default: the cores placement kept for it, if any), off, or a list")
