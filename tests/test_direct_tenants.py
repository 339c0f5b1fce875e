"""The direct relay (dplb/router/direct.py) with a tenants file (``--tenants``), against the ASGI path
(``--no-direct-relay``), with a real router and sim worker process (the comparison of tests/test_direct_keyed.py,
with tenants): several tenants with keys, priority classes, a weight and every limit kind. The relay takes a request
its tenant's gate admits at once and declines what the gate refuses or queues (the ASGI path answers it); both
paths give the same answers (``x-ratelimit-*`` headers, the refusals' bodies) and leave the same usage ledger,
``dplb_tenant_*`` samples, debug ring and access-log lines. The relay's counters prove which requests it took."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from cluster import Cluster, cluster, wait_for
from test_direct_keyed import _VOLATILE, _direct, _samples

from dplb.ops.usage import read_ledger
from dplb.tenants import hash_key

KEYS = {"alpha": "key-alpha", "beta": "key-beta", "rps": "key-rps", "tpm": "key-tpm", "conc": "key-conc",
        "narrow": "key-narrow", "ops": "key-ops"}
TENANTS = """
[priorities]
order = ["interactive", "batch"]

[tenants.alpha]
api_key_sha256 = ["{alpha}"]
priority = "interactive"
requests_per_s = 1000
tokens_per_min = 1000000
max_concurrent = 50

[tenants.beta]
api_key_sha256 = ["{beta}"]
priority = "batch"
weight = 2

[tenants.rps]
api_key_sha256 = ["{rps}"]
priority = "batch"
requests_per_s = 0.001

[tenants.tpm]
api_key_sha256 = ["{tpm}"]
priority = "batch"
tokens_per_min = 100

[tenants.conc]
api_key_sha256 = ["{conc}"]
priority = "interactive"
max_concurrent = 1

[tenants.narrow]
api_key_sha256 = ["{narrow}"]
priority = "batch"
models = ["other-model"]

[tenants.ops]
api_key_sha256 = ["{ops}"]
priority = "batch"
admin = true
"""
# One slot (a second request queues while one runs), 10 ms a token.
WORKER = ["--sim-max-num-seqs", "1", "--sim-decode-step-s", "0.01", "--sim-decode-step-s-per-seq", "0"]
CHAT = {"model": "dplb-sim", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}
COMP = {"model": "dplb-sim", "prompt": "abc", "max_tokens": 3}
# (path, body, tenant or a raw Authorization value, the relay takes it): asked in order on one keep-alive client.
REQUESTS: list[tuple[str, dict[str, Any], str, bool]] = [
    ("/v1/chat/completions", CHAT, "alpha", True),
    ("/v1/chat/completions", {**CHAT, "stream": True, "max_tokens": 6}, "alpha", True),  # usage asked, taken out
    ("/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": True}}, "alpha", True),
    ("/v1/completions", COMP, "beta", True),
    ("/v1/completions", {**COMP, "stream": True, "max_tokens": 5}, "beta", True),
    ("/v1/embeddings", {"model": "dplb-sim", "input": "hello"}, "beta", True),
    ("/v1/completions", {**COMP, "max_tokens": 1}, "rps", True),
    ("/v1/completions", {**COMP, "max_tokens": 1}, "rps", False),  # 429 rate_limited
    ("/v1/chat/completions", {**CHAT, "max_tokens": 200}, "tpm", False),  # 400 tokens_exceed_quota
    ("/v1/completions", {**COMP, "max_tokens": 60}, "tpm", True),  # reserves 61 of 100
    ("/v1/completions", {**COMP, "max_tokens": 60}, "tpm", False),  # 429 tokens_rate_limited
    ("/v1/chat/completions", CHAT, "narrow", False),  # 403 model_not_allowed
    ("/v1/chat/completions", CHAT, "Bearer nobody", False),  # 401
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, "alpha", True),  # the worker's 400
]
STATUSES = [200, 200, 200, 200, 200, 200, 200, 429, 400, 200, 429, 403, 401, 400]
# Values that move with the clock between two runs (a bucket's level and reset time, a refusal's wait).
_CLOCKED = ("x-ratelimit-remaining-", "x-ratelimit-reset-", "retry-after")
_TIMES = re.compile(rb"\b\d+(\.\d+)?(ms|s)\b|\b\d+m\d+s\b")
_ACCESS = re.compile(r"(\S+) tenant=(\S+) status=(\d+) outcome=(\S+) queue_wait_ms=(\d+) prompt_tokens=(\S+) "
                     r"completion_tokens=(\S+)")


def _auth(who: str) -> str:
    return f"Bearer {KEYS[who]}" if who in KEYS else who


def _norm(r: httpx.Response) -> tuple[int, list[tuple[str, str]], bytes]:
    """Status, headers (the clocked values masked, their names kept) and body (ids and times masked)."""
    kept = sorted((k, "N" if k.startswith(_CLOCKED) else v) for k, v in r.headers.multi_items()
                  if k not in ("date", "content-length"))
    return r.status_code, kept, _TIMES.sub(b"T", _VOLATILE.sub(rb'"\1":X', r.content))


def _ask(c: Cluster) -> list[tuple[int, list[tuple[str, str]], bytes]]:
    out = []
    client = httpx.Client(timeout=30)
    try:
        for i, (path, body, who, _) in enumerate(REQUESTS):
            r = client.post(c.url + path, content=json.dumps(body).encode(),
                            headers={"content-type": "application/json", "authorization": _auth(who),
                                     "x-request-id": f"same-{i}"})
            out.append(_norm(r))
            if r.headers.get("connection") == "close":
                client.close()
                client = httpx.Client(timeout=30)
    finally:
        client.close()
    return out


def _held_open(c: Cluster) -> tuple[list[Any], bytes]:
    """While a stream of ``conc`` holds the worker's only slot: a second request of ``conc`` (429 over its
    max_concurrent) and one of ``beta``, which waits in the fair queue until the stream ends and is then served.
    Returns the two answers and the stream's bytes."""
    got: list[Any] = []
    with httpx.Client(timeout=30) as client, client.stream(
            "POST", c.url + "/v1/chat/completions", headers={"authorization": _auth("conc"), "x-request-id": "held"},
            json={**CHAT, "stream": True, "max_tokens": 60}) as held:
        chunks = held.iter_raw()
        first = next(chunks)
        got.append(_norm(httpx.post(c.url + "/v1/completions", json=COMP, timeout=30,
                                    headers={"authorization": _auth("conc"), "x-request-id": "conc-2"})))
        queued: list[httpx.Response] = []
        t = threading.Thread(target=lambda: queued.append(httpx.post(
            c.url + "/v1/completions", json=COMP, timeout=30,
            headers={"authorization": _auth("beta"), "x-request-id": "queued"})))
        t.start()
        time.sleep(0.1)  # (queued before the stream ends)
        body = first + b"".join(chunks)
        t.join(30)
        got.append(_norm(queued[0]))
    assert body.rstrip().endswith(b"data: [DONE]"), body[-200:]
    return got, _VOLATILE.sub(rb'"\1":X', body)


def _accounts(c: Cluster) -> tuple[dict[str, str], list[Any], list[Any], dict[str, Any]]:
    """The compared samples, the debug ring, the access-log lines (a queue wait as waited or not) and the ledger."""
    time.sleep(0.3)  # (the last response's accounting runs after its last byte)
    ring = httpx.get(c.url + "/debug/decisions?limit=100", headers={"authorization": _auth("ops")}, timeout=5)
    assert ring.status_code == 200, ring.text
    decisions = sorted((d["request_id"], d["tenant"], d["worker"]) for d in ring.json())
    log = [(*m.groups()[:4], int(m.group(5)) > 0, *m.groups()[5:]) for m in _ACCESS.finditer(c.router_log())]
    samples = {k: v for k, v in _samples(c).items() if 'route="/metrics"' not in k}  # (the test's own reads)
    counts = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "queued")  # (not the mean times)
    ledger = {t: {k: row[k] for k in counts} for t, row in read_ledger(c.url, KEYS["ops"]).items()}
    return samples, decisions, log, ledger


def _left(c: Cluster) -> dict[str, Any]:
    """A stream of ``alpha`` whose client leaves after 3 events: ``alpha``'s ledger once it is accounted."""
    got = b""
    with httpx.Client(timeout=30) as client, client.stream(
            "POST", c.url + "/v1/chat/completions", headers={"authorization": _auth("alpha"), "x-request-id": "left"},
            json={**CHAT, "stream": True, "max_tokens": 300}) as r:
        for chunk in r.iter_raw():
            got += chunk
            if got.count(b"data:") >= 3:
                break
    led: dict[str, Any] = wait_for(lambda: (x := read_ledger(c.url, KEYS["ops"]).get("alpha"))
                                   and x["requests"].get("cancelled") and x, 10, "the left stream in the ledger")
    return led


def test_tenants_direct_relay_answers_and_accounts_as_the_asgi_path(tmp_path: Path) -> None:
    """Every request of the table, a 429 of ``max_concurrent``, a request queued behind a held slot and a left
    stream: the same answers, headers, ledger, ``dplb_tenant_*`` samples, debug ring and access-log lines on both
    paths; the relay took every request admitted at once (or continued it on the ASGI path) and declined the
    refusals and the queued one."""
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS.format(**{n: hash_key(k) for n, k in KEYS.items()}))
    flags = ["--tenants", str(path), "--access-log"]
    with cluster(str(tmp_path), 1, worker_args={0: WORKER}, router_args=flags) as c:
        direct = _ask(c)
        counts = _direct(c)
        d_held, d_body = _held_open(c)
        held_counts = _direct(c)
        d_acc = _accounts(c)
        d_left = _left(c)
        left_counts = _direct(c)
        c.start_router(*flags, "--no-direct-relay")
        asgi = _ask(c)
        a_held, a_body = _held_open(c)
        a_acc = _accounts(c)
        a_left = _left(c)
        assert _direct(c) == {"direct": 0, "continued": 0, "declined": 0}
    assert [s for s, _, _ in direct] == STATUSES
    for req, d, a in zip(REQUESTS, direct, asgi, strict=True):
        assert d == a, req
    taken = sum(t for *_, t in REQUESTS)
    assert counts["declined"] == len(REQUESTS) - taken, counts
    assert counts["direct"] + counts["continued"] == taken and counts["continued"] <= 1, counts
    # The held stream taken; the 429 and the queued request declined (the ASGI path answered and queued them).
    assert held_counts["declined"] - counts["declined"] == 2, (counts, held_counts)
    assert held_counts["direct"] + held_counts["continued"] == taken + 1, held_counts
    assert [s for s, _, _ in d_held] == [429, 200] and d_held == a_held and d_body == a_body
    assert b'"concurrency_limit_exceeded"' in d_held[0][2] and ("x-ratelimit-limit-concurrent", "1") in d_held[0][1]
    headers = dict(direct[0][1])
    assert headers["x-ratelimit-limit-requests"] == "1000" and headers["x-ratelimit-limit-tokens"] == "1000000"
    assert b'"type":"requests"' in direct[7][2] and b'"tokens_exceed_quota"' in direct[8][2]
    assert b'"type":"tokens"' in direct[10][2] and b'"model_not_allowed"' in direct[11][2]
    assert b'"usage"' not in direct[1][2] and direct[2][2].count(b'"usage"') >= 1  # stripped; the client's kept
    (d_samples, d_ring, d_log, d_led), (a_samples, a_ring, a_log, a_led) = d_acc, a_acc
    assert d_samples == a_samples
    assert any(k.startswith("dplb_tenant_requests_total") and 'tenant="tpm"' in k for k in d_samples), d_samples
    assert d_ring == a_ring and {t for _, t, _ in d_ring} >= {"alpha", "beta", "rps", "tpm", "conc"}
    a_log = [x for x in a_log[len(d_log):] if x[0] != "left"]  # (one log file for both routers: the relay's left)
    assert d_log == a_log, (d_log, a_log)
    assert [w for rid, *_, w, _, _ in d_log if rid == "queued"] == [True], d_log  # it waited in the queue
    assert d_led == a_led and d_led["tpm"]["requests"] == {"ok": 1, "rejected": 1, "client_error": 1}, d_led
    # The left stream: taken by the relay, cancelled in the ledger, its prompt the engine's or the estimate alike.
    assert left_counts["direct"] + left_counts["continued"] == held_counts["direct"] + held_counts["continued"] + 1
    for led in (d_left, a_left):
        assert dict(led["requests"]) == {"ok": 3, "client_error": 1, "cancelled": 1}, led
    assert d_left["prompt_tokens"] == a_left["prompt_tokens"], (d_left, a_left)
