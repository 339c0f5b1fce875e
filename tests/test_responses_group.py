"""Stored responses in a router group (``dplb router --processes 2``, docs/DESIGN.md §3.8, §7, §15): real router
processes on one port and one segment, real sim workers (which keep their responses in memory and answer 404 for an
id they do not have).

Responses are created on fresh connections until both processes have relayed some; then every id is followed up on
(``GET /v1/responses/{id}``, ``…/cancel``, ``previous_response_id``), each from a fresh connection, so the kernel
hands many follow-ups to the process that did not create the response. Without tenants each must reach the creating
worker; with tenants each is allowed for the creating tenant, on either process, and refused for another.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from dplb.tenants import hash_key
from tests.cluster import Cluster, assert_openai_error, cluster, group_children, wait_for

pytestmark = pytest.mark.timeout(180)
ADMIN = "admin-key"
KEYS = {"alice": "alice-key", "bob": "bob-key"}
Headers = dict[str, str]


def _wait_group(c: Cluster, headers: Headers) -> None:
    def up() -> bool:
        r = httpx.get(c.url + "/metrics", headers=headers, timeout=5).text
        return len(group_children(c)) == 2 and 'dplb_router_processes{state="answered"} 2.0' in r
    wait_for(up, 30, f"a group of 2\n{c.tail()}", step_s=0.1)


def _served_by(c: Cluster, headers: Headers) -> dict[str, int]:
    """Request id → router process index, from the group's merged decisions."""
    r = httpx.get(c.url + "/debug/decisions?limit=512", headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    return {d["request_id"]: d["process"] for d in r.json()}


def _create(c: Cluster, headers: Headers, admin: Headers) -> list[dict[str, Any]]:
    """Responses created on fresh connections until each process has relayed 3: each as {id, worker, process}."""
    made: list[dict[str, Any]] = []
    for i in range(60):
        r = httpx.post(c.url + "/v1/responses", headers=headers, timeout=30,
                       json={"model": "dplb-sim", "input": f"note {i}", "max_output_tokens": 2})
        assert r.status_code == 200, r.text
        made.append({"id": r.json()["id"], "worker": r.headers["x-sg-worker-id"], "rid": r.headers["x-request-id"]})
        if i >= 5 and i % 3 == 0:
            served = _served_by(c, admin)
            by = [served[m["rid"]] for m in made]
            if by.count(0) >= 3 and by.count(1) >= 3:
                for m, p in zip(made, by, strict=True):
                    m["process"] = p
                return made
    raise AssertionError(f"the kernel never spread 60 connections over both processes:\n{c.tail()}")


def _follow_ups(c: Cluster, made: list[dict[str, Any]], headers: Headers,
                check: Callable[[str, dict[str, Any], httpx.Response], None]) -> list[tuple[str, int]]:
    """Every follow-up on every response in ``made``, each on a fresh connection, checked by
    ``check(kind, made entry, answer)``; returns (request id, creating process) of those that reached a worker."""
    out = []
    for m in made:
        for _ in range(2):
            answers = {
                "get": httpx.get(c.url + f"/v1/responses/{m['id']}", headers=headers, timeout=10),
                "cancel": httpx.post(c.url + f"/v1/responses/{m['id']}/cancel", headers=headers, timeout=10),
                "previous": httpx.post(c.url + "/v1/responses", headers=headers, timeout=30, json={
                    "model": "dplb-sim", "input": "and then?", "previous_response_id": m["id"],
                    "max_output_tokens": 2}),
            }
            for kind, r in answers.items():
                check(kind, m, r)
                out.append((r.headers.get("x-request-id", ""), m["process"]))
    return out


def _crossed(c: Cluster, sent: list[tuple[str, int]], admin: Headers) -> int:
    """How many follow-ups a process other than the creating one answered."""
    served = _served_by(c, admin)
    return sum(1 for rid, creator in sent if rid in served and served[rid] != creator)


def test_every_follow_up_reaches_the_creating_worker_whichever_process_gets_it(tmp_path: Path) -> None:
    with cluster(str(tmp_path), 2, router_args=["--processes", "2"]) as c:
        _wait_group(c, {})
        made = _create(c, {}, {})

        def check(kind: str, m: dict[str, Any], r: httpx.Response) -> None:
            assert r.headers.get("x-sg-worker-id") == m["worker"], (kind, m, r.status_code, r.text)
            if kind == "cancel":  # the creating worker has it, complete: vLLM's (and the sim's) 400, not a 404
                assert r.status_code == 400 and "Cannot cancel" in r.text, r.text
            else:
                assert r.status_code == 200, (kind, r.text)

        sent = _follow_ups(c, made, {}, check)
        assert _crossed(c, sent, {}) >= 6, "no follow-up crossed between processes: the test proved nothing"


def test_a_tenants_follow_ups_are_allowed_on_every_process_and_refused_to_another_tenant(tmp_path: Path) -> None:
    tf = tmp_path / "tenants.toml"
    tf.write_text("".join(f'[tenants.{t}]\napi_key_sha256 = ["{hash_key(k)}"]\n\n' for t, k in KEYS.items()))
    admin = {"authorization": f"Bearer {ADMIN}"}
    alice, bob = ({"authorization": f"Bearer {KEYS[t]}"} for t in ("alice", "bob"))
    with cluster(str(tmp_path), 2, router_args=["--processes", "2", "--tenants", str(tf), "--api-key", ADMIN]) as c:
        _wait_group(c, admin)
        made = _create(c, alice, admin)

        def allowed(kind: str, m: dict[str, Any], r: httpx.Response) -> None:
            assert r.headers.get("x-sg-worker-id") == m["worker"], (kind, m, r.status_code, r.text)
            assert r.status_code == (400 if kind == "cancel" else 200), (kind, r.text)

        sent = _follow_ups(c, made, alice, allowed)
        assert _crossed(c, sent, admin) >= 6, "no follow-up crossed between processes: the test proved nothing"

        def refused(kind: str, m: dict[str, Any], r: httpx.Response) -> None:
            assert_openai_error(r, 404, "response_not_found")
            assert "x-sg-worker-id" not in r.headers, (kind, r.text)  # the router answered: no worker saw it

        _follow_ups(c, made, bob, refused)
        for m in made:  # another tenant's id as bob's request_id: refused on either process
            r = httpx.post(c.url + "/v1/responses", headers=bob, timeout=10,
                           json={"model": "dplb-sim", "input": "x", "request_id": m["id"]})
            assert_openai_error(r, 409, "response_id_in_use")
        # Nobody in the group knows this id: still refused to a tenant (fail closed) on both processes.
        for _ in range(6):
            assert_openai_error(httpx.get(c.url + "/v1/responses/resp_" + "0" * 32, headers=alice, timeout=10), 404,
                                "response_not_found")
        # A process of the group dies and its parent restarts it into the same router slot: the new process adopts
        # the slot's ring, so the ids its predecessor relayed are still the creating tenant's on every process
        # (they were voided: the owner's follow-ups got 404 response_not_found from the new process).
        old = group_children(c)
        os.kill(old[0], signal.SIGKILL)
        wait_for(lambda: group_children(c).get(0, old[0]) != old[0], 30, f"process 0 restarted\n{c.tail()}", 0.1)
        _wait_group(c, admin)
        _follow_ups(c, [m for m in made if m["process"] == 0], alice, allowed)
