"""Figures of one benchmark run: latency percentiles, throughput, errors, per-worker share.

Contract
- :func:`summarize` turns a list of :class:`~dplb.bench.client.RequestResult` into a plain-JSON dict (the
  ``--output`` file's ``summary``): ``ttft_ms``, ``itl_ms``, ``tpot_ms``, ``e2e_ms`` (each ``mean``, ``p50``,
  ``p95``, ``p99``, ``max``, ``n``), ``requests_per_s``, ``output_tokens_per_s``, ``completed``, ``failed``,
  ``errors_by_status``, ``worker_share`` (fraction 0–1 of all answered requests per ``X-SG-Worker-ID``),
  ``worker_share_max_min`` (max/min request count over workers; inf when a worker got none of ≥ 2),
  ``worker_over_time`` (requests started per worker per ``bucket_s`` window) and ``prefix_worker_spread`` (mean
  number of distinct workers a shared prefix was sent to). Latencies are over successful requests only.
- Percentiles: linear interpolation between closest ranks (numpy's default, as vLLM's benchmark_serving).
- :func:`format_summary` renders the summary as a rich table for the terminal.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence

from dplb.bench.client import RequestResult


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0–100) of ascending ``sorted_values`` by linear interpolation; nan when empty."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def distribution_ms(values_s: Sequence[float]) -> dict[str, float]:
    """``{mean, p50, p95, p99, max, n}`` of ``values_s`` (seconds), in milliseconds (n is a count)."""
    v = sorted(x * 1000.0 for x in values_s)
    if not v:
        return {"mean": math.nan, "p50": math.nan, "p95": math.nan, "p99": math.nan, "max": math.nan, "n": 0}
    return {"mean": sum(v) / len(v), "p50": percentile(v, 50), "p95": percentile(v, 95),
            "p99": percentile(v, 99), "max": v[-1], "n": len(v)}


def summarize(results: Sequence[RequestResult], wall_s: float, *, bucket_s: float = 1.0,
              workers: Sequence[str] = ()) -> dict[str, object]:
    """The summary dict described in the module docstring. ``workers``: ids expected to answer (so a worker that
    got nothing counts in the share as 0); others are added as seen."""
    ok = [r for r in results if r.ok]
    errors = Counter(str(r.status) for r in results if not r.ok)
    counts: Counter[str] = Counter({w: 0 for w in workers})
    counts.update(r.worker for r in results if r.worker is not None)
    answered = sum(counts.values())
    share = {w: (c / answered if answered else 0.0) for w, c in sorted(counts.items(), key=lambda kv: _wkey(kv[0]))}
    nonzero_min = min(counts.values()) if counts else 0
    max_min = (max(counts.values()) / nonzero_min if nonzero_min else math.inf) if len(counts) >= 2 else 1.0
    over_time: dict[str, list[int]] = defaultdict(list)
    nb = int(max((r.start_s for r in results), default=0.0) // bucket_s) + 1
    for w in counts:
        over_time[w] = [0] * nb
    for r in results:
        if r.worker is not None:
            over_time[r.worker][int(r.start_s // bucket_s)] += 1
    spread: dict[int, set[str]] = defaultdict(set)
    for r in ok:
        if r.prefix_id >= 0 and r.worker is not None:
            spread[r.prefix_id].add(r.worker)
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "errors_by_status": dict(errors),
        "duration_s": wall_s,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else math.nan,
        "output_tokens_per_s": out_tokens / wall_s if wall_s > 0 else math.nan,
        "output_tokens": out_tokens,
        "ttft_ms": distribution_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_ms": distribution_ms([x for r in ok for x in r.itl_s]),
        "tpot_ms": distribution_ms([t for r in ok if (t := r.tpot_s) is not None]),
        "e2e_ms": distribution_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
        "worker_requests": dict(sorted(counts.items(), key=lambda kv: _wkey(kv[0]))),
        "worker_share": share,
        "worker_share_max_min": max_min,
        "worker_over_time": {"bucket_s": bucket_s,
                             "counts": dict(sorted(over_time.items(), key=lambda kv: _wkey(kv[0])))},
        "prefix_worker_spread": (sum(len(s) for s in spread.values()) / len(spread)) if spread else None,
    }


def _wkey(w: str) -> tuple[int, str]:
    return (int(w), "") if w.isdigit() else (1 << 30, w)


def first_errors(results: Sequence[RequestResult], limit: int = 3) -> list[str]:
    """Up to ``limit`` distinct error messages ("status: message"), for the terminal."""
    seen: list[str] = []
    for r in results:
        if not r.ok:
            msg = f"{r.status}: {r.error}"
            if msg not in seen:
                seen.append(msg)
            if len(seen) >= limit:
                break
    return seen


def format_summary(summary: dict, title: str = "dplb bench run") -> object:
    """A rich renderable (tables) of :func:`summarize`'s dict."""
    from rich.console import Group
    from rich.table import Table

    t = Table(title=title, show_header=True)
    t.add_column("metric")
    for col in ("mean", "P50", "P95", "P99", "max"):
        t.add_column(col, justify="right")
    for key, label in (("ttft_ms", "TTFT ms"), ("itl_ms", "ITL ms"), ("tpot_ms", "TPOT ms"), ("e2e_ms", "E2E ms")):
        d = summary[key]
        t.add_row(label, *(f"{d[c]:.1f}" for c in ("mean", "p50", "p95", "p99", "max")))
    s = Table(show_header=False)
    s.add_column("k")
    s.add_column("v", justify="right")
    s.add_row("completed / failed", f"{summary['completed']} / {summary['failed']}")
    if summary["errors_by_status"]:
        s.add_row("errors by status", ", ".join(f"{k}: {v}" for k, v in summary["errors_by_status"].items()))
    s.add_row("duration s", f"{summary['duration_s']:.1f}")
    s.add_row("requests/s", f"{summary['requests_per_s']:.2f}")
    s.add_row("output tokens/s", f"{summary['output_tokens_per_s']:.1f}")
    if summary["worker_share"]:
        s.add_row("per-worker share", "  ".join(f"{w}: {v:.0%}" for w, v in summary["worker_share"].items()))
        s.add_row("per-worker max/min", f"{summary['worker_share_max_min']:.2f}")
    return Group(t, s)
