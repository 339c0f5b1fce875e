"""Traces over OTLP/HTTP to a real receiver: server span, dplb.route span with candidate events, client span
whose context reaches the worker as traceparent."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from cluster import cluster, worker_get
from otlp_receiver import OtlpReceiver

SERVER, CLIENT = 2, 3  # SpanKind enum values in the OTLP protobuf


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver()
    yield r
    r.close()


def test_one_trace_per_request_with_three_spans(tmp_path, receiver: OtlpReceiver,
                                                monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.endpoint + "/v1/traces")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    with cluster(str(tmp_path), 2) as c:
        client_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
        sent = []
        for i in range(4):
            h = {"x-request-id": f"trace-{i}"}
            if i == 0:
                h["traceparent"] = f"00-{client_trace}-00f067aa0ba902b7-01"
            r = httpx.post(c.url + "/v1/chat/completions", headers=h, timeout=30, json={
                "model": "dplb-sim", "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 2})
            assert r.status_code == 200
            sent.append((f"trace-{i}", r.headers["x-sg-worker-id"]))
        spans = receiver.wait_for(lambda s: sum(1 for x in s if x["kind"] == SERVER) >= 4)
        by_trace: dict[str, list[dict]] = {}  # type: ignore[type-arg]
        for s in spans:
            by_trace.setdefault(s["trace_id"], []).append(s)
        servers = [s for s in spans if s["kind"] == SERVER]
        assert len(servers) == 4 and len(by_trace) == 4
        assert any(s["trace_id"] == client_trace and s["parent_id"] == "00f067aa0ba902b7" for s in servers)
        for rid, worker in sent:
            srv = next(s for s in servers if s["attrs"].get("dplb.request_id") == rid)
            assert srv["name"] == "POST /v1/chat/completions" and srv["service"] == "dplb-router"
            assert srv["attrs"]["http.response.status_code"] == 200
            trace = by_trace[srv["trace_id"]]
            route = next(s for s in trace if s["name"] == "dplb.route")
            cli = next(s for s in trace if s["kind"] == CLIENT)
            assert route["parent_id"] == srv["span_id"] and cli["parent_id"] == srv["span_id"]
            assert str(route["attrs"]["dplb.worker.id"]) == worker and route["attrs"]["dplb.policy"] == "dplb"
            cands = [e for e in route["events"] if e[0] == "dplb.candidate"]
            assert sorted(e[1]["dplb.worker.id"] for e in cands) == [0, 1]
            for _, attrs in cands:
                for key in ("dplb.score", "dplb.term.queue", "dplb.term.memory", "dplb.term.latency", "dplb.queue",
                            "dplb.kv_cache_usage", "dplb.eligible"):
                    assert key in attrs
            assert cli["name"] == "chat dplb-sim" and cli["attrs"]["gen_ai.operation.name"] == "chat"
            assert cli["attrs"]["gen_ai.request.model"] == "dplb-sim"
            # The worker got our client span's context, not the client's.
            seen = next(e for e in worker_get(c.sock(int(worker)), "/debug/requests").json()
                        if e.get("x_request_id") == rid)
            assert seen["traceparent"].rsplit("-", 1)[0] == f"00-{cli['trace_id']}-{cli['span_id']}"


def test_missing_collector_never_fails_or_slows_requests(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # closed when the block ends: nothing listens there
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{dead}")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    with cluster(str(tmp_path), 1) as c:
        t0 = time.monotonic()
        for i in range(30):
            r = httpx.post(c.url + "/v1/completions", timeout=30, json={"model": "dplb-sim", "prompt": f"{i}",
                                                                        "max_tokens": 1})
            assert r.status_code == 200
        assert time.monotonic() - t0 < 15
        assert "tracing on" in c.router_log()
