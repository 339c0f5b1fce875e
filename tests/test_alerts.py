"""Alert rules: promtool check + unit tests, runbooks, and a live alert drill (real Prometheus + real sim cluster).

The drill loads a copy of ``alerts/dplb.rules.yml`` with every ``for:`` scaled to a few seconds and every range
window shortened (promtool covers the real durations), scrapes a live cluster every second, injects real faults and
reads ``/api/v1/alerts``: a healthy run fires nothing, and each fault fires exactly its alert.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml
from cluster import ROOT, Cluster, Prometheus, cluster, cut_stream, free_port, need

from dplb.obs import metrics as M

RULES = Path(ROOT) / "alerts" / "dplb.rules.yml"
RULE_TESTS = Path(ROOT) / "alerts" / "dplb.rules.test.yml"
RUNBOOKS = Path(ROOT) / "runbooks"
SECTIONS = ("## Meaning", "## Impact", "## Diagnosis", "## Mitigation")
SEVERITIES = {"critical", "warning"}
#: Every metric name dplb/obs/metrics.py defines, with the suffixes Prometheus exposes.
KNOWN_DPLB = {v for k, v in vars(M).items() if k.isupper() and isinstance(v, str) and v.startswith("dplb_")}
SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_info", "_created")


# ---- helpers shared with test_dashboards.py ----------------------------------------------------------------------
def metric_names(expr: str) -> set[str]:
    """The dplb_* and vllm:* metric names an expression reads."""
    return set(re.findall(r"\b(?:dplb_[a-z0-9_]+|vllm:[a-z0-9_:]+)", expr))


def _base(name: str) -> str:
    """``name`` without an exposition suffix (``_total``, ``_bucket``, …)."""
    for suffix in SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in KNOWN_DPLB:
            return name[: -len(suffix)]
    return name


def known_dplb(name: str) -> bool:
    """True when ``name`` is a dplb.obs.metrics name, possibly with an exposition suffix."""
    if name in KNOWN_DPLB:
        return True
    return any(name.endswith(s) and name[: -len(s)] in KNOWN_DPLB for s in SUFFIXES)


class Load:
    """Light background traffic: one request at a time with distinct prompts, ``pause`` seconds apart."""

    def __init__(self, url: str, pause: float = 0.2, stream_every: int = 3) -> None:
        self.url, self.pause, self.stream_every = url, pause, stream_every
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=30) as cl:
            i = 0
            while not self._stop.is_set():
                i += 1
                # a shared 150-byte head then a unique tail: prompts span prefix blocks, some of them cached
                words = "You are the DPLB test assistant; answer briefly. " * 3 + f"request {i} {uuid.uuid4().hex}"
                stream = self.stream_every > 0 and i % self.stream_every == 0
                try:
                    if i % 2:
                        r = cl.post(self.url + "/v1/completions", json={
                            "model": "dplb-sim", "prompt": words, "max_tokens": 4, "stream": stream})
                    else:
                        r = cl.post(self.url + "/v1/chat/completions", json={
                            "model": "dplb-sim", "messages": [{"role": "user", "content": words}], "max_tokens": 4,
                            "stream": stream})
                    self.statuses.append(r.status_code)
                except httpx.HTTPError:
                    self.statuses.append(0)
                self._stop.wait(self.pause)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


# ---- static checks -----------------------------------------------------------------------------------------------
def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


def runbook_pattern() -> str:
    m = re.search(r"^# runbook_url pattern: (\S+)$", RULES.read_text(), re.M)
    assert m and "<AlertName>" in m.group(1), "the rule file must state its runbook_url pattern once at the top"
    return m.group(1)


def test_promtool_check_rules_is_clean() -> None:
    promtool = need("promtool")
    r = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in r.stdout, r.stdout
    assert "WARNING" not in (r.stdout + r.stderr).upper() and r.stderr.strip() == "", r.stdout + r.stderr


def test_promtool_unit_tests_pass() -> None:
    promtool = need("promtool")
    r = subprocess.run([promtool, "test", "rules", str(RULE_TESTS)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_every_alert_is_named_labelled_annotated_and_linked() -> None:
    pattern = runbook_pattern()
    names = [r["alert"] for r in alert_rules()]
    assert len(names) == len(set(names)), names
    assert len(names) >= 12, names
    for r in alert_rules():
        name = r["alert"]
        assert re.fullmatch(r"DPLB[A-Z][A-Za-z0-9]+", name), name
        assert r["labels"]["severity"] in SEVERITIES, name
        assert set(r["annotations"]) == {"summary", "description", "runbook_url"}, name
        assert r["annotations"]["runbook_url"] == pattern.replace("<AlertName>", name), name
        used = metric_names(r["expr"])
        assert used or re.search(r'up\{job="dplb-(router|workers)"\}', r["expr"]), name
        assert all(known_dplb(n) for n in used), (name, [n for n in used if not known_dplb(n)])
        # Scoped to the job that owns its metrics: the workers' job for names only a worker exports
        # (dplb.obs.metrics.WORKER_SIDE), the router's for everything else.
        # dplb_build_info is exported by both jobs (its component label): an alert on the router's names the router's.
        job = "dplb-workers" if used and all(_base(n) in M.WORKER_SIDE - {M.BUILD_INFO} for n in used) \
            else "dplb-router"
        assert f'job="{job}"' in r["expr"] or r["expr"].strip() == 'up{job="dplb-workers"} == 0', \
            f"{name}: scope the expression to the {job} job"
        # Every alert carries the stack it is about (README): no aggregation or match drops the label.
        dropped = [m.group(0) for m in re.finditer(r"\b(?:by|on)\s*\(([^)]*)\)", r["expr"])
                   if "stack" not in re.split(r"\s*,\s*", m.group(1).strip())]
        assert not dropped, f"{name}: {dropped} drops the stack label"


def test_requests_rejected_excludes_exactly_the_client_errors_and_worker_timeouts() -> None:
    from dplb.errors import RouterErrorKind

    expr = next(r["expr"] for r in alert_rules() if r["alert"] == "DPLBRequestsRejected")
    m = re.search(r'dplb_requests_rejected_total\{job="dplb-router", reason!~"([^"]+)"\}', expr)
    assert m, expr
    client = {k.code for k in RouterErrorKind if 400 <= k.status < 500}
    assert set(m.group(1).split("|")) == client | {RouterErrorKind.UPSTREAM_TIMEOUT.code}


def test_every_alert_has_a_runbook_with_the_four_sections() -> None:
    rules = {r["alert"]: r for r in alert_rules()}
    names = set(rules)
    files = {p.stem for p in RUNBOOKS.glob("DPLB*.md")}
    assert files == names, {"without runbook": names - files, "orphan runbooks": files - names}
    for name in names:
        text = (RUNBOOKS / f"{name}.md").read_text()
        assert text.startswith(f"# {name}"), name
        pos = [text.find("\n" + s + "\n") for s in SECTIONS]
        assert all(p > 0 for p in pos) and pos == sorted(pos), (name, dict(zip(SECTIONS, pos, strict=True)))
        for cmd in ("dplb state", "dplb doctor"):
            assert cmd in text, (name, cmd)
        block = re.search(r"```promql\n(.*?)```", text, re.S)
        assert block and block.group(1).strip() == rules[name]["expr"].strip(), f"{name}: runbook shows another expr"
        assert f"{rules[name].get('for', '0m')}" in text or "fires at once" in text, name


def test_every_alert_has_a_firing_case_at_its_for_boundary_and_a_silent_case() -> None:
    doc = yaml.safe_load(RULE_TESTS.read_text())
    step = _seconds(doc.get("evaluation_interval", "1m"))
    rules = {r["alert"]: r for r in alert_rules()}
    fires: set[str] = set()
    silent: set[str] = set()
    for t in doc["tests"]:
        by_alert: dict[str, list[dict[str, Any]]] = {}
        for a in t.get("alert_rule_test", []):
            by_alert.setdefault(a["alertname"], []).append(a)
        for name, cases in by_alert.items():
            if all(not c.get("exp_alerts") for c in cases):
                silent.add(name)
                continue
            times = {_seconds(c["eval_time"]): c.get("exp_alerts") or [] for c in cases}
            for at, exp in times.items():
                if not exp:
                    continue
                assert times.get(at - step) == [], f"{name}: no silent evaluation one interval before {at}s"
                for e in exp:
                    assert e["exp_labels"]["severity"] == rules[name]["labels"]["severity"], name
                    assert set(e["exp_annotations"]) == set(rules[name]["annotations"]), name
                fires.add(name)
    assert fires == set(rules), set(rules) - fires
    assert silent == set(rules), set(rules) - silent


# ---- the live drill ----------------------------------------------------------------------------------------------
def _seconds(d: str) -> float:
    total = 0.0
    for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)", str(d)):
        total += float(n) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}[u]
    return total


MAX_FOR = 12  # the longest scaled for:, seconds


def scale_for(d: str) -> str:
    """``for:`` in the drill: 2 s per minute, at least 4 s (a scrape + evaluations), at most 12 s. (Prometheus
    scrapes its first target ~5 s after start, so ``absent()`` must hold longer than that before it fires.)"""
    s = _seconds(d)
    return "0s" if s == 0 else f"{int(min(MAX_FOR, max(4, s / 30)))}s"


def scale_window(d: str) -> str:
    """Range windows in the drill: 1/30, between 10 s and 30 s (≥ 10 samples at a 1 s scrape interval)."""
    return f"{int(min(30, max(10, _seconds(d) / 30)))}s"


def write_drill_rules(dst: Path) -> Path:
    doc = yaml.safe_load(RULES.read_text())
    for g in doc["groups"]:
        g["interval"] = "1s"
        for r in g["rules"]:
            r["for"] = scale_for(r.get("for", "0s"))
            r["expr"] = re.sub(r"\[(\d+[smhd])\]", lambda m: f"[{scale_window(m.group(1))}]", r["expr"])
    dst.write_text(yaml.safe_dump(doc, sort_keys=False))
    return dst


def test_drill_copy_of_the_rules_is_valid_and_fast(tmp_path: Path) -> None:
    promtool = need("promtool")
    path = write_drill_rules(tmp_path / "drill.rules.yml")
    r = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    drill = [x for g in yaml.safe_load(path.read_text())["groups"] for x in g["rules"]]
    assert [x["alert"] for x in drill] == [x["alert"] for x in alert_rules()]
    for x in drill:
        assert _seconds(x["for"]) <= MAX_FOR and all(_seconds(w) <= 30 for w in re.findall(r"\[(\w+)\]", x["expr"]))


@contextlib.contextmanager
def drill_prom(binary: str, tmp: Path, c: Cluster, worker_ports: list[int] | None = None) -> Iterator[Prometheus]:
    targets = {"dplb-router": [f"127.0.0.1:{c.port}"]}
    if worker_ports:
        targets["dplb-workers"] = [f"127.0.0.1:{p}" for p in worker_ports]
    prom = Prometheus(binary, tmp / "prom", targets, write_drill_rules(tmp / "drill.rules.yml"))
    try:
        prom.wait_up(1 + len(worker_ports or []))
        yield prom
    except BaseException:
        print(c.tail(), prom.log_path.read_text()[-3000:])
        raise
    finally:
        prom.stop()


def expect_exactly(prom: Prometheus, expected: dict[str, dict[str, str]], timeout: float = 45,
                   tolerate: frozenset[str] = frozenset(), settle: float = 3,
                   optional: frozenset[str] = frozenset()) -> None:
    """Wait until the firing alerts are exactly ``expected`` (name -> labels each must include) and no other alert is
    pending, for ``settle`` s in a row. Any other alert firing meanwhile fails the test, except ``tolerate`` (alerts
    firing before the fault, allowed while they resolve) and ``optional`` (a legitimate side effect of the fault
    that may or may not fire; ignored)."""
    deadline = time.monotonic() + timeout
    good_since: float | None = None
    while True:
        alerts = prom.alerts()
        firing: dict[str, list[dict[str, str]]] = {}
        for a in alerts:
            if a["state"] == "firing":
                firing.setdefault(a["labels"]["alertname"], []).append(a["labels"])
        for name in optional:
            firing.pop(name, None)
        pending = {a["labels"]["alertname"] for a in alerts if a["state"] == "pending"} - set(expected) - optional
        extra = set(firing) - set(expected) - tolerate
        assert not extra, f"unexpected alert(s) firing: {extra}: {alerts}"
        ok = not pending and set(firing) == set(expected) and all(
            any(all(ls.get(k) == v for k, v in want.items()) for ls in firing[name])
            for name, want in expected.items())
        now = time.monotonic()
        good_since = (good_since or now) if ok else None
        if good_since is not None and now - good_since >= settle:
            return
        assert now < deadline, f"expected exactly {expected} firing; alerts: {alerts}"
        time.sleep(0.5)


def test_drill_healthy_cluster_under_light_load_fires_nothing(prometheus_bin: str, tmp_path: Path) -> None:
    ports = [free_port(), free_port()]
    with cluster(str(tmp_path), 2, start_workers=False, wait_router_ready=False) as c:
        for k in range(2):
            c.start_worker(k, metrics_port=ports[k])
        load = Load(c.url)
        try:
            with drill_prom(prometheus_bin, tmp_path, c, ports) as prom:
                t0 = time.monotonic()
                while time.monotonic() - t0 < MAX_FOR + 4:  # longer than the longest for:
                    assert prom.firing() == {}, prom.alerts()
                    time.sleep(1)
                assert [a for a in prom.alerts() if a["state"] == "pending"] == []
                rules = [r for g in prom.api("/api/v1/rules")["groups"] for r in g["rules"]]
                assert len(rules) == len(alert_rules())
                assert all(r["health"] == "ok" and not r.get("lastError") for r in rules), rules
        finally:
            load.stop()
        assert len(load.statuses) > 20 and set(load.statuses) == {200}, load.statuses


def test_drill_no_worker_registered_then_one_stuck_warming(prometheus_bin: str, tmp_path: Path) -> None:
    with cluster(str(tmp_path), 2, start_workers=False, wait_router_ready=False) as c, \
            drill_prom(prometheus_bin, tmp_path, c) as prom:
        # The host report says down too (what a fleet's balancer reads): both fire.
        expect_exactly(prom, {"DPLBNoWorkerRegistered": {"job": "dplb-router"},
                              "DPLBHostReportingDown": {"job": "dplb-router"}})
        c.start_worker(0)  # a healthy worker: registers, warms up in well under a second, ready
        c.start_worker(1, "--sim-warmup-delay-s", "120", wait=False)  # a model load that takes 2 minutes
        expect_exactly(prom, {"DPLBWorkerStuckWarming": {"worker": "1"}},
                       tolerate=frozenset({"DPLBNoWorkerRegistered", "DPLBHostReportingDown"}))
        c.kill_worker(1, signal.SIGKILL)  # it would not act on SIGTERM before its load ends (see the README)


def test_drill_all_workers_stopped_fires_no_routable_worker(prometheus_bin: str, tmp_path: Path) -> None:
    with cluster(str(tmp_path), 2) as c, drill_prom(prometheus_bin, tmp_path, c) as prom:
        assert prom.firing() == {}
        for k in range(2):
            c.kill_worker(k, signal.SIGTERM)
        load = Load(c.url, pause=0.3, stream_every=0)
        try:
            expect_exactly(prom, {"DPLBNoRoutableWorker": {"job": "dplb-router"},
                                  "DPLBHostReportingDown": {"job": "dplb-router"}})
        finally:
            load.stop()
        assert set(load.statuses) == {503}, load.statuses


def test_drill_cuda_oom_fires_the_oom_alert(prometheus_bin: str, tmp_path: Path) -> None:
    with cluster(str(tmp_path), 1, worker_args={0: ["--sim-oom-after", "2"]}) as c, \
            drill_prom(prometheus_bin, tmp_path, c) as prom:
        time.sleep(2)  # a few scrapes of the OOM counter at 0
        assert prom.firing() == {}
        r = httpx.post(c.url + "/v1/completions", json={"model": "dplb-sim", "prompt": "x", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 500 and "CUDA out of memory" in r.text, r.text
        expect_exactly(prom, {"DPLBCudaOOM": {"worker": "0"}})


def test_drill_failing_worker_fires_upstream_errors(prometheus_bin: str, tmp_path: Path) -> None:
    """A worker whose engine fails every request (CUDA OOM) beside a healthy one: the client-visible failure rate
    pages (DPLBUpstreamErrors), not only the OOM counter (DPLBCudaOOM)."""
    with cluster(str(tmp_path), 2, worker_args={0: ["--sim-oom-after", "2"]}) as c, \
            drill_prom(prometheus_bin, tmp_path, c) as prom:
        assert prom.firing() == {}
        load = Load(c.url, pause=0.1, stream_every=0)
        try:
            # the router ejects the failing worker for 2 s after 3 failures in a row, so it also gets fewer
            # requests: DPLBLoadImbalance may rightly fire too
            expect_exactly(prom, {"DPLBUpstreamErrors": {"job": "dplb-router"}, "DPLBCudaOOM": {"worker": "0"}},
                           optional=frozenset({"DPLBLoadImbalance"}))
        finally:
            load.stop()
        failed = sum(1 for s in load.statuses if s == 500)
        assert failed and set(load.statuses) <= {200, 500}, load.statuses
        print(f"drill: {failed}/{len(load.statuses)} requests failed with a CUDA OOM")


def test_drill_engine_that_ignores_aborts_fires_inflight_mismatch(prometheus_bin: str, tmp_path: Path) -> None:
    """A client leaves a long stream on an engine that ignores aborts (--sim-ignore-aborts): the orphan stays after
    the worker's reconciler aborted it, and DPLBInflightMismatch fires for that worker."""
    port = free_port()
    with cluster(str(tmp_path), 1, start_workers=False, wait_router_ready=False) as c:
        c.start_worker(0, "--sim-ignore-aborts", "true", metrics_port=port)
        c.start_router()
        with drill_prom(prometheus_bin, tmp_path, c, [port]) as prom:
            assert prom.firing() == {}
            cut_stream(c, 5000)  # 100 s of decode nobody reads
            expect_exactly(prom, {"DPLBInflightMismatch": {"job": "dplb-workers", "worker": "0"}})
            assert prom.query('dplb_worker_orphan_aborts_total{job="dplb-workers"}')[0]["value"][1] == "1"


def test_drill_worker_metrics_port_gone_fires_scrape_down(prometheus_bin: str, tmp_path: Path) -> None:
    ports = [free_port(), free_port()]
    with cluster(str(tmp_path), 2, start_workers=False, wait_router_ready=False) as c:
        for k in range(2):
            c.start_worker(k, metrics_port=ports[k])
        with drill_prom(prometheus_bin, tmp_path, c, ports) as prom:
            assert prom.firing() == {}
            c.kill_worker(1, signal.SIGKILL)  # its metrics port goes with it
            expect_exactly(prom, {"DPLBWorkerScrapeDown": {"job": "dplb-workers", "instance": f"127.0.0.1:{ports[1]}"}},
                           timeout=25)


def test_drill_shm_segment_deleted_then_router_down(prometheus_bin: str, tmp_path: Path) -> None:
    with cluster(str(tmp_path), 2) as c, drill_prom(prometheus_bin, tmp_path, c) as prom:
        assert prom.firing() == {}
        os.unlink(c.shm_path)
        expect_exactly(prom, {"DPLBShmSegmentMissing": {"job": "dplb-router"}})
        r = httpx.post(c.url + "/v1/completions", json={"model": "dplb-sim", "prompt": "x", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 200  # the router still serves, on its own in-flight counts
        assert c.router is not None
        c.router.send_signal(signal.SIGTERM)
        c.router.wait(30)
        expect_exactly(prom, {"DPLBRouterDown": {"job": "dplb-router"}}, tolerate=frozenset({"DPLBShmSegmentMissing"}))
