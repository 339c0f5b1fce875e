"""Metrics: a real Prometheus scrapes a live cluster (router + two workers); bounded cardinality; exemplars."""

from __future__ import annotations

import json
import re
import subprocess
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
from cluster import Cluster, Prometheus, cluster, dplb_cmd, free_port

from dplb.obs import metrics as M

ROUTER_FAMILIES = [
    M.WORKER_QUEUE_LENGTH, M.WORKER_REQUESTS_INFLIGHT, M.WORKER_KV_CACHE_USAGE, M.WORKER_GPU_MEMORY_USED,
    M.WORKER_GPU_MEMORY_TOTAL, M.WORKER_LATENCY_AVG, M.WORKER_SCORE, M.WORKER_SCORE_TERM, M.WORKER_UP,
    M.WORKER_LIFECYCLE, M.WORKER_STATE_LAST_UPDATE, M.WORKER_WARMUP_DURATION, M.WORKER_FIRST_REQUEST_DURATION,
    M.WORKER_CUDA_OOM + "_total", M.WORKER_REQUESTS_RUNNING, M.WORKER_REQUESTS_WAITING, M.WORKER_INFLIGHT_CORRECTION,
    M.WORKER_MAX_QUEUE, M.WORKER_E2E_AVG, M.WORKER_TTFT_AVG, M.PREFIX_QUERY_BLOCKS + "_total",
    M.PREFIX_HIT_BLOCKS + "_total", M.WORKER_MODEL_LOAD_DURATION,
]
ROUTER_GLOBAL = [
    M.WORKERS_REGISTERED, M.LATENCY_BASELINE, M.ROUTING_DECISIONS + "_total",
    M.ROUTING_DECISION_DURATION + "_bucket", M.STATE_READ_AGE + "_bucket", M.REQUESTS_REJECTED + "_total",
    M.UPSTREAM_RETRIES + "_total", M.UPSTREAM_REQUEST_DURATION + "_bucket", M.UPSTREAM_TTFB + "_bucket",
    M.HTTP_REQUESTS + "_total", M.HTTP_REQUEST_DURATION + "_bucket", M.SHM_SEGMENT_PRESENT,
    M.SHM_ERRORS + "_total", M.BUILD_INFO + "_info", M.POLICY_INFO + "_info", M.POLICY_WEIGHT, M.PANIC,
    M.PANIC_ROUTED + "_total",
    M.PREFIX_INDEX_BLOCKS, M.PREFIX_INDEX_CAPACITY, M.PREFIX_INDEX_BYTES, M.PREFIX_ROUTED + "_total",
    "process_resident_memory_bytes", "process_open_fds", "process_cpu_seconds_total",
]
WORKER_FAMILIES = [M.WORKER_INFO + "_info", M.WORKER_REQUESTS + "_total", M.WORKER_ERRORS + "_total",
                   M.NVML_ERRORS + "_total",
                   "vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:e2e_request_latency_seconds_bucket"]


@pytest.fixture
def live(tmp_path) -> Iterator[tuple[Cluster, list[int]]]:  # type: ignore[no-untyped-def]
    ports = [free_port(), free_port()]
    with cluster(str(tmp_path), 2, start_workers=False, wait_router_ready=False) as c:
        for k in range(2):
            c.start_worker(k, metrics_port=ports[k])
        yield c, ports


def test_real_prometheus_scrapes_every_family_and_values_agree(prometheus_bin: str, live, tmp_path) -> None:  # type: ignore[no-untyped-def]
    c, wports = live
    prom = Prometheus(prometheus_bin, tmp_path / "prom", {"dplb-router": [f"127.0.0.1:{c.port}"],
                                                "dplb-workers": [f"127.0.0.1:{p}" for p in wports]})
    try:
        for i in range(20):
            r = httpx.post(c.url + "/v1/chat/completions", timeout=30, json={
                "model": "dplb-sim", "messages": [{"role": "user", "content": f"m{i}"}], "max_tokens": 2})
            assert r.status_code == 200
        httpx.post(c.url + "/v1/chat/completions", content=b"{bad", timeout=10)  # one reject
        prom.wait_up(3)
        time.sleep(2.5)  # at least two scrapes after the traffic
        for fam in ROUTER_FAMILIES:
            got = {r["metric"]["worker"] for r in prom.query(f'{fam}{{job="dplb-router"}}')}
            assert got == {"0", "1"}, (fam, got)
        for fam in ROUTER_GLOBAL:
            assert prom.query(f'{fam}{{job="dplb-router"}}'), fam
        for fam in WORKER_FAMILIES:
            assert len(prom.query(f'{fam}{{job="dplb-workers"}}')) >= 2 or fam.startswith("vllm:"), fam
            assert prom.query(f'{fam}{{job="dplb-workers"}}'), fam
        # Values agree with `dplb state --json` and /debug/decisions.
        st = json.loads(subprocess.run(dplb_cmd("state", "--json", "--shm-path", c.shm_path), capture_output=True,
                                       text=True, check=True).stdout)
        for w in st["workers"]:
            k = str(w["worker"])
            warm = float(prom.query(f'{M.WORKER_WARMUP_DURATION}{{job="dplb-router",worker="{k}"}}')[0]["value"][1])
            assert warm == pytest.approx(w["warmup_seconds"])
            ready = prom.query(f'{M.WORKER_LIFECYCLE}{{job="dplb-router",worker="{k}",state="ready"}}')
            assert ready[0]["value"][1] == "1" and w["lifecycle"] == "ready"
            assert prom.query(f'{M.WORKER_REQUESTS_INFLIGHT}{{worker="{k}"}}')[0]["value"][1] == "0"
            up = prom.query(f'{M.WORKER_UP}{{job="dplb-router",worker="{k}"}}')[0]["value"][1]
            assert (up == "1") == w["routable"] and w["why"] == "ok"  # one eligibility rule for both
        assert prom.query(M.WORKERS_REGISTERED)[0]["value"][1] == str(sum(1 for w in st["workers"] if w["pid"]))
        decisions = httpx.get(c.url + "/debug/decisions?limit=256").json()
        total = float(prom.query(f'sum({M.ROUTING_DECISIONS}_total{{job="dplb-router"}})')[0]["value"][1])
        assert total == len(decisions) == 20
        per = {r["metric"]["worker"]: float(r["value"][1]) for r in
               prom.query(f'sum by (worker) ({M.ROUTING_DECISIONS}_total{{job="dplb-router"}})')}
        for k in ("0", "1"):
            assert per.get(k, 0) == sum(1 for d in decisions if str(d["worker"]) == k)
        rej = prom.query(f'{M.REQUESTS_REJECTED}_total{{reason="invalid_json"}}')
        assert rej[0]["value"][1] == "1"
        # One name, one type, one owner: no dplb_* name in both jobs (so an unfiltered sum never double-counts),
        # and every dplb_* name has a single type and help text across the jobs.
        jobs: dict[str, set[str]] = {}
        for r in prom.query('count by (__name__, job) ({__name__=~"dplb_.+"})'):
            jobs.setdefault(r["metric"]["__name__"], set()).add(r["metric"]["job"])
        both = {n for n, js in jobs.items() if len(js) > 1}
        assert both == {M.BUILD_INFO + "_info"}, both
        worker_side = {re.sub(r"_(total|info|bucket|count|sum|created)$", "", n) for n, js in jobs.items()
                       if "dplb-workers" in js}
        assert worker_side == set(M.WORKER_SIDE), worker_side ^ set(M.WORKER_SIDE)
        assert {n for n, js in jobs.items() if js == {"dplb-workers"}} >= {f + "_total" for f in (
            M.WORKER_REQUESTS, M.WORKER_ERRORS, M.NVML_ERRORS)}
        meta = httpx.get(prom.url + "/api/v1/metadata", timeout=10).json()["data"]
        for name, entries in meta.items():
            if name.startswith("dplb_"):
                assert len(entries) == 1, (name, entries)
        for name in (M.WORKER_REQUESTS, M.WORKER_ERRORS, M.NVML_ERRORS, M.WORKER_CUDA_OOM):
            entries = meta.get(name + "_total") or meta.get(name)
            assert [e["type"] for e in entries or []] == ["counter"], (name, sorted(meta))
        served = float(prom.query(f'sum({M.WORKER_REQUESTS}_total)')[0]["value"][1])
        assert served == 20 + 2  # 20 requests + one warm-up per worker, counted once
    finally:
        prom.stop()


def test_router_metrics_content_type_process_series_and_start_durations(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from prometheus_client import CONTENT_TYPE_LATEST

    args = ["--sim-warmup-delay-s", "1.0", "--sim-first-request-delay-s", "1.0"]
    with cluster(str(tmp_path), 1, worker_args={0: args}) as c:
        r = httpx.get(c.url + "/metrics", timeout=10)
        assert r.headers["content-type"] == CONTENT_TYPE_LATEST, r.headers["content-type"]  # one charset
        assert r.headers["content-type"].count("charset") == 1
        assert c.metric("process_resident_memory_bytes") and c.metric("process_open_fds")
        load = c.metric(M.WORKER_MODEL_LOAD_DURATION, {"worker": "0"})
        warm = c.metric(M.WORKER_WARMUP_DURATION, {"worker": "0"})
        assert load is not None and warm is not None and load >= 1.0 > warm, (load, warm)  # the load, not warm-up
        assert c.metric(M.WORKER_FIRST_REQUEST_DURATION, {"worker": "0"}) == 0
        r = httpx.post(c.url + "/v1/completions", json={"model": "dplb-sim", "prompt": "x", "max_tokens": 1},
                       timeout=30)
        assert r.status_code == 200
        t0 = time.monotonic()
        while not (c.metric(M.WORKER_FIRST_REQUEST_DURATION, {"worker": "0"}) or 0) >= 1.0:
            assert time.monotonic() - t0 < 5
            time.sleep(0.1)


def _series(c: Cluster) -> set[str]:
    text = httpx.get(c.url + "/metrics", timeout=10).text
    return {line.rsplit(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_cardinality_is_bounded(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with cluster(str(tmp_path), 2) as c, httpx.Client(timeout=30) as cl:
        def round_(i: int) -> None:
            tag = uuid.uuid4().hex
            cl.post(c.url + "/v1/completions", headers={"x-request-id": tag},
                    json={"model": f"model-{tag}", "prompt": "x", "max_tokens": 1})  # the sim answers 404
            cl.post(c.url + "/v1/completions", json={"model": "dplb-sim", "prompt": tag, "max_tokens": 1})
            cl.get(c.url + f"/no/such/{tag}?q={i}")
            cl.post(c.url + f"/v1/{tag}", content=b"{}")
        round_(0)
        _series(c)  # the first scrape creates the /metrics route's own series
        before = _series(c)
        for i in range(1, 251):  # 250 rounds × 4 requests = 1,000 requests with distinct models, paths, ids
            round_(i)
        after = _series(c)
        assert after == before, sorted(after ^ before)[:20]


def test_openmetrics_exposes_trace_exemplars(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from otlp_receiver import OtlpReceiver

    rx = OtlpReceiver()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", rx.endpoint + "/v1/traces")
    try:
        with cluster(str(tmp_path), 1) as c:
            r = httpx.post(c.url + "/v1/completions", json={"model": "dplb-sim", "prompt": "x", "max_tokens": 1})
            assert r.status_code == 200
            om = httpx.get(c.url + "/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"})
            assert om.headers["content-type"].startswith("application/openmetrics-text")
            lines = [x for x in om.text.splitlines() if x.startswith(M.UPSTREAM_REQUEST_DURATION + "_bucket")
                     and "# {trace_id=" in x]
            assert lines, "no exemplar on dplb_upstream_request_duration_seconds"
            plain = httpx.get(c.url + "/metrics").text
            assert "# {trace_id=" not in plain
    finally:
        rx.close()
