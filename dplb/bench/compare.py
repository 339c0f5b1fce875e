"""``dplb bench compare``: the same seeded workload against each policy, each on a fresh ``dplb launch`` sim
cluster (docs/DESIGN.md §11).

Contract
- :func:`run_compare` runs every (scenario, policy) pair: it starts ``dplb launch`` with the scenario's sim flags
  and the policy's flags on a free port, a private run directory and a private segment, waits until every worker
  is ready, sends the workload (warm-up requests first, not counted), reads each worker's prefix-cache counters
  over its socket, stops the cluster with SIGINT and returns a JSON-able dict:
  ``{machine, command, scenarios: {name: {description, workload, policies: {label: summary + prefix_cache_hit_rate
  + ratios}}}, targets: [...]}``.
- A *policy* is a name from :data:`dplb.config.POLICIES` or a variant ``LABEL=LAUNCH FLAGS`` (e.g.
  ``dplb-500ms=--policy dplb --state-interval-ms 500``) for parameter sweeps. The first policy is the reference
  of every ``p99_vs_<first>`` ratio; ratios to round_robin and least_loaded are added when they ran.
- :func:`evaluate_targets` turns the results into pass/fail lines against the policy's targets; nothing here asserts.
- Raises :class:`~dplb.errors.DPLBError` when a cluster does not start (with the launcher's log tail).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from dplb.bench.client import RequestResult, Target, run_workload
from dplb.bench.report import summarize
from dplb.bench.scenarios import SCENARIOS, SIM_ARGS, Scenario
from dplb.bench.workload import build_workload
from dplb.config import POLICIES, split_list
from dplb.errors import ConfigError, DPLBError

READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0


def parse_policies(names: str, variants: list[str]) -> dict[str, list[str]]:
    """``"dplb,round_robin"`` plus ``["LABEL=FLAGS", ...]`` → ``{label: launch flags}``, in order.
    Raises :class:`ConfigError` for an unknown policy or a malformed variant."""
    out: dict[str, list[str]] = {}
    for name in split_list(names, "--policies", allow_empty=bool(variants)):
        if name not in POLICIES:
            raise ConfigError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)} (or use --variant)")
        out[name] = ["--policy", name]
    for v in variants:
        label, sep, flags = v.partition("=")
        label = label.strip()
        if not sep or not label or "=" in label:
            raise ConfigError(f"--variant {v!r}: expected LABEL=LAUNCH FLAGS, e.g. "
                              "'dplb-500ms=--state-interval-ms 500'")
        if label in out or label in POLICIES:
            raise ConfigError(f"--variant {v!r}: the label {label!r} is already a policy or variant; pick another")
        try:
            words = shlex.split(flags)
        except ValueError as e:
            raise ConfigError(f"--variant {v!r}: {e}") from e
        _check_launch_flags(label, words)
        out[label] = words
    if not out:
        raise ConfigError("no policy to compare")
    return out


#: `dplb launch` flags that compare sets itself for every cluster.
_OWN_FLAGS = ("--port", "--host", "--run-dir", "--shm-path", "--num-workers", "--metrics-port-base", "--model",
              "--served-model-name", "--emit-systemd", "--remove-logs")


def _check_launch_flags(label: str, words: list[str]) -> None:
    """Refuse flags compare owns and anything `dplb launch` (or the sim engine) would reject, before any run."""
    import argparse
    import contextlib
    import io

    from dplb.ops.launch_cli import add_parser as add_launch_parser
    from dplb.worker.engines import sim_arg_parser

    own = [w for w in words if w.split("=", 1)[0] in _OWN_FLAGS]
    if own:
        raise ConfigError(f"--variant {label}: {', '.join(own)} is set by compare for every cluster")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parser = argparse.ArgumentParser(prog="dplb")
            add_launch_parser(parser.add_subparsers())
            _ns, rest = parser.parse_known_args(["launch", *words])
            _, unknown = sim_arg_parser().parse_known_args(rest)
    except SystemExit:
        msg = err.getvalue().strip().splitlines()
        raise ConfigError(f"--variant {label}: {msg[-1] if msg else 'bad dplb launch flags'}") from None
    if unknown:
        raise ConfigError(f"--variant {label}: unknown dplb launch / sim engine flag(s): {' '.join(unknown)}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SimCluster:
    """A ``dplb launch`` sim cluster in a private run dir and segment; a context manager that stops it."""

    def __init__(self, num_workers: int, scenario: Scenario, launch_flags: list[str], workdir: str) -> None:
        self.port = _free_port()
        self.run_dir = tempfile.mkdtemp(prefix="cluster-", dir=workdir)
        self.shm_path = f"/dev/shm/dplb_bench_{os.getpid()}_{self.port}"
        self.num_workers = num_workers
        argv = [sys.executable, "-m", "dplb.cli", "--log-level", "warning", "launch", "--num-workers",
                str(num_workers), "--port", str(self.port), "--host", "127.0.0.1", "--run-dir", self.run_dir,
                "--shm-path", self.shm_path, "--metrics-port-base", "0", "--drain-timeout", "2", *launch_flags]
        for k, flags in scenario.worker_args.items():
            argv += ["--worker-args", f"{k % num_workers}={flags}"]
        argv += shlex.split(SIM_ARGS) + shlex.split(scenario.sim_args)
        self.argv = argv
        self.log_path = os.path.join(self.run_dir, "launch.log")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> SimCluster:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            self._wait_ready()
        except BaseException:  # Ctrl-C or SIGTERM while starting: stop what was started
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise DPLBError(f"dplb launch exited with {self.proc.returncode}:\n{self._tail()}")
            with open(self.log_path, "rb") as f:
                if b"worker(s) ready; serving" in f.read():
                    return
            time.sleep(0.1)
        raise DPLBError(f"the sim cluster was not ready within {READY_TIMEOUT_S:.0f} s:\n{self._tail()}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def _tail(self, n: int = 30) -> str:
        with contextlib.suppress(OSError), open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
        return ""

    def predicted_blocks(self) -> tuple[float, float]:
        """(hit, query) blocks the router's prefix index predicted (``dplb_prefix_*_blocks_total`` summed over
        workers), from the router's /metrics; (0, 0) when prefix scoring is off."""
        hits = queries = 0.0
        with contextlib.suppress(OSError), urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("dplb_prefix_hit_blocks_total{"):
                    hits += float(line.rsplit(" ", 1)[1])
                elif line.startswith("dplb_prefix_query_blocks_total{"):
                    queries += float(line.rsplit(" ", 1)[1])
        return hits, queries

    def prediction_error(self) -> tuple[float, float, float]:
        """(compared requests, Σ |predicted − engine cached| tokens, Σ engine cached tokens) summed over the workers,
        from the router's /metrics (the workers' KV rings, docs/DESIGN.md §3.7)."""
        names = {"dplb_prefix_compared_requests_total{": 0, "dplb_prefix_prediction_error_tokens_total{": 1,
                 "dplb_prefix_engine_cached_tokens_total{": 2}
        acc = [0.0, 0.0, 0.0]
        with contextlib.suppress(OSError), urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                for prefix, i in names.items():
                    if line.startswith(prefix):
                        acc[i] += float(line.rsplit(" ", 1)[1])
        n, err, cached = acc
        return n, err, cached

    def prefix_cache_tokens(self) -> tuple[float, float]:
        """(hits, queries) in tokens summed over the workers' ``vllm:prefix_cache_*`` counters (over their UDS)."""
        hits = queries = 0.0
        for k in range(self.num_workers):
            text = _uds_get(os.path.join(self.run_dir, f"worker-{k}.sock"), "/metrics")
            for line in text.splitlines():
                if line.startswith("vllm:prefix_cache_hits_total"):
                    hits += float(line.rsplit(" ", 1)[1])
                elif line.startswith("vllm:prefix_cache_queries_total"):
                    queries += float(line.rsplit(" ", 1)[1])
        return hits, queries


def _uds_get(path: str, target: str) -> str:
    """GET ``target`` over the Unix socket ``path`` (HTTP/1.0, whole body); '' when the worker does not answer."""
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(path)
            s.sendall(f"GET {target} HTTP/1.0\r\nHost: worker\r\n\r\n".encode())
            chunks = []
            while data := s.recv(65536):
                chunks.append(data)
    except OSError:
        return ""
    return b"".join(chunks).partition(b"\r\n\r\n")[2].decode(errors="replace")


def _router_ready(url: str, want: int = 1) -> bool:
    """Whether the router at ``url`` routes to ``want`` workers or more (``routable_workers`` of its ``/ready``).
    A run starts only when every worker is routable: a worker the router still holds out (a first heartbeat not
    yet seen, or late once on a loaded box) would otherwise miss a burst that arrives at once."""
    try:
        with urllib.request.urlopen(url + "/ready", timeout=2) as r:
            return r.status == 200 and len(json.loads(r.read()).get("routable_workers", ())) >= want
    except (OSError, ValueError, AttributeError):
        return False


def run_one(scenario: Scenario, label: str, flags: list[str], *, num_workers: int, quick: bool, seed: int,
            workdir: str, stream: bool = True) -> tuple[list[RequestResult], dict[str, Any]]:
    """One (scenario, policy) run on a fresh cluster. The warm-up requests and the measured ones are one
    continuous arrival stream (the measured phase starts in steady state, not from idle); only the measured ones
    count, and the prefix-cache counters are read when the first measured request is sent. Returns (measured
    results, summary with ``prefix_cache_hit_rate`` and ``policy_flags``)."""
    spec = scenario.workload(num_workers, quick, seed)
    requests = build_workload(spec)
    warm = scenario.warmup
    t_measure = requests[warm].send_at_s
    with SimCluster(num_workers, scenario, flags, workdir) as cluster:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not _router_ready(cluster.url, num_workers):
            if time.monotonic() > deadline:
                raise DPLBError(f"{label}: the router at {cluster.url} never routed to all {num_workers} workers "
                                "(its /ready)")
            time.sleep(0.05)
        target = Target(cluster.url, "dplb-sim", "chat", stream)

        async def go() -> tuple[list[RequestResult], float, tuple[float, ...]]:
            async def counters_at_start() -> tuple[float, ...]:
                await asyncio.sleep(t_measure)
                return (*await asyncio.to_thread(cluster.prefix_cache_tokens),
                        *await asyncio.to_thread(cluster.predicted_blocks),
                        *await asyncio.to_thread(cluster.prediction_error))

            before = asyncio.create_task(counters_at_start())
            results, wall = await run_workload(target, requests)
            return results, wall, await before

        results, wall, (hits0, queries0, phits0, pq0, n0, err0, _c0) = asyncio.run(go())
        hits1, queries1 = cluster.prefix_cache_tokens()
        phits1, pq1 = cluster.predicted_blocks()
        time.sleep(0.3)  # the last requests' comparisons reach the rings after their responses
        n1, err1, _c1 = cluster.prediction_error()
    results = results[warm:]
    for r in results:
        r.start_s -= t_measure
    summary = summarize(results, wall - t_measure, workers=[str(k) for k in range(num_workers)])
    q = queries1 - queries0
    summary["prefix_cache_hit_rate"] = (hits1 - hits0) / q if q > 0 else None
    summary["prefix_index_hit_rate"] = (phits1 - phits0) / (pq1 - pq0) if pq1 > pq0 else None
    #: Mean |predicted − engine cached| prompt tokens per request (None: the policy predicts nothing).
    summary["prediction_error_tokens"] = (err1 - err0) / (n1 - n0) if n1 > n0 else None
    summary["policy_flags"] = flags
    summary["label"] = label
    return results, summary


def run_compare(scenario_names: list[str], policies: dict[str, list[str]], *, num_workers: int = 4,
                quick: bool = False, seed: int = 0,
                progress: Callable[[str], None] = lambda s: None,
                ) -> tuple[dict[str, Any], dict[str, dict[str, tuple[list[RequestResult], dict]]]]:
    """Run the matrix. Returns (the JSON-able result dict, ``runs[scenario][label] = (results, summary)`` for
    plots). ``progress`` gets one line per finished run."""
    for name in scenario_names:
        if name not in SCENARIOS:
            raise ConfigError(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")
    if num_workers < 2:
        raise ConfigError("--workers must be ≥ 2 to compare routing")
    out: dict[str, Any] = {"machine": machine(), "quick": quick, "seed": seed, "num_workers": num_workers,
                           "scenarios": {}}
    runs: dict[str, dict[str, tuple[list[RequestResult], dict]]] = {}
    with tempfile.TemporaryDirectory(prefix="dplb-bench-") as workdir:
        for name in scenario_names:
            sc = SCENARIOS[name]
            if sc.runner == "tenants":
                from dplb.bench.tenants import run_tenants

                out["scenarios"][name] = run_tenants(sc, next(iter(policies.values())), num_workers=num_workers,
                                                     quick=quick, seed=seed, workdir=workdir, progress=progress,
                                                     cluster=SimCluster, ready=lambda u: _router_ready(u, num_workers),
                                                     uds_get=_uds_get)
                runs[name] = {}
                continue
            spec = sc.workload(num_workers, quick, seed)
            labels = dict(policies)
            for extra in sc.extra_policies:
                labels.setdefault(extra, ["--policy", extra])
            for label, words in sc.extra_variants.items():
                labels.setdefault(label, shlex.split(words))
            entry: dict[str, Any] = {"description": sc.description, "workload": asdict(spec),
                                     "warmup_requests": sc.warmup, "sim_args": f"{SIM_ARGS} {sc.sim_args}".strip(),
                                     "worker_args": {str(k % num_workers): v for k, v in sc.worker_args.items()},
                                     "policies": {}}
            runs[name] = {}
            for label, flags in labels.items():
                t = time.monotonic()
                results, summary = run_one(sc, label, flags, num_workers=num_workers, quick=quick, seed=seed,
                                           workdir=workdir)
                runs[name][label] = (results, summary)
                entry["policies"][label] = summary
                progress(f"{name:14s} {label:14s} P99 E2E {summary['e2e_ms']['p99']:8.0f} ms  "
                         f"failed {summary['failed']}  ({time.monotonic() - t:.0f} s)")
            _add_ratios(entry["policies"], next(iter(policies)))
            out["scenarios"][name] = entry
    out["targets"] = evaluate_targets(out)
    return out, runs


def _add_ratios(by_policy: dict[str, dict], reference: str) -> None:
    for s in by_policy.values():
        for ref in dict.fromkeys((reference, "round_robin", "least_loaded")):
            if ref in by_policy:
                base = by_policy[ref]["e2e_ms"]["p99"]
                s[f"p99_vs_{ref}"] = s["e2e_ms"]["p99"] / base if base and base == base else None


def evaluate_targets(result: dict[str, Any], default: str = "dplb") -> list[dict[str, Any]]:
    """The default policy's targets as ``{scenario, target, value, limit, passed}`` rows (only those whose runs
    exist): the seed article's 37 % better P99 than round-robin on a heterogeneous cluster, never worse than vLLM
    DP's least-loaded rule, and prefix-cache hit rates within 0.9 of the best affinity policy."""
    rows: list[dict[str, Any]] = []

    def add(scenario: str, target: str, value: float | None, limit: float, higher_is_better: bool = False) -> None:
        passed = value is not None and (value >= limit if higher_is_better else value <= limit)
        rows.append({"scenario": scenario, "target": target, "value": value, "limit": limit, "passed": passed})

    for name, entry in result["scenarios"].items():
        p = entry["policies"]
        if "tenants" in entry:
            from dplb.bench.tenants import tenant_targets

            for target, value, limit, higher in tenant_targets(entry):
                add(name, target, value, limit, higher)
            continue
        if default not in p:
            continue
        d = p[default]
        if name == "heterogeneous" and "round_robin" in p:
            add(name, f"P99 E2E {default} / round_robin ≤ 0.63 (seed: 37 % better)", d.get("p99_vs_round_robin"), 0.63)
        if "least_loaded" in p:
            add(name, f"P99 E2E {default} / least_loaded ≤ 1.0 (vLLM DP's rule)", d.get("p99_vs_least_loaded"), 1.0)
        if name == "burst-herd":
            add(name, f"{default} per-worker max/min share ≤ 1.25", d["worker_share_max_min"], 1.25)
        if name == "shared-prefix" and "prefix_hash" in p:
            ref, got = p["prefix_hash"]["prefix_cache_hit_rate"], d["prefix_cache_hit_rate"]
            ratio = got / ref if ref and got is not None else None
            add(name, f"prefix-cache hit rate {default} / prefix_hash (pure affinity) ≥ 0.9", ratio, 0.9, True)
        if name.startswith("multi-turn"):
            rates = {k: s["prefix_cache_hit_rate"] for k, s in p.items() if s.get("prefix_cache_hit_rate") is not None}
            best = max(rates, key=rates.__getitem__) if rates else None
            got = d.get("prefix_cache_hit_rate")
            ratio = got / rates[best] if best and rates[best] and got is not None else None
            add(name, f"prefix-cache hit rate {default} / best ({best}) ≥ 0.9", ratio, 0.9, True)
            if "least_loaded" in p:
                add(name, f"P99 E2E {default} / least_loaded ≤ 0.9", d.get("p99_vs_least_loaded"), 0.9)
        if name.startswith("cache-pressure"):
            _cache_pressure_targets(name, p, default, add)
        if any(s["failed"] for s in p.values()):
            add(name, "no failed request in any run", float(sum(s["failed"] for s in p.values())), 0.0)
    return rows


def _cache_pressure_targets(name: str, p: dict[str, Any], default: str,
                            add: Callable[..., None]) -> None:
    """Engine truth against the sent-bytes index (``dplb-sent``) and the oracle: prediction error ≥ 5× lower, hit
    rate within 0.03 of the oracle, and (at the knee) TTFT P99 ≤ 0.5× the sent-bytes index's."""
    d, sent, oracle = p[default], p.get("dplb-sent"), p.get("oracle")
    if sent is not None:
        e, es = d.get("prediction_error_tokens"), sent.get("prediction_error_tokens")
        add(name, f"prediction error dplb-sent / {default} ≥ 5 (tokens per request)",
            es / e if e and es is not None else None, 5.0, True)
        if name == "cache-pressure":
            t, ts = d["ttft_ms"]["p99"], sent["ttft_ms"]["p99"]
            add(name, f"TTFT P99 {default} / dplb-sent ≤ 0.5", t / ts if ts else None, 0.5)
    if oracle is not None:
        h, ho = d.get("prefix_cache_hit_rate"), oracle.get("prefix_cache_hit_rate")
        add(name, f"engine hit rate oracle − {default} ≤ 0.03", ho - h if h is not None and ho is not None else None,
            0.03)


def machine() -> dict[str, Any]:
    """Where the benchmark ran: CPU model and count, OS, Python."""
    cpu = platform.processor() or ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"cpu": cpu, "cpus": os.cpu_count(), "os": platform.platform(), "python": platform.python_version()}
