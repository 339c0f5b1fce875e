"""PNG plots of benchmark results (matplotlib, headless ``Agg`` backend; install the ``bench`` extra).

Contract
- :func:`plot_run` writes ``latency_cdf.png`` (E2E and TTFT CDFs) and ``worker_load.png`` (requests started per
  worker per bucket) for one run into ``out_dir``; :func:`plot_compare` writes one ``<scenario>_e2e_cdf.png`` per
  scenario with one CDF per policy, and ``<scenario>_<policy>_worker_load.png``. Both return the written paths.
- Raises :class:`~dplb.errors.ConfigError` when matplotlib is missing (with the install command).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from dplb.bench.client import RequestResult
from dplb.errors import ConfigError


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ConfigError("--plot needs matplotlib: pip install 'dplb[bench]' (or pip install matplotlib)") from e
    return plt


def require_matplotlib() -> None:
    """Raise :class:`ConfigError` (with the install command) now if matplotlib is missing, before a long run."""
    _pyplot()


def _cdf(ax: Any, values_s: Sequence[float], label: str) -> None:
    v = sorted(x * 1000.0 for x in values_s)
    if v:
        ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=label)


def _worker_load(plt: Any, summary: dict, title: str, path: str) -> str:
    fig, ax = plt.subplots(figsize=(8, 4))
    ot = summary["worker_over_time"]
    for w, counts in ot["counts"].items():
        ax.plot([i * ot["bucket_s"] for i in range(len(counts))], counts, label=f"worker {w}", drawstyle="steps-post")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel(f"requests started per {ot['bucket_s']:g} s")
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_run(results: Sequence[RequestResult], summary: dict, out_dir: str, title: str = "") -> list[str]:
    """Latency CDFs and per-worker load over time of one run; returns the PNG paths."""
    plt = _pyplot()
    os.makedirs(out_dir, exist_ok=True)
    ok = [r for r in results if r.ok]
    fig, ax = plt.subplots(figsize=(8, 4))
    _cdf(ax, [r.e2e_s for r in ok if r.e2e_s is not None], "E2E")
    _cdf(ax, [r.ttft_s for r in ok if r.ttft_s is not None], "TTFT")
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title or "latency CDF")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    cdf = os.path.join(out_dir, "latency_cdf.png")
    fig.savefig(cdf, dpi=100)
    plt.close(fig)
    return [cdf, _worker_load(plt, summary, title or "per-worker load", os.path.join(out_dir, "worker_load.png"))]


def plot_compare(runs: dict[str, dict[str, tuple[list[RequestResult], dict]]], out_dir: str) -> list[str]:
    """``runs[scenario][policy] = (results, summary)`` → one E2E CDF per scenario (a line per policy) and one
    per-worker load plot per scenario and policy. Returns the PNG paths."""
    plt = _pyplot()
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for scenario, by_policy in runs.items():
        fig, ax = plt.subplots(figsize=(8, 4))
        for policy, (results, _summary) in by_policy.items():
            _cdf(ax, [r.e2e_s for r in results if r.ok and r.e2e_s is not None], policy)
        ax.set_xlabel("E2E latency (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{scenario}: E2E latency CDF by policy")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = os.path.join(out_dir, f"{scenario}_e2e_cdf.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
        for policy, (_results, summary) in by_policy.items():
            paths.append(_worker_load(plt, summary, f"{scenario} / {policy}: requests per worker",
                                      os.path.join(out_dir, f"{scenario}_{policy}_worker_load.png")))
    return paths
