"""The sim engine's endpoints beyond chat and completions, in vLLM's shapes: LoRA adapters, the Responses API and
the pooling / scoring / tokenizer / audio routes, so every route the router proxies is exercised on CPU.

Contract
- Served names: the base model (``SimConfig.model``) plus the LoRA adapters of ``SimConfig.lora_adapters``
  (``--sim-lora-adapters a,b=/path``: comma-separated ``name`` or ``name=path``) plus those loaded at runtime.
  ``GET /v1/models`` lists them as vLLM does (adapters with ``parent`` = the base model, ``root`` = their path).
- ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` → 200 text, 400 when already loaded or fields are
  missing; ``POST /v1/unload_lora_adapter`` ``{"lora_name"}`` → 200 text, 404 when unknown (vLLM's messages). The
  sim answers them always (vLLM needs ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``).
- ``POST /v1/responses`` (``input`` string or messages, ``instructions``, ``max_output_tokens``, ``stream``,
  ``previous_response_id``, ``request_id``): runs through the scheduler like a chat request; the answer is a
  ``response`` object, or with ``stream`` the event sequence ``response.created`` … ``response.completed``
  (``event:``/``data:`` SSE lines, as vLLM). The last :data:`STORED_RESPONSES` responses are kept:
  ``GET /v1/responses/{id}`` returns one (404 when unknown), and an unknown ``previous_response_id`` is a 404.
  ``background: true`` answers at once with the ``queued`` response and generates it in a task (``in_progress``,
  then ``completed``); ``POST /v1/responses/{id}/cancel`` cancels a queued or in-progress one (its request is
  aborted; the answer is the response, ``status: "cancelled"``) and answers 400 "Cannot cancel a synchronous
  response." for any other, as vLLM.
- The other proxied routes (``/tokenize`` — its chat form with ``messages`` counts the prompt chat completions
  would see —, ``/detokenize``, ``/v1/embeddings``, ``/pooling``, ``/classify``,
  ``/score``, ``/rerank`` and their versions, ``/v1/messages``, audio, …) validate the JSON body (multipart for
  audio) and the model, and answer a deterministic body of the right kind, one result per input for the pooling
  routes (:mod:`dplb.worker.engines.sim.pooling`); no scheduler time. The proxied routes in
  :data:`NOT_SIMULATED` answer an OpenAI-shaped 404 saying the sim does not implement them.
- Every model request is recorded in ``/debug/requests`` and, when sent with ``x-sim-debug: body-sha256``, answered
  with ``x-sim-body-sha256``; each record has
  (``path``, ``status``, ``body_sha256``, ``x_request_id``, ``model``).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import random
import re
import time
import uuid
from collections import deque
from typing import Any, Protocol

import msgspec

from dplb.config import split_list
from dplb.errors import ConfigError
from dplb.runtime.asgi import send_json, until_disconnect
from dplb.worker.engines.base import REQUEST_EXT, Receive, Scope, Send
from dplb.worker.engines.sim import pooling
from dplb.worker.engines.sim.http import DEBUG_HEADER, HTTPError, check_model, decode_object, read_body
from dplb.worker.engines.sim.pooling import POOLING_PATHS
from dplb.worker.engines.sim.prompts import block_hashes, prompt_hash, render_chat, tokenize
from dplb.worker.engines.sim.scheduler import WORDS, SimConfig, SimRequest, SimScheduler
from dplb.worker.engines.sim.text import render_prompt


class SimEngine(Protocol):
    """What the extra endpoints use of :class:`~dplb.worker.engines.sim.engine.SimEngine` (a Protocol)."""

    config: SimConfig
    scheduler: SimScheduler
    debug_requests: deque[dict[str, Any]]
    last_prompt_tokens: int

STORED_RESPONSES = 1024
_json = msgspec.json.Encoder().encode
_RESPONSES, _RESPONSES_PREFIX = "/v1/responses", "/v1/responses/"
_LORA = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
_AUDIO = ("/v1/audio/transcriptions", "/v1/audio/translations")
_GENERIC = frozenset({
    "/tokenize", "/detokenize", "/v1/embeddings", "/v2/embed", "/pooling", "/classify", "/score", "/v1/score",
    "/rerank", "/v1/rerank", "/v2/rerank", "/v1/messages", "/v1/messages/count_tokens", *_AUDIO})
#: Routes the router proxies that the sim does not simulate: answered 404 with an OpenAI-shaped error saying so
#: (vLLM serves them; a real model is needed to use them). 404, not 501: a worker 5xx counts against its health.
NOT_SIMULATED = frozenset({
    "/v1/chat/completions/batch", "/v1/chat/completions/render", "/v1/completions/render", "/v1/messages/render",
    "/v1/responses/render", "/v1/chat/completions/derender", "/v1/completions/derender", "/inference/v1/generate",
    "/generative_scoring", "/v1/systemone", "/invocations"})
_FORM_MODEL = re.compile(rb'name="model"[^\r\n]*\r\n(?:[^\r\n]+\r\n)*\r\n([^\r\n]{1,256})\r\n', re.IGNORECASE)


def parse_adapters(text: str) -> dict[str, str]:
    """``"a,b=/p"`` → ``{"a": "/adapters/a", "b": "/p"}`` (name → path); ``""`` → ``{}``. Raises
    :class:`~dplb.errors.ConfigError` for an empty item or name (:func:`dplb.config.split_list`)."""
    out: dict[str, str] = {}
    for item in split_list(text, "--sim-lora-adapters", allow_empty=True):
        name, _, path = item.partition("=")
        if not name.strip():
            raise ConfigError(f"--sim-lora-adapters {text!r}: {item!r} has no name (expected NAME or NAME=PATH)")
        out[name.strip()] = path.strip() or f"/adapters/{name.strip()}"
    return out


class SimApi:
    """The extra endpoints of one :class:`~dplb.worker.engines.sim.engine.SimEngine` (module docstring)."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine
        self.adapters = parse_adapters(engine.config.lora_adapters)
        self.responses: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self.background: dict[str, asyncio.Task[None]] = {}  # response id → its generation (background: true)

    @property
    def served(self) -> frozenset[str]:
        """Every model name this engine answers for (base model and adapters)."""
        return frozenset((self.engine.config.model, *self.adapters))

    def handles(self, path: str) -> bool:
        """True for the paths this module answers (:data:`NOT_SIMULATED` ones with their 404)."""
        return path in _GENERIC or path in _LORA or path == _RESPONSES or path in NOT_SIMULATED or \
            path.startswith(_RESPONSES_PREFIX)

    def models_body(self, created: int) -> bytes:
        """The ``/v1/models`` answer: the base model, then each adapter."""
        cfg = self.engine.config
        data = [{"id": cfg.model, "object": "model", "created": created, "owned_by": "vllm", "root": cfg.model,
                 "parent": None, "max_model_len": cfg.max_model_len, "permission": []}]
        data += [{"id": n, "object": "model", "created": created, "owned_by": "vllm", "root": p, "parent": cfg.model,
                  "max_model_len": cfg.max_model_len, "permission": []} for n, p in self.adapters.items()]
        return _json({"object": "list", "data": data})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one request on one of :meth:`handles`' paths."""
        path, method = scope["path"], scope["method"]
        hdr = dict(scope["headers"])
        xrid = hdr.get(b"x-request-id")
        headers = [(b"x-request-id", xrid)] if xrid else []
        rec: dict[str, Any] = {"request_id": None, "x_request_id": xrid.decode("latin-1") if xrid else None,
                               "path": path, "body_sha256": None, "status": 0, "model": None, "aborted": False,
                               "time_unix": time.time(), "prompt_tokens": 0, "completion_tokens": 0,
                               "cached_tokens": 0, "traceparent": None,
                               "header_names": sorted({k.decode("latin-1") for k, _ in scope["headers"]})}
        self.engine.debug_requests.append(rec)
        want = "GET" if path.startswith(_RESPONSES_PREFIX) and not path.endswith("/cancel") else "POST"
        try:
            if method != want and path not in NOT_SIMULATED:
                raise HTTPError(405, "Method Not Allowed")
            body = await read_body(receive)
            if body is None:
                rec["aborted"] = True
                return
            rec["body_sha256"] = sha = hashlib.sha256(body).hexdigest()
            if hdr.get(DEBUG_HEADER) == b"body-sha256":  # opt-in, as in sim.py: never reaches a client that did not ask
                headers.append((b"x-sim-body-sha256", sha.encode()))
            if path in NOT_SIMULATED:
                raise HTTPError(404, f"The DPLB sim engine does not implement {path}; vLLM serves it (start the "
                                     "stack with --model to use it).", "NotFoundError")
            if path in _LORA:
                status, out = self._lora(path, body)
                rec["status"] = status
                await send_json(send, status, out, headers, b"text/plain; charset=utf-8" if status == 200 else
                            b"application/json")
                return
            if path.startswith(_RESPONSES_PREFIX):
                out = self._stored(path[len(_RESPONSES_PREFIX):])
                rec["status"] = 200
                await send_json(send, 200, out, headers)
                return
            data = self._parse(path, body, hdr.get(b"content-type", b""))
            rec["model"] = data.get("model")
            if path == _RESPONSES:
                owner = (scope.get("extensions") or {}).get(REQUEST_EXT)
                await self._respond(receive, send, data, headers, rec, owner)
                return
            rec["status"] = 200
            await send_json(send, 200, _json(self._generic(path, data)), headers)
        except HTTPError as e:
            rec["status"] = e.status
            await send_json(send, e.status, e.body(), headers)

    # ---- parsing -----------------------------------------------------------------------------------------------
    def _parse(self, path: str, body: bytes, ctype: bytes) -> dict[str, Any]:
        if path in _AUDIO:
            if not ctype.lower().startswith(b"multipart/form-data"):
                raise HTTPError(400, "audio endpoints take multipart/form-data")
            m = _FORM_MODEL.search(body)
            data: Any = {"model": m.group(1).decode() if m else None, "bytes": len(body)}
        else:
            data = decode_object(body)
        check_model(data.get("model"), self.served)
        return data

    # ---- LoRA --------------------------------------------------------------------------------------------------
    def _lora(self, path: str, body: bytes) -> tuple[int, bytes]:
        try:
            data = msgspec.json.decode(body)
        except msgspec.DecodeError as e:
            raise HTTPError(400, f"Invalid JSON body: {e}") from None
        name = data.get("lora_name") if isinstance(data, dict) else None
        if not isinstance(name, str) or not name:
            raise HTTPError(400, "Both 'lora_name' and 'lora_path' must be provided." if path == _LORA[0]
                         else "'lora_name' needs to be provided to unload a LoRA adapter.")
        if path == _LORA[0]:
            lora_path = data.get("lora_path")
            if not isinstance(lora_path, str) or not lora_path:
                raise HTTPError(400, "Both 'lora_name' and 'lora_path' must be provided.")
            if name in self.adapters or name == self.engine.config.model:
                raise HTTPError(400, f"The lora adapter '{name}' has already been loaded.", "InvalidUserInput")
            self.adapters[name] = lora_path
            return 200, f"Success: LoRA adapter '{name}' added successfully.".encode()
        if name not in self.adapters:
            raise HTTPError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self.adapters[name]
        return 200, f"Success: LoRA adapter '{name}' removed successfully.".encode()

    # ---- generic routes ----------------------------------------------------------------------------------------
    def _generic(self, path: str, data: dict[str, Any]) -> dict[str, Any]:
        model = data.get("model") or self.engine.config.model
        text = data.get("prompt") or data.get("input") or data.get("text_1") or data.get("query") or ""
        ids = tokenize(text if isinstance(text, str) else msgspec.json.encode(text).decode())
        if path == "/tokenize" and "messages" in data:  # vLLM's chat form: the prompt chat completions would see
            try:
                ids = tokenize(render_prompt(data)[0])
            except ValueError as e:
                raise HTTPError(400, str(e)) from None
        if path == "/tokenize":
            return {"count": len(ids), "max_model_len": self.engine.config.max_model_len, "tokens": ids}
        if path == "/detokenize":
            return {"prompt": pooling.detokenize(data.get("tokens"))}
        if path in _AUDIO:
            return {"text": " ".join(random.Random(data["bytes"]).choice(WORDS) for _ in range(8))}
        if path == "/v1/messages/count_tokens":
            return {"input_tokens": len(ids)}
        if path in POOLING_PATHS:
            return pooling.answer(path, data, model)
        return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model,
                "content": [{"type": "text", "text": "yes"}], "stop_reason": "max_tokens",
                "usage": {"input_tokens": len(ids), "output_tokens": 1}}  # /v1/messages

    # ---- Responses API -----------------------------------------------------------------------------------------
    def _stored(self, rest: str) -> bytes:
        rid, cancel = (rest[: -len("/cancel")], True) if rest.endswith("/cancel") else (rest, False)
        resp = self.responses.get(rid)
        if resp is None:
            raise HTTPError(404, f"Response with id '{rid}' not found.", "invalid_request_error")
        if cancel:
            # vLLM: only a queued or in-progress (background) response can be cancelled; it answers the response.
            if resp["status"] not in ("queued", "in_progress"):
                raise HTTPError(400, "Cannot cancel a synchronous response.", "invalid_request_error")
            resp["status"] = "cancelled"
            task = self.background.pop(rid, None)
            if task is not None:
                task.cancel()
        return _json(resp)

    async def _respond(self, receive: Receive, send: Send, data: dict[str, Any],
                       headers: list[tuple[bytes, bytes]], rec: dict[str, Any], owner: Any = None) -> None:
        eng, cfg = self.engine, self.engine.config
        prev = data.get("previous_response_id")
        if prev is not None and not isinstance(prev, str):
            raise HTTPError(400, f"'previous_response_id' must be a string, got {prev!r}")
        if prev is not None and prev not in self.responses:
            raise HTTPError(404, f"Response with id '{prev}' not found.", "invalid_request_error")
        inp = data.get("input")
        try:
            msgs = [{"role": "user", "content": inp}] if isinstance(inp, str) else inp
            if isinstance(data.get("instructions"), str):
                msgs = [{"role": "system", "content": data["instructions"]}, *(msgs or [])]
            ids = tokenize(render_chat(msgs))
        except ValueError as e:
            raise HTTPError(400, str(e)) from None
        max_tokens = data.get("max_output_tokens") or cfg.default_max_tokens
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise HTTPError(400, f"max_output_tokens must be a positive integer, got {max_tokens!r}")
        max_tokens = min(max_tokens, cfg.max_model_len - len(ids))
        given = data.get("request_id")
        rid = given if isinstance(given, str) else f"resp_{uuid.uuid4().hex}"
        rec["request_id"] = rid
        stream = data.get("stream") is True
        req = SimRequest(stream=stream, owner=None if data.get("background") is True else owner)
        req.add_seq(0, len(ids), block_hashes(ids, cfg.block_size), max_tokens, cfg.block_size)
        rng = random.Random(f"{cfg.seed}:{prompt_hash(ids)}:0")
        rec["prompt_tokens"] = eng.last_prompt_tokens = len(ids)
        words: list[str] = []
        resp: dict[str, Any] = {
                "id": rid, "object": "response", "created_at": int(time.time()), "status": "in_progress",
                "model": data.get("model") or cfg.model, "output": [], "parallel_tool_calls": True,
                "tool_choice": "auto", "tools": [], "temperature": 1.0, "top_p": 1.0, "incomplete_details": None,
                "instructions": data.get("instructions"), "metadata": None, "error": None,
                "previous_response_id": prev, "usage": None}
        msg_id = f"msg_{uuid.uuid4().hex}"
        if data.get("background") is True:
            self._start_background(data, req, rng, resp, msg_id, len(ids))
            rec["status"] = 200
            await send_json(send, 200, _json(resp), headers)
            return
        seq_no = [0]

        def event(kind: str, **fields: Any) -> bytes:
            seq_no[0] += 1
            return (b"event: " + kind.encode() + b"\ndata: " +
                    _json({"type": kind, "sequence_number": seq_no[0] - 1, **fields}) + b"\n\n")

        def item(status: str) -> dict[str, Any]:
            return {"type": "message", "id": msg_id, "status": status, "role": "assistant",
                    "content": [{"type": "output_text", "text": " ".join(words), "annotations": [], "logprobs": []}]}

        eng.scheduler.submit(req)
        watcher = asyncio.ensure_future(self._watch(receive, req))
        try:
            if stream:
                rec["status"] = 200
                await send({"type": "http.response.start", "status": 200, "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                    *headers]})
                part0 = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                await send({"type": "http.response.body", "more_body": True, "body": b"".join((
                    event("response.created", response=resp), event("response.in_progress", response=resp),
                    event("response.output_item.added", output_index=0, item={**item("in_progress"), "content": []}),
                    event("response.content_part.added", item_id=msg_id, output_index=0, content_index=0,
                          part=part0)))})
            seq = req.seqs[0]
            while True:
                await req.event.wait()
                req.event.clear()
                if req.aborted:
                    rec["aborted"] = True
                    return
                deltas = []
                while len(words) < seq.generated:
                    words.append(rng.choice(WORDS))
                    deltas.append(event("response.output_text.delta", item_id=msg_id, output_index=0,
                                        content_index=0, delta=(" " if len(words) > 1 else "") + words[-1],
                                        logprobs=[]))
                if stream and deltas:
                    await send({"type": "http.response.body", "body": b"".join(deltas), "more_body": True})
                if req.done:
                    break
            done = item("completed")
            resp.update(status="completed", output=[done], usage={
                "input_tokens": len(ids), "input_tokens_details": {"cached_tokens": seq.cached_tokens},
                "output_tokens": len(words), "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": len(ids) + len(words)})
            self._store(rid, resp)
            rec.update(status=200, completion_tokens=len(words))
            if not stream:
                await send_json(send, 200, _json(resp), headers)
                return
            text = done["content"][0]
            await send({"type": "http.response.body", "more_body": False, "body": b"".join((
                event("response.output_text.done", item_id=msg_id, output_index=0, content_index=0,
                      text=text["text"], logprobs=[]),
                event("response.content_part.done", item_id=msg_id, output_index=0, content_index=0, part=text),
                event("response.output_item.done", output_index=0, item=done),
                event("response.completed", response=resp)))})
        finally:
            watcher.cancel()
            if not req.done:
                eng.scheduler.abort(req)

    def _store(self, rid: str, resp: dict[str, Any]) -> None:
        """Keep ``resp`` for ``GET /v1/responses/{rid}`` (the last :data:`STORED_RESPONSES`)."""
        self.responses[rid] = resp
        self.responses.move_to_end(rid)
        if len(self.responses) > STORED_RESPONSES:
            self.responses.popitem(last=False)

    def _start_background(self, data: dict[str, Any], req: SimRequest, rng: random.Random, resp: dict[str, Any],
                          msg_id: str, prompt_tokens: int) -> None:
        """Store ``resp`` as ``queued`` and start its generation (:meth:`_run_background`). Raises HTTPError 400 for
        ``store: false`` (vLLM's rule) or ``stream: true`` (not simulated)."""
        if data.get("store") is False:
            raise HTTPError(400, "background can only be used when `store` is true")
        if data.get("stream") is True:
            raise HTTPError(400, "The DPLB sim engine does not stream background responses; poll GET "
                                 "/v1/responses/{id} instead (vLLM streams them).")
        resp.update(status="queued", background=True)
        self._store(str(resp["id"]), resp)
        self.background[str(resp["id"])] = asyncio.ensure_future(
            self._run_background(req, rng, resp, msg_id, prompt_tokens))

    async def _run_background(self, req: SimRequest, rng: random.Random, resp: dict[str, Any], msg_id: str,
                              prompt_tokens: int) -> None:
        """Generate a ``background: true`` response: queued → in_progress → completed (or cancelled, when
        ``…/cancel`` cancels this task: the request is aborted and frees its KV blocks)."""
        sched = self.engine.scheduler
        sched.submit(req)
        try:
            seq = req.seqs[0]
            while not req.done:
                await req.event.wait()
                req.event.clear()
                if req.aborted:
                    resp["status"] = "failed" if resp["status"] != "cancelled" else "cancelled"
                    return
                if resp["status"] == "queued" and seq.generated:
                    resp["status"] = "in_progress"
            words = [rng.choice(WORDS) for _ in range(seq.generated)]
            resp.update(status="completed", output=[{
                "type": "message", "id": msg_id, "status": "completed", "role": "assistant",
                "content": [{"type": "output_text", "text": " ".join(words), "annotations": [], "logprobs": []}]}],
                usage={"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": seq.cached_tokens},
                       "output_tokens": len(words), "output_tokens_details": {"reasoning_tokens": 0},
                       "total_tokens": prompt_tokens + len(words)})
        finally:
            if not req.done:
                sched.abort(req, client=False)  # a cancel is not a disconnect: the lose_aborts knob spares it
            self.background.pop(str(resp["id"]), None)

    async def _watch(self, receive: Receive, req: SimRequest) -> None:
        """A client disconnect aborts ``req`` (frees its KV blocks)."""
        await until_disconnect(receive)
        self.engine.scheduler.abort(req)


__all__ = ["STORED_RESPONSES", "SimApi", "parse_adapters"]
