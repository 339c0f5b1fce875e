"""Policy plugins behave the same in pure Python and compiled (tests/test_native.py runs this file against the
mypyc build too): a plugin may subclass any built-in scorer, picker or filter, and whatever a plugin's ``score`` or
``pick`` returns is normalised by the framework (dplb.policy.framework.plugin_scores / plugin_pick) or refused with
one clear :class:`dplb.errors.PluginError`, logged once; a broken observational hook (``inputs``, ``notes``,
``stats``) leaves its part of a view out instead of failing the request or the scrape.
"""

from __future__ import annotations

import array
import logging
import math
import os
import textwrap
from fractions import Fraction
from typing import Any

import httpx
import pytest
from cluster import cluster

from dplb.config import PolicyConfig
from dplb.errors import PluginError
from dplb.policy import PickContext, Scorer, make_policy, register_scorer
from dplb.policy.decision import Candidate
from dplb.policy.filters import Fresh, NotTried, UnderHardCap
from dplb.policy.framework import PICKERS, Picker
from dplb.policy.pickers import LeastLoaded, MaxScore, RoundRobin
from dplb.policy.scorers import LatencyScorer, MemoryScorer, QueueScorer
from dplb.state.shm import Lifecycle, WorkerState

NOW = 10**12


def _snap(n: int = 4, busy: int = -1) -> list[WorkerState]:
    return [WorkerState(k, pid=1 + k, lifecycle=Lifecycle.READY, heartbeat_mono_ns=NOW,
                        num_running=8 if k == busy else 0) for k in range(n)]


class Returns(Scorer):
    """A scorer that returns ``Returns.value(cands)``: what each test sets."""

    name = "returns_inproc"
    value: Any = None

    def score(self, cands: list[Candidate], ctx: PickContext) -> Any:
        return type(self).value(cands)


register_scorer(Returns)


def _pick_with(value: Any, n: int = 4) -> Any:
    Returns.value = value
    p = make_policy(PolicyConfig(weights=(("queue", 0.5), ("returns_inproc", 0.5))), n)
    return p.pick(_snap(n, busy=0), NOW)


@pytest.mark.parametrize("make", [
    lambda cs: tuple(1.0 for _ in cs),                       # a tuple (compiled: "list object expected; got tuple")
    lambda cs: [1 for _ in cs],                              # ints
    lambda cs: [True for _ in cs],                           # bools
    lambda cs: array.array("d", [1.0] * len(cs)),            # a sequence that is not a list
    lambda cs: [Fraction(3, 2) for _ in cs],                 # another real number: clamped to 1.0
], ids=["tuple", "ints", "bools", "array", "fractions"])
def test_any_sequence_of_numbers_becomes_the_frameworks_floats(make) -> None:  # type: ignore[no-untyped-def]
    d = _pick_with(make)
    terms = [d.terms(c)["returns_inproc"] for c in d.candidates]
    assert terms == [1.0] * 4 and all(type(t) is float for t in terms), terms
    assert d.worker != 0  # the busy worker loses on the queue term: the scores were used


def test_out_of_range_values_are_still_clamped() -> None:
    d = _pick_with(lambda cs: (5, math.nan, -3, 0.25))
    assert [d.terms(c)["returns_inproc"] for c in d.candidates] == [1.0, 0.0, 0.0, 0.25]


@pytest.mark.parametrize(("make", "says"), [
    (lambda cs: [1.0] * (len(cs) - 1), "score() returned 3 values for 4 candidates"),
    (lambda cs: [1.0, "0.5", 1.0, 1.0], "score() returned '0.5' (a str) at index 1"),
    (lambda cs: [1.0, 1.0, None, 1.0], "score() returned None (a NoneType) at index 2"),
    (lambda cs: (1.0 for _ in cs), "score() returned a generator, not a sequence of numbers"),
    (lambda cs: {c.worker_id: 1.0 for c in cs}, "score() returned a dict, not a sequence of numbers"),
    (lambda cs: 1.0, "score() returned a float, not a sequence of numbers"),
], ids=["short", "str", "none", "generator", "dict", "scalar"])
def test_anything_else_fails_the_pick_with_one_clear_error_logged_once(make, says, caplog) -> None:  # type: ignore[no-untyped-def]
    """The pick fails, as it does when the plugin raises (the request gets the router's error answer), with a
    message naming the plugin, what it returned and what it must return; logged once per plugin and process."""
    from dplb.policy import framework

    framework._REPORTED.discard("returns_inproc")
    with caplog.at_level(logging.ERROR, logger="dplb.policy"):
        for _ in range(3):
            with pytest.raises(PluginError) as e:
                _pick_with(make)
    msg = str(e.value)
    assert msg.startswith(f"policy plugin 'returns_inproc' ({__name__}.Returns): {says}; it must return one number "
                          "per candidate, in order; every pick fails until it is fixed"), msg
    logged = [r.getMessage() for r in caplog.records if r.name == "dplb.policy"]
    assert logged == [msg], logged


# ---- the observational hooks: inputs, notes, stats -----------------------------------------------------------------
class Views(Scorer):
    """A scorer whose ``inputs``, ``notes`` and ``stats`` return ``Views.value`` (or raise it): what each test sets."""

    name = "views_inproc"
    value: Any = None

    def score(self, cands: list[Candidate], ctx: PickContext) -> list[float]:
        return [0.5 for _ in cands]

    def _hook(self) -> Any:
        if isinstance(type(self).value, Exception):
            raise type(self).value
        return type(self).value

    def inputs(self, c: Candidate, ctx: PickContext) -> Any:
        return self._hook()

    def notes(self, request: Any, worker: int) -> Any:
        return self._hook()

    def stats(self) -> Any:
        return self._hook()


register_scorer(Views)


@pytest.mark.parametrize(("value", "says"), [
    (["a list"], "returned a list"),
    ({1: 2.0}, "returned a mapping with a key that is not a str"),
    ({"n": "many"}, None),  # a fine note or input; not a number for stats
    (RuntimeError("boom"), "raised RuntimeError: boom"),
], ids=["list", "int-key", "str-value", "raises"])
def test_a_broken_view_hook_leaves_its_part_out_and_the_pick_goes_on(value, says, caplog) -> None:  # type: ignore[no-untyped-def]
    """``inputs``/``notes``/``stats`` feed views and metrics, never the choice: whatever they return or raise, the
    pick, the decision's JSON view and the stats go on without the broken part, one error logged per hook (a
    plugin's notes returning a list made every request a 500, and its stats every /metrics scrape)."""
    from dplb.policy import framework

    for hook in ("inputs", "notes", "stats"):
        framework._REPORTED.discard(f"views_inproc.{hook}")
    Views.value = value
    p = make_policy(PolicyConfig(weights=(("queue", 0.5), ("views_inproc", 0.5))), 4)
    with caplog.at_level(logging.ERROR, logger="dplb.policy"):
        for _ in range(3):
            d = p.pick(_snap(4, busy=0), NOW)
            assert d.worker is not None and d.worker != 0
            view = d.to_dict()
            notes, stats = d.notes, p.plugin_stats()
    ok = says is None
    assert notes == (value if ok else None) and d.prefix_outcome() is None
    assert all(("n" in c) == ok for c in view["candidates"]), view["candidates"]  # type: ignore[union-attr]
    assert "views_inproc" not in stats
    logged = [r.getMessage() for r in caplog.records if r.name == "dplb.policy"]
    hooks = ["stats"] if ok else ["inputs", "notes", "stats"]
    assert len(logged) == len(hooks), logged
    for hook in hooks:
        want = "returned a mapping with a value that is not a real number" if ok else says
        line = next(m for m in logged if f"{hook}()" in m)
        assert line.startswith(f"policy plugin 'views_inproc' ({__name__}.Views): {hook}() {want}") \
            and line.endswith(f"its {hook} are left out"), line


# ---- subclasses of the built-ins -------------------------------------------------------------------------------------
class HalfQueue(QueueScorer):
    """A plugin's tweak of a built-in scorer: half its term (compiled: "interpreted classes cannot inherit from
    compiled" when the built-in was not opened to them)."""

    name = "half_queue_inproc"

    def score(self, cands: list[Candidate], ctx: PickContext) -> list[float]:
        return [v / 2 for v in super().score(cands, ctx)]


register_scorer(HalfQueue)


@pytest.mark.parametrize("base", [QueueScorer, MemoryScorer, LatencyScorer, MaxScore, RoundRobin, LeastLoaded, Fresh,
                                  NotTried, UnderHardCap])
def test_every_built_in_can_be_subclassed(base) -> None:  # type: ignore[no-untyped-def]
    sub = type(f"My{base.__name__}", (base,), {"name": f"my_{base.__name__.lower()}"})
    obj = sub(PolicyConfig()) if base in (Fresh, NotTried, UnderHardCap) else sub(PolicyConfig(), 4)
    assert isinstance(obj, base)


def test_a_subclassed_built_in_scorer_runs_its_override() -> None:
    p = make_policy(PolicyConfig(weights=(("queue", 0.5), ("half_queue_inproc", 0.5))), 4)
    d = p.pick(_snap(busy=0), NOW)
    busy = d.candidates[0]
    assert d.terms(busy)["half_queue_inproc"] == pytest.approx(d.terms(busy)["queue"] / 2) and d.worker != 0


class ListPicker(MaxScore):
    """A picker returning a list instead of a tuple (what ``pick`` unpacks either way in pure Python)."""

    def pick(self, eligible: list[Candidate], ctx: PickContext) -> Any:
        return [eligible[-1], "mine"]


class BarePicker(Picker):
    """A picker returning the candidate alone."""

    def pick(self, eligible: list[Candidate], ctx: PickContext) -> Any:
        return eligible[0]


def test_a_plugin_pickers_result_is_normalised_or_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(PICKERS, "round_robin", ListPicker)
    d = make_policy(PolicyConfig(name="round_robin"), 4).pick(_snap(), NOW)
    assert d.worker is not None and d.reason == "mine"
    monkeypatch.setitem(PICKERS, "round_robin", BarePicker)
    with pytest.raises(PluginError, match=r"pick\(\) returned .*; it must return \(candidate, reason: str\)"):
        make_policy(PolicyConfig(name="round_robin"), 4).pick(_snap(), NOW)


def test_plugins_that_subclass_built_ins_or_return_tuples_on_a_real_router(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """What a plugin author writes, loaded by ``--policy-plugin`` into a real router (the compiled one when
    tests/test_native.py runs this file against the build): a subclass of the built-in queue scorer and a scorer
    returning a tuple of ints. Every request is answered and the decisions carry both terms as numbers."""
    plugdir = tmp_path / "plug"
    plugdir.mkdir()
    (plugdir / "tweaks_plugin.py").write_text(textwrap.dedent('''
        from dplb.policy import register_scorer
        from dplb.policy.framework import Scorer
        from dplb.policy.scorers import QueueScorer

        class Halved(QueueScorer):
            name = "halved"

            def score(self, cands, ctx):
                return [v / 2 for v in super().score(cands, ctx)]

        class LastOne(Scorer):
            name = "last_one"

            def score(self, cands, ctx):
                return tuple(int(c.worker_id == self.num_workers - 1) for c in cands)

        class Noisy(Scorer):
            name = "noisy"

            def score(self, cands, ctx):
                return [0.0 for _ in cands]

            def notes(self, request, worker):
                return ["not", "a", "dict"]

            def stats(self):
                raise RuntimeError("broken stats")

        register_scorer(Halved)
        register_scorer(LastOne)
        register_scorer(Noisy)
    '''))
    monkeypatch.setenv("PYTHONPATH", f"{plugdir}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    args = ["--policy-plugin", "tweaks_plugin", "--weights", "queue=0.4,halved=0.2,last_one=0.3,noisy=0.1"]
    with cluster(str(tmp_path), 2, router_args=args) as c:
        body = {"model": "dplb-sim", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
        got = [httpx.post(c.url + "/v1/chat/completions", json=body, timeout=30) for _ in range(4)]
        assert [r.status_code for r in got] == [200] * 4, [r.text for r in got]
        assert {r.headers["x-sg-worker-id"] for r in got} == {"1"}
        d = httpx.get(c.url + "/debug/decisions?limit=1").json()[0]
        terms = d["candidates"][1]["terms"]
        assert terms["last_one"] == 1.0 and terms["halved"] == pytest.approx(terms["queue"] / 2), terms
        # A plugin's broken notes and stats hooks (views only) cost neither the requests nor the scrape.
        m = httpx.get(c.url + "/metrics", timeout=30)
        assert m.status_code == 200 and "dplb_policy_weight" in m.text, m.text[:300]
        log = c.router_log()
        assert log.count("policy plugin 'noisy'") == 2 and "its notes are left out" in log \
            and "stats() raised RuntimeError: broken stats" in log, log[-2000:]
