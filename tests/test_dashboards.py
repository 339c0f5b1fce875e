"""Dashboards: the committed JSON is what the grafanalib sources generate, it imports into Grafana 11/12 (schema,
data source variable, ids, grid, units), it only names real metrics, and every query works against a real
Prometheus scraping a live sim cluster (router + 2 workers) under light load."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from itertools import combinations
from pathlib import Path
from typing import Any

import pytest
from cluster import ROOT, cluster, free_port, need
from test_alerts import Load, Prometheus, known_dplb, metric_names

from dplb.obs import metrics as M
from dplb.worker.engines.sim.scheduler import SimConfig, SimScheduler

DASH_DIR = Path(ROOT) / "dashboards"
DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
REQUIRED_UNITS = {"s", "bytes", "percentunit", "reqps"}


def _generator() -> Any:
    sys.path.insert(0, str(DASH_DIR))
    try:
        import generate
    finally:
        sys.path.remove(str(DASH_DIR))
    return generate


def dashboards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASH_DIR.glob("*.json"))}


def data_panels(d: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in d["panels"] if p["type"] != "row"]


def all_exprs() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, expr) of every query."""
    return [(name, p["title"], t["expr"]) for name, d in dashboards().items() for p in data_panels(d)
            for t in p["targets"]]


def sim_vllm_names() -> set[str]:
    """Every vllm:* sample name the sim engine exposes."""
    reg = SimScheduler(SimConfig()).metrics.registry
    return {s.name for fam in reg.collect() for s in fam.samples}


# ---- generation --------------------------------------------------------------------------------------------------
def test_committed_json_equals_regenerated_json() -> None:
    gen = _generator()
    out = gen.generate()
    assert {p.name for p in out} == {"dplb-overview.json", "dplb-routing.json", "dplb-engine.json", "dplb-fleet.json",
                                     "dplb-integrity.json"}
    for path, text in out.items():
        assert path.exists(), f"{path.name} not committed: run .venv/bin/python dashboards/generate.py"
        assert path.read_text() == text, f"{path.name} differs from its source: run .venv/bin/python dashboards/generate.py"
    r = subprocess.run([sys.executable, str(DASH_DIR / "generate.py"), "--check"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_check_mode_fails_on_any_difference(tmp_path: Path) -> None:
    copy = tmp_path / "dashboards"
    shutil.copytree(DASH_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / "dplb-routing.json"
    target.write_text(target.read_text().replace('"Score per worker"', '"Score per worker (edited by hand)"'))
    r = subprocess.run([sys.executable, str(copy / "generate.py"), "--check"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and "dplb-routing.json" in r.stderr, r.stdout + r.stderr
    r = subprocess.run([sys.executable, str(copy / "generate.py")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and target.read_text() == (DASH_DIR / "dplb-routing.json").read_text()


# ---- Grafana 11/12 import rules ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["dplb-overview.json", "dplb-routing.json", "dplb-engine.json", "dplb-fleet.json"])
def test_dashboard_is_importable_by_current_grafana(name: str) -> None:
    d = dashboards()[name]
    assert d["schemaVersion"] >= 39 and d["uid"] and d["title"] and not d.get("rows")
    variables = {v["name"]: v for v in d["templating"]["list"]}
    ds = variables["DS_PROMETHEUS"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    # @grafana/schema VariableOption: current needs text and value; TimePickerConfig has no time_options any more
    assert ds["current"] == {"selected": False, "text": "default", "value": "default"}
    assert "time_options" not in d.get("timepicker", {}) and set(d.get("timepicker", {})) <= {
        "hidden", "refresh_intervals", "nowDelay"}
    assert list(variables) == ["DS_PROMETHEUS", "stack", "worker"]
    stack = variables["stack"]
    assert stack["query"] == f'label_values({M.BUILD_INFO}_info{{job="dplb-router"}}, stack)'
    assert not stack["multi"] and not stack["includeAll"]  # one stack at a time: several never add up
    w = variables["worker"]
    assert w["type"] == "query" and w["datasource"] == DS
    assert w["query"] == f'label_values({M.WORKER_UP}{{job="dplb-router", stack="$stack"}}, worker)'
    assert w["includeAll"] and w["multi"] and w["allValue"] == ".*"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) and i > 0 for i in ids), ids
    boxes = []
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["y"] >= 0 and g["w"] > 0 and g["h"] > 0 and g["x"] + g["w"] <= 24, (p["title"], g)
        boxes.append((p["title"], g))
    for (ta, a), (tb, b) in combinations(boxes, 2):
        overlap = a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"] and a["y"] < b["y"] + b["h"] and \
            b["y"] < a["y"] + a["h"]
        assert not overlap, f"panels overlap: {ta!r} {a} and {tb!r} {b}"
    for p in data_panels(d):
        assert p["datasource"] == DS, p["title"]
        assert p["targets"] and all(t["datasource"] == DS and t["expr"] for t in p["targets"]), p["title"]
        for t in p["targets"]:  # every series is scoped to the chosen stack, router and workers (the fleet: all)
            for sel in re.findall(r'\{([^{}]*job="dplb-[a-z]+"[^{}]*)\}', t["expr"]) if name != "dplb-fleet.json" \
                    else []:
                assert 'stack="$stack"' in sel and "instance" not in sel, (p["title"], sel)
            if 'worker=~"$worker"' in t["expr"]:
                assert t["expr"].count('worker=~"$worker"') == t["expr"].count('worker!="none"'), p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        assert p["fieldConfig"]["defaults"].get("unit"), f"{p['title']}: no unit"
        assert p.get("description"), f"{p['title']}: no description"


def expected_unit(expr: str) -> str | None:
    """The unit an expression's result has, when its shape tells (None: a plain count)."""
    expr = re.sub(r'"[^"]*"', '""', expr)  # label values (route regexes) are not operators
    if re.search(r"_tokens_total\b.*/.*_requests_total\b", expr):
        return None  # tokens per request: a count
    if "/" in expr or re.search(r"_(ratio|perc)\b", expr):
        return "percentunit"
    if "histogram_quantile" in expr or re.search(r"_seconds\b", expr):
        return "s"
    if re.search(r"_bytes\b", expr):
        return "bytes"
    if "rate(" in expr and re.search(r"(requests|decisions|rejected|retries)_total\b|_seconds_count\b", expr):
        return "reqps"
    return None


def test_units_match_what_the_panels_show() -> None:
    seen = set()
    for d in dashboards().values():
        for p in data_panels(d):
            unit = p["fieldConfig"]["defaults"]["unit"]
            seen.add(unit)
            want = {expected_unit(t["expr"]) for t in p["targets"]}
            if len(want) == 1 and None not in want and "increase(" not in p["targets"][0]["expr"]:
                assert unit == want.pop(), (p["title"], unit)
    assert seen >= REQUIRED_UNITS, REQUIRED_UNITS - seen


def test_every_metric_name_exists() -> None:
    vllm = sim_vllm_names()
    for name, title, expr in all_exprs():
        names = metric_names(expr)
        assert names, (name, title, expr)
        for n in names:
            assert known_dplb(n) or n in vllm, f"{name} / {title}: unknown metric {n}"


def test_the_issue_panels_are_all_there() -> None:
    text = " ".join(e for _, _, e in all_exprs())
    for needed in (M.UPSTREAM_REQUEST_DURATION + "_bucket", M.UPSTREAM_TTFB + "_bucket", M.REQUESTS_REJECTED,
                   M.ROUTING_DECISIONS, M.HTTP_REQUESTS, M.WORKER_UP, M.WORKER_LIFECYCLE, M.SHM_SEGMENT_PRESENT,
                   M.WORKER_SCORE, M.WORKER_SCORE_TERM, M.WORKER_QUEUE_LENGTH, M.WORKER_REQUESTS_INFLIGHT,
                   M.WORKER_KV_CACHE_USAGE, M.WORKER_GPU_MEMORY_USED, M.WORKER_GPU_MEMORY_TOTAL, M.WORKER_LATENCY_AVG,
                   M.LATENCY_BASELINE, M.WORKER_STATE_LAST_UPDATE, M.WORKER_WARMUP_DURATION,
                   M.WORKER_FIRST_REQUEST_DURATION, M.WORKER_CUDA_OOM, M.ROUTING_DECISION_DURATION,
                   "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                   "vllm:time_to_first_token_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                   "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"):
        assert needed in text, needed
    for q in ("0.5", "0.95", "0.99"):
        assert f"histogram_quantile({q}, sum by (le) (rate({M.UPSTREAM_REQUEST_DURATION}_bucket" in text, q
        assert f"histogram_quantile({q}, sum by (le) (rate({M.UPSTREAM_TTFB}_bucket" in text, q
    for term in ("queue", "memory", "latency"):
        assert f'term="{term}"' in text, term


def test_integrity_metrics_are_on_a_dashboard() -> None:
    """Stalls, failed-fast requests, ejections, retries, resumed streams, panic routing and the reconciler's counts
    each have a panel (an SRE paged by DPLBWorkerStalled or DPLBInflightMismatch needs them in one place)."""
    text = " ".join(e for name, _, e in all_exprs() if name == "dplb-integrity.json")
    for needed in (M.WORKER_STALLED, M.WORKER_STALLS + "_total", M.STALLED_REQUESTS_FAILED + "_total",
                   M.WORKER_EJECTIONS + "_total", M.UPSTREAM_RETRIES + "_total", M.STREAMS_RESUMED + "_total",
                   M.STREAM_RESUME_REFUSED + "_total", M.WORKER_ORPHANS, M.WORKER_ORPHAN_ABORTS + "_total",
                   M.WORKER_LEAKED_INFLIGHT, M.WORKER_ENGINE_REQUESTS, M.PANIC, M.PANIC_ROUTED + "_total"):
        assert needed in text, needed


def test_dashboards_rows_and_panels_named_in_runbooks_exist() -> None:
    """Every dashboard title a runbook names (`` `DPLB …` ``, exactly: a prefix such as `DPLB routing` is not a
    title), every ``panel "…"`` and ``row "…"``; a panel named after a dashboard in the same sentence is on that
    dashboard. A runbook sent the on-call to a `DPLB tenants` dashboard that never existed."""
    boards = {d["title"]: {p["title"] for p in d["panels"]} for d in dashboards().values()}
    rows = {p["title"] for d in dashboards().values() for p in d["panels"] if p["type"] == "row"}
    panels = {t for titles in boards.values() for t in titles} - rows
    named: set[str] = set()
    for rb in sorted((Path(ROOT) / "runbooks").glob("*.md")):
        text = " ".join(rb.read_text().split())  # a name may wrap onto the next line
        for t in re.findall(r"`(DPLB [^`]+)`", text):
            assert t in boards, f"{rb.name} names a dashboard that does not exist: {t!r} (there are {sorted(boards)})"
        for t in re.findall(r'panel "([^"]+)"', text):
            assert t in panels, f"{rb.name} names a panel that does not exist: {t!r}"
            named.add(t)
        for t in re.findall(r'row "([^"]+)"', text):
            assert t in rows, f"{rb.name} names a row that does not exist: {t!r}"
        for board, tail in re.findall(r"`(DPLB [^`]+)` dashboard((?:,? (?:and )?(?:row|panel) \"[^\"]+\":?)+)", text):
            for t in re.findall(r'(?:row|panel) "([^"]+)"', tail):
                assert t in boards[board], f"{rb.name}: {t!r} is not on the {board!r} dashboard"
    assert len(named) >= 8, named


# ---- every query against a real Prometheus and a live cluster -----------------------------------------------------
def substitute(expr: str, worker: str, stack: str) -> str:
    """``expr`` with Grafana's variables replaced as the dashboard would (``$stack``: the Stack variable)."""
    return (expr.replace("$__rate_interval", "30s").replace("$__interval", "15s").replace("$__range", "5m")
            .replace("$worker", worker).replace("$stack", stack))


def no_value_text(name: str, title: str) -> str:
    """The panel's noValue text ("" when it has none)."""
    p = next(p for p in data_panels(dashboards()[name]) if p["title"] == title)
    return str(p["fieldConfig"]["defaults"].get("noValue", ""))


def test_routing_dashboard_has_the_prefix_cache_hit_rate_panel() -> None:
    p = next(p for p in data_panels(dashboards()["dplb-routing.json"]) if p["title"] == "Prefix cache hit rate per worker")
    expr = p["targets"][0]["expr"]
    assert "vllm:prefix_cache_hits_total" in expr and "vllm:prefix_cache_queries_total" in expr and "> 0)" in expr
    assert p["fieldConfig"]["defaults"]["unit"] == "percentunit" and "worker" in p["targets"][0]["legendFormat"]


def test_routing_dashboard_shows_predicted_against_confirmed_per_worker() -> None:
    """The prefix rows compare, per worker, what the router's index predicted with what the engine confirmed (its
    KV ring's counters), and show the prediction error per request; one series per worker, not per router process."""
    panels = {p["title"]: p for p in data_panels(dashboards()["dplb-routing.json"])}
    p = panels["Predicted vs engine-cached prompt tokens per worker"]
    exprs = [t["expr"] for t in p["targets"]]
    assert M.PREFIX_PREDICTED + "_total" in exprs[0] and M.PREFIX_ENGINE_CACHED + "_total" in exprs[1]
    assert all(M.PREFIX_COMPARED + "_total" in e and "max by (worker)" in e for e in exprs)
    assert [t["legendFormat"] for t in p["targets"]] == ["worker {{worker}} predicted", "worker {{worker}} confirmed"]
    err = [t["expr"] for t in panels["Prefix prediction error per request"]["targets"]]
    assert M.PREFIX_PREDICTION_ERROR + "_total" in err[0] and M.PREFIX_ENGINE_EVENTS in err[1]


def test_every_query_evaluates_and_returns_data_against_a_live_cluster(tmp_path: Path) -> None:
    binary = need("prometheus")
    ports = [free_port(), free_port()]
    with cluster(str(tmp_path), 2, start_workers=False, wait_router_ready=False) as c:
        for k in range(2):
            c.start_worker(k, metrics_port=ports[k])
        load = Load(c.url, pause=0.1)
        prom = Prometheus(binary, tmp_path / "prom", {"dplb-router": [f"127.0.0.1:{c.port}"],
                                                     "dplb-workers": [f"127.0.0.1:{p}" for p in ports]},
                          labels={"stack": "test-stack"})
        try:
            prom.wait_up(3)
            time.sleep(8)  # ≥ 8 scrapes of traffic in every 30 s rate window
            failures = []
            for worker in (".*", "1"):
                for name, title, expr in all_exprs():
                    q = substitute(expr, worker, "test-stack")
                    try:
                        res = prom.query(q)
                    except AssertionError as e:
                        failures.append(f"{name} / {title}: error {e}\n  {q}")
                        continue
                    if "/" in expr and any(r["value"][1] in ("NaN", "+Inf", "-Inf") for r in res):
                        failures.append(f"{name} / {title}: NaN/Inf (a division by zero)\n  {q}")
                    if any(r["metric"].get("worker") == "none" for r in res):
                        failures.append(f"{name} / {title}: a worker=\"none\" series\n  {q}")
                    no_gpu = no_value_text(name, title) == "no GPU" and M.WORKER_GPU_MEMORY_TOTAL in expr
                    no_slo = no_value_text(name, title) == "no SLO" and M.TENANT_SLO_OBJECTIVE in expr  # no tenants
                    # Without --tenants (this cluster) the router keeps no tenant ledger (dplb.router.tenancy).
                    no_tenants = no_value_text(name, title) == "no tenants" and "dplb_tenant_" in expr
                    if not res and not (no_gpu or no_slo or no_tenants):
                        failures.append(f"{name} / {title}: no data\n  {q}")
                    elif res and worker == "1" and "worker" in res[0]["metric"] and \
                            {r["metric"]["worker"] for r in res} != {"1"}:
                        failures.append(f"{name} / {title}: $worker=1 not applied\n  {q}")
            assert not failures, "\n".join(failures)
        finally:
            load.stop()
            prom.stop()
        assert set(load.statuses) == {200} and len(load.statuses) > 20, load.statuses
