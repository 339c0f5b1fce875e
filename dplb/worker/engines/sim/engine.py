"""The sim engine: a CPU-cheap, vLLM-like inference engine behind a DPLB worker (docs/DESIGN.md §8). A product
feature: it lets the router, policies, dashboards and benchmarks run unchanged on machines without a GPU.

Contract
- :class:`SimEngine` implements :class:`dplb.worker.engines.base.Engine`: ``name = "sim"``, ``app`` (ASGI), ``start()``,
  ``stats()`` (no I/O), ``metrics_text()``, ``shutdown()`` (idempotent). Configure it with a
  :class:`~dplb.worker.engines.sim.scheduler.SimConfig` (knobs, units and faults are documented there).
- HTTP surface, in vLLM's shapes: ``POST /v1/chat/completions`` and ``/v1/completions`` (non-streaming and SSE
  streaming, ``n``, ``stream_options.include_usage``/``continuous_usage_stats``, ``priority`` (the scheduler's
  ``scheduling_policy``); sampling parameters are accepted
  and ignored), ``GET /v1/models``, ``/health`` (200, empty), ``/load`` (``{"num_running", "num_waiting",
  "kv_cache_usage"}``), ``/metrics`` (``vllm:*`` Prometheus text), ``/debug/requests`` (the last 256 model
  requests); LoRA adapters, ``/v1/responses`` and the pooling/scoring/tokenizer/audio routes are
  :mod:`dplb.worker.engines.sim.api`. Errors are OpenAI-shaped: ``{"error": {"message", "type", "param", "code"}}``; a
  ``model`` that is neither the served one nor a loaded adapter is a 404 like vLLM's.
- ``/debug/requests`` records per request: ``request_id``, ``x_request_id``, ``traceparent``, ``path``,
  ``body_sha256``, ``prompt_tokens``, ``completion_tokens`` (sent), ``cached_tokens``, ``priority`` (the body's,
  0 when absent; set once the body parsed), ``status``, ``aborted``,
  ``time_unix``, ``header_names`` (the lower-case request header names received; the router's hop-by-hop tests).
- A model request sent with ``x-sim-debug: body-sha256`` gets ``x-sim-body-sha256`` (hex SHA-256 of the exact
  request body bytes) in its response (tests of byte-for-byte forwarding); no other response carries an ``x-sim-*``
  header. Responses echo ``X-Request-Id``; the response id is ``chatcmpl-<X-Request-Id>``/``cmpl-<…>`` (random
  when absent), as vLLM.
- Tokens: the prompt's whitespace-separated words (chat: messages rendered as ``"role: content\\n"`` lines;
  ``continue_final_message`` renders the final message open). Output: ``max_tokens`` words, each a deterministic
  function of (``seed``, choice index, the context so far) (:mod:`dplb.worker.engines.sim.text`), so the same
  request gives the same text and a request continuing a partial answer gives the rest of it;
  ``finish_reason`` is always ``"length"``.
- Timing: one scheduler step lasts ``(decode_step_s + decode_step_s_per_seq * running + prefill_s_per_token *
  uncached prompt tokens admitted this step) / speed`` seconds, and yields one token per running sequence; see
  :mod:`dplb.worker.engines.sim.scheduler` for batching, KV blocks and the prefix cache.
- A client disconnect (ASGI ``http.disconnect``) aborts the request at once and frees its KV blocks (unless the
  ``lose_aborts``/``ignore_aborts`` fault knobs say otherwise). :meth:`SimEngine.requests` lists what the scheduler
  holds, each with the worker's open HTTP request it serves; :meth:`SimEngine.abort` aborts one by engine id (the
  worker's reconciler, docs/DESIGN.md §8.1).
- The HTTP layer is a small raw ASGI app, not Litestar: measured in-process, ~4 µs per request against ~95 µs for
  the same handler in Litestar, and it watches ``http.disconnect`` directly. Serve it with uvicorn, e.g.
  ``python -m dplb.worker.engines.sim --uds /run/dplb/worker-0.sock --max-num-seqs 8 --speed 0.5``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import time
import uuid
from collections import deque
from typing import Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dplb.runtime.asgi import send_json, until_disconnect
from dplb.worker.engines.base import REQUEST_EXT, ASGIApp, EngineRequest, EngineStats, Receive, Scope, Send
from dplb.worker.engines.sim import logprobs, text
from dplb.worker.engines.sim.api import SimApi
from dplb.worker.engines.sim.http import DEBUG_HEADER, HTTPError, ShortKeepAlive, read_body
from dplb.worker.engines.sim.prompts import block_hashes, prompt_hash
from dplb.worker.engines.sim.request import ParsedRequest, parse_request
from dplb.worker.engines.sim.scheduler import SimConfig, SimRequest, SimScheduler
from dplb.worker.kv_events import ZMQ_AVAILABLE, KvEventPublisher

__all__ = ["SimConfig", "SimEngine"]

log = logging.getLogger(__name__)
DEBUG_RECORDS = 256
_json = msgspec.json.Encoder().encode
_CHAT, _COMPLETIONS = "/v1/chat/completions", "/v1/completions"
_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."  # vLLM's EngineDeadError


def _cached(req: SimRequest) -> int:
    """Prompt tokens the prefix cache served ``req``: per prompt, the most any of its choices got (the ``n`` choices of
    one prompt share its hash list; ``usage.prompt_tokens`` counts each prompt once too)."""
    best: dict[int, int] = {}
    for s in req.seqs:
        k = id(s.block_hashes)
        best[k] = max(best.get(k, 0), s.cached_tokens)
    return sum(best.values())


class SimEngine:
    """A vLLM-like engine on CPU. Serve ``engine.app`` with uvicorn (any socket); call :meth:`start` first.

    Counters (plain attributes, per HTTP request): ``requests_total`` (valid model requests; the ``oom_after``
    count), ``completed_total`` (responses fully sent; the ``crash_after``/``hang_after``/``stall_after`` count),
    ``aborted_total`` (client disconnects or shutdown before completion), ``cuda_oom_total``, ``overloaded_total``
    (503s).
    """

    name = "sim"

    def __init__(self, config: SimConfig | None = None) -> None:
        self.config = config or SimConfig()
        self.scheduler = SimScheduler(self.config)
        self.app: ASGIApp | None = self  # ASGI 3 entry point: __call__
        self.requests_total = self.completed_total = self.aborted_total = 0
        self.cuda_oom_total = self.overloaded_total = 0
        self.inflight = 0
        self.last_prompt_tokens = 0
        self.started = False
        self.hung = False
        self.stalled = False
        self.dead = False  # the engine_death_after fault fired
        self.debug_requests: deque[dict[str, Any]] = deque(maxlen=DEBUG_RECORDS)
        self._active: dict[SimRequest, dict[str, Any]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # the serving loop (bound on the first HTTP call)
        self._release: asyncio.Event | None = None  # set at shutdown: frees parked (hung) handlers
        self._closed = False
        self._created = int(time.time())
        self.api = SimApi(self)
        self._kv_endpoint = ""
        self.keepalive = ShortKeepAlive(self.config.close_after_response_s)  # (a fault: off unless asked for)

    # ---- Engine protocol ----
    def enable_kv_events(self, endpoint: str) -> bool:
        """Publish the prefix cache's vLLM KV events on a ZMQ PUB socket bound at ``endpoint`` (from :meth:`start`
        on; the encoding is ``kv_events_map``). False when pyzmq is missing or the cache is off (no events then)."""
        if not ZMQ_AVAILABLE or self.config.prefix_cache_blocks <= 0:
            return False
        self._kv_endpoint = endpoint
        self.scheduler.prefix_cache.record_events = True
        return True

    async def start(self) -> None:
        """Simulated model load: sleeps ``warmup_delay_s``. Requests are served even before (as a warm-up probe)."""
        if self._kv_endpoint and self.scheduler.publisher is None:
            self.scheduler.publisher = KvEventPublisher(self._kv_endpoint, map_events=self.config.kv_events_map)
        if self.config.warmup_delay_s > 0:
            await asyncio.sleep(self.config.warmup_delay_s)
        self.started = True

    def stats(self) -> EngineStats:
        """Scheduler state now (sequences, KV fraction 0–1); plain attribute reads, safe from any thread."""
        s = self.scheduler
        return EngineStats(num_running=s.num_running, num_waiting=s.num_waiting, kv_cache_usage=s.kv_cache_usage,
                           max_num_seqs=self.config.max_num_seqs, cuda_oom_total=self.cuda_oom_total,
                           last_prompt_tokens=self.last_prompt_tokens, kv_total_blocks=self.config.kv_blocks,
                           kv_block_size=self.config.block_size, progress_total=s.progress_total,
                           progress_known=True, max_loras=self.config.max_loras)

    def failure(self) -> str | None:
        """The engine's fatal error once the ``engine_death_after`` fault fired (the worker then exits 1), else None."""
        return f"sim engine died (engine_death_after={self.config.engine_death_after}): {_DEAD}" if self.dead else None

    def requests(self) -> list[EngineRequest]:
        """Every request the scheduler holds (waiting or running), with the open HTTP request it serves (None for
        a background response); ``t0`` on the serving loop's clock."""
        return [EngineRequest(r.id, r.owner, r.t0) for r in list(self.scheduler.live.values())]

    async def abort(self, request_id: str) -> None:
        """Abort engine request ``request_id`` (the reconciler's abort: lost only under ``ignore_aborts``)."""
        req = self.scheduler.live.get(request_id)
        if req is not None and self.scheduler.abort(req, client=False):
            self.aborted_total += 1
            rec = self._active.get(req)
            if rec is not None:
                rec["aborted"] = True

    def metrics_text(self) -> bytes:
        """The ``vllm:*`` metrics (private registry) in Prometheus text format."""
        return generate_latest(self.scheduler.metrics.registry)

    async def shutdown(self) -> None:
        """Stop the scheduler, abort in-flight requests and release hung handlers. Idempotent; any thread/loop."""
        if self._closed:
            return
        self._closed = True
        loop = self._loop
        if loop is None:
            return
        try:
            current: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            current = None
        if current is loop:
            self._close_on_loop()
        else:
            with contextlib.suppress(RuntimeError):  # the serving loop is already closed: nothing left to stop
                loop.call_soon_threadsafe(self._close_on_loop)

    def _close_on_loop(self) -> None:
        self.scheduler.stop()
        if self.scheduler.publisher is not None:
            self.scheduler.publisher.close()
            self.scheduler.publisher = None
        for req in list(self.scheduler.live.values()):  # background responses too
            if self.scheduler.abort_now(req):
                self.aborted_total += 1
                rec = self._active.get(req)
                if rec is not None:
                    rec["aborted"] = True
        if self._release is not None:
            self._release.set()

    # ---- ASGI ----
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """ASGI 3 entry point (``engine.app is engine``)."""
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await self.shutdown()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._release = asyncio.Event()
        if self.hung:
            await self._park(receive, send)
            return
        path, method = scope["path"], scope["method"]
        if path in (_CHAT, _COMPLETIONS):
            if self._closed:
                await send_json(send, 503, HTTPError(503, "sim engine shut down", "ServiceUnavailableError").body())
            elif method != "POST":
                await send_json(send, 405, b'{"detail":"Method Not Allowed"}')
            else:
                await self._model(scope, receive, send, path == _CHAT)
                self.keepalive.after(scope)
            return
        if path == "/reset_prefix_cache" and method == "POST":  # vLLM's dev-mode endpoint
            self.scheduler.prefix_cache.clear()
            self.scheduler.flush_events()
            await send_json(send, 200, b"")
            return
        if self.api.handles(path):
            await self.api(scope, receive, send)
            return
        route = {"/health": self._health, "/v1/models": self._models, "/load": self._load,
                 "/metrics": self._metrics, "/debug/requests": self._debug}.get(path)
        echo = [(k, v) for k, v in scope["headers"] if k == b"x-request-id"][:1]
        if route is None:
            await send_json(send, 404, b'{"detail":"Not Found"}', echo)
        elif method not in ("GET", "HEAD"):
            await send_json(send, 405, b'{"detail":"Method Not Allowed"}', echo)
        else:
            await route(send, echo)

    async def _health(self, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        await send_json(send, 200, b"", headers)

    async def _models(self, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        await send_json(send, 200, self.api.models_body(self._created), headers)

    async def _load(self, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        s = self.scheduler
        await send_json(send, 200, _json({"num_running": s.num_running, "num_waiting": s.num_waiting,
                                         "kv_cache_usage": s.kv_cache_usage}), headers)

    async def _metrics(self, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        await send_json(send, 200, self.metrics_text(), headers, CONTENT_TYPE_LATEST.encode())

    async def _debug(self, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        await send_json(send, 200, _json(list(self.debug_requests)), headers)

    async def _park(self, receive: Receive, send: Send) -> None:
        """Hang fault: never answer; return when the client goes away or the engine shuts down."""
        assert self._release is not None
        gone = asyncio.ensure_future(until_disconnect(receive))
        released = asyncio.ensure_future(self._release.wait())
        await asyncio.wait({gone, released}, return_when=asyncio.FIRST_COMPLETED)
        disconnected = gone.done()
        gone.cancel()
        released.cancel()
        if not disconnected:
            await send_json(send, 503, HTTPError(503, "sim engine shut down", "ServiceUnavailableError").body())

    def _abort(self, req: SimRequest, rec: dict[str, Any]) -> None:
        if self.scheduler.abort(req):
            self.aborted_total += 1
            rec["aborted"] = True

    async def _watch(self, receive: Receive, req: SimRequest, rec: dict[str, Any]) -> None:
        await until_disconnect(receive)
        self._abort(req, rec)  # no-op when the request is already done

    async def _model(self, scope: Scope, receive: Receive, send: Send, chat: bool) -> None:
        cfg = self.config
        self.inflight += 1
        try:
            hdr = {k: v for k, v in scope["headers"] if k in (b"x-request-id", b"traceparent", DEBUG_HEADER)}
            xrid, tp = hdr.get(b"x-request-id"), hdr.get(b"traceparent")
            rid = ("chatcmpl-" if chat else "cmpl-") + (xrid.decode("latin-1") if xrid else uuid.uuid4().hex)
            rec: dict[str, Any] = {
                "request_id": rid, "x_request_id": xrid.decode("latin-1") if xrid else None,
                "traceparent": tp.decode("latin-1") if tp else None, "path": scope["path"], "body_sha256": None,
                "prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0, "priority": 0, "status": 0,
                "aborted": False, "time_unix": time.time(),
                "header_names": sorted({k.decode("latin-1") for k, _ in scope["headers"]})}
            self.debug_requests.append(rec)
            headers = [(b"x-request-id", xrid)] if xrid else []
            try:
                body = await read_body(receive)
                if body is None:
                    rec["aborted"] = True
                    return
                rec["body_sha256"] = sha = hashlib.sha256(body).hexdigest()
                if hdr.get(DEBUG_HEADER) == b"body-sha256":  # opt-in: never reaches a client that did not ask
                    headers.append((b"x-sim-body-sha256", sha.encode()))
                if cfg.max_inflight_503 and self.inflight > cfg.max_inflight_503:
                    self.overloaded_total += 1
                    headers.append((b"retry-after", b"1"))
                    raise HTTPError(503, f"The server is overloaded: more than {cfg.max_inflight_503} requests in "
                                         "flight. Retry later or on another worker.", "ServiceUnavailableError",
                                    "server_overloaded")
                if self.dead:
                    raise HTTPError(500, _DEAD, "InternalServerError")
                p = parse_request(body, chat, cfg, self.api.served)
                rec["priority"] = p.priority
                self.requests_total += 1
                if cfg.first_request_delay_s and self.requests_total == 2:  # the first after the warm-up request
                    await asyncio.sleep(cfg.first_request_delay_s)
                if cfg.oom_after and self.requests_total >= cfg.oom_after:
                    self.cuda_oom_total += 1
                    raise HTTPError(500, "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
                                         "of 79.19 GiB of which 1.06 GiB is free. (simulated by the DPLB sim engine, "
                                         f"oom_after={cfg.oom_after})", "InternalServerError")
            except HTTPError as e:
                rec["status"] = e.status
                await send_json(send, e.status, e.body(), headers)
                return
            owner = (scope.get("extensions") or {}).get(REQUEST_EXT)
            if await self._generate(receive, send, p, rid, rec, headers, chat, owner):
                self._completed()
        finally:
            self.inflight -= 1

    async def _generate(self, receive: Receive, send: Send, p: ParsedRequest, rid: str, rec: dict[str, Any],
                        headers: list[tuple[bytes, bytes]], chat: bool, owner: Any = None) -> bool:
        """Run ``p`` through the scheduler and answer it (``owner``: the worker's open HTTP request it serves);
        True when the full response was sent."""
        cfg = self.config
        req = SimRequest(stream=p.stream, owner=owner, priority=p.priority)
        seeds, rngs = [], []
        for pi, ids in enumerate(p.prompts):
            hashes, ph = block_hashes(ids, cfg.block_size), prompt_hash(ids)
            lead = bool(p.leads and p.leads[pi])
            for j in range(p.n):
                req.add_seq(pi * p.n + j, len(ids), hashes, p.max_tokens[pi], cfg.block_size, ids)
                seeds.append(f"{cfg.seed}:{ph}:{pi * p.n + j}")
                rngs.append(text.TextGen(cfg.seed, ids, j, lead))
        lps = None if p.logprobs is None else [logprobs.SequenceLogprobs(s, p.logprobs, chat) for s in seeds]
        prompt_tokens = sum(len(ids) for ids in p.prompts)
        rec["prompt_tokens"] = self.last_prompt_tokens = prompt_tokens
        if owner is not None and len(p.prompts) == 1:
            owner.prompt_token_ids = p.prompts[0]
        self._active[req] = rec
        self.scheduler.submit(req)
        watcher = asyncio.ensure_future(self._watch(receive, req, rec))
        try:
            if p.stream:
                return await self._stream(send, req, p, rid, rec, headers, chat, rngs, prompt_tokens, lps)
            while not req.done:
                await req.event.wait()
                req.event.clear()
                if self.dead:
                    rec["status"] = 500
                    await send_json(send, 500, HTTPError(500, _DEAD, "InternalServerError").body(), headers)
                    return False
                if req.aborted:
                    if self._closed:
                        rec["status"] = 503
                        await send_json(send, 503, HTTPError(503, "sim engine shut down",
                                                            "ServiceUnavailableError").body(), headers)
                    return False
            choices: list[dict[str, Any]] = []
            for i, (seq, rng) in enumerate(zip(req.seqs, rngs, strict=True)):
                out = rng.text(seq.max_tokens)
                choice: dict[str, Any] = ({"index": seq.index, "message": {"role": "assistant", "content": out,
                                           "refusal": None, "tool_calls": [], "reasoning_content": None}}
                                          if chat else {"index": seq.index, "text": out})
                choice.update(logprobs=lps[i].chunk(logprobs.tokens_of(out)) if lps else None,
                              finish_reason="length", stop_reason=None)
                choices.append(choice)
            completion = sum(s.max_tokens for s in req.seqs)
            rec.update(status=200, completion_tokens=completion)
            await send_json(send, 200, _json({
                "id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": cfg.model, "choices": choices, "usage": {
                    "prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion,
                    "completion_tokens": completion,
                    "prompt_tokens_details": {"cached_tokens": _cached(req)}}}), headers)
            return True
        finally:
            watcher.cancel()
            self._active.pop(req, None)
            if not req.done:
                self._abort(req, rec)
            rec["cached_tokens"] = cached = _cached(req)
            if owner is not None:
                owner.cached_tokens = cached

    async def _stream(self, send: Send, req: SimRequest, p: ParsedRequest, rid: str, rec: dict[str, Any],
                      headers: list[tuple[bytes, bytes]], chat: bool, rngs: list[text.TextGen],
                      prompt_tokens: int, lps: list[logprobs.SequenceLogprobs] | None) -> bool:
        cfg = self.config
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": cfg.model}
        sent = [0] * len(req.seqs)

        def usage() -> dict[str, Any]:
            c = sum(sent)
            return {"prompt_tokens": prompt_tokens, "completion_tokens": c, "total_tokens": prompt_tokens + c,
                    "prompt_tokens_details": {"cached_tokens": _cached(req)}}

        def event(choices: list[dict[str, Any]], with_usage: bool) -> bytes:
            obj: dict[str, Any] = {**head, "choices": choices}
            if with_usage:
                obj["usage"] = usage()
            return b"data: " + _json(obj) + b"\n\n"

        rec["status"] = 200
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"), *headers]})
        first = True
        while True:
            await req.event.wait()
            req.event.clear()
            if self.dead:  # vLLM's stream generator: the error event, then [DONE], then a clean end
                for part in (b"data: " + json.dumps(HTTPError(500, _DEAD, "InternalServerError").as_dict()).encode()
                             + b"\n\n", b"data: [DONE]\n\n", b""):
                    await send({"type": "http.response.body", "body": part, "more_body": bool(part)})
                return False
            if req.aborted:
                return False
            events: list[bytes] = []
            if chat and first:  # vLLM sends the role chunk with the first output, after prefill
                events += [event([{"index": s.index, "delta": {"role": "assistant", "content": ""},
                                   "logprobs": None, "finish_reason": None}], p.continuous_usage) for s in req.seqs]
            first = False
            for i, seq in enumerate(req.seqs):
                while sent[i] < seq.generated:
                    tok = rngs[i].token()
                    sent[i] += 1
                    done = sent[i] == seq.max_tokens
                    c: dict[str, Any] = ({"index": seq.index, "delta": {"content": tok}} if chat
                                         else {"index": seq.index, "text": tok})
                    c.update(logprobs=lps[i].chunk([tok]) if lps else None, finish_reason="length" if done else None)
                    if done or not chat:
                        c["stop_reason"] = None
                    events.append(event([c], p.continuous_usage))
            rec["completion_tokens"] = sum(sent)
            if cfg.chunk_delay_s > 0:
                for ev in events:
                    await send({"type": "http.response.body", "body": ev, "more_body": True})
                    await asyncio.sleep(cfg.chunk_delay_s)
            elif events:
                await send({"type": "http.response.body", "body": b"".join(events), "more_body": True})
            if req.done and all(n == s.max_tokens for n, s in zip(sent, req.seqs, strict=True)):
                break
        tail = (event([], True) if p.include_usage else b"") + b"data: [DONE]\n\n"
        await send({"type": "http.response.body", "body": tail, "more_body": False})
        return True

    def _completed(self) -> None:
        """A response was fully sent: drive the crash, stall, engine-death and hang faults."""
        cfg = self.config
        self.completed_total += 1
        if cfg.crash_after and self.completed_total == cfg.crash_after:
            log.error("sim engine: crash_after=%d requests reached; exiting with status 1 (simulated crash)",
                      cfg.crash_after)
            asyncio.get_running_loop().call_later(0.05, os._exit, 1)
        if cfg.stall_after and self.completed_total == cfg.stall_after and not self.stalled:
            log.error("sim engine: stall_after=%d requests reached; the engine makes no progress %s (simulated "
                      "stall: HTTP, health and the collector carry on)", cfg.stall_after,
                      f"for {cfg.stall_for_s:g} s" if cfg.stall_for_s else "any more")
            self.stalled = True
            self.scheduler.freeze()
            if cfg.stall_for_s:
                asyncio.get_running_loop().call_later(cfg.stall_for_s, self._end_stall)
        if cfg.engine_death_after and self.completed_total == cfg.engine_death_after and not self.dead:
            log.error("sim engine: engine_death_after=%d requests reached; the engine dies under its HTTP server "
                      "(simulated EngineCore death: requests in flight get vLLM's error)", cfg.engine_death_after)
            self.dead = True
            self.scheduler.freeze()
            for req in list(self.scheduler.live.values()):
                req.event.set()  # their handlers answer the error
        if cfg.hang_after and self.completed_total >= cfg.hang_after and not self.hung:
            log.error("sim engine: hang_after=%d requests reached; no longer answering (simulated hang)",
                      cfg.hang_after)
            self.hung = True
            self.scheduler.freeze()

    def _end_stall(self) -> None:
        """The stall fault's ``stall_for_s`` passed: the scheduler steps again."""
        log.warning("sim engine: stall over after %g s; the engine makes progress again", self.config.stall_for_s)
        self.stalled = False
        self.scheduler.thaw()

