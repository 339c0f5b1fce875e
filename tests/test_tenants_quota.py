"""A tenant's token quota and its class's TTFT SLO on a real router with real sim workers (docs/DESIGN.md §15): a
burst of concurrent requests admits only the reservations (prompt estimate + max_tokens) that fit
``tokens_per_min``, a request larger than the whole quota is a 400, unused reservations go back to the bucket;
the TTFT SLO and histogram count streamed responses only."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from dplb.ops.usage import ledger_of
from dplb.tenants import hash_key
from tests.cluster import assert_openai_error, cluster, post, worker_get

KEY = "quota-key"


def write(path: Path, extra: str) -> str:
    path.write_text(f"""
[priorities]
order = ["interactive"]

[tenants.chat]
api_key_sha256 = ["{hash_key(KEY)}"]
priority = "interactive"
{extra}""")
    return str(path)


def body(max_tokens: int, stream: bool = False) -> dict:
    return {"model": "dplb-sim", "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": max_tokens, "stream": stream}


AUTH = {"authorization": f"Bearer {KEY}"}


def generated(c, n: int) -> float:  # type: ignore[no-untyped-def]
    total = 0.0
    for k in range(n):
        for line in worker_get(c.sock(k), "/metrics").text.splitlines():
            if line.startswith("vllm:generation_tokens_total{"):
                total += float(line.rpartition(" ")[2])
    return total


def test_a_burst_of_concurrent_requests_admits_only_what_fits_the_token_quota(tmp_path: Path) -> None:
    """tokens_per_min = 1000; 12 concurrent requests of max_tokens 200 (a prompt estimate of well under 50 tokens):
    each reserves 200 + its prompt estimate, so exactly 4 fit; the other 8 get 429 with Retry-After. Counting only
    the prompt at admission (as before) let all 12 run: 2 400 tokens inside a 1 000 tokens/min quota."""
    tf = write(tmp_path / "t.toml", "tokens_per_min = 1000\n")
    slow = ["--sim-decode-step-s", "0.005"]
    with cluster(str(tmp_path), 2, worker_args={0: slow, 1: slow}, router_args=["--tenants", tf]) as c:
        gen0 = generated(c, 2)

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as client:
                return await asyncio.gather(*(client.post(c.url + "/v1/chat/completions", json=body(200),
                                                          headers=AUTH) for _ in range(12)))
        rs = asyncio.run(burst())
        ok = [r for r in rs if r.status_code == 200]
        limited = [r for r in rs if r.status_code != 200]
        assert len(ok) == 4, [r.status_code for r in rs]
        for r in limited:
            assert_openai_error(r, 429, "rate_limit_exceeded")  # OpenAI's code; the reason label is DPLB's
            assert r.json()["error"]["type"] == "tokens"
            assert int(r.headers["retry-after"]) >= 1 and r.headers["x-ratelimit-limit-tokens"] == "1000"
        assert sum(r.json()["usage"]["completion_tokens"] for r in ok) == generated(c, 2) - gen0 == 800
        metrics = httpx.get(c.url + "/metrics", timeout=5).text
        assert f'dplb_requests_rejected_total{{reason="tokens_rate_limit_exceeded"}} {len(limited)}.0' in metrics
        # One request larger than the whole quota can never fit: a client error at once, not a wait.
        big = post(c, "/v1/chat/completions", body(2000), headers=AUTH)
        assert_openai_error(big, 400, "tokens_exceed_quota")
        assert "1000 tokens/min" in big.json()["error"]["message"]
        # The four ran to their end and used fewer prompt tokens than reserved: the bucket holds what is left
        # (1000 − 4 × their real usage, plus what refilled), never less.
        used = sum(r.json()["usage"]["total_tokens"] for r in ok)
        remaining = int(post(c, "/v1/chat/completions", body(1), headers=AUTH).headers
                        .get("x-ratelimit-remaining-tokens", "-1"))
        assert remaining >= 1000 - used - 60, (remaining, used)  # the 1-token request's own reservation, at most


def test_the_ttft_slo_counts_streamed_requests_only(tmp_path: Path) -> None:
    """A non-streamed response's first body byte is the whole answer: 40 tokens at 20 ms a step is ~0.8 s, over
    ttft_s = 0.3. Counted as TTFT (as before) each was a bad event of a healthy class; now only the streams count
    (their first token comes after one step), and the non-streamed ones count in availability and E2E."""
    tf = write(tmp_path / "t.toml", "[slo.interactive]\navailability = 0.99\nttft_s = 0.3\nttft_target = 0.9\n")
    with cluster(str(tmp_path), 1, worker_args={0: ["--sim-decode-step-s", "0.02"]},
                 router_args=["--tenants", tf]) as c:
        # Every series of the class's SLOs exists at 0 from the start: the error-budget panel divides bad by all,
        # and a bad series born only with the first bad event left it empty while nothing had failed.
        zero = [ln for ln in httpx.get(c.url + "/metrics", headers=AUTH, timeout=5).text.splitlines()
                if ln.startswith("dplb_tenant_slo_events_total{") and 'tenant="chat"' in ln]
        assert sorted(ln.rpartition(" ")[2] for ln in zero) == ["0.0"] * 4, zero
        assert sum('result="bad"' in ln for ln in zero) == 2, zero
        for stream in (False, False, False, True, True):
            r = post(c, "/v1/chat/completions", body(40, stream), headers=AUTH)
            assert r.status_code == 200, r.text
        text = httpx.get(c.url + "/metrics", headers=AUTH, timeout=5).text
        events = {ln.rpartition(" ")[0]: float(ln.rpartition(" ")[2]) for ln in text.splitlines()
                  if ln.startswith("dplb_tenant_slo_events_total{")}
        ttft = {k: v for k, v in events.items() if 'slo="ttft"' in k}
        avail = {k: v for k, v in events.items() if 'slo="availability"' in k}
        assert sum(ttft.values()) == 2 and not any(v for k, v in ttft.items() if 'result="bad"' in k), ttft
        assert sum(avail.values()) == 5
        led = ledger_of(text)["chat"]
        assert led["e2e_s_mean"] > 0.3  # the non-streamed requests' latency is in E2E
        count = [ln for ln in text.splitlines() if ln.startswith("dplb_tenant_ttft_seconds_count{")]
        assert [float(ln.rpartition(" ")[2]) for ln in count] == [2.0], count


def test_the_reservation_counts_every_sequence_n_or_best_of_generates(tmp_path: Path) -> None:
    """tokens_per_min = 2000: ``n = 10, max_tokens = 300`` generates 3000 tokens, so it can never fit (400 at once);
    reserving max_tokens once (as before) admitted it with 200 and 3000 completion tokens. ``best_of`` (vLLM
    completions) and ``n`` as a string (vLLM's lax integer) count the same; ``n = 4, max_tokens = 200`` (800
    reserved) fits twice but not three times in a burst, and its 800 tokens are really generated."""
    tf = write(tmp_path / "t.toml", "tokens_per_min = 2000\n")
    with cluster(str(tmp_path), 2, router_args=["--tenants", tf]) as c:
        for extra in ({"n": 10}, {"n": "10"}, {"best_of": 10, "n": 1}):
            r = post(c, "/v1/completions", {"model": "dplb-sim", "prompt": "hi", "max_tokens": 300, **extra},
                     headers=AUTH)
            assert_openai_error(r, 400, "tokens_exceed_quota")
            assert "2000 tokens/min" in r.json()["error"]["message"]
        big = dict(body(300), n=10)
        assert_openai_error(post(c, "/v1/chat/completions", big, headers=AUTH), 400, "tokens_exceed_quota")

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as client:
                return await asyncio.gather(*(client.post(c.url + "/v1/chat/completions",
                                                          json=dict(body(200), n=4), headers=AUTH)
                                              for _ in range(3)))
        codes = sorted(r.status_code for r in asyncio.run(burst()))
        assert codes == [200, 200, 429], codes
