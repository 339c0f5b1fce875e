"""The policy framework's extension point: a user adds a scorer in one file plus one registration line, and its
term shows up in decisions, /debug/decisions, traces and metrics without edits there."""

from __future__ import annotations

import os
import textwrap
from collections import Counter
from typing import Any

import httpx
import pytest
from cluster import cluster

from dplb.config import PolicyConfig
from dplb.obs.metrics import WorkerStateCollector
from dplb.obs.tracing import candidate_event_attributes
from dplb.policy import PickContext, Scorer, make_policy, register_scorer
from dplb.policy.decision import Candidate
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
        r = subprocess.run([sys.executable, "-m", "dplb.cli", "router", "--num-workers", "1", "--port", "0",
                            "--run-dir", str(tmp_path / "run2"), *extra], capture_output=True, text=True, timeout=30)
        assert r.returncode != 0 and needle in r.stderr, r.stderr


# A non-default value for each router/policy flag whose default cannot simply be bumped.
_FLAG_VALUES = {
    "--host": "127.0.0.1", "--api-key": "sekret", "--api-key-exempt": "/health", "--weights": "queue=1",
    "--policy-plugin": "json", "--cors-allowed-origins": "https://a.example", "--router-processes": "3",
    "--latency-deadband": "0.5", "--waiting-weight": "2",
}


def test_every_router_flag_reaches_the_router_config() -> None:
    """Issue 14: `dplb launch` hands its router the validated :class:`RouterConfig` whole (JSON in the environment)
    instead of re-emitting flags, so a flag can only be lost where the config is built. Every flag of the router and
    policy groups must change the config when set, and the config must survive the JSON hand-off unchanged."""
    import argparse

    from dplb.config import RouterConfig
    from dplb.router.cli import add_router_args, router_config

    p = argparse.ArgumentParser()
    add_router_args(p)

    def build(argv: list[str]) -> RouterConfig:
        return router_config(p.parse_args(argv), run_dir="/tmp/x", shm_path=None, num_workers=2)

    base = build([])
    for action in p._actions:
        if not action.option_strings or action.dest == "help":
            continue
        flag = action.option_strings[0]
        if action.nargs == 0:
            argv = [flag]
        elif action.choices:
            argv = [flag, next(str(c) for c in action.choices if c != action.default)]
        elif flag in _FLAG_VALUES:
            argv = [flag, _FLAG_VALUES[flag]]
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
