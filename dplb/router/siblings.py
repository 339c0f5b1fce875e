"""One answer for a router group: ``/metrics`` and ``/debug/decisions`` merged over its processes (docs/DESIGN.md §7).

With ``--processes N`` a scrape lands on any one process (``SO_REUSEPORT``). That process asks each sibling over
its private socket (:meth:`dplb.config.RouterConfig.process_socket`, ``?scope=process``: that process alone) and
merges:

- Metrics (:func:`merge_metrics`; the rule is :data:`dplb.obs.metrics.GROUP_SHARED`): the per-worker figures every
  process derives from the same shm segment and router slots, and the settings, are the answering process's own
  view, once. Everything a process owns — its counters and histograms, ``process_*`` resources, its latency
  baseline and prefix-index copy — is one series per process with a ``process`` label: nothing is summed twice, and
  a restarted process resets only its own series, which ``rate()`` handles (a summed series would drop by that
  process's share and ``rate()`` would count the survivors' whole history again). Samples are grouped by label set
  so the OpenMetrics output stays valid. A sibling that does not answer within :data:`FETCH_TIMEOUT_S` is left out
  and ``dplb_router_processes{state="answered"}`` says so.
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
from dplb.obs.metrics import GROUP_SHARED, ROUTER_PROCESSES

FETCH_TIMEOUT_S = 2.0
SCOPE_PROCESS = "process"  # ?scope=process: this process alone (what siblings ask each other)


async def fetch_siblings(cfg: RouterConfig, path: str, authorization: str | None = None) -> dict[int, bytes | None]:
    """GET ``path`` (with ``scope=process``) from every other process of the group over its private socket, with
    ``authorization`` (the ``Authorization`` header of the request being answered: the siblings load the same
    keys — ``--api-key`` and the tenants file — so a request this process let in is let in there too), else
    ``--api-key``'s. Returns process index → body, None for a process that did not answer 200 in time."""
    headers = {"authorization": authorization} if authorization else \
        {"authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
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


def _group_key(s: Sample) -> tuple[tuple[str, str], ...]:
    """A sample's label set without ``le``: the samples of one labelled child (total + created, or buckets + count
    + sum + created) share it and must stay together."""
    return tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))


class _Merged:
    """A collector over already-merged families (what ``generate_latest`` takes)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def merge_metrics(local: Iterable[Metric], index: int, siblings: dict[int, bytes | None], processes: int) -> _Merged:
    """Merge this process's families (``registry.collect()``; it is process ``index``) with the siblings' text
    expositions (module docstring). Exemplars of this process's samples are kept. Returns an object for
    ``generate_latest``."""
    theirs: dict[str, list[Sample]] = {}  # family name → siblings' samples, each with its process label
    for i, body in sorted(siblings.items()):
        if body is None:
            continue
        for fam in text_string_to_metric_families(body.decode(errors="replace")):
            tag = str(i)
            theirs.setdefault(fam.name.removesuffix("_created"), []).extend(
                Sample(s.name, {**s.labels, "process": tag}, s.value, s.timestamp) for s in fam.samples)
    out: list[Metric] = []
    own = str(index)
    for fam in local:
        if fam.name in GROUP_SHARED:
            out.append(fam)
            continue
        merged = Metric(fam.name, fam.documentation, fam.type, fam.unit)
        samples = [Sample(s.name, {**s.labels, "process": own}, s.value, s.timestamp, s.exemplar)
                   for s in fam.samples]
        samples += theirs.get(fam.name, ())
        samples.sort(key=_group_key)  # stable: a child's samples keep their order, children stay together
        merged.samples = samples
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
            items += [{**d, "process": i} for d in json.loads(body)]  # (they say so too; the index is ours)
        except (ValueError, TypeError):
            continue
    items.sort(key=lambda d: d.get("time", 0.0), reverse=True)
    return items[:limit]
