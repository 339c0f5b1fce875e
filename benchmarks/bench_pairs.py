"""Alternated runs of one `dplb bench compare` scenario, to tell a policy difference from run-to-run noise.

Usage:
  python benchmarks/bench_pairs.py run --scenario multi-turn-slow --seed 1 [--full] --order sent,ev,sent,ev \\
      --jsonl OUT.jsonl
  python benchmarks/bench_pairs.py summary OUT.jsonl [MORE.jsonl ...]

``run`` starts a fresh sim cluster per entry of ``--order`` (``dplb.bench.compare.run_one``: the same seeded
workload, warm-up and figures as ``dplb bench compare``, without the scenario's extra reference policies) and
appends one JSON line per run: P99/P50 E2E and TTFT (ms), engine prefix-cache hit rate, prediction error (tokens per
request), per-worker max/min share, wall time (s) and the box's 1-minute load average. Labels: ``ev`` (the default
policy, index fed by the engines' KV events), ``sent`` (``--scorer-param prefix.truth=sent``), ``oracle`` (the sim
oracle of the cache-pressure scenarios).

``summary`` pairs the i-th ``sent`` run of a (scenario, seed, size) with its i-th ``ev`` run and prints, per seed and
over all seeds, the ratio sent ÷ ev of P99 E2E and TTFT (below 1: the events-fed default is slower) beside the
same-policy ratios (the i-th run of a label ÷ its first: the noise floor of the same code on the same seed), within
each ``--set`` tag.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any

from dplb.bench.compare import run_one
from dplb.bench.scenarios import CACHE_PRESSURE_VARIANTS, SCENARIOS

FLAGS = {"ev": ["--policy", "dplb"], "sent": shlex.split(CACHE_PRESSURE_VARIANTS["dplb-sent"]),
         "oracle": shlex.split(CACHE_PRESSURE_VARIANTS["oracle"])}


def run(args: argparse.Namespace) -> None:
    labels = args.order.split(",")
    for lab in labels:
        if lab not in FLAGS:
            sys.exit(f"--order: unknown label {lab!r}; choose from {', '.join(FLAGS)}")
    with tempfile.TemporaryDirectory(prefix="dplb-pairs-") as wd:
        for i, lab in enumerate(labels):
            t = time.monotonic()
            _, s = run_one(SCENARIOS[args.scenario], lab, FLAGS[lab], num_workers=args.workers, quick=not args.full,
                           seed=args.seed, workdir=wd)
            with open("/proc/loadavg") as f:
                load = float(f.read().split()[0])
            rec = {"scenario": args.scenario, "seed": args.seed, "quick": not args.full, "run": i, "label": lab,
                   "e2e_p99": s["e2e_ms"]["p99"], "ttft_p99": s["ttft_ms"]["p99"], "e2e_p50": s["e2e_ms"]["p50"],
                   "ttft_p50": s["ttft_ms"]["p50"], "failed": s["failed"], "hit": s.get("prefix_cache_hit_rate"),
                   "pred_err": s.get("prediction_error_tokens"), "share_max_min": s.get("worker_share_max_min"),
                   "wall_s": time.monotonic() - t, "load": load, "set": args.set}
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(rec) + "\n")
            print(json.dumps(rec), flush=True)


def _fmt(xs: list[float], digits: int = 0) -> str:
    return " / ".join(f"{x:.{digits}f}" for x in xs) or "–"


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}–{max(xs):.2f})" if xs else "–"


def summary(paths: list[str]) -> None:
    groups: dict[tuple[str, str, int, str], list[dict[str, Any]]] = defaultdict(list)
    for p in paths:
        with open(p) as f:
            for line in f:
                r = json.loads(line)
                groups[(r["scenario"], "quick" if r["quick"] else "full", r["seed"], r.get("set", ""))].append(r)
    total: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    print("| scenario | size | seed | order | E2E P99 ev | E2E P99 sent | sent ÷ ev | TTFT P99 ev | TTFT P99 sent "
          "| sent ÷ ev | same-policy E2E (ev; sent) | same-policy TTFT (ev; sent) |")
    print("|---|---|---:|---|---|---|---|---|---|---|---|---|")
    for (sc, size, seed, run_set), rs in sorted(groups.items()):
        ev = [r for r in rs if r["label"] == "ev"]
        se = [r for r in rs if r["label"] == "sent"]
        if not ev or not se:
            continue
        row = [sc, size, f"{seed}{' ' + run_set if run_set else ''}", "".join(r["label"][0].upper() for r in rs)]
        agg = total[(sc, size)]
        same_policy = []
        for key in ("e2e_p99", "ttft_p99"):
            ratio = [s[key] / e[key] for e, s in zip(ev, se, strict=False)]
            noise_ev = [r[key] / ev[0][key] for r in ev[1:]]
            noise_se = [r[key] / se[0][key] for r in se[1:]]
            agg[key] += ratio
            agg[key + "_noise"] += noise_ev + noise_se
            agg[key + "_ev"] += [r[key] for r in ev]
            agg[key + "_sent"] += [r[key] for r in se]
            row += [_fmt([r[key] for r in ev]), _fmt([r[key] for r in se]), _fmt(ratio, 2)]
            same_policy.append(f"{_fmt(noise_ev, 2)}; {_fmt(noise_se, 2)}")
        row += same_policy
        print("| " + " | ".join(row) + " |")
    print()
    print("| scenario | size | pairs | sent ÷ ev E2E P99: median (range) | same-policy E2E P99 | sent ÷ ev TTFT P99 "
          "| same-policy TTFT P99 | median E2E P99 ev / sent (ms) | median TTFT P99 ev / sent (ms) |")
    print("|---|---|---:|---|---|---|---|---|---|")
    for (sc, size), a in sorted(total.items()):
        med = statistics.median
        print(f"| {sc} | {size} | {len(a['e2e_p99'])} | {_spread(a['e2e_p99'])} | {_spread(a['e2e_p99_noise'])} | "
              f"{_spread(a['ttft_p99'])} | {_spread(a['ttft_p99_noise'])} | "
              f"{med(a['e2e_p99_ev']):.0f} / {med(a['e2e_p99_sent']):.0f} | "
              f"{med(a['ttft_p99_ev']):.0f} / {med(a['ttft_p99_sent']):.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--scenario", required=True, choices=sorted(SCENARIOS))
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--full", action="store_true", help="the scenario's full request count (default: quick)")
    r.add_argument("--workers", type=int, default=4)
    r.add_argument("--order", default="ev,sent,ev,sent", help="labels in run order, comma-separated")
    r.add_argument("--jsonl", required=True, help="append one JSON line per run here")
    r.add_argument("--set", default="", help="a tag kept in each line; summary pairs runs within a tag")
    s = sub.add_parser("summary")
    s.add_argument("paths", nargs="+")
    args = ap.parse_args()
    if args.cmd == "run":
        run(args)
    else:
        summary(args.paths)


if __name__ == "__main__":
    main()
