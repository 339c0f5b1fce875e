"""Tenants in a router group (``--processes 2``) with real processes and real signals: a bad tenants file on disk
never takes the group down (a restarted process starts on the last good copy, the supervisor never stops a
serving sibling for a failing one), and siblings authenticate to each other when the group merges
``/debug/decisions`` and ``/metrics`` (a keyed ``/metrics`` answering only an operator's key)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from dplb.router.privileges import TENANT_DECISION_FIELDS
from dplb.tenants import LAST_GOOD_NAME, hash_key
from tests.cluster import Cluster, assert_openai_error, cluster, group_children, post, wait_for
from tests.test_tenants_cluster import auth, chat, write_tenants

pytestmark = pytest.mark.timeout(120)
OPS_KEY = "ops-key"


def _wait_group(c: Cluster, timeout: float = 30) -> dict[int, int]:
    def up() -> dict[int, int] | None:
        kids = group_children(c)
        ok = len(kids) == 2 and c.metric("dplb_router_processes", {"state": "answered"}) == 2
        return kids if ok else None
    return wait_for(up, timeout, f"a group of 2\n{c.tail()}", step_s=0.1)


def _all_ok(c: Cluster, n: int) -> None:
    """``n`` requests, each on a new connection (spread over both processes by the kernel), all 200."""
    for _ in range(n):
        r = post(c, "/v1/chat/completions", chat(), headers={**auth("chat"), "connection": "close"})
        assert r.status_code == 200, (r.status_code, r.text, c.tail())


def _break(c: Cluster, path: Path) -> None:
    """Make the file on disk invalid and SIGHUP the group: both processes refuse it and keep what runs."""
    path.write_text(path.read_text() + "garbage [\n")
    assert c.router is not None
    c.router.send_signal(signal.SIGHUP)
    wait_for(lambda: c.router_log().count("not reloaded, keeping the previous one") >= 2, 10, "both refusals")


def test_a_restarted_process_starts_on_the_last_good_tenants_file(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    tf = write_tenants(path)
    with cluster(str(tmp_path), 1, router_args=["--tenants", tf, "--processes", "2"]) as c:
        kids = _wait_group(c)
        assert os.path.exists(os.path.join(c.run_dir, LAST_GOOD_NAME))
        _break(c, path)
        assert c.metric("dplb_tenants_file_valid", {"process": "0"}) == 0
        os.kill(kids[0], signal.SIGKILL)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3:  # while process 0 restarts, the group keeps serving
            _all_ok(c, 1)
        new = _wait_group(c)
        assert new[0] != kids[0] and new[1] == kids[1]
        log = c.router_log()
        assert "tenants file not loaded, starting with its last good copy" in log, c.tail()
        assert "not valid TOML" in log
        _all_ok(c, 20)
        assert c.metric("dplb_tenants_file_valid", {"process": "0"}) == 0
        assert c.metric("dplb_tenants_file_load_failures_total", {"process": "0"}) == 1
        assert c.router is not None and c.router.poll() is None
        # The file fixed and reloaded: valid again, and the fixed version becomes the last good one.
        write_tenants(path)
        c.router.send_signal(signal.SIGHUP)
        wait_for(lambda: c.metric("dplb_tenants_file_valid", {"process": "0"}) == 1, 10, "the fixed file")


def test_a_process_that_cannot_start_never_stops_its_serving_sibling(tmp_path: Path) -> None:
    """With nothing to fall back on (no last good copy), the restarted process fails again and again; the group
    keeps serving on the healthy one instead of giving up after MAX_START_FAILURES."""
    path = tmp_path / "tenants.toml"
    tf = write_tenants(path)
    with cluster(str(tmp_path), 1, router_args=["--tenants", tf, "--processes", "2"]) as c:
        kids = _wait_group(c)
        _break(c, path)
        os.unlink(os.path.join(c.run_dir, LAST_GOOD_NAME))
        os.kill(kids[0], signal.SIGKILL)
        wait_for(lambda: "failed to start 5 times in a row" in c.router_log(), 40, "the fifth failed start",
                 step_s=0.2)
        assert "processes 1 still serve" in c.router_log(), c.tail()
        assert c.router is not None and c.router.poll() is None
        assert group_children(c).get(1) == kids[1]
        _all_ok(c, 10)


def test_siblings_authenticate_to_each_other(tmp_path: Path) -> None:
    """/debug/decisions (and /metrics when it needs a key) of a group with tenants holds every process's part,
    and no sibling answers the merge with a 401. A keyed /metrics (and /metrics/host) names every tenant's traffic
    and every worker's load: any tenant's key read it; now only an operator's key does (here an ``admin`` tenant),
    a tenant's key gets 403 ``admin_only``, and a tenant's decisions are its own view on every process."""
    tf = write_tenants(tmp_path / "tenants.toml", f"""
[tenants.ops]
api_key_sha256 = ["{hash_key(OPS_KEY)}"]
priority = "batch"
admin = true
""")
    with cluster(str(tmp_path), 1, router_args=["--tenants", tf, "--processes", "2",
                                                     "--api-key-exempt", "/health,/ready"]) as c:
        _wait_group_keyed(c)
        _all_ok(c, 30)
        h, ops = auth("chat"), {"authorization": f"Bearer {OPS_KEY}"}
        got = httpx.get(c.url + "/debug/decisions?limit=100", headers=h, timeout=10)
        assert got.status_code == 200, got.text
        assert {d["process"] for d in got.json()} == {0, 1}, got.json()
        assert {k for d in got.json() for k in d} == {*TENANT_DECISION_FIELDS, "process"}, got.json()[0]
        whole = httpx.get(c.url + "/debug/decisions?limit=100", headers=ops, timeout=10).json()
        assert {d["process"] for d in whole} == {0, 1} and all("candidates" in d for d in whole), whole[0]
        for path in ("/metrics", "/metrics/host"):
            for _ in range(4):  # new connections: both processes refuse
                r = httpx.get(c.url + path, headers={**h, "connection": "close"}, timeout=10)
                assert_openai_error(r, 403, "admin_only")
            assert httpx.get(c.url + path, headers=ops, timeout=10).status_code == 200
        text = httpx.get(c.url + "/metrics", headers=ops, timeout=10).text
        assert 'dplb_router_processes{state="answered"} 2.0' in text
        assert 'code="401"' not in text and 'status="401"' not in text, [
            ln for ln in text.splitlines() if "401" in ln]


def _wait_group_keyed(c: Cluster) -> None:
    wait_for(lambda: len(group_children(c)) == 2 and "router group: 2 processes" in c.router_log(), 30,
             f"a group of 2\n{c.tail()}", step_s=0.1)
