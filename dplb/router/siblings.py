"""One answer for a router group: ``/metrics`` and ``/debug/decisions`` merged over its processes (issue 14).

With ``--processes N`` a scrape lands on any one process (``SO_REUSEPORT``). That process asks each sibling over
its private socket (:meth:`dplb.config.RouterConfig.process_socket`, ``?scope=process``: that process alone) and
merges:

- Metrics (:func:`merge_metrics`; the rules are :data:`dplb.metrics.GROUP_SUMMED_GAUGES` and its neighbours):
  counters and histograms of each process's own work are summed sample by sample (``_created``: the oldest), so
  nothing is counted twice or lost; per-process resources (RSS, open fds, CPU seconds, prefix-index size) are
  summed; the per-worker figures derived from shm are the answering process's own — every process computes them
  from the same segment and the same router slots, so they already describe the whole group. A sibling that does
  not answer within :data:`FETCH_TIMEOUT_S` is left out and ``dplb_router_processes{state="answered"}`` says so.
  A restarted process starts its counters at 0: the group's sums drop by its share (Prometheus' ``rate()``
  reads that as a counter reset).
- Decisions (:func:`merge_decisions`): every process's ring, each entry labelled ``process``, newest first.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Iterator
from typing import Any

import aiohttp
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from dplb.config import RouterConfig
from dplb.metrics import GROUP_LOCAL, GROUP_MIN, GROUP_SUMMED_GAUGES, ROUTER_PROCESSES

FETCH_TIMEOUT_S = 2.0
SCOPE_PROCESS = "process"  # ?scope=process: this process alone (what siblings ask each other)


async def fetch_siblings(cfg: RouterConfig, path: str) -> dict[int, bytes | None]:
    """GET ``path`` (with ``scope=process``) from every other process of the group over its private socket.
    Returns process index → body, None for a process that did not answer 200 in time."""
    headers = {"authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    sep = "&" if "?" in path else "?"

    async def one(i: int) -> bytes | None:
        try:
            conn = aiohttp.UnixConnector(path=cfg.process_socket(i))
            timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S)
            async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s, \
                    s.get(f"http://router{path}{sep}scope={SCOPE_PROCESS}", headers=headers) as r:
                return await r.read() if r.status == 200 else None
        except (TimeoutError, aiohttp.ClientError, OSError):
            return None

    others = [i for i in range(cfg.processes) if i != cfg.process_index]
    bodies = await asyncio.gather(*(one(i) for i in others))
    return dict(zip(others, bodies, strict=True))


def _rule(family: Metric) -> str:
    """How a family merges over the group: "sum", "min" or "local" (module docstring)."""
    if family.name in GROUP_LOCAL:
        return "local"
    if family.type in ("counter", "histogram", "summary") or family.name in GROUP_SUMMED_GAUGES:
        return "sum"
    return "min" if family.name in GROUP_MIN else "local"


def _key(s: Sample) -> tuple[str, tuple[tuple[str, str], ...]]:
    return s.name, tuple(sorted(s.labels.items()))


class _Merged:
    """A collector over already-merged families (what ``generate_latest`` takes)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def merge_metrics(local: Iterable[Metric], siblings: dict[int, bytes | None], processes: int) -> _Merged:
    """Merge this process's families (``registry.collect()``) with the siblings' text expositions (module
    docstring). Exemplars of this process's samples are kept. Returns an object for ``generate_latest``."""
    theirs: dict[tuple[str, tuple[tuple[str, str], ...]], list[float]] = {}
    by_family: dict[str, list[Sample]] = {}
    for body in siblings.values():
        if body is None:
            continue
        for fam in text_string_to_metric_families(body.decode(errors="replace")):
            for s in fam.samples:
                theirs.setdefault(_key(s), []).append(s.value)
                by_family.setdefault(fam.name.removesuffix("_created"), []).append(s)
    out: list[Metric] = []
    for fam in local:
        rule = _rule(fam)
        if rule == "local":
            out.append(fam)
            continue
        merged = Metric(fam.name, fam.documentation, fam.type, fam.unit)
        seen = set()
        for s in fam.samples:
            k = _key(s)
            seen.add(k)
            vals = theirs.get(k, [])
            v = min([s.value, *vals]) if rule == "min" or s.name.endswith("_created") else s.value + sum(vals)
            merged.samples.append(Sample(s.name, s.labels, v, s.timestamp, s.exemplar))
        for s in by_family.get(fam.name, ()):  # label sets only siblings have (a status only they served)
            k = _key(s)
            if k in seen:
                continue
            seen.add(k)
            vals = theirs[k]
            v = min(vals) if rule == "min" or s.name.endswith("_created") else sum(vals)
            merged.samples.append(Sample(s.name, s.labels, v))
        out.append(merged)
    out.append(processes_family(processes, 1 + sum(1 for b in siblings.values() if b is not None)))
    return _Merged(out)


def processes_family(configured: int, answered: int) -> GaugeMetricFamily:
    """``dplb_router_processes{state="configured"|"answered"}`` (a single-process router exports 1 and 1)."""
    g = GaugeMetricFamily(ROUTER_PROCESSES, "Router processes of this group: configured (--processes) and those "
                          "whose metrics this answer merges (answered).", labels=["state"])
    g.add_metric(["configured"], configured)
    g.add_metric(["answered"], answered)
    return g


class SingleProcess:
    """Collector of :func:`processes_family` for a router without siblings."""

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield processes_family(1, 1)


def merge_decisions(local: list[dict[str, Any]], index: int, siblings: dict[int, bytes | None],
                    limit: int) -> list[dict[str, Any]]:
    """This process's decisions and the siblings' (JSON lists from ``/debug/decisions``), each labelled with its
    ``process`` index, newest first, at most ``limit``."""
    items = [{**d, "process": index} for d in local]
    for i, body in siblings.items():
        if body is None:
            continue
        try:
            items += [{**d, "process": i} for d in json.loads(body)]
        except (ValueError, TypeError):
            continue
    items.sort(key=lambda d: d.get("time", 0.0), reverse=True)
    return items[:limit]
