"""A tenant's limits hold for a router group as a whole (``--processes 2``, real processes, the sim engine): every
request on a fresh connection, so the kernel spreads them over both processes (checked in each test through the
group's per-process ledger), and the group admits what the tenants file says — not twice it (docs/DESIGN.md §15,
:mod:`dplb.router.group_quota`)."""

from __future__ import annotations

import collections
import itertools
import json
import os
import re
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from dplb.tenants import hash_key, last_good_path, tenant_tag
from tests.cluster import Cluster, cluster, dplb_cmd, post, wait_for
from tests.test_tenants_cluster import SLOW, chat, write_tenants

pytestmark = pytest.mark.timeout(150)
KEY = "quota-key"
HEAD = {"authorization": f"Bearer {KEY}", "connection": "close"}
FAST = ["--sim-decode-step-s", "0.0005", "--sim-decode-step-s-per-seq", "0"]  # 300 tokens in ~0.15 s


def _tenants(tmp_path: Path, limits: str) -> str:
    return write_tenants(tmp_path / "tenants.toml",
                         f'[tenants.q]\napi_key_sha256 = ["{hash_key(KEY)}"]\npriority = "batch"\n{limits}\n')


def _group(c: Cluster) -> None:
    wait_for(lambda: c.metric("dplb_router_processes", {"state": "answered"}) == 2, 30, f"a group of 2\n{c.tail()}",
             step_s=0.1)
    time.sleep(1.2)  # both processes' monitors have seen each other (heartbeats every 0.5 s)


def _per_process(c: Cluster) -> dict[str, float]:
    """Requests of tenant q each process finished, any outcome (the group's merged /metrics)."""
    out: dict[str, float] = collections.defaultdict(float)
    for line in httpx.get(c.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("dplb_tenant_requests_total{") and 'tenant="q"' in line:
            m = re.search(r'process="(\d+)"', line)
            out[m.group(1) if m else "?"] += float(line.rsplit(" ", 1)[1])
    return out


def _burst(c: Cluster, n: int, body: dict, spacing_s: float = 0.0) -> list[httpx.Response]:
    """``n`` requests of tenant q at once (or ``spacing_s`` apart), each on its own connection."""
    got: list[httpx.Response] = []
    lock = threading.Lock()

    def one() -> None:
        r = post(c, "/v1/chat/completions", body, headers=HEAD)
        with lock:
            got.append(r)

    threads = []
    for _ in range(n):
        th = threading.Thread(target=one)
        th.start()
        threads.append(th)
        if spacing_s:
            time.sleep(spacing_s)
    for th in threads:
        th.join()
    return got


def _both_served(c: Cluster) -> None:
    per = wait_for(lambda: (lambda p: p if len(p) == 2 else None)(_per_process(c)), 5, "both processes' ledgers")
    assert all(v > 0 for v in per.values()), per


def test_requests_per_s_holds_for_the_group(tmp_path: Path) -> None:
    """5 requests/s over 3 rounds 1 s apart: about 5 a round for the group (10 when each process had its bucket)."""
    tf = _tenants(tmp_path, "requests_per_s = 5")
    with cluster(str(tmp_path), 1, router_args=["--tenants", tf, "--processes", "2"]) as c:
        _group(c)
        t0 = time.monotonic()
        rounds = []
        for i in range(3):
            time.sleep(max(0.0, t0 + i - time.monotonic()))
            rounds.append(collections.Counter(r.status_code for r in _burst(c, 20, chat(2))))
        elapsed = time.monotonic() - t0
        ok = sum(r[200] for r in rounds)
        assert set().union(*rounds) <= {200, 429}, rounds
        # 5 at the start + 5/s refill, + one per peer per round for two admissions in the same instant
        assert ok <= 5 + 5 * elapsed + 3, (rounds, elapsed)
        assert ok >= 12, rounds
        _both_served(c)


def test_max_concurrent_holds_for_the_group(tmp_path: Path) -> None:
    """max_concurrent 2: of 6 long requests 50 ms apart, each on its own connection, 2 run (3 with a bucket each)."""
    tf = _tenants(tmp_path, "max_concurrent = 2")
    with cluster(str(tmp_path), 1, worker_args={0: SLOW}, router_args=["--tenants", tf, "--processes", "2"]) as c:
        _group(c)
        got = collections.Counter(r.status_code for r in _burst(c, 6, chat(30), spacing_s=0.05))
        assert got == {200: 2, 429: 4}, got
        _both_served(c)
        # the open requests ended: the group's count is back to 0 (2 run again)
        again = collections.Counter(r.status_code for r in _burst(c, 2, chat(2), spacing_s=0.05))
        assert again == {200: 2}, again


def test_tokens_per_min_and_remaining_hold_for_the_group(tmp_path: Path) -> None:
    """tokens_per_min 3000, each request reserving about 325: about 10 admitted for the group (20 with a bucket
    each); x-ratelimit-remaining-tokens is never above the limit and falls with every admission, whichever process
    admits it (two buckets made it jump back up)."""
    tf = _tenants(tmp_path, "tokens_per_min = 3000")
    with cluster(str(tmp_path), 1, worker_args={0: FAST}, router_args=["--tenants", tf, "--processes", "2"]) as c:
        _group(c)
        seen = []
        t0 = time.monotonic()
        for _ in range(14):
            r = post(c, "/v1/chat/completions", chat(300), headers=HEAD)
            assert r.status_code in (200, 429), r.text
            rem = int(r.headers["x-ratelimit-remaining-tokens"])
            assert r.headers["x-ratelimit-limit-tokens"] == "3000"
            assert 0 <= rem <= 3000
            if r.status_code == 200:
                seen.append(rem)
        elapsed = time.monotonic() - t0
        assert len(seen) <= 3000 // 300 + 1 + elapsed * 50 / 300, (seen, elapsed)
        assert all(b < a for a, b in itertools.pairwise(seen)), seen
        _both_served(c)


def test_dplb_state_shows_the_groups_tenant_tables_by_tag_and_by_name(tmp_path: Path) -> None:
    """``dplb state`` of a group with two limited tenants: every router slot's tenant table (what the processes
    share so that the limits hold group-wide), each entry by its 56-bit tag in hex, named from ``--tenants FILE`` or
    else from the last good copy in the segment's run directory, and a ``tenants:`` line in the table view whose
    sums are what the group admitted. It showed none of it: the tables were in the segment only."""
    tf = write_tenants(tmp_path / "tenants.toml",
                       f'[tenants.q]\napi_key_sha256 = ["{hash_key(KEY)}"]\nrequests_per_s = 100\npriority = "batch"\n'
                       f'[tenants.r]\napi_key_sha256 = ["{hash_key("r-key")}"]\nmax_concurrent = 8\npriority = "batch"\n')
    tags = {n: f"0x{tenant_tag(n):014x}" for n in ("q", "r", "small")}  # small: write_tenants's, limited, idle
    with cluster(str(tmp_path), 1, router_args=["--tenants", tf, "--processes", "2"]) as c:
        _group(c)

        def text_line() -> str:
            out = subprocess.run(dplb_cmd("state", "--shm-path", c.shm_path), capture_output=True, text=True,
                                 timeout=30).stdout
            return next(ln for ln in out.splitlines() if ln.startswith("tenants ("))

        assert post(c, "/v1/chat/completions", chat(), headers=HEAD).status_code == 200
        # One process has admitted a limited tenant, the other has no entry yet: still a group of 2 (it said 1)
        line = text_line()
        assert "summed over 2 router processes' tables): " in line and "q 0 open, 1 admitted" in line, line
        for _ in range(5):
            assert post(c, "/v1/chat/completions", chat(), headers=HEAD).status_code == 200
        for _ in range(4):
            r = post(c, "/v1/chat/completions", chat(), headers={"authorization": "Bearer r-key",
                                                                 "connection": "close"})
            assert r.status_code == 200, r.text

        def state(*args: str) -> dict:
            out = subprocess.run(dplb_cmd("state", "--json", "--shm-path", c.shm_path, *args), capture_output=True,
                                 text=True, timeout=30)
            assert out.returncode == 0, out.stderr
            return json.loads(out.stdout)  # type: ignore[no-any-return]

        def sums(snap: dict) -> dict[str, list[int]]:
            got: dict[str, list[int]] = {}
            for rs in snap["routers"]:
                for e in rs["tenants"]:
                    s = got.setdefault(e["name"] or e["tag"], [0, 0])
                    s[0] += e["inflight"]
                    s[1] += e["requests"]
            return got

        named = state("--tenants", tf)
        assert len(named["routers"]) == 2 and named["tenants_file"] == tf, named
        assert sums(named) == {"q": [0, 6], "r": [0, 4], "small": [0, 0]}, named["routers"]
        e = named["routers"][0]["tenants"][0]
        assert set(e) == {"tag", "name", "inflight", "requests", "tokens_taken", "tokens_given", "age_s"}, e
        # The segment was made without a run dir (as `dplb segment create` without $DPLB_RUN_DIR makes it): the
        # router recorded its own, so the router's last good copy there names the tables without --tenants.
        from_copy = state()
        assert from_copy["header"]["run_dir"] == c.run_dir, from_copy["header"]
        assert from_copy["tenants_file"] == last_good_path(c.run_dir) and sums(from_copy) == sums(named)
        assert "recorded the run directory" in Path(c.run_dir, "router.log").read_text()
        line = text_line()
        assert "q 0 open, 6 admitted" in line and "r 0 open, 4 admitted" in line, line
        os.unlink(last_good_path(c.run_dir))  # no copy to name them: by tag, and the text view says how to name them
        snap = state()
        assert snap["tenants_file"] is None, snap
        assert sums(snap) == {tags["q"]: [0, 6], tags["r"]: [0, 4], tags["small"]: [0, 0]}, snap["routers"]
        line = text_line()
        assert f"{tags['q']} 0 open, 6 admitted" in line and "pass --tenants FILE to name them" in line, line
        # Each process's start line says the limits are the group's (it did not)
        loaded = [ln for ln in Path(c.run_dir, "router.log").read_text().splitlines() if "tenants file" in ln]
        assert len(loaded) == 2 and all("; tenant limits are enforced group-wide across the 2 router processes (3 "
                                        "limited tenants)" in ln for ln in loaded), loaded
