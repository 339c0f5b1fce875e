"""Tenants on a real router with real sim workers (docs/DESIGN.md §15): keys (401), model allow-lists (403), rate
limits (429 + Retry-After + x-ratelimit-*), the usage ledger against the engines' own counters, the fair queue
(a light tenant is not stuck behind a flood; a queued client that leaves is never sent; timeouts; drain), and
SIGHUP reloads."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import httpx
import pytest

from dplb.ops.usage import format_table, ledger_of, read_ledger
from dplb.tenants import hash_key
from tests.cluster import assert_openai_error, cluster, post, wait_for, worker_get

KEYS = {"chat": "chat-key", "batch": "batch-key", "small": "small-key", "narrow": "narrow-key"}
SLOW = ["--sim-max-num-seqs", "2", "--sim-decode-step-s", "0.05", "--sim-decode-step-s-per-seq", "0"]


def write_tenants(path: Path, extra: str = "") -> str:
    path.write_text(f"""
[priorities]
order = ["interactive", "batch"]

[tenants.chat]
api_key_sha256 = ["{hash_key(KEYS['chat'])}"]
priority = "interactive"

[tenants.batch]
api_key_sha256 = ["{hash_key(KEYS['batch'])}"]
priority = "batch"

[tenants.small]
api_key_sha256 = ["{hash_key(KEYS['small'])}"]
priority = "batch"
requests_per_s = 1
models = ["dplb-sim"]

[tenants.narrow]
api_key_sha256 = ["{hash_key(KEYS['narrow'])}"]
priority = "batch"
models = ["other-model"]
{extra}""")
    return str(path)


def auth(tenant: str) -> dict[str, str | bytes]:
    return {"authorization": f"Bearer {KEYS[tenant]}"}


def chat(max_tokens: int = 4, stream: bool = False, usage: bool = False, model: str = "dplb-sim") -> dict:
    b: dict = {"model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": max_tokens,
               "stream": stream}
    if usage:
        b["stream_options"] = {"include_usage": True}
    return b


def sim_counter(sock: str, name: str) -> float:
    for line in worker_get(sock, "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rpartition(" ")[2])
    return 0.0


def test_keys_models_and_rate_limits(tmp_path: Path) -> None:
    tf = write_tenants(tmp_path / "tenants.toml")
    with cluster(str(tmp_path), 1, router_args=["--tenants", tf]) as c:
        assert_openai_error(post(c, "/v1/chat/completions", chat()), 401, "invalid_api_key")
        r = post(c, "/v1/chat/completions", chat(), headers={"authorization": "Bearer nope"})
        assert_openai_error(r, 401, "invalid_api_key")
        assert post(c, "/v1/chat/completions", chat(), headers=auth("chat")).status_code == 200
        assert httpx.get(c.url + "/v1/models", timeout=5).status_code == 401  # local routes need a tenant's key
        assert httpx.get(c.url + "/v1/models", headers=auth("batch"), timeout=5).status_code == 200
        r = post(c, "/v1/chat/completions", chat(), headers=auth("narrow"))
        assert_openai_error(r, 403, "model_not_allowed")
        assert "other-model" in r.json()["error"]["message"]
        ok = post(c, "/v1/chat/completions", chat(), headers=auth("small"))
        assert ok.status_code == 200 and ok.headers["x-ratelimit-limit-requests"] == "1"
        r = post(c, "/v1/chat/completions", chat(), headers=auth("small"))
        assert_openai_error(r, 429, "rate_limit_exceeded")
        assert r.headers["retry-after"] == "1" and r.headers["x-ratelimit-remaining-requests"] == "0"
        assert r.headers["x-ratelimit-reset-requests"].endswith(("ms", "s"))
        time.sleep(1.1)
        assert post(c, "/v1/chat/completions", chat(), headers=auth("small")).status_code == 200
        decisions = httpx.get(c.url + "/debug/decisions", headers=auth("chat"), timeout=5).json()
        assert {d["tenant"] for d in decisions} >= {"chat"}
        led = read_ledger(c.url)  # what `dplb usage` prints
        table = format_table(led).splitlines()
        assert table[0].split()[:3] == ["TENANT", "OK", "REQUESTS"] and any(ln.startswith("small ") for ln in table)
        assert led["small"]["requests"] == {"ok": 2, "rejected": 1}
        assert led["narrow"]["requests"] == {"rejected": 1} and led["chat"]["requests"] == {"ok": 1}


def test_ledger_tokens_equal_the_engines_and_a_client_gets_no_usage_it_did_not_ask_for(tmp_path: Path) -> None:
    tf = write_tenants(tmp_path / "tenants.toml")
    with cluster(str(tmp_path), 2, router_args=["--tenants", tf]) as c:
        def engine(name: str) -> float:
            return sum(sim_counter(c.sock(k), name) for k in range(2))

        prompt0, gen0 = engine("vllm:prompt_tokens_total"), engine("vllm:generation_tokens_total")  # warm-ups
        for i in range(6):
            tenant = "chat" if i % 2 else "batch"
            body = chat(max_tokens=3 + i, stream=i % 3 != 0, usage=i % 3 == 1)
            r = post(c, "/v1/chat/completions", body, headers=auth(tenant))
            assert r.status_code == 200, r.text
            if body["stream"]:
                events = [ln for ln in r.text.split("\n\n") if ln.startswith("data: {")]
                has_usage = any('"usage"' in e for e in events)
                assert has_usage == (i % 3 == 1), r.text  # asked for: relayed; not asked for: not there
                assert r.text.endswith("data: [DONE]\n\n")
        led = ledger_of(httpx.get(c.url + "/metrics", timeout=5).text)
        prompt = engine("vllm:prompt_tokens_total") - prompt0
        gen = engine("vllm:generation_tokens_total") - gen0
        assert led["chat"]["completion_tokens"] + led["batch"]["completion_tokens"] == gen == sum(3 + i for i in
                                                                                                   range(6))
        assert led["chat"]["prompt_tokens"] + led["batch"]["prompt_tokens"] == prompt > 0
        assert led["chat"]["requests"] == {"ok": 3} and led["batch"]["requests"] == {"ok": 3}


async def _ttft(client: httpx.AsyncClient, url: str, tenant: str, max_tokens: int) -> float:
    t0 = time.perf_counter()
    async with client.stream("POST", url + "/v1/chat/completions", json=chat(max_tokens, stream=True),
                             headers=auth(tenant)) as r:
        assert r.status_code == 200
        ttft = None
        async for _ in r.aiter_bytes():
            ttft = ttft or time.perf_counter() - t0
    assert ttft is not None, "empty stream"
    return ttft


def test_fair_queue_serves_the_light_tenant_at_the_next_free_slot(tmp_path: Path) -> None:
    """One worker with 2 batch slots, 50 ms steps: batch floods 10 requests of 40 tokens (2 s each). FIFO would
    make chat wait for all 10 (≈ 10 s); the fair queue sends it at the next free slot (≤ 2 s)."""
    tf = write_tenants(tmp_path / "tenants.toml")
    with cluster(str(tmp_path), 1, worker_args={0: SLOW}, router_args=["--tenants", tf]) as c:
        async def go() -> tuple[float, list[float]]:
            async with httpx.AsyncClient(timeout=60) as client:
                flood = [asyncio.create_task(_ttft(client, c.url, "batch", 40)) for _ in range(10)]
                await asyncio.sleep(0.5)
                queued = ledger_of((await client.get(c.url + "/metrics")).text)["batch"]["queued"]
                assert queued == 8, queued  # two run, eight wait in the router, none in the engine
                light = await _ttft(client, c.url, "chat", 2)
                return light, await asyncio.gather(*flood)
        light, flood = asyncio.run(go())
        assert light < 3.0, (light, sorted(flood))
        assert max(flood) > 6.0  # the flood really was queued behind itself
        state = worker_get(c.sock(0), "/metrics").text
        assert "vllm:num_requests_waiting" in state


def test_a_stream_the_client_cancels_is_charged_its_prompt_and_what_was_generated(tmp_path: Path) -> None:
    """The engine ran the prefill of a stream its client left mid-way: the ledger charges the router's prompt
    estimate (no engine count arrives) and the generated events relayed; it charged 0 prompt tokens."""
    tf = write_tenants(tmp_path / "tenants.toml")
    with cluster(str(tmp_path), 1, worker_args={0: SLOW}, router_args=["--tenants", tf]) as c:
        prompt0 = sim_counter(c.sock(0), "vllm:prompt_tokens_total")
        body = chat(max_tokens=200, stream=True)
        body["messages"][0]["content"] = "a longer prompt of some forty bytes " * 4
        with httpx.Client(timeout=30) as client, \
                client.stream("POST", c.url + "/v1/chat/completions", json=body, headers=auth("batch")) as r:
            assert r.status_code == 200
            got = 0
            for line in r.iter_lines():
                got += line.startswith("data: {")
                if got == 5:
                    break  # the client leaves mid-stream
        wait_for(lambda: ledger_of(httpx.get(c.url + "/metrics", timeout=5).text).get("batch", {}).get(
            "requests") == {"cancelled": 1}, 10, "the cancelled stream in the ledger")
        led = ledger_of(httpx.get(c.url + "/metrics", timeout=5).text)["batch"]
        engine_prompt = sim_counter(c.sock(0), "vllm:prompt_tokens_total") - prompt0
        assert engine_prompt > 0 and 0.5 * engine_prompt <= led["prompt_tokens"] <= 2 * engine_prompt, \
            (led, engine_prompt)
        assert 5 <= led["completion_tokens"] < 200, led


def test_queued_client_that_leaves_is_never_sent_and_timeouts_answer_503(tmp_path: Path) -> None:
    tf = write_tenants(tmp_path / "tenants.toml")
    with cluster(str(tmp_path), 1, worker_args={0: SLOW},
                 router_args=["--tenants", tf, "--queue-timeout", "1"]) as c:
        async def go() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as client:
                hold = [asyncio.create_task(client.post(c.url + "/v1/chat/completions", json=chat(60),
                                                        headers=auth("batch"))) for _ in range(2)]
                await asyncio.sleep(0.3)
                with pytest.raises(httpx.TimeoutException):  # queued, then the client gives up
                    await client.post(c.url + "/v1/chat/completions", json=chat(5), headers=auth("chat"),
                                      timeout=0.4)
                timed_out = await client.post(c.url + "/v1/chat/completions", json=chat(5), headers=auth("chat"))
                return [timed_out, *await asyncio.gather(*hold)]
        timed_out, *held = asyncio.run(go())
        assert_openai_error(timed_out, 503, "queue_timeout")
        assert timed_out.headers["retry-after"] == "1"
        assert all(r.status_code == 200 for r in held)
        reqs = [r for r in worker_get(c.sock(0), "/debug/requests").json() if r["path"] == "/v1/chat/completions"]
        assert len(reqs) == 2, reqs  # the two that ran; the one whose client left never reached the engine
        led = ledger_of(httpx.get(c.url + "/metrics", timeout=5).text)
        assert led["chat"]["requests"] == {"cancelled": 1, "server_error": 1}


def test_sighup_reloads_and_a_bad_file_keeps_the_old_one(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    tf = write_tenants(path)
    with cluster(str(tmp_path), 1, router_args=["--tenants", tf]) as c:
        new_key = "new-key"
        assert post(c, "/v1/chat/completions", chat(), headers={"authorization": f"Bearer {new_key}"}).status_code \
            == 401
        write_tenants(path, f'[tenants.new]\napi_key_sha256 = ["{hash_key(new_key)}"]\npriority = "batch"\n')
        assert c.router is not None
        c.router.send_signal(signal.SIGHUP)
        wait_for(lambda: "reloaded" in c.router_log(), 10, "the reload log line")
        assert post(c, "/v1/chat/completions", chat(), headers={"authorization": f"Bearer {new_key}"}).status_code \
            == 200
        path.write_text("[tenants.broken\n")
        c.router.send_signal(signal.SIGHUP)
        wait_for(lambda: "not reloaded, keeping the previous one" in c.router_log(), 10, "the refusal log line")
        assert post(c, "/v1/chat/completions", chat(), headers={"authorization": f"Bearer {new_key}"}).status_code \
            == 200


def test_drain_answers_every_queued_request(tmp_path: Path) -> None:
    tf = write_tenants(tmp_path / "tenants.toml")
    with cluster(str(tmp_path), 1, worker_args={0: SLOW}, router_args=["--tenants", tf]) as c:
        async def go() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as client:
                tasks = [asyncio.create_task(client.post(c.url + "/v1/chat/completions", json=chat(20),
                                                         headers=auth("batch"))) for _ in range(5)]
                await asyncio.sleep(0.5)
                assert c.router is not None
                c.router.send_signal(signal.SIGTERM)
                return list(await asyncio.gather(*tasks))
        got = asyncio.run(go())
        codes = sorted(r.status_code for r in got)
        assert codes == [200, 200, 503, 503, 503], [r.text for r in got]
        for r in got:
            if r.status_code == 503:
                assert_openai_error(r, 503, "router_draining")


def test_two_router_processes_share_room_through_the_segment(tmp_path: Path) -> None:
    """With --processes 2 each process queues its own requests, but room is counted from every process's in-flight
    requests (router slots): the engine never holds more than its batch slots, and the light tenant still runs at
    the next free slot."""
    tf = write_tenants(tmp_path / "tenants.toml")
    with cluster(str(tmp_path), 1, worker_args={0: SLOW}, router_args=["--tenants", tf, "--processes", "2"]) as c:
        assert c.segment is not None
        segment = c.segment

        async def go() -> tuple[float, list[float], list[int]]:
            waiting = []
            async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as client:
                flood = [asyncio.create_task(_ttft(client, c.url, "batch", 40)) for _ in range(10)]
                for _ in range(10):
                    await asyncio.sleep(0.1)
                    waiting.append(segment.read(0).num_waiting)
                light = await _ttft(client, c.url, "chat", 2)
                return light, await asyncio.gather(*flood), waiting
        light, flood, waiting = asyncio.run(go())
        # Everything beyond the 2 slots waited in the routers, not the engine (a request granted a freed slot may be
        # seen waiting for the engine's next step, 50 ms; without the fair queue the engine would hold 8).
        assert max(waiting) <= 1, waiting
        # The next free slot comes within one 2 s flood request; with 2 processes the slot may go to the other
        # process's queued flood request first (each process grants from its own queue), so up to two. FIFO would
        # put the light request behind the whole flood (10 requests on 2 slots: ~10 s).
        assert light < 4.5, (light, sorted(flood))
        assert max(flood) > 6.0
        led = ledger_of(httpx.get(c.url + "/metrics", timeout=5).text)  # the group's merged answer
        assert led["batch"]["requests"] == {"ok": 10} and led["chat"]["requests"] == {"ok": 1}


def test_reserve_holds_a_slot_for_the_urgent_class(tmp_path: Path) -> None:
    """One worker with 2 batch slots, [priorities] reserve = 1: the batch class fills one slot, the other waits for
    chat, which runs at once (without the reserve it would wait ~1.5 s for the next free slot); with
    --engine-priority the engine receives each request's class rank as ``priority``."""
    path = tmp_path / "tenants.toml"
    write_tenants(path)
    path.write_text(path.read_text().replace('order = ["interactive", "batch"]',
                                             'order = ["interactive", "batch"]\nreserve = 1'))
    with cluster(str(tmp_path), 1, worker_args={0: [*SLOW, "--sim-scheduling-policy", "priority"]},
                 router_args=["--tenants", str(path), "--engine-priority"]) as c:
        assert c.segment is not None
        segment = c.segment

        async def go() -> tuple[float, list[float], list[int]]:
            running = []
            async with httpx.AsyncClient(timeout=60) as client:
                flood = [asyncio.create_task(_ttft(client, c.url, "batch", 40)) for _ in range(3)]
                for _ in range(5):
                    await asyncio.sleep(0.1)
                    running.append(segment.read(0).num_running)
                light = await _ttft(client, c.url, "chat", 2)
                return light, await asyncio.gather(*flood), running
        light, flood, running = asyncio.run(go())
        assert max(running) == 1, running  # the batch class leaves the reserved slot free
        assert light < 0.9, (light, sorted(flood))
        assert sorted(flood)[2] > 3.5, flood  # TTFTs: one batch request at a time (2 s each); on 2 slots: 0, 0, 2 s
        reqs = [r for r in worker_get(c.sock(0), "/debug/requests").json() if r["path"] == "/v1/chat/completions"]
        assert sorted(r["priority"] for r in reqs) == [0, 1, 1, 1]  # --engine-priority: the class rank


def test_two_router_processes_split_a_backlog_fairly_when_connections_spread(tmp_path: Path) -> None:
    """--processes 2, one class, equal weights, 4 batch slots: A keeps 64 requests open, B 16, each on a new
    connection (so SO_REUSEPORT spreads both tenants over both processes, and each stays backlogged in each). Each
    process runs its own VTC over the requests it holds and the room is shared, so the served tokens split about
    evenly (FIFO would split them 4:1, Jain 0.74). B holds 16, not fewer, so that each process nearly always holds
    some of B's requests: a process holding none of them serves A alone, which is right but not what this tests."""
    tf = tmp_path / "tenants.toml"
    tf.write_text("".join(f'[tenants.{t}]\napi_key_sha256 = ["{hash_key(KEYS[t])}"]\n\n' for t in ("chat", "batch")))
    fast = ["--sim-max-num-seqs", "4", "--sim-decode-step-s", "0.02", "--sim-decode-step-s-per-seq", "0"]
    with cluster(str(tmp_path), 1, worker_args={0: fast}, router_args=["--tenants", str(tf), "--processes", "2"]) as c:
        async def go() -> dict[str, int]:
            served = {"chat": 0, "batch": 0}
            stop = time.monotonic() + 10.0
            window = (time.monotonic() + 2.0, stop)  # after the backlog has formed
            async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as client:
                async def loop(tenant: str) -> None:
                    while time.monotonic() < stop:
                        r = await client.post(c.url + "/v1/chat/completions", json=chat(20), headers=auth(tenant))
                        assert r.status_code == 200, r.text
                        if window[0] <= time.monotonic() <= window[1]:
                            served[tenant] += r.json()["usage"]["completion_tokens"]
                await asyncio.gather(*(loop("batch") for _ in range(64)), *(loop("chat") for _ in range(16)))
            return served
        served = asyncio.run(go())
    a, b = served["batch"], served["chat"]
    jain = (a + b) ** 2 / (2 * (a * a + b * b))
    assert jain >= 0.9, served


def test_weight_two_gets_twice_the_tokens_when_a_batch_of_slots_frees_at_once(tmp_path: Path) -> None:
    """Weights 2 and 1, one class, 2 workers x 16 batch slots, 30 closed-loop clients per tenant (each sends its next
    request when the last one ends), equal requests: they start together, so they end together and 16 slots free
    at once, while the weighted tenant's clients are still reading their answers. Without holding those slots for
    it (fair queue anticipation) the slots went to the other tenant's queued requests and the lift erased the
    deficit: 1.11-1.24 in 6 runs. With it: 1.87-1.96 in 6 runs (the box at load 2-8), and down to ~1.65 when the
    clients' turnaround passes anticipation_s on a saturated box; the bounds, 1.5-2.5, keep 0.26 above the worst
    run without it."""
    tf = tmp_path / "tenants.toml"
    tf.write_text("".join(f'[tenants.{t}]\napi_key_sha256 = ["{hash_key(KEYS[t])}"]\nweight = {w}\n\n'
                          for t, w in (("chat", 2.0), ("batch", 1.0))))
    sim = ["--sim-max-num-seqs", "16", "--sim-decode-step-s", "0.01"]
    with cluster(str(tmp_path), 2, worker_args={0: sim, 1: sim}, router_args=["--tenants", str(tf)]) as c:
        async def go() -> dict[str, int]:
            served = {"chat": 0, "batch": 0}
            stop = time.monotonic() + 13.0
            window = (time.monotonic() + 3.0, stop)  # after the backlog has formed
            async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100)) as client:
                async def loop(tenant: str) -> None:
                    while time.monotonic() < stop:
                        r = await client.post(c.url + "/v1/chat/completions", json=chat(30), headers=auth(tenant))
                        assert r.status_code == 200, r.text
                        if window[0] <= time.monotonic() <= window[1]:
                            served[tenant] += r.json()["usage"]["completion_tokens"]
                await asyncio.gather(*(loop(t) for t in ("chat", "batch") for _ in range(30)))
            return served
        served = asyncio.run(go())
    assert served["batch"] > 0, served
    assert 1.5 <= served["chat"] / served["batch"] <= 2.5, served


def test_without_tenants_key_or_access_log_the_router_keeps_no_ledger(tmp_path: Path) -> None:
    """The gate is off by default (docs/DESIGN.md §15, "Off costs nothing"): no dplb_tenant_* sample, the tenant is
    still "default" in /debug/decisions; with --api-key the default tenant is metered again."""
    with cluster(str(tmp_path), 1) as c:
        for stream in (False, True):
            assert post(c, "/v1/chat/completions", chat(stream=stream)).status_code == 200
        assert read_ledger(c.url) == {}
        assert {d["tenant"] for d in httpx.get(c.url + "/debug/decisions", timeout=5).json()} == {"default"}
        c.start_router("--api-key", "k")
        key = {"authorization": "Bearer k"}
        assert post(c, "/v1/chat/completions", chat(), headers=key).status_code == 200  # JSON: the engine's usage
        led = wait_for(lambda: read_ledger(c.url, "k") or None, 5, "the default tenant's ledger")
        assert led["default"]["requests"] == {"ok": 1} and led["default"]["completion_tokens"] == 4


def test_a_concurrency_429_carries_x_ratelimit_headers_like_the_other_limits(tmp_path: Path) -> None:
    """Every limit 429 carries Retry-After and x-ratelimit-* (README): max_concurrent's too, with its limit and
    0 remaining, and the tenant's request-rate headers as well."""
    extra = (f'[tenants.one]\napi_key_sha256 = ["{hash_key("one-key")}"]\npriority = "batch"\nmax_concurrent = 1\n'
             'requests_per_s = 100\n')
    tf = write_tenants(tmp_path / "tenants.toml", extra)
    with cluster(str(tmp_path), 1, worker_args={0: SLOW}, router_args=["--tenants", tf]) as c:
        async def go() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as client:
                h = {"authorization": "Bearer one-key"}
                first = asyncio.create_task(client.post(c.url + "/v1/chat/completions", json=chat(20), headers=h))
                await asyncio.sleep(0.4)
                second = await client.post(c.url + "/v1/chat/completions", json=chat(2), headers=h)
                return [await first, second]
        first, second = asyncio.run(go())
        assert first.status_code == 200
        assert_openai_error(second, 429, "concurrency_limit_exceeded")
        assert second.headers["retry-after"] == "1"
        assert second.headers["x-ratelimit-limit-concurrent"] == "1"
        assert second.headers["x-ratelimit-remaining-concurrent"] == "0"
        assert second.headers["x-ratelimit-reset-concurrent"] == "1s"
        assert second.headers["x-ratelimit-limit-requests"] == "100"


def test_models_list_only_what_the_tenant_may_use(tmp_path: Path) -> None:
    """/v1/models and /v1/models/{id} show a tenant only the models of its allow-list (a LoRA adapter it may not
    use is neither listed nor retrievable); a tenant without one sees every model."""
    tf = write_tenants(tmp_path / "tenants.toml")
    with cluster(str(tmp_path), 1, worker_args={0: ["--sim-lora-adapters", "lora-a"]},
                 router_args=["--tenants", tf]) as c:
        def ids(tenant: str) -> set[str]:
            r = httpx.get(c.url + "/v1/models", headers=auth(tenant), timeout=10)
            assert r.status_code == 200, r.text
            return {m["id"] for m in r.json()["data"]}
        assert ids("chat") == {"dplb-sim", "lora-a"}
        assert ids("small") == {"dplb-sim"}
        assert ids("narrow") == set()
        assert httpx.get(c.url + "/v1/models/lora-a", headers=auth("chat"), timeout=10).status_code == 200
        hidden = httpx.get(c.url + "/v1/models/lora-a", headers=auth("small"), timeout=10)
        assert_openai_error(hidden, 404, "model_not_found")
        assert "Served models: dplb-sim\"" in hidden.text, hidden.text
