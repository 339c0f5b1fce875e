"""Send a workload to an OpenAI-compatible endpoint and measure every request.

Contract
- :func:`run_workload` sends each :class:`~dplb.bench.workload.BenchRequest` at its ``send_at_s`` (or as soon as
  a slot is free under ``max_concurrency``; a request with ``after`` ≥ 0 waits for that request to complete, then
  its ``think_s``: the next turn of a conversation), over one aiohttp session with keep-alive, and returns one
  :class:`RequestResult` per request, in request order. It never raises for a failed request: HTTP errors,
  broken streams and connection errors are recorded in the result (``status``, ``error``).
- Streaming (``stream=True``): TTFT = time to the first chunk with generated text; ITL = gaps between successive
  text chunks; output tokens from the final ``usage`` chunk (``stream_options.include_usage``), else the number of
  text chunks. A stream that ends without ``data: [DONE]`` or carries an ``error`` event is a failure
  (``status = "stream_error"``), whatever its HTTP status. Non-streaming: TTFT = E2E.
- ``worker`` is the response's ``X-SG-Worker-ID`` (None when absent, e.g. talking to a worker directly).
- ``Target.session_header``: every turn of a multi-turn conversation carries this header with the value
  ``conversation-<n>`` (what a chat front end sends so a front balancer can hash a conversation onto one host);
  requests outside a conversation carry none.
- Times are seconds from :func:`time.perf_counter`; ``start_s`` is relative to the start of the run.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import msgspec

from dplb.bench.workload import BenchRequest

_decode = msgspec.json.decode


@dataclass(slots=True)
class RequestResult:
    """What happened to one request. Times in seconds; ``status`` is the HTTP status, or ``"stream_error"`` /
    ``"connection_error"``; ``ok`` only for a 200 with a complete answer."""

    index: int
    ok: bool = False
    status: int | str = 0
    error: str = ""
    worker: str | None = None
    start_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    prefix_id: int = -1
    streamed: bool = True

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (E2E − TTFT) / (tokens − 1); None below 2 tokens."""
        if not self.ok or not self.streamed or self.e2e_s is None or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True, slots=True)
class Target:
    """Where and how to send: ``base_url`` like ``http://127.0.0.1:30000`` (``/v1`` suffix optional)."""

    base_url: str
    model: str
    endpoint: str = "chat"  # or "completions"
    stream: bool = True
    api_key: str | None = None
    timeout_s: float = 600.0
    session_header: str | None = None

    @property
    def url(self) -> str:
        base = self.base_url.rstrip("/")
        base = base[:-3] if base.endswith("/v1") else base
        return f"{base}/v1/{'chat/completions' if self.endpoint == 'chat' else 'completions'}"


def _body(t: Target, r: BenchRequest) -> dict[str, object]:
    body: dict[str, object] = {"model": t.model, "max_tokens": r.max_tokens, "stream": t.stream}
    if t.endpoint == "chat":
        body["messages"] = r.messages
    else:
        body["prompt"] = r.prompt
    # Ask for exactly max_tokens where the server supports it (vLLM, the sim); others ignore unknown fields.
    body["ignore_eos"] = True
    if t.stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _chunk_text(obj: dict, chat: bool) -> str:
    choices = obj.get("choices") or ()
    if not choices:
        return ""
    c = choices[0]
    if chat:
        return (c.get("delta") or {}).get("content") or ""
    return c.get("text") or ""


async def _one(session: aiohttp.ClientSession, t: Target, r: BenchRequest, t0: float) -> RequestResult:
    res = RequestResult(r.index, prefix_id=r.prefix_id, streamed=t.stream)
    chat = t.endpoint == "chat"
    start = time.perf_counter()
    res.start_s = start - t0
    try:
        headers = {"Content-Type": "application/json"}
        if t.session_header and r.conversation >= 0:
            headers[t.session_header] = f"conversation-{r.conversation}"
        async with session.post(t.url, data=msgspec.json.encode(_body(t, r)), headers=headers) as resp:
            res.status = resp.status
            res.worker = resp.headers.get("X-SG-Worker-ID")
            if resp.status != 200:
                text = await resp.text(errors="replace")
                res.error = text[:300]
                res.e2e_s = time.perf_counter() - start
                return res
            if not t.stream:
                data = _decode(await resp.read())
                res.e2e_s = res.ttft_s = time.perf_counter() - start
                usage = data.get("usage") or {}
                res.output_tokens = int(usage.get("completion_tokens") or 0)
                res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                res.ok = True
                return res
            last = None
            done = False
            chunks = 0
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    break
                obj = _decode(payload)
                if "error" in obj:
                    res.status, res.error = "stream_error", str(obj["error"])[:300]
                    break
                now = time.perf_counter()
                if _chunk_text(obj, chat):
                    chunks += 1
                    if last is None:
                        res.ttft_s = now - start
                    else:
                        res.itl_s.append(now - last)
                    last = now
                usage = obj.get("usage")
                if usage:
                    res.output_tokens = int(usage.get("completion_tokens") or 0)
                    res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            res.e2e_s = time.perf_counter() - start
            if not done:
                if res.status != "stream_error":
                    res.status, res.error = "stream_error", "stream ended without data: [DONE]"
                return res
            res.output_tokens = res.output_tokens or chunks
            res.ok = res.ttft_s is not None
            if not res.ok:
                res.status, res.error = "stream_error", "no generated text in the stream"
            return res
    except (TimeoutError, aiohttp.ClientError, msgspec.DecodeError, OSError) as e:
        if isinstance(e, TimeoutError):
            res.status, res.error = "timeout", f"no complete answer within --timeout {t.timeout_s:g} s"
        else:
            res.status = "connection_error" if res.status in (0, 200) or isinstance(res.status, str) else res.status
            res.error = f"{type(e).__name__}: {e}"[:300]
        res.e2e_s = time.perf_counter() - start
        return res


async def preflight(target: Target) -> None:
    """Fail fast when nothing answers at ``target.base_url``: one GET of ``/v1/models`` (any HTTP status is an
    answer). Raises :class:`~dplb.errors.ConfigError` naming the URL and the reason."""
    from dplb.errors import ConfigError

    url = target.url.rsplit("/v1/", 1)[0] + "/v1/models"
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s, \
                s.get(url, headers=headers) as resp:
            await resp.read()
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        reason = getattr(e, "os_error", None) or e
        raise ConfigError(f"cannot reach {url}: {reason or type(e).__name__} (is the router running? --base-url)")\
            from None


async def run_workload(
    target: Target, requests: list[BenchRequest], *, max_concurrency: int | None = None,
    on_done: Callable[[RequestResult], None] | None = None,
) -> tuple[list[RequestResult], float]:
    """Send ``requests`` to ``target`` on schedule; returns (results in request order, wall seconds of the run).

    ``max_concurrency``: at most this many requests in flight (None = unlimited; arrivals still follow
    ``send_at_s``). ``on_done`` is called after each request (a progress bar).
    """
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    timeout = aiohttp.ClientTimeout(total=target.timeout_s)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results: list[RequestResult | None] = [None] * len(requests)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=False),
                                     timeout=timeout, headers=headers) as session:
        t0 = time.perf_counter()
        done = {r.after: asyncio.Event() for r in requests if r.after >= 0}

        async def go(i: int, r: BenchRequest) -> None:
            if r.after >= 0:
                await done[r.after].wait()
                await asyncio.sleep(r.think_s)
            if sem is not None:
                async with sem:
                    res = await _one(session, target, r, t0)
            else:
                res = await _one(session, target, r, t0)
            results[i] = res
            if i in done:
                done[i].set()
            if on_done is not None:
                on_done(res)

        tasks = []
        for i, r in enumerate(requests):
            delay = t0 + r.send_at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(go(i, r)))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    return [r for r in results if r is not None], wall
