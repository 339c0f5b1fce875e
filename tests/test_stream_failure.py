"""A stream the worker itself fails: vLLM's engine dies under its live API server, which ends every open stream
with ``data: {"error": {…, "code": 500}}``, then ``data: [DONE]`` and a clean end (the sim's
``--sim-engine-death-after`` sends the same bytes). The router relays them unchanged and counts the request as an
upstream error — in ``dplb_upstream_request_duration_seconds``, in the worker's passive health and in a tenant's
SLO ledger — on the direct relay and on the ASGI path alike; the worker counts it in its ``errors_total``."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from dplb.errors import event_failure, stream_failure
from dplb.router.health import Outcome, Verdict
from dplb.tenants import hash_key
from tests.cluster import Cluster, cluster, wait_for

# vLLM's stream error event for EngineDeadError (create_streaming_error_response: json.dumps of ErrorResponse).
DEAD_EVENT = (b'data: {"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the root '
              b'cause.", "type": "InternalServerError", "param": null, "code": 500}}\n\n')
DONE = b"data: [DONE]\n\n"
# Death at the 3rd completed request: the worker's warm-up, the pool's warm-up request, then the short request
# that ends while the long stream is in flight.
SIM = ["--sim-engine-death-after", "3", "--sim-decode-step-s", "0.02"]


def test_stream_failure_finds_the_error_event_in_the_last_chunks() -> None:
    assert stream_failure(DEAD_EVENT + DONE) == "EngineCore encountered an issue. See stack trace (above) for the " \
                                                "root cause."
    tok = b'data: {"id":"x","choices":[{"index":0,"text":" \\"error\\" said"}]}\n\n'
    assert stream_failure(tok + DONE) is None  # the word in a token's text is not an event
    assert stream_failure(b'data: {"error": {"message": "bad", "code": 400}}\n\n' + DONE) is None  # a 4xx refusal
    assert stream_failure(b'data: {"error": {"message": "x", "code": "worker_failed"}}\n\n') is None  # not numeric
    assert stream_failure(b'"error": {"code": 500}}\n\n' + DONE) is None  # the end of an event cut in front
    assert stream_failure(b'data: {"error": {"message": "m", "code": 503}}\r\n\r\n') == "m"
    assert event_failure({"error": {"code": 500, "message": "m"}, "choices": []}) is None
    assert event_failure({"error": {"code": True}}) is None
    assert (Outcome.FAILED_STREAM.recorded, Outcome.FAILED_STREAM.verdict) == ("upstream_error", Verdict.FAILURE)
    assert Outcome.FAILED_STREAM.reusable and Outcome.FAILED_STREAM.failed and not Outcome.OK.failed


def _stream_until_death(c: Cluster, headers: dict[str, str]) -> tuple[bytes, int]:
    """A long completions stream on the (only) worker; once it has tokens, a short request completes there and the
    engine dies. Returns (the stream's body as the client got it, its status); the read must end cleanly."""
    got: list[bytes] = []
    status: list[int] = []
    started = threading.Event()

    def stream() -> None:
        body = {"model": "dplb-sim", "prompt": "tell me", "max_tokens": 300, "stream": True}
        with httpx.Client(timeout=30) as client, client.stream("POST", c.url + "/v1/completions", json=body,
                                                                headers=headers) as r:
            status.append(r.status_code)
            for chunk in r.iter_raw():  # raises on an abnormal close (an incomplete chunked body)
                got.append(chunk)
                started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(20), c.tail()
    short = httpx.post(c.url + "/v1/completions", json={"model": "dplb-sim", "prompt": "x", "max_tokens": 1},
                       headers=headers, timeout=30)
    assert short.status_code == 200, short.text
    t.join(30)
    assert not t.is_alive()
    return b"".join(got), status[0]


def _warm_pool(c: Cluster, headers: dict[str, str]) -> None:
    """One request: the router then holds an idle connection to the worker (the direct relay needs one)."""
    r = httpx.post(c.url + "/v1/completions", json={"model": "dplb-sim", "prompt": "w", "max_tokens": 1},
                   headers=headers, timeout=30)
    assert r.status_code == 200


def _sample(c: Cluster, name: str, **labels: str) -> float:
    """The value of ``name`` with exactly ``labels`` (in any order) on the router's /metrics; 0 when absent."""
    for line in httpx.get(c.url + "/metrics", timeout=5).text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.startswith(name + "{") and dict(re.findall(r'(\w+)="([^"]*)"', head[len(name):])) == labels:
            return float(value)
    return 0.0


def _upstream(c: Cluster, outcome: str) -> float:
    return _sample(c, "dplb_upstream_request_duration_seconds_count", outcome=outcome, worker="0")


@pytest.mark.parametrize("path", ["direct", "asgi"])
def test_a_stream_the_worker_fails_is_relayed_unchanged_and_counted_as_an_upstream_error(
        tmp_path: Path, path: str) -> None:
    router = [] if path == "direct" else ["--no-direct-relay"]
    with cluster(str(tmp_path), 1, worker_args={0: SIM}, router_args=router) as c:
        _warm_pool(c, {})
        body, status = _stream_until_death(c, {})
        assert status == 200
        assert body.endswith(DEAD_EVENT + DONE), body[-400:]  # the worker's bytes, then a clean end
        assert body.count(DONE) == 1 and b"worker_failed" not in body
        assert _upstream(c, "upstream_error") == 1, c.tail()
        assert _upstream(c, "ok") == 2  # the pool's warm-up and the short request
        direct = _sample(c, "dplb_direct_relay_requests_total", path="direct")
        assert (direct >= 1) if path == "direct" else direct == 0
        assert "failed stream" in c.router_log() and "counted as an upstream error" in c.router_log()
        # The worker saw its engine die: it exits 1 (its supervisor restarts it), having counted the error.
        assert c.workers[0].wait(15) == 1
        assert "sim engine died (engine_death_after=3)" in c.tail(80)


def test_the_worker_counts_the_failed_stream_in_its_errors(tmp_path: Path) -> None:
    """The slot's ``errors_total`` (what ``dplb state`` and the router's per-worker figures show) counts it."""
    with cluster(str(tmp_path), 1, worker_args={0: SIM}) as c:
        _warm_pool(c, {})
        assert c.segment is not None
        before = c.segment.read(0).errors_total
        _stream_until_death(c, {})
        wait_for(lambda: c.segment.read(0).errors_total == before + 1, 5, "errors_total + 1")  # type: ignore[union-attr]


def test_the_router_counts_the_dead_engines_worker_restart_by_how_it_left(tmp_path: Path) -> None:
    """The dying worker's own counters leave with it (it exits 0.1 s after the death, its replacement starts at 0,
    so no 15 s scrape sees them): the router counts the replacement in dplb_worker_restarts_total, ``exited`` for a
    worker that published stopped before leaving (the engine death), ``killed`` for one that did not (SIGKILL)."""
    with cluster(str(tmp_path), 1, worker_args={0: SIM}) as c:
        _warm_pool(c, {})
        _stream_until_death(c, {})
        assert c.workers[0].wait(15) == 1
        assert _sample(c, "dplb_worker_restarts_total", reason="exited", worker="0") == 0  # no new process yet
        c.start_worker(0)  # what the supervisor (dplb launch, systemd) does
        try:
            wait_for(lambda: _sample(c, "dplb_worker_restarts_total", reason="exited", worker="0") == 1, 20,
                     "the engine death's restart counted as exited")
        except AssertionError as e:  # say which way it went wrong (once seen in a loaded full-suite run)
            replaced = [ln for ln in c.router_log().splitlines() if "replaced" in ln]
            raise AssertionError(f"{e}; killed={_sample(c, 'dplb_worker_restarts_total', reason='killed', worker='0')}"
                                 f", router log: {replaced}") from None
        c.kill_worker(0, signal.SIGKILL)
        c.start_worker(0)
        wait_for(lambda: _sample(c, "dplb_worker_restarts_total", reason="killed", worker="0") == 1, 10,
                 "the SIGKILL's restart counted as killed")
        assert _sample(c, "dplb_worker_restarts_total", reason="exited", worker="0") == 1
        assert "worker 0 replaced" in c.router_log()


def test_a_worker_that_stopped_unseen_by_the_router_is_counted_exited(tmp_path: Path) -> None:
    """The old process's ``stopped`` may stand in the slot for less than one router monitor step before its
    replacement overwrites it (a fast supervisor): the replacement says how its predecessor left
    (``FLAG_PREV_STOPPED``), so the restart still counts ``exited``. The router is SIGSTOPped from before the old
    worker's SIGTERM until the new one is ready, so it never sees ``stopped`` itself."""
    with cluster(str(tmp_path), 1, worker_args={0: SIM}) as c:
        assert c.router is not None
        os.kill(c.router.pid, signal.SIGSTOP)
        try:
            c.kill_worker(0, signal.SIGTERM)  # drains (nothing in flight), publishes stopped, exits 0
            assert c.workers[0].wait(15) == 0
            c.start_worker(0)
        finally:
            os.kill(c.router.pid, signal.SIGCONT)
        wait_for(lambda: _sample(c, "dplb_worker_restarts_total", reason="exited", worker="0") == 1, 20,
                 "the unseen stop's restart counted as exited")
        assert not _sample(c, "dplb_worker_restarts_total", reason="killed", worker="0")


def _tenants(path: Path) -> str:
    path.write_text(f"""
[priorities]
order = ["interactive"]

[tenants.chat]
api_key_sha256 = ["{hash_key('chat-key')}"]
priority = "interactive"

[slo.interactive]
availability = 0.99
""")
    return str(path)


def test_a_failed_stream_is_bad_in_the_tenants_slo_ledger(tmp_path: Path) -> None:
    """With tenants (the ASGI path's hooked relay, the usage meter on), the failed stream is a ``server_error`` and
    a bad availability event, though its status was 200; the requests that succeeded are good."""
    tf = _tenants(tmp_path / "tenants.toml")
    auth = {"authorization": "Bearer chat-key"}
    with cluster(str(tmp_path), 1, worker_args={0: SIM}, router_args=["--tenants", tf]) as c:
        _warm_pool(c, auth)
        body, status = _stream_until_death(c, auth)
        assert status == 200 and body.endswith(DEAD_EVENT + DONE), body[-400:]

        def ledger() -> dict[str, Any]:
            t = {"tenant": "chat", "priority": "interactive"}
            return {"server_error": _sample(c, "dplb_tenant_requests_total", **t, outcome="server_error"),
                    "ok": _sample(c, "dplb_tenant_requests_total", **t, outcome="ok"),
                    "bad": _sample(c, "dplb_tenant_slo_events_total", **t, slo="availability", result="bad"),
                    "good": _sample(c, "dplb_tenant_slo_events_total", **t, slo="availability", result="good")}

        wait_for(lambda: ledger()["server_error"] == 1, 5, "the failed stream in the ledger")
        assert ledger() == {"server_error": 1, "ok": 2, "bad": 1, "good": 2}, json.dumps(ledger())
        assert _upstream(c, "upstream_error") == 1



def test_a_stream_cut_by_a_dying_worker_is_bad_in_the_tenants_slo_ledger(tmp_path: Path) -> None:
    """The same ledger for a stream the router ends with its own error event (the worker process was SIGKILLed
    mid-stream): status 200 was sent, the request failed (before, it counted ``ok`` and a good event)."""
    tf = _tenants(tmp_path / "tenants.toml")
    auth = {"authorization": "Bearer chat-key"}
    with cluster(str(tmp_path), 1, worker_args={0: ["--sim-decode-step-s", "0.02"]},
                 router_args=["--tenants", tf]) as c:
        got: list[bytes] = []
        body = {"model": "dplb-sim", "prompt": "tell me", "max_tokens": 300, "stream": True}
        with httpx.Client(timeout=30) as client, client.stream("POST", c.url + "/v1/completions", json=body,
                                                                headers=auth) as r:
            with pytest.raises(httpx.RemoteProtocolError):  # the abnormal close
                for chunk in r.iter_raw():
                    got.append(chunk)
                    if len(got) == 3:
                        c.kill_worker(0)
        assert b"worker_failed" in b"".join(got)
        t = {"tenant": "chat", "priority": "interactive"}
        wait_for(lambda: _sample(c, "dplb_tenant_requests_total", **t, outcome="server_error") == 1, 5,
                 "the cut stream in the ledger")
        assert _sample(c, "dplb_tenant_requests_total", **t, outcome="ok") == 0
        assert _sample(c, "dplb_tenant_slo_events_total", **t, slo="availability", result="bad") == 1
