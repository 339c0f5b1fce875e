"""Sim engine: OpenAI surface, timing model (batching, speed, prefix cache, KV capacity), fault knobs, metrics.

Every HTTP test runs a real uvicorn server on a real Unix socket (in a background thread; in a subprocess for the
crash test) and talks to it with httpx or the OpenAI SDK. Step times are a few milliseconds and ratio bounds are
generous: these machines are small and noisy.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import httpx
import openai
import pytest
import uvicorn

from dplb.errors import ConfigError
from dplb.worker.engines.base import EngineStats
from dplb.worker.engines.sim import logprobs
from dplb.worker.engines.sim.engine import SimConfig, SimEngine
from dplb.worker.engines.sim.prompts import PrefixCache, block_hashes, tokenize

FAST: dict[str, Any] = {"decode_step_s": 0.002, "decode_step_s_per_seq": 0.0, "prefill_s_per_token": 0.0}


class Served:
    """A :class:`SimEngine` served by uvicorn on ``path`` in a background thread."""

    def __init__(self, engine: SimEngine, path: str) -> None:
        self.engine, self.path = engine, path
        assert engine.app is not None
        self.server = uvicorn.Server(uvicorn.Config(engine.app, uds=path, lifespan="off", log_level="warning",
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.01)
        self.client = httpx.Client(transport=httpx.HTTPTransport(uds=path), base_url="http://sim", timeout=30)

    def aclient(self, timeout: float = 30) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=self.path), base_url="http://sim",
                                 timeout=timeout)

    def stop(self) -> None:
        self.client.close()
        asyncio.run(self.engine.shutdown())  # from another loop: hands the work to the serving loop
        self.server.should_exit = True
        self.thread.join(10)
        assert not self.thread.is_alive()


@pytest.fixture
def sock_dir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="dplbsim", dir="/tmp")  # short: UDS paths are limited to ~107 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def sim(sock_dir: str) -> Iterator[Callable[..., Served]]:
    """Factory: ``sim(**SimConfig fields)`` → a served engine, stopped after the test."""
    servers: list[Served] = []

    def make(**kw: Any) -> Served:
        s = Served(SimEngine(SimConfig(**kw)), os.path.join(sock_dir, f"w{len(servers)}.sock"))
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.stop()


def _comp(max_tokens: int, prompt: Any = "hello world", **kw: Any) -> dict[str, Any]:
    return {"model": "dplb-sim", "prompt": prompt, "max_tokens": max_tokens, **kw}


async def _timed(c: httpx.AsyncClient, body: dict[str, Any]) -> float:
    t = time.perf_counter()
    r = await c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return time.perf_counter() - t


def _concurrent(s: Served, bodies: list[dict[str, Any]]) -> list[float]:
    """E2E seconds of ``bodies`` sent all at once."""
    async def main() -> list[float]:
        async with s.aclient() as c:
            return list(await asyncio.gather(*(_timed(c, b) for b in bodies)))
    return asyncio.run(main())


async def _ttft(c: httpx.AsyncClient, body: dict[str, Any]) -> float:
    """Seconds to the first SSE data event of a streaming completion (read to the end)."""
    t = time.perf_counter()
    first = None
    async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and first is None:
                first = time.perf_counter() - t
    assert first is not None
    return first


def _wait_for(cond: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# ---------------------------------------------------------------- OpenAI surface

def test_openai_sdk_chat_completion_stream_models(sim: Callable[..., Served]) -> None:
    s = sim(**FAST)
    oa = openai.OpenAI(api_key="none", base_url="http://sim/v1",
                       http_client=cast(Any, httpx.Client(transport=httpx.HTTPTransport(uds=s.path))))
    assert [m.id for m in oa.models.list().data] == ["dplb-sim"]

    msgs: Any = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "tell me about foxes"}]
    r1 = oa.chat.completions.create(model="dplb-sim", messages=msgs, max_tokens=7, temperature=0.7)
    assert r1.id.startswith("chatcmpl-") and r1.object == "chat.completion" and r1.model == "dplb-sim"
    c1 = r1.choices[0]
    assert c1.finish_reason == "length" and c1.message.role == "assistant" and c1.index == 0
    assert c1.message.content is not None and len(c1.message.content.split()) == 7
    assert r1.usage is not None and (r1.usage.prompt_tokens, r1.usage.completion_tokens) == (8, 7)
    assert r1.usage.total_tokens == 15
    r2 = oa.chat.completions.create(model="dplb-sim", messages=msgs, max_tokens=7)
    assert r2.choices[0].message.content == c1.message.content  # deterministic
    other = oa.chat.completions.create(model="dplb-sim", messages=[{"role": "user", "content": "x"}], max_tokens=7)
    assert other.choices[0].message.content != c1.message.content

    rn = oa.chat.completions.create(model="dplb-sim", messages=msgs, max_tokens=7, n=2)
    assert [c.index for c in rn.choices] == [0, 1]
    assert rn.choices[0].message.content == c1.message.content != rn.choices[1].message.content
    assert rn.usage is not None and rn.usage.completion_tokens == 14 and rn.usage.prompt_tokens == 8

    # content given as a list of text parts renders like the plain string
    parts: Any = [{"role": "system", "content": [{"type": "text", "text": "be brief"}]}, msgs[1]]
    rp = oa.chat.completions.create(model="dplb-sim", messages=parts, max_tokens=7)
    assert rp.choices[0].message.content == c1.message.content

    rc = oa.completions.create(model="dplb-sim", prompt="once upon a time", max_tokens=5)
    assert rc.id.startswith("cmpl-") and rc.object == "text_completion"
    assert len(rc.choices[0].text.split()) == 5 and rc.choices[0].finish_reason == "length"
    assert rc.usage is not None and (rc.usage.prompt_tokens, rc.usage.completion_tokens) == (4, 5)

    chunks = list(oa.chat.completions.create(model="dplb-sim", messages=msgs, max_tokens=7, stream=True,
                                             stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [ch for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert len(content) == 7  # one chunk per token
    assert "".join(ch.choices[0].delta.content or "" for ch in content) == c1.message.content
    assert content[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (8, 7)
    assert all(ch.id == chunks[0].id and ch.id.startswith("chatcmpl-") for ch in chunks)


def test_raw_stream_done_last_headers_and_body_hash(sim: Callable[..., Served]) -> None:
    s = sim(**FAST)
    body = b'{"model":"dplb-sim","prompt":"a b c","max_tokens":4,"stream":true,"vendor_param":{"x":1},' \
           b'"stream_options":{"include_usage":true}}'
    with s.client.stream("POST", "/v1/completions", content=body, headers={"X-Request-Id": "rid-42",
                                                                               "x-sim-debug": "body-sha256"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-request-id"] == "rid-42"
        assert r.headers["x-sim-body-sha256"] == hashlib.sha256(body).hexdigest()
        events = [ln for ln in r.iter_lines() if ln]
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert [p["choices"][0]["index"] for p in payloads[:-1]] == [0, 0, 0, 0]
    assert all(p["id"] == "cmpl-rid-42" for p in payloads)
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 4

    # error responses carry the body hash too; batch prompts x n give len(prompts) * n choices
    bad = b"not json at all"
    r = s.client.post("/v1/completions", content=bad, headers={"x-sim-debug": "body-sha256"})
    assert r.status_code == 400 and r.headers["x-sim-body-sha256"] == hashlib.sha256(bad).hexdigest()
    r = s.client.post("/v1/completions", json=_comp(3, prompt=["a b", "c d e"], n=2))
    assert r.status_code == 200
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3] and out["usage"]["prompt_tokens"] == 5
    assert out["usage"]["completion_tokens"] == 12


# ---------------------------------------------------------------- timing model

def test_latency_grows_with_concurrency(sim: Callable[..., Served]) -> None:
    s = sim(decode_step_s=0.005, decode_step_s_per_seq=0.005, prefill_s_per_token=0.0)
    single = [_concurrent(s, [_comp(10)])[0] for _ in range(3)]  # ≈ 10 × 0.010 s
    eight = _concurrent(s, [_comp(10, prompt=f"p{i}") for i in range(8)])  # ≈ 10 × 0.045 s
    m1, m8 = sum(single) / len(single), sum(eight) / len(eight)
    assert m8 > 2.0 * m1, (m1, m8)


def test_speed_half_roughly_halves_throughput(sim: Callable[..., Served]) -> None:
    cfg = {"decode_step_s": 0.03, "decode_step_s_per_seq": 0.002, "prefill_s_per_token": 0.0001}
    full, half = sim(**cfg), sim(speed=0.5, **cfg)
    bodies = [_comp(12, prompt=f"q{i} a b c") for i in range(4)]  # ≈ 12 × 0.038 s at speed 1

    def batch(s: Served) -> float:
        """Best of two timed batches (a GC pause or a busy neighbour can stall one)."""
        async def main() -> float:
            async with s.aclient() as c:
                await asyncio.gather(*(_timed(c, _comp(1)) for _ in bodies))  # warm: connections, scheduler task
                best = float("inf")
                for _ in range(2):
                    t = time.perf_counter()
                    await asyncio.gather(*(_timed(c, b) for b in bodies))
                    best = min(best, time.perf_counter() - t)
                return best
        return asyncio.run(main())

    t_full, t_half = batch(full), batch(half)
    assert 1.6 <= t_half / t_full <= 2.6, (t_full, t_half)


def test_prefix_cache_hit_cuts_prefill(sim: Callable[..., Served]) -> None:
    s = sim(decode_step_s=0.005, decode_step_s_per_seq=0.0, prefill_s_per_token=0.001, block_size=16)
    shared = " ".join(f"w{i}" for i in range(400))  # 400 tokens = 25 full blocks ≈ 0.4 s of prefill

    async def main() -> tuple[float, float]:
        async with s.aclient() as c:
            cold = await _ttft(c, _comp(2, prompt=shared))
            hits = [await _ttft(c, _comp(2, prompt=f"{shared} more words {i}")) for i in range(2)]
            return cold, min(hits)

    t1, t2 = asyncio.run(main())
    assert t1 >= 0.35 and t2 < 0.5 * t1, (t1, t2)
    sched = s.engine.scheduler
    assert sched.prefix_cache_hits_total == 800 and sched.prefix_cache_queries_total == 400 + 2 * 403
    assert 'vllm:prefix_cache_hits_total{model_name="dplb-sim"} 800.0' in s.engine.metrics_text().decode()
    recs = s.client.get("/debug/requests").json()
    assert [r["cached_tokens"] for r in recs] == [0, 400, 400]


def test_full_kv_cache_makes_requests_wait(sim: Callable[..., Served]) -> None:
    # each request needs ceil((10 + 40) / 16) = 4 blocks = the whole cache; slots (16) are free
    s = sim(kv_blocks=4, block_size=16, max_model_len=64, decode_step_s=0.01, decode_step_s_per_seq=0.0)
    prompt = " ".join(f"t{i}" for i in range(10))
    seen: list[EngineStats] = []

    async def main() -> list[float]:
        async with s.aclient() as c:
            a = asyncio.ensure_future(_timed(c, _comp(40, prompt=prompt)))
            await asyncio.sleep(0.05)
            b = asyncio.ensure_future(_timed(c, _comp(40, prompt=prompt + " x")))
            for _ in range(100):
                st = s.engine.stats()
                if st.num_waiting:
                    seen.append(st)
                    break
                await asyncio.sleep(0.01)
            return [await a, await b]

    ta, tb = asyncio.run(main())
    assert seen, "the second request never waited"
    st = seen[0]
    assert (st.num_running, st.num_waiting, st.kv_cache_usage, st.max_num_seqs) == (1, 1, 1.0, 16)
    assert tb > 1.5 * ta, (ta, tb)
    assert s.engine.stats().kv_cache_usage == 0.0 and s.engine.stats().last_prompt_tokens == 11


def test_no_busy_loop(sim: Callable[..., Served]) -> None:
    s = sim(decode_step_s=0.02, decode_step_s_per_seq=0.001)
    c0, t0 = time.process_time(), time.perf_counter()
    time.sleep(0.5)  # idle: the scheduler awaits an event
    assert time.process_time() - c0 < 0.1
    c0, t0 = time.process_time(), time.perf_counter()
    _concurrent(s, [_comp(25, prompt=f"b{i}") for i in range(8)])  # ~0.7 s of sleeping steps
    assert time.process_time() - c0 < 0.5 * (time.perf_counter() - t0)


# ---------------------------------------------------------------- faults

def test_warmup_delay() -> None:
    e = SimEngine(SimConfig(warmup_delay_s=0.3))
    t = time.perf_counter()
    asyncio.run(e.start())
    assert time.perf_counter() - t >= 0.3 and e.started
    t = time.perf_counter()
    asyncio.run(SimEngine().start())
    assert time.perf_counter() - t < 0.2


def test_crash_after_exits_process(sock_dir: str) -> None:
    path = os.path.join(sock_dir, "crash.sock")
    proc = subprocess.Popen([sys.executable, "-m", "dplb.worker.engines.sim", "--uds", path, "--crash-after", "2",
                             "--decode-step-s", "0.002"], stderr=subprocess.PIPE, text=True)
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=path), base_url="http://sim", timeout=10) as c:
            def healthy() -> bool:
                with contextlib.suppress(httpx.TransportError):
                    return c.get("/health").status_code == 200
                return False
            assert _wait_for(healthy, 20), "sim subprocess did not come up"
            assert c.post("/v1/completions", json=_comp(3)).status_code == 200
            time.sleep(0.2)
            assert proc.poll() is None  # one request: still alive
            assert c.post("/v1/completions", json=_comp(3)).status_code == 200  # the 2nd is answered, then exit
        assert proc.wait(timeout=5) == 1
        assert proc.stderr is not None and "crash_after=2" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_hang_after_stops_answering(sim: Callable[..., Served]) -> None:
    s = sim(hang_after=1, decode_step_s=0.005, decode_step_s_per_seq=0.0)

    async def main() -> tuple[int, bool]:
        async with s.aclient() as c, c.stream("POST", "/v1/completions", json=_comp(400, stream=True)) as ra:
            lines = ra.aiter_lines()
            got = 0
            while got < 3:  # the long stream is flowing
                got += (await lines.__anext__()).startswith("data: ")
            assert (await c.post("/v1/completions", json=_comp(2))).status_code == 200  # completes → hang
            done = False
            with contextlib.suppress(TimeoutError):
                while True:
                    line = await asyncio.wait_for(lines.__anext__(), 0.5)
                    got += line.startswith("data: ")
                    done = done or line == "data: [DONE]"
            return got, done

    got, done = asyncio.run(main())
    assert not done and got < 400  # the in-flight stream stopped mid-way
    assert s.engine.hung
    with pytest.raises(httpx.ReadTimeout):
        s.client.post("/v1/completions", json=_comp(2), timeout=0.5)
    with pytest.raises(httpx.ReadTimeout):
        s.client.get("/health", timeout=0.3)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sk:  # the socket still accepts connections
        sk.settimeout(1)
        sk.connect(s.path)


def test_oom_after(sim: Callable[..., Served]) -> None:
    s = sim(oom_after=2, **FAST)
    assert s.client.post("/v1/completions", json=_comp(2)).status_code == 200
    assert s.engine.stats().cuda_oom_total == 0
    r = s.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 500
    err = r.json()["error"]
    assert "CUDA out of memory" in err["message"] and err["code"] == 500 and err["type"]
    assert s.engine.stats().cuda_oom_total == 1
    assert s.client.post("/v1/completions", json=_comp(2)).status_code == 500  # and every later one
    assert s.engine.stats().cuda_oom_total == 2


def test_max_inflight_503(sim: Callable[..., Served]) -> None:
    s = sim(max_inflight_503=1, decode_step_s=0.01, decode_step_s_per_seq=0.0)

    async def main() -> tuple[httpx.Response, float]:
        async with s.aclient() as c:
            a = asyncio.ensure_future(_timed(c, _comp(30)))
            await asyncio.sleep(0.05)
            t = time.perf_counter()
            r = await c.post("/v1/completions", json=_comp(2))
            dt = time.perf_counter() - t
            await a
            return r, dt

    r, dt = asyncio.run(main())
    assert r.status_code == 503 and dt < 0.2
    assert r.json()["error"]["code"] == "server_overloaded" and r.headers["retry-after"] == "1"
    assert s.client.post("/v1/completions", json=_comp(2)).status_code == 200  # back under the limit
    assert s.engine.overloaded_total == 1


def test_client_disconnect_aborts(sim: Callable[..., Served]) -> None:
    s = sim(decode_step_s=0.01, decode_step_s_per_seq=0.0)
    with s.client.stream("POST", "/v1/completions", json=_comp(300, stream=True)) as r:
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: ")
            if got == 3:
                assert s.engine.stats().num_running == 1
                break  # drops the half-read stream: httpx closes the connection
    t = time.monotonic()
    assert _wait_for(lambda: s.engine.stats().num_running == 0, 1.0)
    assert time.monotonic() - t < 1.0 and s.engine.aborted_total == 1
    assert s.engine.stats().kv_cache_usage == 0.0
    rec = s.client.get("/debug/requests").json()[-1]
    assert rec["aborted"] and 3 <= rec["completion_tokens"] < 300

    with pytest.raises(httpx.ReadTimeout):  # non-streaming: the client gives up
        s.client.post("/v1/completions", json=_comp(300), timeout=0.2)
    assert _wait_for(lambda: s.engine.aborted_total == 2 and s.engine.stats().num_running == 0, 1.0)
    text = s.engine.metrics_text().decode()
    assert 'vllm:request_success_total{finished_reason="abort",model_name="dplb-sim"} 2.0' in text


def test_chunk_delay_paces_stream(sim: Callable[..., Served]) -> None:
    s = sim(chunk_delay_s=0.05, **FAST)

    async def main() -> float:
        async with s.aclient() as c:
            t = time.perf_counter()
            await _ttft(c, _comp(6))
            return time.perf_counter() - t

    assert asyncio.run(main()) >= 0.3  # 6 token chunks x 0.05 s


def test_shutdown_aborts_inflight_and_refuses_new(sim: Callable[..., Served]) -> None:
    s = sim(decode_step_s=0.01, decode_step_s_per_seq=0.0)

    async def main() -> tuple[int, int]:
        async with s.aclient() as c:
            pending = asyncio.ensure_future(c.post("/v1/completions", json=_comp(300)))
            await asyncio.sleep(0.1)
            await s.engine.shutdown()  # from another thread's loop: handed to the serving loop
            await s.engine.shutdown()  # idempotent
            first = (await pending).status_code
            return first, (await c.post("/v1/completions", json=_comp(2))).status_code

    assert asyncio.run(main()) == (503, 503)
    assert s.engine.aborted_total == 1 and s.engine.stats().num_running == 0


# ---------------------------------------------------------------- validation, endpoints, metrics

@pytest.fixture(scope="module")
def strict_server() -> Iterator[Served]:
    """One server (max_model_len 256) shared by the bad-input cases."""
    d = tempfile.mkdtemp(prefix="dplbsim", dir="/tmp")
    s = Served(SimEngine(SimConfig(max_model_len=256, **FAST)), os.path.join(d, "strict.sock"))
    yield s
    s.stop()
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", b"{not json"),
    ("/v1/chat/completions", b"[1, 2]"),
    ("/v1/chat/completions", b'{"model": "dplb-sim"}'),
    ("/v1/chat/completions", b'{"messages": "hi"}'),
    ("/v1/chat/completions", b'{"messages": [{"content": "no role"}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 99999}'),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": -1}'),
    ("/v1/completions", b'{"prompt": "x", "n": 0}'),
    ("/v1/completions", b'{"max_tokens": 3}'),
    ("/v1/completions", b'{"prompt": []}'),
    ("/v1/completions", ('{"prompt": "' + "w " * 300 + '"}').encode()),  # over max_model_len (256)
])
def test_bad_input_is_openai_shaped_400(strict_server: Served, path: str, body: bytes) -> None:
    s = strict_server
    r = s.client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "BadRequestError" and err["message"]
    assert s.engine.stats().num_running == 0 and s.engine.requests_total == 0


def test_endpoints_metrics_and_debug(sim: Callable[..., Served]) -> None:
    s = sim(model="tiny", **FAST)
    assert s.client.get("/health").status_code == 200 and s.client.get("/health").content == b""
    assert s.client.get("/load").json() == {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0}
    assert s.client.get("/v1/models", headers={"X-Request-Id": "m1"}).headers["x-request-id"] == "m1"
    r = s.client.post("/v1/completions", json=_comp(2))  # _comp names the default model
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    assert s.client.get("/nope").status_code == 404 and s.client.get("/v1/completions").status_code == 405
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    r = s.client.post("/v1/completions", json={"model": "tiny", "prompt": "p q", "max_tokens": 3},
                      headers={"x-request-id": "abc", "traceparent": tp, "x-sim-debug": "body-sha256"})
    assert r.status_code == 200 and r.json()["id"] == "cmpl-abc" and r.json()["model"] == "tiny"
    rec = s.client.get("/debug/requests").json()[-1]
    assert rec["x_request_id"] == "abc" and rec["traceparent"] == tp and rec["status"] == 200
    assert rec["prompt_tokens"] == 2 and rec["completion_tokens"] == 3 and not rec["aborted"]
    assert rec["body_sha256"] == r.headers["x-sim-body-sha256"]
    assert {"x-request-id", "traceparent", "content-type"} <= set(rec["header_names"])
    m = s.client.get("/metrics")
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket"):
        assert f'{name}{{' in m.text and 'model_name="tiny"' in m.text, name
    assert 'vllm:generation_tokens_total{model_name="tiny"} 3.0' in m.text
    assert 'vllm:request_success_total{finished_reason="length",model_name="tiny"} 1.0' in m.text


def test_config_validation() -> None:
    cases: list[tuple[dict[str, Any], str]] = [({"max_num_seqs": 0}, "max_num_seqs"), ({"speed": 0.0}, "speed"),
                       ({"decode_step_s": -1.0}, "decode_step_s"), ({"crash_after": -1}, "crash_after"),
                       ({"max_num_seqs": 1.5}, "max_num_seqs"), ({"speed": float("nan")}, "speed"),
                       ({"model": ""}, "model"), ({"kv_blocks": 4, "max_model_len": 8192}, "kv_blocks")]
    for kw, needle in cases:
        with pytest.raises(ConfigError, match=needle):
            SimConfig(**kw)
    SimConfig(kv_blocks=4, block_size=16, max_model_len=64)  # exactly one max-length sequence fits


def test_tokenizer_block_hashes_and_lru() -> None:
    assert tokenize("a  b\nc") == tokenize("a b c") and len(tokenize("a b c")) == 3 and tokenize("   ") == [0]
    a, b = tokenize(" ".join(f"x{i}" for i in range(40))), tokenize(" ".join(f"x{i}" for i in range(20)) + " y")
    ha, hb = block_hashes(a, 8), block_hashes(b, 8)
    assert len(ha) == 5 and len(hb) == 2 and ha[:2] == hb[:2]  # a trailing partial block is not hashed
    assert block_hashes(a[8:], 8)[0] != ha[1]  # chained: same block, different prefix → different hash
    cache = PrefixCache(3)
    cache.insert(ha[:3])
    assert cache.match(ha, 2) == 2 and cache.match(ha, 5) == 3  # a chain is touched tail first: 2, 1, 0 (oldest first)
    cache.insert(ha[3:5])  # evicts the two least recently used: the first chain's tail (vLLM frees tails first)
    assert len(cache) == 3 and cache.match(ha, 5) == 1 and cache.match(ha[3:], 5) == 2
    assert PrefixCache(0).match(ha, 5) == 0


def test_continuation_yields_the_rest_of_the_answer(sim: Callable[..., Served]) -> None:
    """A chat continuing a partial assistant message (continue_final_message) and a completions prompt extended by
    the delivered text both produce exactly the rest of the original answer: the text is a function of the
    context, so there is no duplicated or lost token at the seam."""
    s = sim()
    chat = {"model": "dplb-sim", "messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 12}
    r = s.client.post("/v1/chat/completions", json=chat).json()
    full, p0 = r["choices"][0]["message"]["content"], r["usage"]["prompt_tokens"]
    words = full.split(" ")
    assert len(words) == 12
    for d in (1, 5, 11):
        part = " ".join(words[:d])
        cont = {**chat, "messages": [*chat["messages"], {"role": "assistant", "content": part}], "max_tokens": 12 - d,
                "continue_final_message": True, "add_generation_prompt": False}
        rc = s.client.post("/v1/chat/completions", json=cont).json()
        assert part + rc["choices"][0]["message"]["content"] == full, d
        assert rc["usage"]["prompt_tokens"] == p0 + d
    both = {**chat, "continue_final_message": True}  # add_generation_prompt defaults to true: vLLM's 400
    assert s.client.post("/v1/chat/completions", json=both).status_code == 400
    comp = _comp(12, prompt="once upon a time")
    full = s.client.post("/v1/completions", json=comp).json()["choices"][0]["text"]
    toks = logprobs.tokens_of(full)
    assert full.startswith(" ") and len(toks) == 12  # continues the prompt's text: a leading space
    for d in (1, 6):
        part = "".join(toks[:d])
        rest = s.client.post("/v1/completions", json=_comp(12 - d, prompt="once upon a time" + part)).json()
        assert part + rest["choices"][0]["text"] == full, d
    assert s.client.post("/v1/completions", json=_comp(3, prompt="ends with space ")).json()[
        "choices"][0]["text"][0] != " "
