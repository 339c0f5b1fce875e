"""`dplb bench`: workloads, figures, and the run/compare tools against real sim clusters."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import statistics
import subprocess
import sys

import numpy as np
import pytest

from dplb.bench.client import RequestResult
from dplb.bench.compare import evaluate_targets, parse_policies
from dplb.bench.report import percentile, summarize
from dplb.bench.scenarios import SCENARIOS, capacity_rps
from dplb.bench.workload import WorkloadSpec, build_workload
from dplb.errors import ConfigError
from dplb.ops.launcher import parse_worker_args
from tests.cluster import ROOT, cluster, dplb_cmd


# ---- workloads --------------------------------------------------------------------------------------------------
def test_workload_is_seeded_and_poisson_at_the_rate() -> None:
    spec = WorkloadSpec(num_prompts=4000, request_rate=20.0, input_len=10, output_len=5, seed=3)
    a, b = build_workload(spec), build_workload(spec)
    assert [(r.messages, r.max_tokens, r.send_at_s) for r in a] == [(r.messages, r.max_tokens, r.send_at_s) for r in b]
    assert build_workload(WorkloadSpec(num_prompts=5, seed=4))[0].messages != a[0].messages
    gaps = [y.send_at_s - x.send_at_s for x, y in itertools.pairwise(a)]
    assert all(g >= 0 for g in gaps)
    assert 0.045 < sum(gaps) / len(gaps) < 0.055  # mean gap 1/20 s
    cv = float(np.std(gaps) / np.mean(gaps))
    assert 0.9 < cv < 1.1  # exponential gaps: coefficient of variation 1
    assert all(len(r.messages[-1]["content"].split()) == 10 + 3 for r in a)  # "request i xxxxxxxx:" + 10 words
    assert {r.max_tokens for r in a} == {5}


def test_bursts_inf_and_lengths() -> None:
    bursts = build_workload(WorkloadSpec(num_prompts=10, burst_size=4, burst_interval_s=2.0, idle_s=1.0))
    assert [r.send_at_s for r in bursts] == [1.0] * 4 + [3.0] * 4 + [5.0] * 2
    assert {r.send_at_s for r in build_workload(WorkloadSpec(num_prompts=7))} == {0.0}
    mixed = build_workload(WorkloadSpec(num_prompts=2000, input_len=100, output_len=10, range_ratio=0.5,
                                        long_fraction=0.2, long_input_len=1000, long_output_len=200, seed=1))
    outs = [r.max_tokens for r in mixed]
    assert min(outs) >= 5 and max(outs) <= 300
    long = sum(1 for o in outs if o >= 100)
    assert 340 < long < 460  # ~20 %


def test_shared_prefixes() -> None:
    reqs = build_workload(WorkloadSpec(num_prompts=1000, shared_prefix_fraction=0.9, num_prefixes=8, prefix_len=50))
    shared = [r for r in reqs if r.prefix_id >= 0]
    assert 850 < len(shared) < 950
    assert {r.prefix_id for r in shared} == set(range(8))
    by_id: dict[int, set[str]] = {}
    for r in shared:
        assert r.messages[0]["role"] == "system"
        by_id.setdefault(r.prefix_id, set()).add(r.messages[0]["content"])
    assert all(len(v) == 1 for v in by_id.values())  # one text per prefix
    assert len({next(iter(v)) for v in by_id.values()}) == 8
    assert len({r.messages[-1]["content"] for r in reqs}) == 1000  # every user turn is distinct


def test_multi_turn_conversations() -> None:
    """Each turn sends the whole history (system, earlier turns with a reply, the new user turn), waits for the
    previous turn, and conversations start by Poisson arrivals at request_rate / turns."""
    spec = WorkloadSpec(num_prompts=400 * 5, conversations=400, turns=5, request_rate=10.0, input_len=20,
                        output_len=8, prefix_len=500, think_s=2.0, seed=1)
    reqs = build_workload(spec)
    assert len(reqs) == 2000 and reqs == build_workload(spec)
    first = [r for r in reqs if r.after < 0]
    assert len(first) == 400 and all(r.index % 5 == 0 for r in first)
    assert {r.messages[0]["content"] for r in reqs} == {reqs[0].messages[0]["content"]}  # one system prompt
    assert len(reqs[0].messages[0]["content"].split()) >= 500
    for r in reqs:
        t = r.index % 5
        assert len(r.messages) == 2 + 2 * t and r.messages[-1]["role"] == "user"
        if t:
            prev = reqs[r.index - 1]
            assert r.after == prev.index and r.messages[: len(prev.messages)] == prev.messages  # history extends
            assert r.messages[len(prev.messages)]["role"] == "assistant" and r.send_at_s == prev.send_at_s
    gaps = [y.send_at_s - x.send_at_s for x, y in itertools.pairwise(first)]
    assert 0.45 < sum(gaps) / len(gaps) < 0.55  # 2 conversations/s = 10 requests/s over 5 turns
    thinks = [r.think_s for r in reqs if r.after >= 0]
    assert 1.8 < sum(thinks) / len(thinks) < 2.2
    with pytest.raises(ConfigError, match="conversations × turns"):
        WorkloadSpec(num_prompts=7, conversations=2, turns=5)


def test_jsonl_datasets(tmp_path) -> None:  # type: ignore[no-untyped-def]
    p = tmp_path / "data.jsonl"
    rows = [
        {"conversations": [{"from": "human", "value": "hello there"}, {"from": "gpt", "value": "a b c d"}]},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why"},
                      {"role": "assistant", "content": "x y"}]},
        {"prompt": "complete this", "max_tokens": 7},
    ]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    reqs = build_workload(WorkloadSpec(num_prompts=3, dataset=str(p)))
    assert [r.max_tokens for r in reqs] == [4, 2, 7]
    assert reqs[0].messages == [{"role": "user", "content": "hello there"}]
    assert [m["role"] for m in reqs[1].messages] == ["system", "user"]
    forced = build_workload(WorkloadSpec(num_prompts=3, dataset=str(p), output_len=9), force_output_len=True)
    assert [r.max_tokens for r in forced] == [9, 9, 9]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n\n{"conversations": [{"from": "alien", "value": "?"}]}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:3: unknown speaker 'alien'"):  # physical line numbers
        build_workload(WorkloadSpec(num_prompts=1, dataset=str(bad)))
    for text, why in (('[{"prompt": "x"}]', "a JSON list"), ('{"messages": [{"role": "system", "content": "s"}]}',
                                                              "no user turn"), ('{"foo": 1}', "missing key"),
                      ("{not json", "not JSON")):
        bad.write_text(text + "\n")
        with pytest.raises(ConfigError, match=why):
            build_workload(WorkloadSpec(num_prompts=1, dataset=str(bad)))
    # a row without a reply or max_tokens asks for --output-len, not 1 token
    p.write_text('{"prompt": "no length given"}\n')
    assert build_workload(WorkloadSpec(num_prompts=1, dataset=str(p), output_len=21))[0].max_tokens == 21
    with pytest.raises(ConfigError, match="cannot read"):
        build_workload(WorkloadSpec(num_prompts=1, dataset=str(tmp_path / "missing.jsonl")))


@pytest.mark.parametrize("kw", [{"num_prompts": 0}, {"request_rate": 0.0}, {"range_ratio": 1.0},
                                {"shared_prefix_fraction": 1.5}, {"input_len": 0}, {"burst_size": -1}])
def test_bad_specs_are_refused(kw: dict) -> None:
    with pytest.raises(ConfigError):
        WorkloadSpec(**kw)


# ---- figures ----------------------------------------------------------------------------------------------------
def test_percentile_matches_numpy() -> None:
    rng = random.Random(0)
    for n in (1, 2, 5, 101, 1000):
        v = sorted(rng.random() for _ in range(n))
        for q in (0, 50, 95, 99, 100):
            assert math.isclose(percentile(v, q), float(np.percentile(v, q)), rel_tol=1e-12)
    assert math.isnan(percentile([], 50))


def test_summarize_shares_errors_and_tpot() -> None:
    res = [RequestResult(i, ok=True, status=200, worker=str(i % 3), start_s=i * 0.5, ttft_s=0.1, e2e_s=1.1,
                         itl_s=[0.1] * 9, output_tokens=11) for i in range(9)]
    res.append(RequestResult(9, ok=False, status=503, worker="1", start_s=1.0, error="full"))
    res.append(RequestResult(10, ok=False, status="stream_error", worker="2", start_s=2.0))
    s = summarize(res, wall_s=5.0, workers=["0", "1", "2", "3"])
    assert s["completed"] == 9 and s["failed"] == 2
    assert s["errors_by_status"] == {"503": 1, "stream_error": 1}
    assert s["worker_requests"] == {"0": 3, "1": 4, "2": 4, "3": 0}
    assert math.isinf(s["worker_share_max_min"])  # worker 3 got nothing
    assert math.isclose(sum(s["worker_share"].values()), 1.0)
    assert math.isclose(s["tpot_ms"]["p50"], 100.0) and math.isclose(s["e2e_ms"]["p99"], 1100.0)
    assert math.isclose(s["requests_per_s"], 9 / 5.0) and s["output_tokens"] == 99
    assert s["worker_over_time"]["counts"]["0"][:2] == [1, 1]  # starts 0.0 and 1.5 s in 1-s buckets


def test_targets_and_policy_parsing() -> None:
    assert parse_policies("dplb,least_loaded", ["slow=--state-interval-ms 500"]) == {
        "dplb": ["--policy", "dplb"], "least_loaded": ["--policy", "least_loaded"],
        "slow": ["--state-interval-ms", "500"]}
    with pytest.raises(ConfigError, match="unknown policy"):
        parse_policies("dplb,nginx", [])
    with pytest.raises(ConfigError, match="LABEL=LAUNCH FLAGS"):
        parse_policies("dplb", ["no-equals-sign"])
    # regressions: each was a hang, a silent swap, a traceback or a late failure
    for variant, why in (("x=--port 31050", "set by compare"), ("dplb=--policy round_robin", "already a policy"),
                         ("x=--weights 'open", "No closing quotation"), ("x=--no-such-flag 3", "unknown"),
                         ("x=--policy nope", "invalid choice")):
        with pytest.raises(ConfigError, match=why):
            parse_policies("dplb", [variant])
    with pytest.raises(ConfigError, match="already a policy or variant"):
        parse_policies("dplb", ["a=--seed 1", "a=--seed 2"])

    def summ(p99: float, **kw: object) -> dict:
        return {"e2e_ms": {"p99": p99}, "failed": 0, "worker_share_max_min": 1.0, "prefix_cache_hit_rate": None,
                **kw}

    result = {"scenarios": {
        "heterogeneous": {"policies": {"dplb": summ(500, p99_vs_round_robin=0.5, p99_vs_least_loaded=1.02),
                                       "round_robin": summ(1000), "least_loaded": summ(490)}},
        "shared-prefix": {"policies": {"dplb": summ(100, prefix_cache_hit_rate=0.7),
                                       "prefix_hash": summ(300, prefix_cache_hit_rate=0.85)}},
    }}
    rows = evaluate_targets(result)
    assert [(r["scenario"], r["passed"]) for r in rows] == [
        ("heterogeneous", True), ("heterogeneous", False), ("shared-prefix", False)]
    assert math.isclose(rows[2]["value"], 0.7 / 0.85) and rows[2]["limit"] == 0.9


def test_capacity_model() -> None:
    # 8 sequences, each 32 steps of (20 + 2.5·8) ms plus 128 prefill tokens at 0.2 ms: 8 / 1.3056 s
    assert math.isclose(capacity_rps(128, 32), 8 / (32 * 0.04 + 128 * 0.0002))
    assert math.isclose(capacity_rps(128, 32, speed=0.5), capacity_rps(128, 32) / 2)
    assert set(SCENARIOS) == {"homogeneous", "heterogeneous", "bursty", "mixed-lengths", "shared-prefix",
                              "multi-turn", "multi-turn-slow", "burst-herd", "tenants", "cache-pressure",
                              "cache-pressure-50", "cache-fits"}
    cp = SCENARIOS["cache-pressure"]
    assert set(cp.extra_variants) == {"dplb-sent", "oracle"} and "least_loaded" in cp.extra_policies
    fits = SCENARIOS["cache-fits"]  # cache-pressure's workload and load, a cache ~1.25x its working set
    assert (fits.base, fits.load, fits.extra_variants) == (cp.base, cp.load, cp.extra_variants)
    assert fits.sim_args == "--sim-prefix-cache-blocks 640" and cp.sim_args == "--sim-prefix-cache-blocks 192"
    mt = SCENARIOS["multi-turn"]
    # mean over 5 turns of the history: 600 system + 200·(t+1) user + 32·t replies, t = 0..4
    assert mt.mean_lengths() == (600 + 200 * 3 + 32 * 2, 32.0)
    spec = mt.workload(4, quick=True)
    assert spec.conversations * spec.turns == spec.num_prompts == 250 and spec.conversations >= 40 + 10


def test_worker_args_parsing() -> None:
    assert parse_worker_args(["3=--sim-speed 0.5", "3=--sim-seed 2", "0=--x 'a b'"], 4) == {
        3: ["--sim-speed", "0.5", "--sim-seed", "2"], 0: ["--x", "a b"]}
    for bad in ("4=--x", "x=--y", "--sim-speed 0.5", "-1=--x"):
        with pytest.raises(ConfigError, match="--worker-args"):
            parse_worker_args([bad], 4)


# ---- against real clusters --------------------------------------------------------------------------------------
def test_bench_run_against_the_router(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Two sim workers (one at half speed) behind a real router: every figure is there and consistent."""
    out = tmp_path / "run.json"
    with cluster(str(tmp_path / "c"), 2, worker_args={1: ["--sim-speed", "0.5"]}) as c:
        r = subprocess.run(dplb_cmd("bench", "run", "--base-url", c.url, "--num-prompts", "40", "--request-rate",
                                    "40", "--input-len", "20", "--output-len", "8", "--seed", "1", "--output",
                                    str(out), "--plot", str(tmp_path / "plots"), "--no-progress"),
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert r.returncode == 0, r.stderr + r.stdout
        assert "E2E ms" in r.stdout and "per-worker share" in r.stdout
        bad = subprocess.run(dplb_cmd("bench", "run", "--base-url", c.url, "--model", "nope", "--num-prompts", "3",
                                      "--no-progress", "--output", str(tmp_path / "bad.json")),
                             capture_output=True, text=True, timeout=60, cwd=ROOT)
        plain = subprocess.run(dplb_cmd("bench", "run", "--base-url", c.url + "/v1/", "--num-prompts", "5",
                                        "--no-stream", "--no-progress", "--output", str(tmp_path / "plain.json")),
                               capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert plain.returncode == 0, plain.stderr
    ps = json.loads((tmp_path / "plain.json").read_text(), parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))
    assert ps["summary"]["completed"] == 5 and ps["summary"]["tpot_ms"]["n"] == 0  # no TPOT without streaming
    assert ps["summary"]["itl_ms"]["p50"] is None
    data = json.loads(out.read_text())
    s = data["summary"]
    assert s["completed"] == 40 and s["failed"] == 0
    assert set(s["worker_requests"]) == {"0", "1"} and all(v > 0 for v in s["worker_requests"].values())
    assert s["output_tokens"] == 40 * 8
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        d = s[key]
        assert 0 < d["p50"] <= d["p95"] <= d["p99"] <= d["max"], (key, d)
    assert s["ttft_ms"]["p50"] < s["e2e_ms"]["p50"]
    assert all(len(rec) and rec["worker"] in ("0", "1") for rec in data["requests"])
    assert (tmp_path / "plots" / "latency_cdf.png").stat().st_size > 1000
    assert (tmp_path / "plots" / "worker_load.png").stat().st_size > 1000
    # a wrong model: every request fails with the router's 404 model_not_found, counted by status, exit 1
    assert bad.returncode == 1
    assert json.loads((tmp_path / "bad.json").read_text())["summary"]["errors_by_status"] == {"404": 3}


def test_bench_compare_smoke(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The whole tool on one scenario, two policies, tiny counts (what CI runs to keep it working)."""
    out = tmp_path / "cmp.json"
    r = subprocess.run(dplb_cmd("bench", "compare", "--scenario", "heterogeneous", "--policies",
                                "dplb,round_robin", "--prompts", "12", "--workers", "2", "--output", str(out),
                                "--plot", str(tmp_path / "plots"), "--markdown", str(tmp_path / "cmp.md")),
                       capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    assert "P99 E2E dplb / round_robin" in r.stdout
    data = json.loads(out.read_text())
    pol = data["scenarios"]["heterogeneous"]["policies"]
    assert set(pol) == {"dplb", "round_robin"}
    for s in pol.values():
        assert s["completed"] == 12 and s["failed"] == 0
        assert set(s["worker_requests"]) == {"0", "1"}
    assert pol["dplb"]["p99_vs_dplb"] == 1.0
    assert data["scenarios"]["heterogeneous"]["worker_args"] == {"1": "--sim-speed 0.5"}
    assert (tmp_path / "plots" / "heterogeneous_e2e_cdf.png").exists()
    assert {row["scenario"] for row in data["targets"]} == {"heterogeneous"}
    assert data["machine"]["cpus"] and data["wall_s"] > 0
    md = (tmp_path / "cmp.md").read_text()
    assert "| heterogeneous | dplb |" in md and "| heterogeneous | round_robin |" in md and "P99 E2E dplb" in md


def test_bench_flags_are_checked(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tests.cluster import free_port

    nobody = f"http://127.0.0.1:{free_port()}"
    for args in (["run", "--num-prompts", "0"], ["run", "--max-concurrency", "0"], ["run", "--timeout", "0"],
                 ["run", "--base-url", "127.0.0.1:30000"], ["run", "--base-url", "ftp://x"],
                 ["run", "--burst-size", "4", "--request-rate", "5"],
                 ["run", "--base-url", nobody, "--num-prompts", "3"],  # nothing listening: fails before sending
                 ["run", "--base-url", nobody, "--output", str(tmp_path)],  # a directory, refused up front
                 ["compare", "--scenario", "nope"], ["compare", "--policies", "nginx"],
                 ["compare", "--variant", "x=--port 1"]):
        r = subprocess.run(dplb_cmd("bench", *args), capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert r.returncode == 2 and "Traceback" not in r.stderr and "error:" in r.stderr, (args, r.stderr)


def test_compare_stopped_mid_run_leaves_nothing_behind(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """SIGTERM (or Ctrl-C) during a run stops that run's cluster: no process, socket or segment is left."""
    import os
    import signal
    import time

    proc = subprocess.Popen(dplb_cmd("bench", "compare", "--scenario", "homogeneous", "--policies", "dplb",
                                     "--prompts", "2000", "--workers", "2"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT, start_new_session=True)
    segment_prefix = f"dplb_bench_{proc.pid}_"

    def ps() -> list[str]:
        return subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()

    def ours(pid: str) -> bool:
        """The router gets its config in the environment ($DPLB_ROUTER_CONFIG), so look there too for the run dir."""
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                return f"DPLB_RUN_DIR={run_dir}".encode() in f.read().split(b"\0")
        except OSError:
            return False

    def cluster_pids() -> list[str]:
        # only this run's cluster (its run dir is in every child's arguments or environment): another benchmark on
        # the machine must not count
        return [ln.split()[0] for ln in ps() if "dplb.cli" in ln and (run_dir in ln or ours(ln.split()[0]))]

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(f.startswith(segment_prefix) for f in os.listdir("/dev/shm")):
        time.sleep(0.2)
    assert any(f.startswith(segment_prefix) for f in os.listdir("/dev/shm")), "the cluster never started"
    launcher = next(ln.split() for ln in ps() if segment_prefix in ln and " launch " in ln)
    run_dir = launcher[launcher.index("--run-dir") + 1]
    time.sleep(3)
    assert len(cluster_pids()) >= 4  # launcher, 2 workers, router
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and cluster_pids():
        time.sleep(0.2)
    assert cluster_pids() == []
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(segment_prefix)]


def test_capacity_bench_quick(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """benchmarks/bench_capacity.py --quick on DPLB with one router process (a few seconds): it runs, counts every
    streamed token and reports router CPU per request and per token from /proc."""
    out = tmp_path / "cap.json"
    r = subprocess.run([sys.executable, f"{ROOT}/benchmarks/bench_capacity.py", "--quick", "--targets", "dplb1",
                        "--json", str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())["dplb1"]
    assert res["tokens_per_stream"] == 64
    assert 0 < res["req_us"] < 10_000 and 0 < res["tok_us"] < 1_000
    assert "µs/request" in r.stdout


def test_router_latency_phase_measures_the_relay_floor(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """bench_router.py's concurrency-1 phase, a few requests: direct, routed and through benchmarks/raw_relay.py
    (a byte relay: the floor any process in the path costs), each answered in full; the router's added P50 is the
    floor's plus the router's own."""
    sys.path.insert(0, f"{ROOT}/benchmarks")
    import bench_router

    with cluster(str(tmp_path), 1, worker_args={0: bench_router.INSTANT_SIM}) as c, \
            bench_router.raw_relay(c.sock(0)) as (relay_port, _):
        res = asyncio.run(bench_router.latency(c, 30, 3, relay_port))
    assert 0 < res["direct_p50_ms"] < 1000 and 0 < res["router_p50_ms"] < 1000, res
    assert math.isclose(res["floor_added_p50_ms"] + res["router_own_p50_ms"], res["added_p50_ms"], abs_tol=1e-9), res


def _children(pid: int) -> list[int]:
    """The child pids of process ``pid`` (this test's own router), from its ``/proc/PID/task/PID/children``."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


@pytest.mark.parametrize(("args", "children"), [((), 0), (("--processes", "2"), 2)])
def test_bench_and_test_routers_run_the_processes_they_name(tmp_path, args, children) -> None:  # type: ignore[no-untyped-def]
    """A router started by the tests and benchmarks (tests/cluster.py, bench_capacity's targets) runs one process
    unless it names a count. The router's own default is one process per 8 cores, so on a 16-core host
    bench_capacity's ``dplb1`` ran two processes and its "2 processes / 1" ratio compared two with two (1.01x)."""
    with cluster(str(tmp_path), 1, router_args=list(args)) as c:
        assert c.router is not None
        with open(f"/proc/{c.router.pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        assert argv[argv.index(b"--processes") + 1] == str(max(1, children)).encode()
        assert len(_children(c.router.pid)) == children


def test_capacity_bench_kv_targets(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """benchmarks/bench_capacity.py's KV-event targets, tiny (8 workers, 200 requests, 2 runs alternated, ~20 s):
    dplb1kv's 8 workers publish their engines' KV events into the rings the router drains and dplb1kvsent's
    publish none; both report router CPU per request, the medians over the runs and the kv − kvsent difference."""
    out = tmp_path / "kv.json"
    r = subprocess.run([sys.executable, f"{ROOT}/benchmarks/bench_capacity.py", "--targets", "dplb1kv,dplb1kvsent",
                        "--requests", "200", "--streams", "20", "--tokens", "4", "--rounds", "1", "--repeat", "2",
                        "--json", str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    kv, sent, diff = res["dplb1kv"], res["dplb1kvsent"], res["kv_minus_kvsent"]
    for t in (kv, sent):
        assert len(t["runs"]) == 2 and t["workers"] == 8
        # 80 streamed tokens may cost under one 10 ms tick of router CPU: tok_us may be 0
        assert 0 < t["req_us"] < 10_000 and 0 <= t["tok_us"] < 1_000 and t["tokens_per_stream"] == 4
    assert kv["kv_event_workers"] == 8 and kv["kv_ring_entries"] > 200  # the engines stored and evicted blocks
    assert sent["kv_event_workers"] == 0 and sent["kv_ring_entries"] == 0
    assert len(diff["req_us_all"]) == 2
    assert diff["req_us"] == pytest.approx(statistics.median(
        a["req_us"] - b["req_us"] for a, b in zip(kv["runs"], sent["runs"], strict=True)))
    assert "kv − kvsent" in r.stdout and "=== dplb1kv, 2 runs" in r.stdout


def test_multi_turn_run_sends_one_session_header_per_conversation(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`dplb bench run --conversations N --session-header NAME` sends NAME: conversation-<n> with every turn of
    conversation n (what a front balancer hashes on), each turn carrying the whole history; a plain run sends
    none. The endpoint is a small real HTTP server that records what it receives."""
    import http.server
    import threading

    seen: list[tuple[str | None, int]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _send(self, body: dict) -> None:  # type: ignore[type-arg]
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._send({"object": "list", "data": [{"id": "dplb-sim", "object": "model"}]})

        def do_POST(self) -> None:
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.headers.get("x-session-id"), len(req["messages"])))
            self._send({"id": "x", "object": "chat.completion", "model": "dplb-sim",
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                     "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}})

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        common = ["bench", "run", "--base-url", url, "--no-stream", "--no-progress", "--input-len", "5",
                  "--output-len", "2", "--request-rate", "50"]
        r = subprocess.run(dplb_cmd(*common, "--conversations", "3", "--turns", "2", "--think-time", "0",
                                    "--session-header", "x-session-id"),
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert r.returncode == 0, r.stderr
        multi = list(seen)
        seen.clear()
        plain = subprocess.run(dplb_cmd(*common, "--num-prompts", "3"), capture_output=True, text=True, timeout=60,
                               cwd=ROOT)
        assert plain.returncode == 0, plain.stderr
        bad = subprocess.run(dplb_cmd(*common, "--conversations", "1", "--session-header", "x session"),
                             capture_output=True, text=True, timeout=60, cwd=ROOT)
    finally:
        server.shutdown()
    assert sorted(multi) == sorted((f"conversation-{c}", n) for c in range(3) for n in (2, 4)), multi
    assert [h for h, _ in seen] == [None] * 3
    assert bad.returncode == 2 and "--session-header" in bad.stderr and "Traceback" not in bad.stderr


def test_cache_pressure_targets() -> None:
    """Engine truth against the sent-bytes index and the oracle: error ratio, TTFT P99 ratio at the knee only, hit
    rate gap to the oracle."""
    def summ(ttft_p99: float, err: float | None, hit: float) -> dict:
        return {"e2e_ms": {"p99": 1000.0}, "ttft_ms": {"p99": ttft_p99}, "failed": 0, "worker_share_max_min": 1.0,
                "prefix_cache_hit_rate": hit, "prediction_error_tokens": err}

    pols = {"dplb": summ(400, 10, 0.50), "dplb-sent": summ(1000, 300, 0.45), "oracle": summ(380, 1, 0.52)}
    rows = evaluate_targets({"scenarios": {"cache-pressure": {"policies": pols},
                                           "cache-pressure-50": {"policies": dict(pols, dplb=summ(900, 100, 0.4))}}})
    got = {(r["scenario"], r["target"].split(" ")[0] + r["target"].split(" ")[1]): (r["value"], r["passed"])
           for r in rows}
    assert got[("cache-pressure", "predictionerror")] == (30.0, True)
    assert got[("cache-pressure", "TTFTP99")] == (0.4, True)
    assert math.isclose(got[("cache-pressure", "enginehit")][0], 0.02) and got[("cache-pressure", "enginehit")][1]
    assert got[("cache-pressure-50", "predictionerror")] == (3.0, False)
    assert ("cache-pressure-50", "TTFTP99") not in got  # the TTFT target is the knee's
    assert got[("cache-pressure-50", "enginehit")][1] is False


def test_oracle_scores_what_the_engines_hold(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The bench oracle counts, per worker, the leading sim blocks its engine's events say it holds."""
    import json as _json

    from dplb.bench.oracle import OracleScorer
    from dplb.config import PolicyConfig
    from dplb.policy import RouteRequest, make_policy
    from dplb.state.shm import Lifecycle, WorkerState
    from dplb.worker.engines.sim.prompts import block_hashes as sim_blocks
    from dplb.worker.engines.sim.prompts import render_chat, tokenize
    from dplb.worker.kv_events import BlockRemoved, BlockStored, EventBatch

    monkeypatch.delenv("DPLB_RUN_DIR", raising=False)
    import dplb.bench.oracle  # noqa: F401  (registers the scorer)

    pol = make_policy(PolicyConfig(weights=(("queue", 0.5), ("prefix_oracle", 0.5))), 2)
    sc = pol.scorer("prefix_oracle")
    assert isinstance(sc, OracleScorer)
    messages = [{"role": "user", "content": " ".join(f"w{i}" for i in range(100))}]
    hashes = sim_blocks(tokenize(render_chat(messages)), 16)
    sc.engines[1].on_batch(EventBatch(0.0, [BlockStored(hashes, None, [], 16)]), False)
    sc.engines[0].on_batch(EventBatch(0.0, [BlockStored(hashes[:2], None, [], 16)]), False)
    now = 10**12
    snap = [WorkerState(k, pid=1 + k, lifecycle=Lifecycle.READY, heartbeat_mono_ns=now) for k in range(2)]
    d = pol.pick(snap, now, RouteRequest(_json.dumps(messages).encode()))
    assert d.worker == 1 and d.notes is not None and d.notes["prefix_hit_blocks"] == len(hashes)
    sc.engines[1].on_batch(EventBatch(0.0, [BlockRemoved(hashes[1:])]), False)
    d = pol.pick(snap, now, RouteRequest(_json.dumps(messages).encode()))
    assert d.worker == 0 and d.notes is not None and d.notes["prefix_hit_blocks"] == 2


def test_compare_waits_until_the_router_routes_to_every_worker(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Regression: a compare run started on the router's first ``/ready`` (one routable worker), so a worker the
    router still held out missed a burst that arrived at once (burst-herd once gave one worker none of its 64
    requests). The readiness check counts routable workers: a frozen worker's stale heartbeat takes it out."""
    import os
    import signal
    import time

    from dplb.bench.compare import _router_ready

    with cluster(str(tmp_path / "c"), 2) as c:
        deadline = time.monotonic() + 30
        while not _router_ready(c.url, 2) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _router_ready(c.url, 2) and _router_ready(c.url) and not _router_ready(c.url, 3)
        frozen = c.workers[1]
        os.kill(frozen.pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 30
            while _router_ready(c.url, 2) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not _router_ready(c.url, 2) and _router_ready(c.url, 1)
        finally:
            os.kill(frozen.pid, signal.SIGCONT)
    assert not _router_ready(c.url)  # the router is gone: not ready, no exception
