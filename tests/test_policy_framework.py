"""The policy framework's extension point: a user adds a scorer in one file plus one registration line, and its
term shows up in decisions, /debug/decisions, traces and metrics without edits there; its guarantees: terms clamped
into [0, 1] unless a scorer is marked bounded, each plugin's own declared parameters (``--scorer-param``), one
namespace of names, and what plugins learn, note and report reaching the router's state and metrics by name."""

from __future__ import annotations

import math
import os
import textwrap
from collections import Counter
from typing import Any

import httpx
import pytest
from cluster import cluster, free_port
from prometheus_client import generate_latest

from dplb.config import PolicyConfig, parse_param
from dplb.errors import ConfigError
from dplb.obs.metrics_router import RouterMetrics
from dplb.obs.metrics_scrape import WorkerStateCollector
from dplb.obs.tracing import candidate_event_attributes
from dplb.policy import PickContext, RouteRequest, Scorer, make_policy, register_scorer
from dplb.policy.decision import Candidate
from dplb.policy.framework import Param, Picker, clamp_unit, register_picker
from dplb.policy.prefix import ENTRY_BYTES
from dplb.policy.scorers import PrefixScorer
from dplb.state.shm import Lifecycle, WorkerState

NOW = 10**12


class OddWorkers(Scorer):
    """Toy scorer: odd worker ids score 1, even ones 0."""

    name = "odd_inproc"

    def score(self, cands: list[Candidate], ctx: PickContext) -> list[float]:
        return [float(c.worker_id % 2) for c in cands]

    def inputs(self, c: Candidate, ctx: PickContext) -> dict[str, Any]:
        return {"odd": bool(c.worker_id % 2)}


register_scorer(OddWorkers)  # the one registration line


def test_a_registered_toy_scorer_shows_up_everywhere() -> None:
    p = make_policy(PolicyConfig(weights=(("queue", 0.5), ("odd_inproc", 0.5))), 4)
    snap = [WorkerState(k, pid=1 + k, lifecycle=Lifecycle.READY, heartbeat_mono_ns=NOW) for k in range(4)]
    picks = Counter(p.pick(snap, NOW).worker for _ in range(8))
    assert set(picks) == {1, 3}  # the toy term decides between equal loads
    d = p.pick(snap, NOW)
    view = d.to_dict()
    c1 = view["candidates"][1]  # type: ignore[index]
    assert c1["terms"] == {"queue": pytest.approx(1 - c1["queue"] / 16), "odd_inproc": 1.0} and c1["odd"] is True
    attrs = candidate_event_attributes(d, d.candidates[1])
    assert attrs["dplb.term.odd_inproc"] == 1.0 and attrs["dplb.odd"] is True
    fams = {m.name: m for m in WorkerStateCollector(lambda: (p.pick(snap, NOW, dry_run=True), [0] * 4, 4, None,
                                                             p)).collect()}
    terms = {(s.labels["worker"], s.labels["term"]): s.value for s in fams["dplb_worker_score_term"].samples}
    assert terms[("1", "odd_inproc")] == 1.0 and terms[("0", "odd_inproc")] == 0.0
    weights = {s.labels["term"]: s.value for s in fams["dplb_policy_weight"].samples}
    assert weights == {"queue": 0.5, "odd_inproc": 0.5}


def test_name_clash_and_bad_names_are_refused() -> None:
    class Other(Scorer):
        name = "queue"

    with pytest.raises(ValueError, match="already registered"):
        register_scorer(Other)
    Other.name = "not an identifier"
    with pytest.raises(ValueError, match="identifier"):
        register_scorer(Other)


def test_a_plugin_module_on_a_real_router(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """The same from outside the package: one file with the class and its registration line, loaded by
    ``--policy-plugin``; every request goes to the worker the toy scorer prefers, and /debug/decisions and /metrics
    carry its term. A plugin that cannot be imported, or a weight for an unregistered scorer, stops start-up with
    a message naming it."""
    plugdir = tmp_path / "plug"
    plugdir.mkdir()
    (plugdir / "last_worker_scorer.py").write_text(textwrap.dedent('''
        from dplb.policy import Scorer, register_scorer

        class LastWorker(Scorer):
            name = "last_worker"

            def score(self, cands, ctx):
                return [1.0 if c.worker_id == self.num_workers - 1 else 0.0 for c in cands]

        register_scorer(LastWorker)
    '''))
    monkeypatch.setenv("PYTHONPATH", f"{plugdir}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    args = ["--policy-plugin", "last_worker_scorer", "--weights", "queue=0.5,last_worker=0.5"]
    with cluster(str(tmp_path), 2, router_args=args) as c:
        body = {"model": "dplb-sim", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
        got = {httpx.post(c.url + "/v1/chat/completions", json=body, timeout=30).headers["x-sg-worker-id"]
               for _ in range(5)}
        assert got == {"1"}
        d = httpx.get(c.url + "/debug/decisions?limit=1").json()[0]
        assert d["candidates"][1]["terms"]["last_worker"] == 1.0
        assert 'dplb_worker_score_term{term="last_worker",worker="1"} 1.0' in httpx.get(c.url + "/metrics").text
    import subprocess
    import sys

    for extra, needle in ((["--policy-plugin", "no_such_module"], "--policy-plugin no_such_module: cannot import"),
                          (["--weights", "queue=0.5,speed=0.5"], "unknown scorer 'speed'")):
        r = subprocess.run([sys.executable, "-m", "dplb.cli", "router", "--num-workers", "1", "--port", str(free_port()),
                            "--run-dir", str(tmp_path / "run2"), *extra], capture_output=True, text=True, timeout=30)
        assert r.returncode != 0 and needle in r.stderr, r.stderr


# A non-default value for each router/policy flag whose default cannot simply be bumped.
_FLAG_VALUES = {
    "--host": "127.0.0.1", "--api-key": "sekret", "--api-key-exempt": "/health", "--weights": "queue=1",
    "--policy-plugin": "json", "--cors-allowed-origins": "https://a.example", "--router-processes": "3",
    "--latency-deadband": "0.5", "--waiting-weight": "2", "--scorer-param": "prefix.max_blocks=512",
    "--agent-port": "31999",
}


def test_every_router_flag_reaches_the_router_config(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`dplb launch` hands its router the validated :class:`RouterConfig` whole (JSON in the environment)
    instead of re-emitting flags, so a flag can only be lost where the config is built. Every flag of the router and
    policy groups must change the config when set, and the config must survive the JSON hand-off unchanged."""
    import argparse

    from dplb.config import RouterConfig
    from dplb.router.cli import add_router_args, router_config

    p = argparse.ArgumentParser()
    add_router_args(p)

    def build(argv: list[str]) -> RouterConfig:
        return router_config(p.parse_args(argv), run_dir="/tmp/x", shm_path=None, num_workers=2)

    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[tenants.a]\napi_key_sha256 = ["' + "0" * 64 + '"]\n')
    values = {**_FLAG_VALUES, "--tenants": str(tenants)}
    base = build([])
    for action in p._actions:
        if not action.option_strings or action.dest == "help":
            continue
        flag = action.option_strings[0]
        if flag == "--engine-priority":  # needs the tenants file's classes
            argv = [flag, "--tenants", str(tenants)]
        elif action.nargs == 0:
            argv = [flag]
        elif action.choices:
            argv = [flag, next(str(c) for c in action.choices if c != action.default)]
        elif flag in values:
            argv = [flag, values[flag]]
        else:
            argv = [flag, str(type(action.default)(action.default * 2 + 1))]  # int/float defaults
        cfg = build(argv)
        assert cfg != base, f"{flag} does not reach RouterConfig"
        assert RouterConfig.from_json(cfg.to_json(), cfg.api_key) == cfg, flag


def test_exported_inputs_are_what_the_score_used() -> None:
    """Regression: with --latency-signal ttft the exported latency was the E2E mean. Metrics and trace
    events now carry every input the scorers read: the latency they used, max_queue, running/waiting separately,
    the correction, baseline, lifecycle and state age."""
    p = make_policy(PolicyConfig(latency_signal="ttft"), 2)
    for _ in range(50):
        p.observe_latency(2.0, 0.2)
    snap = [WorkerState(k, pid=1 + k, lifecycle=Lifecycle.READY, heartbeat_mono_ns=NOW - 10**8, num_running=2,
                        num_waiting=k, avg_latency_s=1.5, avg_ttft_s=0.05 * (k + 1), max_num_seqs=8)
            for k in range(2)]
    d = p.pick(snap, NOW, dry_run=True)
    fams = {m.name: {s.labels.get("worker"): s.value for s in m.samples}
            for m in WorkerStateCollector(lambda: (d, [0, 0], 2, p.baseline_s, p)).collect()}
    assert fams["dplb_worker_latency_avg_seconds"] == {"0": 0.05, "1": pytest.approx(0.1)}  # TTFT, as scored
    assert fams["dplb_worker_e2e_avg_seconds"] == {"0": 1.5, "1": 1.5}
    assert fams["dplb_worker_ttft_avg_seconds"]["1"] == pytest.approx(0.1)
    assert fams["dplb_worker_requests_running"] == {"0": 2, "1": 2}
    assert fams["dplb_worker_requests_waiting"] == {"0": 0, "1": 1}
    assert fams["dplb_worker_inflight_correction"] == {"0": 0, "1": 0} and fams["dplb_worker_max_queue"]["0"] == 16
    info = next(m for m in WorkerStateCollector(lambda: (d, [0, 0], 2, p.baseline_s, p)).collect()
                if m.name == "dplb_policy")
    assert info.samples[0].labels["latency_signal"] == "ttft" and info.samples[0].labels["max_queue"] == "16"
    attrs = candidate_event_attributes(d, d.candidates[1])
    assert attrs["dplb.latency_s"] == pytest.approx(0.1) and attrs["dplb.baseline_s"] == 0.2
    assert attrs["dplb.max_queue"] == 16 and attrs["dplb.lifecycle"] == "ready"
    assert attrs["dplb.state_age_s"] == pytest.approx(0.1) and attrs["dplb.num_waiting"] == 1


# ---- the framework's guarantees ------------------------------------------------------------------------------------
class Boost(Scorer):
    """Toy scorer that ignores the contract: 5.0 for worker 0, NaN for worker 2, −3 for worker 3, 1.0 for the
    rest; its own parameter ``factor`` scales worker 0's value."""

    name = "boost_inproc"
    parameters = (Param("factor", float, default=1.0, check=lambda v: v > 0, expect="> 0"),)

    def score(self, cands: list[Candidate], ctx: PickContext) -> list[float]:
        f = self.params["factor"]
        return [[5.0 * f, 1.0, math.nan, -3.0][c.worker_id % 4] for c in cands]


class Trusted(Boost):
    """The same values, marked bounded: the framework trusts it."""

    name = "bounded_boost_inproc"
    bounded = True


register_scorer(Boost)
register_scorer(Trusted)


def test_scores_of_an_unbounded_scorer_are_clamped() -> None:
    """Unclamped, worker 0 (queue 8: queue term 0.5) would score 0.5·0.5 + 0.5·5 = 2.75 and win every pick over an
    idle worker 1 (0.5 + 0.5 = 1). Clamped, its boost term is 1.0, the idle worker wins, and every term the
    decision shows is in [0, 1] (NaN → 0, −3 → 0)."""
    p = make_policy(PolicyConfig(weights=(("queue", 0.5), ("boost_inproc", 0.5))), 4)
    snap = [WorkerState(k, pid=1 + k, lifecycle=Lifecycle.READY, heartbeat_mono_ns=NOW, num_running=8 if k == 0
                        else 0) for k in range(4)]
    d = p.pick(snap, NOW)
    assert d.worker == 1
    terms = [d.terms(c)["boost_inproc"] for c in d.candidates]
    assert terms == [1.0, 1.0, 0.0, 0.0]
    assert all(0.0 <= c.score <= 1.0 for c in d.candidates)
    assert clamp_unit([2.0, -0.5, math.nan, 0.25, math.inf, -math.inf]) == [1.0, 0.0, 0.0, 0.25, 1.0, 0.0]


def test_a_bounded_scorer_is_trusted() -> None:
    """``bounded = True`` skips the clamp (the built-ins, whose [0, 1] guarantee tests/test_scorers.py checks)."""
    p = make_policy(PolicyConfig(weights=(("queue", 0.5), ("bounded_boost_inproc", 0.5))), 4)
    snap = [WorkerState(k, pid=1 + k, lifecycle=Lifecycle.READY, heartbeat_mono_ns=NOW) for k in range(4)]
    d = p.pick(snap, NOW)
    assert d.terms(d.candidates[0])["bounded_boost_inproc"] == 5.0 and d.worker == 0


def test_a_plugin_gets_its_own_parameters() -> None:
    p = make_policy(PolicyConfig(weights=(("queue", 0.5), ("boost_inproc", 0.5)),
                                 params=(("boost_inproc", "factor", "0.1"),)), 4)
    snap = [WorkerState(k, pid=1 + k, lifecycle=Lifecycle.READY, heartbeat_mono_ns=NOW) for k in range(4)]
    d = p.pick(snap, NOW)
    assert d.terms(d.candidates[0])["boost_inproc"] == pytest.approx(0.5)  # 5.0 · 0.1, inside [0, 1]
    assert p.plugin_params()["boost_inproc"] == {"factor": 0.1}
    info = next(m for m in WorkerStateCollector(lambda: (d, [0] * 4, 4, None, p)).collect() if m.name == "dplb_policy")
    labels = info.samples[0].labels
    assert labels["boost_inproc_factor"] == "0.1" and labels["prefix_block_bytes"] == "128"
    assert labels["latency_deadband"] == "0.25"
    with pytest.raises(ConfigError, match=r"boost_inproc\.factor must be a finite number, > 0"):
        make_policy(PolicyConfig(params=(("boost_inproc", "factor", "0"),)), 4)


@pytest.mark.parametrize("params, expect", [
    ((), {"waiting_weight": "1", "queue_waiting_weight": "1", "prefix_block_bytes": "128"}),
    ((("queue", "waiting_weight", "4"),), {"waiting_weight": "4", "queue_waiting_weight": "4"}),
    ((("latency", "deadband", "0.1"), ("memory", "signal", "gpu")), {"latency_deadband": "0.1", "memory_signal": "gpu"}),
    ((("prefix", "block_bytes", "64"),), {"prefix_block_bytes": "64"}),
])
def test_policy_info_shows_the_parameters_in_force_under_their_flag_names(params, expect) -> None:  # type: ignore[no-untyped-def]
    """dplb_policy_info's older-flag labels (``waiting_weight`` for ``--waiting-weight``) show what the plugin
    uses, also when ``--scorer-param`` set it: never 1 beside ``queue_waiting_weight="4"``."""
    p = make_policy(PolicyConfig(params=params), 2)
    snap = [WorkerState(k, pid=1 + k, lifecycle=Lifecycle.READY, heartbeat_mono_ns=NOW) for k in range(2)]
    d = p.pick(snap, NOW, dry_run=True)
    info = next(m for m in WorkerStateCollector(lambda: (d, [0] * 2, 2, None, p)).collect() if m.name == "dplb_policy")
    labels = info.samples[0].labels
    assert {k: labels[k] for k in expect} == expect


PARSE = [  # --scorer-param text → (plugin, param, value) or the error
    ("prefix.block_bytes=128", ("prefix", "block_bytes", "128")),
    (" prefix . ttl_s = 5 ", ("prefix", "ttl_s", "5")),
    ("prefix.block_bytes", "PLUGIN.PARAM=VALUE"),
    ("block_bytes=128", "PLUGIN.PARAM=VALUE"),
    ("prefix.=1", "PLUGIN.PARAM=VALUE"),
    ("pre fix.a=1", "PLUGIN.PARAM=VALUE"),
    ("prefix.block_bytes=", "PLUGIN.PARAM=VALUE"),
]


@pytest.mark.parametrize(("text", "want"), PARSE)
def test_parse_param(text: str, want: object) -> None:
    if isinstance(want, tuple):
        assert parse_param(text) == want
    else:
        with pytest.raises(ConfigError, match=str(want)):
            parse_param(text)


def test_config_refuses_a_parameter_given_twice() -> None:
    with pytest.raises(ConfigError, match=r"prefix\.ttl_s is given twice"):
        PolicyConfig(params=(("prefix", "ttl_s", "1"), ("prefix", "ttl_s", "2")))


def test_scorer_param_on_the_command_line() -> None:
    """``--scorer-param`` reaches the plugin through the validated config (and its JSON hand-off); a bad one stops
    ``dplb router`` with one line naming the flag: unknown plugin, unknown parameter, bad value."""
    import argparse
    import subprocess
    import sys

    from dplb.config import RouterConfig
    from dplb.router.cli import add_router_args, router_config

    ap = argparse.ArgumentParser()
    add_router_args(ap)
    cfg = router_config(ap.parse_args(["--scorer-param", "prefix.block_bytes=64", "--scorer-param",
                                       "latency.deadband=0.1"]), run_dir="/tmp/x", shm_path=None, num_workers=2)
    assert RouterConfig.from_json(cfg.to_json()) == cfg
    p = make_policy(cfg.policy, 2)
    assert p.scorer("prefix").block_bytes == 64 and p.scorer("latency").params["deadband"] == 0.1  # type: ignore[union-attr]
    for arg, needle in (("nope.x=1", "--scorer-param nope.x=1: no plugin 'nope'; scorers: "),
                        ("prefix.size=1", "--scorer-param prefix.size=1: prefix has no parameter 'size'"),
                        ("prefix.block_bytes=abc", "prefix.block_bytes must be an integer, 1..65536 bytes"),
                        ("prefix-block_bytes", "--scorer-param must be PLUGIN.PARAM=VALUE"),
                        ("random.seed=1", "--scorer-param random.seed=1: random is not in use")):
        r = subprocess.run([sys.executable, "-m", "dplb.cli", "router", "--num-workers", "1", "--port", str(free_port()),
                            "--run-dir", "/tmp/dplb-noexist", "--scorer-param", arg], capture_output=True, text=True,
                           timeout=30)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode != 0 and needle in r.stderr and len(lines) == 1, r.stderr


def test_a_parameter_for_a_plugin_not_in_use_is_refused() -> None:
    """A ``--scorer-param`` that would change nothing (its scorer is not weighted, its picker is not the policy's)
    is a one-line error naming the flag, after the value itself was checked; the same parameter is accepted where
    the plugin runs."""
    unweighted = PolicyConfig(weights=(("queue", 1.0),), params=(("prefix", "block_bytes", "64"),))
    with pytest.raises(ConfigError, match=r"^--scorer-param prefix\.block_bytes=64: prefix is not in use \(this "
                       r"configuration runs scorers queue, picker max_score \(--policy dplb\)\); weight it in "
                       r"--weights or drop the flag$"):
        make_policy(unweighted, 2)
    with pytest.raises(ConfigError, match=r"random\.seed=3: random is not in use .* choose the --policy that uses"):
        make_policy(PolicyConfig(params=(("random", "seed", "3"),)), 2)
    assert make_policy(PolicyConfig(name="random", params=(("random", "seed", "3"),)), 2).picker.params["seed"] == 3
    with pytest.raises(ConfigError, match=r"prefix\.block_bytes must be an integer"):  # the value is checked first
        make_policy(PolicyConfig(weights=(("queue", 1.0),), params=(("prefix", "block_bytes", "x"),)), 2)


def test_one_namespace_for_scorers_and_pickers() -> None:
    class Clash(Picker):
        name = "prefix"  # a scorer's name

    with pytest.raises(ValueError, match="already registered"):
        register_picker(Clash)


class SecondPrefix(PrefixScorer):
    """A second scorer that shares what it learns."""

    name = "copy_prefix_inproc"


register_scorer(SecondPrefix)


def test_only_one_scorer_may_share_what_it_learns() -> None:
    with pytest.raises(ConfigError, match="share what they learn"):
        make_policy(PolicyConfig(weights=(("prefix", 0.5), ("copy_prefix_inproc", 0.5))), 2)


def test_metrics_read_plugin_notes_and_stats_by_name() -> None:
    """The router's metrics know no plugin internals: they count the notes a routed decision carries and export
    the stats a plugin reports, by name."""
    m = RouterMetrics("test")
    p = make_policy(PolicyConfig(), 2)
    snap = [WorkerState(k, pid=1 + k, lifecycle=Lifecycle.READY, heartbeat_mono_ns=NOW) for k in range(2)]
    prompt = b'[{"role":"user","content":"' + b"hello " * 100 + b'"}]'
    for i in range(3):
        m.observe_decision(p.pick(snap, NOW + i, RouteRequest(prompt)), 1e-5)
    text = generate_latest(m.registry).decode()
    n = len(prompt) // 128
    assert 'dplb_prefix_routed_total{outcome="miss"} 1.0' in text
    assert 'dplb_prefix_routed_total{outcome="hit"} 2.0' in text
    chosen = p.pick(snap, NOW + 9, RouteRequest(prompt)).worker
    assert f'dplb_prefix_query_blocks_total{{worker="{chosen}"}} {3.0 * n}' in text
    assert f'dplb_prefix_hit_blocks_total{{worker="{chosen}"}} {2.0 * n}' in text
    fams = {f.name: f for f in WorkerStateCollector(lambda: (None, [0, 0], 2, None, p)).collect()}
    assert fams["dplb_prefix_index_blocks"].samples[0].value == n
    assert fams["dplb_prefix_index_bytes"].samples[0].value == n * ENTRY_BYTES
    off = make_policy(PolicyConfig(prefix_block_bytes=0), 2)
    assert "dplb_prefix_index_blocks" not in {f.name for f in WorkerStateCollector(lambda: (None, [0, 0], 2, None,
                                                                                           off)).collect()}
