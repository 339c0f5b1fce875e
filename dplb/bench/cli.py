"""``dplb bench run`` and ``dplb bench compare``: flags → workload/target → run → table, JSON, plots.

Contract: flags are validated once (a bad flag is a :class:`~dplb.errors.ConfigError`, one line, exit 2).
``bench run`` exits 0 when it ran (even with failed requests: they are figures), 1 when every request failed.
``bench compare`` exits 0 when the matrix ran; with ``--strict`` it exits 1 if a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from typing import Any

from dplb.config import split_list
from dplb.errors import ConfigError
from dplb.flags import flag_number, flag_rate


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds ``(default: X)`` to a flag's help, except for a flag without a default (None: "(default: None)" says
    nothing) or whose help already states it ("(default on)")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default is None or "default" in text:
            return text
        return super()._get_help_string(action)


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="load-test one OpenAI endpoint (router, worker or anything else)",
                       description="A benchmark_serving-style client: sends a seeded workload, reports TTFT, ITL, "
                       "TPOT and E2E percentiles, throughput, errors by status and the per-worker share "
                       "(X-SG-Worker-ID).", formatter_class=_DefaultsFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="endpoint")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat", help="OpenAI route")
    p.add_argument("--model", default="dplb-sim", help="model name to send")
    p.add_argument("--api-key", help="bearer token (when omitted: $DPLB_API_KEY)")
    p.add_argument("--num-prompts", type=int, default=200, help="requests to send")
    p.add_argument("--request-rate", type=flag_rate, default=math.inf, help="Poisson requests/s; inf = all at once")
    p.add_argument("--max-concurrency", type=int, help="most requests in flight at once (default unlimited)")
    p.add_argument("--burst-size", type=int, default=0, help="send bursts of N requests together (instead of Poisson)")
    p.add_argument("--burst-interval", type=flag_number, default=2.0, help="seconds between bursts")
    p.add_argument("--dataset", default="synthetic", help="synthetic, or a ShareGPT-style .jsonl file")
    p.add_argument("--input-len", type=int, default=128, help="prompt words (≈ tokens)")
    p.add_argument("--output-len", type=int, default=32, help="max_tokens per request")
    p.add_argument("--range-ratio", type=flag_number, default=0.0, help="lengths uniform in len·(1 ± ratio)")
    p.add_argument("--long-fraction", type=flag_number, default=0.0, help="fraction of long requests")
    p.add_argument("--long-input-len", type=int, default=1024, help="prompt words of a long request")
    p.add_argument("--long-output-len", type=int, default=256, help="max_tokens of a long request")
    p.add_argument("--shared-prefix-fraction", type=flag_number, default=0.0,
                   help="fraction of requests that start with a shared system prompt")
    p.add_argument("--num-prefixes", type=int, default=4, help="distinct shared system prompts")
    p.add_argument("--prefix-len", type=int, default=512, help="words per shared system prompt")
    p.add_argument("--force-output-len", action="store_true", help="JSONL: ask for --output-len, not the reply's")
    p.add_argument("--conversations", type=int, default=0,
                   help="multi-turn: this many chats of --turns turns (each turn sends the whole history, after the "
                   "previous turn completed and a think time); --num-prompts is then conversations x turns")
    p.add_argument("--turns", type=int, default=5, help="multi-turn: turns per conversation")
    p.add_argument("--think-time", type=flag_number, default=1.0, help="multi-turn: mean seconds between turns")
    p.add_argument("--session-header", metavar="NAME",
                   help="multi-turn: send NAME: conversation-<n> with every turn (for a front balancer's "
                   "conversation hash, e.g. x-session-id)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True, help="SSE streaming (default on)")
    p.add_argument("--timeout", type=flag_number, default=600.0, help="seconds per request")
    p.add_argument("--output", metavar="FILE.json", help="write every figure (and per-request records) here")
    p.add_argument("--plot", metavar="DIR", help="write latency CDF and per-worker load PNGs here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_run)


def _cmd_run(args: argparse.Namespace, rest: list[str]) -> int:
    from dataclasses import asdict

    from rich.console import Console
    from tqdm import tqdm

    from dplb.bench.client import Target, run_workload
    from dplb.bench.report import first_errors, format_summary, summarize
    from dplb.bench.workload import WorkloadSpec, build_workload

    if rest:
        raise ConfigError(f"unknown argument(s): {' '.join(rest)}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ConfigError("--max-concurrency must be ≥ 1")
    if args.burst_size and not math.isinf(args.request_rate):
        raise ConfigError("--burst-size and --request-rate are two arrival patterns; give one")
    if not args.timeout > 0:
        raise ConfigError(f"--timeout must be > 0 seconds, got {args.timeout}")
    _check_url(args.base_url)
    _check_outputs(args.output, args.plot)
    if args.session_header is not None and not args.session_header.replace("-", "").replace("_", "").isalnum():
        raise ConfigError(f"--session-header {args.session_header!r} is not an HTTP header name")
    if args.conversations > 0 and args.turns >= 1:
        args.num_prompts = args.conversations * args.turns
    spec = WorkloadSpec(
        num_prompts=args.num_prompts, request_rate=args.request_rate, burst_size=args.burst_size,
        burst_interval_s=args.burst_interval, input_len=args.input_len, output_len=args.output_len,
        range_ratio=args.range_ratio, long_fraction=args.long_fraction, long_input_len=args.long_input_len,
        long_output_len=args.long_output_len, shared_prefix_fraction=args.shared_prefix_fraction,
        num_prefixes=args.num_prefixes, prefix_len=args.prefix_len, dataset=args.dataset, seed=args.seed,
        conversations=args.conversations, turns=args.turns, think_s=args.think_time)
    requests = build_workload(spec, force_output_len=args.force_output_len)
    target = Target(args.base_url, args.model, args.endpoint, args.stream,
                    args.api_key or os.environ.get("DPLB_API_KEY"), args.timeout, args.session_header)
    from dplb.bench.client import preflight

    asyncio.run(preflight(target))
    bar = tqdm(total=len(requests), unit="req", disable=args.no_progress, file=sys.stderr)
    results, wall = asyncio.run(run_workload(target, requests, max_concurrency=args.max_concurrency,
                                             on_done=lambda r: bar.update(1)))
    bar.close()
    summary = summarize(results, wall)
    console = Console()
    console.print(format_summary(summary, f"dplb bench run → {target.url}"))
    for msg in first_errors(results):
        console.print(f"[red]error[/red] {msg}", markup=True, highlight=False)
    if args.output:
        _write_json(args.output, {"target": asdict(target) | {"api_key": None}, "workload": asdict(spec),
                                  "max_concurrency": args.max_concurrency, "summary": summary,
                                  "requests": [_record(r) for r in results]})
        console.print(f"wrote {args.output}")
    if args.plot:
        from dplb.bench.plots import plot_run

        for path in plot_run(results, summary, args.plot):
            console.print(f"wrote {path}")
    return 0 if summary["completed"] else 1


def _check_url(url: str) -> None:
    from urllib.parse import urlsplit

    try:
        u = urlsplit(url)
        ok = u.scheme in ("http", "https") and bool(u.hostname)
        u.port  # noqa: B018  (raises ValueError for a bad port)
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(f"--base-url {url!r}: expected http(s)://HOST[:PORT], e.g. http://127.0.0.1:30000")


def _check_outputs(output: str | None, plot: str | None) -> None:
    """Refuse output paths that cannot be written before the run, not after it."""
    if output:
        if os.path.isdir(output):
            raise ConfigError(f"--output {output} is a directory; give a file name, e.g. {output}/run.json")
        d = os.path.dirname(os.path.abspath(output))
        try:
            os.makedirs(d, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--output {output}: cannot create {d}: {e.strerror or e}") from None
        if not os.access(d, os.W_OK):
            raise ConfigError(f"--output {output}: {d} is not writable")
    if plot:
        from dplb.bench.plots import require_matplotlib

        require_matplotlib()
        try:
            os.makedirs(plot, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--plot {plot}: cannot create it: {e.strerror or e}") from None
        if not os.access(plot, os.W_OK):
            raise ConfigError(f"--plot {plot} is not writable")


def _json_safe(x: Any) -> Any:
    """NaN and ±inf → null (they are not JSON), recursively."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    return x


def _record(r: Any) -> dict[str, Any]:
    return {"index": r.index, "ok": r.ok, "status": r.status, "error": r.error, "worker": r.worker,
            "start_s": r.start_s, "ttft_s": r.ttft_s, "e2e_s": r.e2e_s, "output_tokens": r.output_tokens,
            "prompt_tokens": r.prompt_tokens, "prefix_id": r.prefix_id}


def _write_json(path: str, obj: Any) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(_json_safe(obj), f, indent=1, default=lambda x: None, allow_nan=False)
        f.write("\n")


def _add_compare(sub: argparse._SubParsersAction) -> None:
    from dplb.bench.scenarios import SCENARIOS

    p = sub.add_parser("compare", help="run scenarios × policies on fresh sim clusters and print one table",
                       description="For each scenario and policy: start a fresh sim cluster with `dplb launch`, "
                       "send the same seeded workload, stop it; print P50/P95/P99 E2E and TTFT, throughput, "
                       "per-worker share and errors, each policy's P99 ratio to the first, and the targets.",
                       formatter_class=_DefaultsFormatter)
    p.add_argument("--scenario", default="all", help=f"comma-separated: {', '.join(SCENARIOS)} (default all)")
    p.add_argument("--policies", default="dplb,round_robin,least_loaded,power_of_two,random",
                   help="comma-separated policies; the first is the reference of the ratios")
    p.add_argument("--variant", action="append", default=[], metavar="LABEL=FLAGS",
                   help="an extra run with these `dplb launch` flags, e.g. 'dplb-500ms=--state-interval-ms 500'")
    p.add_argument("--workers", type=int, default=4, help="sim workers per cluster")
    p.add_argument("--quick", action="store_true", help="fewer requests per run (the whole matrix in minutes)")
    p.add_argument("--prompts", type=int, help="override the measured requests per run (a smoke test)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (the same for every policy)")
    p.add_argument("--output", metavar="FILE.json", help="write every figure here")
    p.add_argument("--plot", metavar="DIR", help="write per-scenario CDF and per-worker load PNGs here")
    p.add_argument("--markdown", metavar="FILE.md", help="write the table, targets, machine and command as markdown")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    p.set_defaults(func=_cmd_compare)


def _cmd_compare(args: argparse.Namespace, rest: list[str]) -> int:
    import dataclasses
    import shlex
    import signal
    import time

    from rich.console import Console

    from dplb.bench import scenarios as sc_mod
    from dplb.bench.compare import parse_policies, run_compare

    if rest:
        raise ConfigError(f"unknown argument(s): {' '.join(rest)}")
    _check_outputs(args.output, args.plot)
    if args.markdown:
        _check_outputs(args.markdown, None)
    names = list(sc_mod.SCENARIOS) if args.scenario == "all" else split_list(args.scenario, "--scenario")
    policies = parse_policies(args.policies, args.variant)
    if args.prompts is not None:
        if args.prompts < 1:
            raise ConfigError("--prompts must be ≥ 1")
        for n in names:
            if n in sc_mod.SCENARIOS:
                s = sc_mod.SCENARIOS[n]
                sc_mod.SCENARIOS[n] = dataclasses.replace(s, quick_prompts=args.prompts, full_prompts=args.prompts,
                                                          warmup=min(s.warmup, args.prompts))
    console = Console(stderr=True)

    def _terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through the running cluster's context manager, which stops it

    signal.signal(signal.SIGTERM, _terminate)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # started in the background by a shell
        signal.signal(signal.SIGINT, signal.default_int_handler)
    t0 = time.monotonic()
    result, runs = run_compare(names, policies, num_workers=args.workers, quick=args.quick, seed=args.seed,
                               progress=lambda line: console.print(line, highlight=False))
    result["command"] = "dplb bench " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    result["wall_s"] = time.monotonic() - t0
    out = Console(width=None if sys.stdout.isatty() else 200)
    out.print(compare_table(result))
    for ok, text in _target_lines(result):
        out.print(f"{'PASS' if ok else 'FAIL'}  {text}", highlight=False)
    out.print(f"matrix finished in {result['wall_s']:.0f} s")
    if args.output:
        _write_json(args.output, result)
        out.print(f"wrote {args.output}")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(compare_markdown(result))
        out.print(f"wrote {args.markdown}")
    if args.plot:
        from dplb.bench.plots import plot_compare

        out.print(f"wrote {len(plot_compare(runs, args.plot))} plots into {args.plot}")
    return 1 if args.strict and not all(r["passed"] for r in result["targets"]) else 0


def _fmt(x: Any, fmt: str, dash: str) -> str:
    return dash if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _cells(s: dict[str, Any], ref: str, dash: str, extra_refs: tuple[str, ...] = ()) -> list[str]:
    """One policy's figures as table cells, E2E P50 … P99 ratio to ``ref`` (then to each of ``extra_refs``)."""
    e, t = s["e2e_ms"], s["ttft_ms"]
    cells = [_fmt(e["p50"], ".0f", dash), _fmt(e["p95"], ".0f", dash), _fmt(e["p99"], ".0f", dash),
             _fmt(t["p50"], ".0f", dash), _fmt(t["p99"], ".0f", dash), _fmt(s["requests_per_s"], ".2f", dash),
             _fmt(s["output_tokens_per_s"], ".0f", dash), _fmt(s["worker_share_max_min"], ".2f", dash),
             _fmt(s.get("prefix_cache_hit_rate"), ".2f", dash), _fmt(s.get("prediction_error_tokens"), ".0f", dash),
             str(s["failed"])]
    return cells + [_fmt(s.get(f"p99_vs_{r}"), ".2f", dash) for r in (ref, *extra_refs)]


def _target_lines(result: dict[str, Any]) -> list[tuple[bool, str]]:
    """(passed, "scenario: target (got value)") per target row."""
    out = []
    for row in result["targets"]:
        v = "n/a" if row["value"] is None else f"{row['value']:.3f}"
        out.append((row["passed"], f"{row['scenario']}: {row['target']} (got {v})"))
    return out


def compare_table(result: dict[str, Any]) -> Any:
    """A rich table: one row per scenario × policy."""
    from rich.table import Table

    t = Table(title=f"dplb bench compare ({result['num_workers']} sim workers"
                    f"{', quick' if result['quick'] else ''}; latencies in ms)")
    for col in ("scenario", "policy", "E2E P50", "E2E P95", "E2E P99", "TTFT P50", "TTFT P99", "req/s", "tok/s",
                "max/min", "prefix hit", "pred err", "failed", "P99 ratio"):
        t.add_column(col, justify="left" if col in ("scenario", "policy") else "right")
    for name, entry in result["scenarios"].items():
        ref = next(iter(entry["policies"]))
        for i, (label, s) in enumerate(entry["policies"].items()):
            t.add_row(name if i == 0 else "", label, *_cells(s, ref, "-"))
        t.add_section()
    return t


def compare_markdown(result: dict[str, Any]) -> str:
    """The compare result as markdown: machine, command, one table (latencies in ms), the targets."""
    m = result["machine"]
    lines = [f"Machine: {m['cpu']} × {m['cpus']} CPUs, {m['os']}, Python {m['python']}. "
             f"{result['num_workers']} sim workers; matrix wall time {result.get('wall_s', 0):.0f} s.", "",
             f"Command: `{result.get('command', 'dplb bench compare')}`", "",
             "| scenario | policy | E2E P50 | E2E P95 | E2E P99 | TTFT P50 | TTFT P99 | req/s | tok/s | max/min share "
             "| prefix hit | pred err (tokens) | failed | P99 / first | P99 / round_robin | P99 / least_loaded |",
             "|---|---|" + "---:|" * 14]
    for name, entry in result["scenarios"].items():
        ref = next(iter(entry["policies"]))
        for label, s in entry["policies"].items():
            cells = _cells(s, ref, "–", ("round_robin", "least_loaded"))
            lines.append(f"| {name} | {label} | " + " | ".join(cells) + " |")
    lines += ["", "Targets:", ""]
    lines += [f"- **{'PASS' if ok else 'FAIL'}** {text}" for ok, text in _target_lines(result)]
    return "\n".join(lines) + "\n"


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``dplb bench`` with its ``run`` and ``compare`` subcommands."""
    p = sub.add_parser("bench", help="benchmarks: load-test an endpoint, or compare policies on sim clusters")
    bsub = p.add_subparsers(dest="bench_cmd", required=True, metavar="{run,compare}")
    _add_run(bsub)
    _add_compare(bsub)
