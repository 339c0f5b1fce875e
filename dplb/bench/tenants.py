"""The ``tenants`` scenario of ``dplb bench compare``: one tenant floods, another sends light interactive traffic,
with and without the router's fair queue (docs/DESIGN.md §11, §15).

Contract
- :func:`run_tenants` starts two fresh ``dplb launch`` sim clusters (the compare cluster shape of
  :mod:`dplb.bench.scenarios`): ``fifo`` (no tenants file: today's behaviour, the engines queue FIFO) and ``fair``
  (``--tenants`` with tenants A and B, equal weights, one priority class). Each runs two phases:
  1. *flood*: A keeps :data:`FLOOD_CONCURRENCY` requests of :data:`FLOOD_OUTPUT` tokens open (closed loop; the
     first one per batch slot staggered over one request's duration, so slots free evenly as in a flood that has
     run for a while), far over its half of the batch slots; after a warm-up of two request durations B
     sends Poisson arrivals at :data:`LIGHT_RATE` req/s of :data:`LIGHT_OUTPUT` tokens, streamed. Measured: B's
     TTFT P50/P99, the engines' generated tokens/s over B's window (the workers' ``vllm:generation_tokens_total``).
  2. *backlog*: A (96 open) and B (32 open) both keep more requests open than their half of the slots;
     measured: completion tokens each got over a window, and Jain's fairness index ``(Σx)² / (n·Σx²)`` of the two.
  B's TTFT alone (no A) is measured once on the fifo cluster first.
- The physical bound of B's TTFT under a flood: its solo TTFT P99 plus the wait for the next free batch slot —
  for each of B's arrivals, the time until the next request (A's or B's: together they hold every slot)
  completes that no earlier arrival of B took (:func:`next_slot_waits`), P99 over the arrivals, measured in the
  fair run. On average a slot frees every
  ``FLOOD_OUTPUT · step / slots`` seconds (``step`` = ``DECODE_STEP_S + DECODE_STEP_S_PER_SEQ · MAX_NUM_SEQS``;
  printed as ``slot_gap_ms``), but the slots' phases drift, so the P99 wait is several gaps.
- Priority modes (the flood phase only, on fresh clusters): B is class ``interactive``, A class ``batch``
  (:func:`priority_tenants_file`, ``[priorities] reserve`` = :data:`RESERVE` slots per worker held for
  ``interactive``), ``--engine-priority`` and the sims on ``--sim-scheduling-policy priority``:
  ``priority`` (one router process), ``priority-2proc`` (``--router-processes 2``) and ``priority-noreserve``
  (reserve 0: what the engine's priority scheduling alone gives, shown in the table for reference and not a
  target). Target of the modes with a reserve (:data:`TARGET_MODES`): B's TTFT P99 ≤ 3× its solo P99.
- Returns a compare entry: ``policies`` holds B's flood-phase summary per mode (the compare table's rows) and
  ``tenants`` the headline figures; :func:`tenant_targets` turns them into target rows.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

from dplb.bench.client import RequestResult, Target, run_workload
from dplb.bench.report import percentile, summarize
from dplb.bench.scenarios import DECODE_STEP_S, DECODE_STEP_S_PER_SEQ, MAX_NUM_SEQS, Scenario
from dplb.bench.workload import BenchRequest, WorkloadSpec, build_workload
from dplb.tenants import hash_key

FLOOD_CONCURRENCY = 96
FLOOD_OUTPUT = 200
LIGHT_RATE = 3.0
LIGHT_OUTPUT = 16
BACKLOG = {"A": 96, "B": 32}
BACKLOG_OUTPUT = 64
KEYS = {"A": "bench-tenant-a", "B": "bench-tenant-b"}
RESERVE = 2  # slots per worker: B's mean concurrency (3 req/s × ~0.7 s) is ~2 over 4 workers, P(> 8) < 0.1 %
PRIORITY_MODES = {"priority": (RESERVE, 1), "priority-2proc": (RESERVE, 2), "priority-noreserve": (0, 1)}
TARGET_MODES = ("priority", "priority-2proc")  # the reserve is DPLB's answer; without it is the reference row
FLOOD_REQUESTS = 1000  # more than a closed loop completes in a phase (it is cancelled at the phase's end)


def tenants_file(path: str) -> str:
    """Write the fair run's tenants file (A and B, equal weights, one class) at ``path``; returns it."""
    with open(path, "w") as f:
        for name, key in KEYS.items():
            f.write(f'[tenants.{name}]\napi_key_sha256 = ["{hash_key(key)}"]\nweight = 1.0\n\n')
    return path


def priority_tenants_file(path: str, reserve: int) -> str:
    """Write a priority run's tenants file at ``path``: B ``interactive``, A ``batch``, equal weights, ``reserve``
    slots per worker held for ``interactive``; returns it."""
    with open(path, "w") as f:
        f.write(f'[priorities]\norder = ["interactive", "batch"]\nreserve = {reserve}\n\n')
        for name, key in KEYS.items():
            cls = "interactive" if name == "B" else "batch"
            f.write(f'[tenants.{name}]\napi_key_sha256 = ["{hash_key(key)}"]\npriority = "{cls}"\n\n')
    return path


def _flood(n: int, output: int, stagger_s: float, slots: int, seed: int) -> list[BenchRequest]:
    """``n`` requests of ``output`` tokens: the first ``slots`` sent evenly over ``stagger_s`` (so the batch slots
    they take free up evenly, one every ``stagger_s / slots``, as in a long-running flood), the rest at its end."""
    reqs = build_workload(WorkloadSpec(num_prompts=n, input_len=32, output_len=output, seed=seed))
    for r in reqs:
        r.send_at_s = min(r.index, slots) * stagger_s / slots
    return reqs


def _generated(run_dir: str, workers: int, uds_get: Callable[[str, str], str]) -> float:
    total = 0.0
    for k in range(workers):
        for line in uds_get(os.path.join(run_dir, f"worker-{k}.sock"), "/metrics").splitlines():
            if line.startswith("vllm:generation_tokens_total"):
                total += float(line.rsplit(" ", 1)[1])
    return total


async def _closed_loop(target: Target, reqs: list[BenchRequest], concurrency: int,
                       done: list[tuple[float, RequestResult]]) -> None:
    """Send ``reqs`` with at most ``concurrency`` open; ``done`` gets (perf_counter at completion, result)."""
    await run_workload(target, reqs, max_concurrency=concurrency,
                       on_done=lambda r: done.append((time.perf_counter(), r)))


def next_slot_waits(arrivals: list[float], frees: list[float]) -> list[float]:
    """The least wait for a batch slot each arrival can have, seconds: arrivals in time order, each matched to the
    first slot that frees at or after it and that no earlier arrival took (``frees``: completion times of requests
    that held every slot; a freed slot admits one request). Serving the light tenant's requests in arrival order,
    each in the first slot it can have, is the least wait any scheduler can give them, so these waits are a lower
    bound. Arrivals left without a free slot are left out."""
    frees = sorted(frees)
    out = []
    j = 0
    for t in sorted(arrivals):
        j = bisect.bisect_left(frees, t, lo=j)
        if j >= len(frees):
            break
        out.append(frees[j] - t)
        j += 1
    return out


async def _phase_flood(url: str, run_dir: str, workers: int, n_light: int, seed: int, warm_s: float,
                       uds_get: Callable[[str, str], str]) -> dict[str, Any]:
    step = DECODE_STEP_S + DECODE_STEP_S_PER_SEQ * MAX_NUM_SEQS
    a = Target(url, "dplb-sim", "chat", stream=False, api_key=KEYS["A"])
    b = Target(url, "dplb-sim", "chat", stream=True, api_key=KEYS["B"])
    done: list[tuple[float, RequestResult]] = []
    slots = workers * MAX_NUM_SEQS
    reqs = _flood(FLOOD_REQUESTS, FLOOD_OUTPUT, FLOOD_OUTPUT * step, slots, seed)
    flood = asyncio.create_task(_closed_loop(a, reqs, FLOOD_CONCURRENCY, done))
    await asyncio.sleep(warm_s)
    light = build_workload(WorkloadSpec(num_prompts=n_light, input_len=16, output_len=LIGHT_OUTPUT,
                                        request_rate=LIGHT_RATE, seed=seed + 1))
    g0, t0 = await asyncio.to_thread(_generated, run_dir, workers, uds_get), time.perf_counter()
    results, wall = await run_workload(b, light)
    frees = [t for t, r in done if r.ok] + [t0 + r.start_s + r.e2e_s for r in results if r.ok and r.e2e_s]
    waits = next_slot_waits([t0 + r.start_s for r in results], frees)
    g1, t1 = await asyncio.to_thread(_generated, run_dir, workers, uds_get), time.perf_counter()
    flood.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await flood
    return {"light": results, "wall": wall, "tokens_per_s": (g1 - g0) / (t1 - t0),
            "flood_failed": sum(1 for _, r in done if not r.ok), "next_slot_waits": waits}


async def _phase_backlog(url: str, seed: int, warm_s: float, window_s: float) -> dict[str, float]:
    done: dict[str, list[tuple[float, RequestResult]]] = {"A": [], "B": []}
    t0 = time.perf_counter()
    tasks = [asyncio.create_task(_closed_loop(Target(url, "dplb-sim", "chat", stream=False, api_key=KEYS[t]),
                                              _flood(FLOOD_REQUESTS, BACKLOG_OUTPUT, 0.0, 1, seed + 2 + i), n, done[t]))
             for i, (t, n) in enumerate(BACKLOG.items())]
    await asyncio.sleep(warm_s + window_s)
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    lo, hi = t0 + warm_s, t0 + warm_s + window_s
    tokens = {t: float(sum(r.output_tokens for at, r in rs if r.ok and lo <= at <= hi)) for t, rs in done.items()}
    return tokens


def jain(xs: list[float]) -> float | None:
    """Jain's fairness index ``(Σx)² / (n·Σx²)`` (1 = equal shares; None without service)."""
    sq = sum(x * x for x in xs)
    return sum(xs) ** 2 / (len(xs) * sq) if sq else None


def _p99_ms(values: list[float]) -> float | None:
    return percentile(sorted(values), 99) * 1000 if values else None


def _ttft_p(results: list[RequestResult], q: float) -> float | None:
    vals = sorted(r.ttft_s for r in results if r.ok and r.ttft_s is not None)
    return percentile(vals, q) if vals else None


async def _one_mode(url: str, run_dir: str, num_workers: int, n_light: int, seed: int, solo: bool,
                    window_s: float, uds_get: Callable[[str, str], str],
                    ) -> tuple[list[RequestResult] | None, dict[str, Any], dict[str, float]]:
    """One cluster's phases: B alone (when ``solo``), the flood, the backlog."""
    alone = None
    if solo:
        reqs = build_workload(WorkloadSpec(num_prompts=max(20, n_light // 3), input_len=16, output_len=LIGHT_OUTPUT,
                                           request_rate=LIGHT_RATE, seed=seed + 1))
        alone, _ = await run_workload(Target(url, "dplb-sim", "chat", stream=True, api_key=KEYS["B"]), reqs)
    step = DECODE_STEP_S + DECODE_STEP_S_PER_SEQ * MAX_NUM_SEQS
    flood = await _phase_flood(url, run_dir, num_workers, n_light, seed, FLOOD_OUTPUT * step * 2, uds_get)
    backlog = await _phase_backlog(url, seed, BACKLOG_OUTPUT * step * 3, window_s)
    return alone, flood, backlog


def run_tenants(sc: Scenario, flags: list[str], *, num_workers: int, quick: bool, seed: int, workdir: str,
                progress: Callable[[str], None], cluster: Any, ready: Callable[[str], bool],
                uds_get: Callable[[str, str], str]) -> dict[str, Any]:
    """Both modes of the scenario (module docstring); ``flags``: the first policy's launch flags; ``cluster``,
    ``ready``, ``uds_get``: compare's sim cluster, its router readiness check and its worker-socket GET."""
    n_light = sc.quick_prompts if quick else sc.full_prompts
    window_s = 15.0 if quick else 40.0
    tf = tenants_file(os.path.join(workdir, "tenants.toml"))
    policies: dict[str, Any] = {}
    figures: dict[str, Any] = {}
    for mode, extra in (("fifo", []), ("fair", ["--tenants", tf])):
        t = time.monotonic()
        with cluster(num_workers, sc, [*flags, *extra], workdir) as c:
            while not ready(c.url):
                time.sleep(0.05)
            solo, flood, backlog = asyncio.run(_one_mode(c.url, c.run_dir, num_workers, n_light, seed,
                                                         mode == "fifo", window_s, uds_get))
        if solo is not None:
            figures["solo_ttft_p99_ms"] = (_ttft_p(solo, 99) or 0) * 1000
        light = flood["light"]
        summary = summarize(light, flood["wall"], workers=[str(k) for k in range(num_workers)])
        summary.update(label=mode, policy_flags=[*flags, *extra])
        policies[mode] = summary
        f = figures[mode] = {"b_ttft_p50_ms": (_ttft_p(light, 50) or 0) * 1000,
                             "b_ttft_p99_ms": (_ttft_p(light, 99) or 0) * 1000,
                             "tokens_per_s": flood["tokens_per_s"], "flood_failed": flood["flood_failed"],
                             "backlog_tokens": backlog, "jain": jain(list(backlog.values())),
                             "next_slot_wait_p99_ms": _p99_ms(flood["next_slot_waits"])}
        progress(f"tenants        {mode:14s} B TTFT P99 {f['b_ttft_p99_ms']:8.0f} ms  {f['tokens_per_s']:6.0f} tok/s  "
                 f"Jain {f['jain'] or 0:.3f}  ({time.monotonic() - t:.0f} s)")
    _headline(figures, num_workers)
    _priority_modes(policies, figures, flags, num_workers, n_light, seed, workdir, progress,
                    lambda f: cluster(num_workers, sc, f, workdir), ready, uds_get)
    return {"description": sc.description, "workload": {
        "flood": {"tenant": "A", "concurrency": FLOOD_CONCURRENCY, "output_tokens": FLOOD_OUTPUT, "stream": False},
        "light": {"tenant": "B", "rate_rps": LIGHT_RATE, "output_tokens": LIGHT_OUTPUT, "requests": n_light,
                  "stream": True},
        "backlog": {"concurrency": BACKLOG, "output_tokens": BACKLOG_OUTPUT, "window_s": window_s}},
        "policies": policies, "tenants": figures}


def _priority_modes(policies: dict[str, Any], figures: dict[str, Any], flags: list[str], num_workers: int,
                    n_light: int, seed: int, workdir: str, progress: Callable[[str], None],
                    cluster: Callable[[list[str]], Any], ready: Callable[[str], bool],
                    uds_get: Callable[[str, str], str]) -> None:
    """The priority modes (module docstring): B's flood-phase summary into ``policies``, figures into
    ``figures`` (which holds ``solo_ttft_p99_ms`` already)."""
    for mode, (reserve, procs) in PRIORITY_MODES.items():
        t = time.monotonic()
        ptf = priority_tenants_file(os.path.join(workdir, f"tenants-{mode}.toml"), reserve)
        extra = ["--tenants", ptf, "--engine-priority", "--sim-scheduling-policy", "priority",
                 "--router-processes", str(procs)]
        with cluster([*flags, *extra]) as c:
            while not ready(c.url):
                time.sleep(0.05)
            step = DECODE_STEP_S + DECODE_STEP_S_PER_SEQ * MAX_NUM_SEQS
            flood = asyncio.run(_phase_flood(c.url, c.run_dir, num_workers, n_light, seed, FLOOD_OUTPUT * step * 2,
                                             uds_get))
        light = flood["light"]
        summary = summarize(light, flood["wall"], workers=[str(k) for k in range(num_workers)])
        summary.update(label=mode, policy_flags=[*flags, *extra])
        policies[mode] = summary
        p99 = (_ttft_p(light, 99) or 0) * 1000
        f = figures[mode] = {"b_ttft_p50_ms": (_ttft_p(light, 50) or 0) * 1000, "b_ttft_p99_ms": p99,
                             "tokens_per_s": flood["tokens_per_s"], "flood_failed": flood["flood_failed"],
                             "reserve": reserve, "router_processes": procs,
                             "b_p99_vs_solo": p99 / figures["solo_ttft_p99_ms"] if figures["solo_ttft_p99_ms"]
                             else None}
        progress(f"tenants        {mode:18s} B TTFT P99 {p99:8.0f} ms  {f['tokens_per_s']:6.0f} tok/s  "
                 f"({time.monotonic() - t:.0f} s)")


def _headline(figures: dict[str, Any], num_workers: int) -> None:
    """The physical bound and the ratios (module docstring), added to ``figures``."""
    step = DECODE_STEP_S + DECODE_STEP_S_PER_SEQ * MAX_NUM_SEQS
    fifo, fair = figures["fifo"], figures["fair"]
    gap_ms = FLOOD_OUTPUT * step / (num_workers * MAX_NUM_SEQS) * 1000
    figures["slot_gap_ms"] = gap_ms  # one slot frees this often on average
    # The wait for the next free slot no earlier arrival took, P99 over B's arrivals as measured in the fair run
    # (the slots' phases drift, so it is closer to an exponential's ln(100) x the mean gap than to the gap itself),
    # plus B's own solo TTFT.
    measured = fair["next_slot_wait_p99_ms"]
    figures["physical_bound_ms"] = figures["solo_ttft_p99_ms"] + (measured if measured is not None else gap_ms)
    figures["b_p99_fair_vs_fifo"] = fair["b_ttft_p99_ms"] / fifo["b_ttft_p99_ms"] if fifo["b_ttft_p99_ms"] else None
    figures["b_p99_fair_vs_bound"] = fair["b_ttft_p99_ms"] / figures["physical_bound_ms"]
    figures["throughput_fair_vs_fifo"] = fair["tokens_per_s"] / fifo["tokens_per_s"] if fifo["tokens_per_s"] else None


def tenant_targets(entry: dict[str, Any]) -> list[tuple[str, float | None, float, bool]]:
    """(target, value, limit, higher is better) rows of the scenario's figures."""
    f = entry["tenants"]
    return [
        ("B's TTFT P99 fair / FIFO ≤ 0.1", f["b_p99_fair_vs_fifo"], 0.1, False),
        (f"B's TTFT P99 fair / physical bound ({f['physical_bound_ms']:.0f} ms) ≤ 2", f["b_p99_fair_vs_bound"], 2.0,
         False),
        ("throughput fair / FIFO ≥ 0.95", f["throughput_fair_vs_fifo"], 0.95, True),
        ("Jain's index of served tokens, both backlogged, equal weights ≥ 0.95", f["fair"]["jain"], 0.95, True),
        *((f"two classes ({m}): B's TTFT P99 / solo ≤ 3", f[m]["b_p99_vs_solo"], 3.0, False)
          for m in TARGET_MODES if m in f),
    ]


__all__ = ["jain", "priority_tenants_file", "run_tenants", "tenant_targets", "tenants_file"]
