"""Streams that survive their worker (``--resume-streams``; docs/DESIGN.md §14): a chat or completions SSE stream
with n = 1 whose worker dies (connection reset, EOF mid-body), goes silent past ``--idle-timeout`` or fails the
stream with a 5xx error event is re-issued to another worker with what the client already received as the
continuation, and the answer is stitched into the same stream.

Contract
- Off (the default) nothing here runs: the proxy never builds a :class:`ResumeStream` and the hot path is unchanged.
  On, :func:`track` looks at a streamed chat/completions request once, before its first attempt; a request that
  could not be resumed (:func:`refusal`: n > 1, logprobs, structured outputs / guided decoding, tools, ``echo``,
  a prompt that is not one string, a final message already continued) is relayed byte for byte as before, and if
  it breaks, its error event says why it was not resumed.
- Tracked streams are relayed by whole SSE events (a partial event in flight when the worker dies never reaches
  the client) and parsed: the text delivered (chat ``delta.content``, completions ``text``), the tokens delivered
  (one per event with text, or the stream's own ``usage.completion_tokens`` when it carries continuous usage), the
  id and ``created`` of the first event, whether a finish reason, tool calls or reasoning were delivered.
- The continuation (:func:`continuation`) is the original body with: chat — a final ``{"role": "assistant",
  "content": <delivered text>}`` message, ``continue_final_message: true``, ``add_generation_prompt: false``;
  completions — ``prompt`` + the delivered text; ``max_tokens`` / ``max_completion_tokens`` reduced by the
  tokens delivered (refused when nothing is left) and ``min_tokens`` likewise (not below 0). Nothing delivered:
  the original body unchanged. Refused when it exceeds ``--max-body-bytes``. It is the one body the router
  changes; each one a worker takes (its response head arrived) is counted (``dplb_streams_resumed_total``),
  logged and traced (``dplb.stream_resumed``).
- Stitching (:meth:`ResumeStream.feed` after a resume): every event of the resumed answer gets the original
  ``id`` and ``created`` and choice index 0; its role-only first chunk is dropped (the client had it); ``usage``
  is rewritten to prompt_tokens = the original prompt (as seen in the stream; else as the worker that takes the
  continuation counts it — ``POST /tokenize`` of the original request when the continuation's head arrives and
  usage is wanted, :mod:`dplb.router.prompt_count`; else, when it cannot say, the resumed prompt minus the tokens
  delivered), completion_tokens = delivered + resumed, total = their sum, and
  ``prompt_tokens_details.cached_tokens`` = the original's (as seen, else the continuation's capped at that
  prompt_tokens: the delivered text it also caches is not the client's prompt); exactly one ``[DONE]`` ends it.
- Each stream is resumed at most :data:`MAX_RESUMES` times. A stream not resumed ends as without the flag: a
  final ``data: {"error": …}`` event naming the reason, no ``[DONE]``, an abnormal close; counted in
  ``dplb_stream_resume_refused_total{reason}`` (reasons: :data:`dplb.obs.metrics.RESUME_REFUSALS`). The event and
  the router log say the reason as a phrase (:data:`REFUSAL_PHRASES`, e.g. ``n > 1`` for the label ``n``); the
  metric label and the trace event keep the short label.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

import msgspec

from dplb.errors import RouterErrorKind, UpstreamError, UpstreamTimeout, error_body, event_failure
from dplb.router.attempt import Attempt, Upstreams
from dplb.router.exchange import Exchange
from dplb.router.health import Outcome
from dplb.router.peek import ResumeFields as _Fields
from dplb.router.peek import resume_fields as _fields
from dplb.router.prompt_count import original_prompt_tokens

log = logging.getLogger("dplb.router.resume")
MAX_RESUMES = 3  # per stream: a worker that breaks every stream it is given cannot hold one forever
_CHAT, _COMPLETIONS = "/v1/chat/completions", "/v1/completions"
_EVENT_END = re.compile(rb"\r?\n\r?\n")
_DONE = b"[DONE]"
_KEEPALIVE = b": keep-alive\n\n"
_ERROR_READ = 4096  # bytes of a refusing worker's body read for its message
_STRUCTURED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
_json = msgspec.json.Encoder().encode
#: What a client (the error event) and an on-call (the router log) read for each short reason label.
REFUSAL_PHRASES: dict[str, str] = {
    "n": "n > 1 or best_of > 1",
    "logprobs": "logprobs or prompt_logprobs requested",
    "structured_output": "structured output or guided decoding requested",
    "tools": "tools offered",
    "echo": "echo requested",
    "prompt_not_text": "the prompt is not one string",
    "continued_message": "the request already continues its final message",
    "tool_calls": "tool calls were already streamed",
    "reasoning": "reasoning was already streamed",
    "max_tokens": "no max_tokens left after the tokens delivered",
    "body_too_large": "the continuation would exceed --max-body-bytes",
    "too_many_resumes": f"already resumed {MAX_RESUMES} times",
    "finished": "the answer had finished and only its usage was lost",
    "no_worker": "no other worker could take it",
    "worker_refused": "the other worker refused the continuation",
}


def refusal(chat: bool, fields: _Fields) -> str | None:
    """Why a stream of this request could not be resumed (a :data:`dplb.obs.metrics.RESUME_REFUSALS` label), or
    None."""
    f = fields
    if f.n not in (None, 1) or f.best_of not in (None, 1):
        return "n"
    lp = f.logprobs  # chat: a boolean; completions: how many alternatives (0 asks for the sampled token's)
    if (lp is True if chat else lp is not None and lp is not False) or f.prompt_logprobs is not None:
        return "logprobs"
    rf = f.response_format
    if (isinstance(rf, dict) and rf.get("type") not in (None, "text")) or \
            any(getattr(f, k) is not None for k in _STRUCTURED):
        return "structured_output"
    if f.tools and f.tool_choice != "none":
        return "tools"
    if f.echo:
        return "echo"
    if chat and f.continue_final_message is True:
        return "continued_message"
    if not chat and not isinstance(f.prompt, str):
        return "prompt_not_text"
    return None


def track(ex: Exchange) -> ResumeStream | None:
    """The resume state of ``ex`` when it is a streamed chat/completions POST (eligible or not), else None."""
    route = ex.route
    if route is None or ex.peek.stream is not True or ex.scope["method"] != "POST" or \
            route.path not in (_CHAT, _COMPLETIONS):
        return None
    chat = route.path == _CHAT
    try:
        fields = _fields.decode(ex.body)
    except msgspec.DecodeError:  # a field of an unexpected shape: the worker answers it, it is not resumed
        return ResumeStream(chat, ex.body, "structured_output", False)
    opts = fields.stream_options
    usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
    return ResumeStream(chat, ex.body, refusal(chat, fields), usage)


def continuation(body: bytes, chat: bool, text: str, tokens: int, limit: int) -> bytes | str:
    """The request body that continues ``body`` after ``text`` (``tokens`` tokens) was delivered, or the
    :data:`dplb.obs.metrics.RESUME_REFUSALS` label why it cannot be built (``max_tokens``: nothing left;
    ``body_too_large``: over ``limit`` bytes). See the module docstring for what changes."""
    if not text and not tokens:
        return body
    obj = msgspec.json.decode(body)
    for key in ("max_tokens", "max_completion_tokens"):
        v = obj.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            if v - tokens <= 0:
                return "max_tokens"
            obj[key] = v - tokens
    low = obj.get("min_tokens")
    if isinstance(low, int) and not isinstance(low, bool) and low > 0:
        obj["min_tokens"] = max(0, low - tokens)
    if chat:
        obj["messages"] = [*obj["messages"], {"role": "assistant", "content": text}]
        obj["continue_final_message"] = True
        obj["add_generation_prompt"] = False
    else:
        obj["prompt"] = obj["prompt"] + text
    out = _json(obj)
    return "body_too_large" if len(out) > limit else out


class ResumeStream:
    """What one tracked stream delivered so far, and its stitching state (module docstring). ``refused``: the
    up-front reason it cannot be resumed (None: eligible); ``broken``: why the current attempt ended early (None:
    it did not); ``resumes``: continuations sent."""

    __slots__ = ("body", "break_kind", "broken", "broken_on", "buf", "cached_tokens", "chat", "created", "done",
                 "finished", "id", "parts", "prompt_tokens", "reasoning", "refused", "resumes", "role_sent",
                 "seg_chunks", "seg_usage", "t_break", "tokens_before", "tool_calls", "usage_sent", "want_usage")

    def __init__(self, chat: bool, body: bytes, refused: str | None, want_usage: bool) -> None:
        self.chat, self.body, self.refused, self.want_usage = chat, body, refused, want_usage
        self.broken: str | None = None
        self.broken_on = -1  # the worker the continuation being placed follows (-1: none, or counted already)
        self.break_kind = RouterErrorKind.UPSTREAM_FAILED  # the error kind of the event if not resumed
        self.buf = b""
        self.parts: list[str] = []
        self.tokens_before = 0  # tokens delivered by the segments before the current one
        self.seg_chunks = 0  # events with text in the current segment
        self.seg_usage: int | None = None  # the current segment's own completion_tokens, when it reports usage
        self.id: Any = None
        self.created: Any = None
        self.prompt_tokens: int | None = None
        self.cached_tokens: int | None = None  # the original request's, when its own segment reported usage
        self.resumes = 0
        self.t_break = 0.0
        self.role_sent = self.done = self.finished = self.tool_calls = self.reasoning = self.usage_sent = False

    @property
    def tokens(self) -> int:
        """Tokens delivered to the client so far."""
        seg = self.seg_usage if self.seg_usage is not None else self.seg_chunks
        return self.tokens_before + seg

    @property
    def text(self) -> str:
        """The text delivered to the client so far."""
        return "".join(self.parts)

    def next_segment(self) -> None:
        """A continuation is sent: what was delivered becomes the base of the next segment."""
        self.tokens_before, self.seg_chunks, self.seg_usage = self.tokens, 0, None
        self.buf, self.broken = b"", None
        self.resumes += 1

    def feed(self, chunk: bytes) -> bytes:
        """The whole events of ``chunk`` (after what was buffered) to relay, stitched after a resume; a trailing
        partial event is kept for the next chunk. Sets :attr:`broken` on a worker's 5xx error event (the events
        after it are dropped)."""
        buf = self.buf + chunk
        out: list[bytes] = []
        start = 0
        for m in _EVENT_END.finditer(buf):
            ev = buf[start:m.start()]
            start = m.end()
            kept = self._event(ev)
            if self.broken is not None:
                break
            if kept is not None:
                out.append(kept + b"\n\n")
        self.buf = buf[start:]
        return b"".join(out)

    def _event(self, ev: bytes) -> bytes | None:
        """One event (without its blank line) → the bytes to relay, or None to drop it."""
        if not ev.startswith(b"data:"):
            return ev  # a comment, or a field this stream does not use
        data = ev[5:].strip()
        if data == _DONE:
            if self.done:
                return None
            self.done = True
            return ev
        try:
            obj = msgspec.json.decode(data)
        except msgspec.DecodeError:
            return ev
        if not isinstance(obj, dict):
            return ev
        failure = event_failure(obj)
        if failure is not None:
            self.broken = f"the worker failed the stream: {failure}"
            return None
        if obj.get("error") is not None and "choices" not in obj:
            return ev
        stitch = self.resumes > 0 and self.id is not None
        keep = self._choices(obj.get("choices"), stitch)
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self._usage(usage, stitch)
            keep = True
        if self.id is None:
            self.id, self.created = obj.get("id"), obj.get("created")
        if not stitch:
            return ev
        if not keep:
            return None
        obj["id"], obj["created"] = self.id, self.created
        return b"data: " + _json(obj)

    def _choices(self, choices: Any, stitch: bool) -> bool:
        """Record what the choices deliver (rewritten for stitching); False when nothing is left to relay."""
        keep = False
        for c in choices if isinstance(choices, list) else ():
            if not isinstance(c, dict):
                continue
            if c.get("finish_reason") is not None:
                self.finished = keep = True
            if self.chat:
                delta = c.get("delta")
                if not isinstance(delta, dict):
                    continue
                if stitch and self.role_sent:
                    delta.pop("role", None)
                self.role_sent |= "role" in delta
                if delta.get("tool_calls"):
                    self.tool_calls = True
                if delta.get("reasoning_content") or delta.get("reasoning"):
                    self.reasoning = True
                piece = delta.get("content")
                keep |= bool(piece) or any(k != "content" for k in delta)
            else:
                piece = c.get("text")
                keep |= bool(piece) or c.get("logprobs") is not None
            if isinstance(piece, str) and piece:
                self.parts.append(piece)
                self.seg_chunks += 1
            if stitch:
                c["index"] = 0
        return keep

    def _usage(self, usage: dict[str, Any], stitch: bool) -> None:
        """Record a usage block (and make it add up across the seam when stitching: the original request's prompt
        and cached tokens, never the continuation's — whose prompt holds the delivered text, often cached)."""
        prompt, comp = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if not isinstance(prompt, int) or not isinstance(comp, int):
            return
        self.seg_usage = comp
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if not stitch:
            self.prompt_tokens = prompt
            if isinstance(cached, int):
                self.cached_tokens = cached
        else:
            p = self.prompt_tokens if self.prompt_tokens is not None else max(0, prompt - self.tokens_before)
            c = self.tokens_before + comp
            usage.update(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)
            if isinstance(details, dict) and isinstance(cached, int):
                # The original prompt is the continuation's prefix: of its cached tokens at most p are the original's.
                details["cached_tokens"] = self.cached_tokens if self.cached_tokens is not None else min(cached, p)
        self.usage_sent = True

    def why_not(self) -> str | None:
        """Why the broken stream cannot be resumed now, or None (then :func:`continuation` decides the rest)."""
        if self.refused is not None:
            return self.refused
        if self.tool_calls:
            return "tool_calls"
        if self.reasoning:
            return "reasoning"
        if self.resumes >= MAX_RESUMES:
            return "too_many_resumes"
        return None


class ResumableAttempt(Attempt):
    """An :class:`Attempt` of a tracked stream: relays whole events through its :class:`ResumeStream`, and leaves
    the stream open (``stream.broken`` set) instead of ending it with an error when the worker breaks off."""

    __slots__ = ("continuing", "stream")

    def __init__(self, up: Upstreams, ex: Exchange, worker: int, stream: ResumeStream) -> None:
        super().__init__(up, ex, worker)
        self.stream = stream
        self.continuing = False  # the client has the response head already: this attempt continues the stream

    @property
    def _tracking(self) -> bool:
        return self.stream.refused is None and self.is_sse and self.status == 200

    async def start_response(self, status: int, headers: list[tuple[bytes, bytes]]) -> bool:
        s = self.stream
        if s.broken_on >= 0:  # a worker took the continuation: now it is a resume
            resumed(self.up, self.ex, s.broken_on, self.worker)
            s.broken_on = -1
        self.continuing = bool(self.ex.status)
        if not self.continuing:  # nothing sent to the client yet: relay the head as usual
            return await super().start_response(status, headers)
        if status == 200 and s.want_usage and s.prompt_tokens is None and s.tokens_before:
            # The continuation's own prompt count includes the delivered text, re-tokenized: ask for the original's
            # (its prefill is under way meanwhile; the usage event comes at its end).
            s.prompt_tokens = await original_prompt_tokens(self.up.pool, self.worker, s.body, s.chat)
        self.status = status  # a resumed segment: the client has its head already
        self.outcome = Outcome.BROKEN
        return True

    async def no_head(self, kind: RouterErrorKind, message: str) -> None:
        s = self.stream
        if s.refused is None and (self.ex.status or kind is RouterErrorKind.UPSTREAM_FAILED):
            s.broken, s.t_break = message, time.perf_counter()  # resumed: nothing was generated for the client
            return
        await super().no_head(kind, message)

    async def relay_body(self) -> None:
        if not self._tracking:
            if self.continuing:
                await self._refused_by_worker()
                return
            await super().relay_body()
            return
        ex, conn, cfg, s = self.ex, self.conn, self.up.cfg, self.stream
        assert conn is not None
        send = ex.send
        try:
            async for chunk in conn.chunks(cfg.idle_timeout_s, cfg.sse_keepalive_s):
                if ex.gone:
                    break
                if not chunk:
                    if not s.buf:
                        await send({"type": "http.response.body", "body": _KEEPALIVE, "more_body": True})
                    continue
                out = s.feed(chunk)
                if out and ex.tenant is not None:  # the usage ledger meters (and may drop) whole events
                    out = ex.tenant.chunk(out)
                if out:
                    if self.t_first is None:
                        self.t_first = time.perf_counter()
                        if s.resumes:
                            self.up.metrics.resume_duration.observe(self.t_first - s.t_break)
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                if s.broken is not None:  # the worker's own 5xx error event
                    s.t_break, self.outcome = time.perf_counter(), Outcome.BROKEN
                    return
        except UpstreamError as e:
            await self._broken(e)
            return
        if ex.gone:
            self.outcome = Outcome.CLIENT_LEFT
            return
        if not s.done:  # the worker ended the body cleanly but without [DONE]: a broken stream all the same
            s.broken, s.t_break, self.outcome = "the worker ended the stream early", time.perf_counter(), Outcome.BROKEN
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        self.outcome = Outcome.of_status(self.status)

    async def _broken(self, e: UpstreamError) -> None:
        s = self.stream
        if self.ex.gone or not self.is_sse:
            await super()._broken(e)
            return
        if self.stalled:  # cut by the stall check (dplb.policy.stall): resumed like a worker that died
            self.outcome, why = Outcome.STALLED, self._stall_message()
            s.break_kind = RouterErrorKind.WORKER_STALLED
        else:
            self.outcome = Outcome.TIMEOUT if isinstance(e, UpstreamTimeout) else Outcome.BROKEN
            why = f"worker {self.worker} stopped mid-response: {e}"
        s.broken, s.t_break = why, time.perf_counter()
        if s.refused is None:
            log.warning("worker %d broke off stream %s after %d tokens (%s)", self.worker, self.ex.rid.decode(),
                        s.tokens, e)
        else:  # relayed untracked: what it delivered was not counted
            log.warning("worker %d broke off stream %s, which cannot be resumed (%s) (%s)", self.worker,
                        self.ex.rid.decode(), REFUSAL_PHRASES[s.refused], e)

    async def _refused_by_worker(self) -> None:
        """A resumed segment answered with an error (or not a stream): its message ends the client's stream."""
        s, conn = self.stream, self.conn
        assert conn is not None
        body = b""
        try:
            async for chunk in conn.chunks(self.up.cfg.idle_timeout_s):
                body = (body + chunk)[:_ERROR_READ]
        except UpstreamError:
            self.outcome = Outcome.BROKEN
        else:
            self.outcome = Outcome.of_status(self.status)
        try:
            msg = msgspec.json.decode(body)["error"]["message"]
        except (msgspec.DecodeError, KeyError, TypeError):
            msg = body[:200].decode("utf-8", "replace")
        s.broken = f"worker {self.worker} refused the continuation ({self.status}: {msg})"
        s.refused = "worker_refused"


async def end_stream(up: Upstreams, ex: Exchange, reason: str, message: str) -> None:
    """End a broken stream that is not resumed: count ``reason`` (a :data:`dplb.obs.metrics.RESUME_REFUSALS`
    label), trace it, send the error event naming it as a phrase (:data:`REFUSAL_PHRASES`; no ``[DONE]``)."""
    phrase = REFUSAL_PHRASES[reason]
    up.metrics.resume_refused.labels(reason).inc()
    ex.trace.resume_refused(reason)
    kind = ex.resume.break_kind if ex.resume is not None else RouterErrorKind.UPSTREAM_FAILED
    evt = b"data: " + error_body(kind, f"{message}; the stream was not resumed on another worker: {phrase}") + b"\n\n"
    log.warning("stream %s not resumed (%s; reason=%s): %s", ex.rid.decode(), phrase, reason, message)
    if not ex.gone:
        await ex.send({"type": "http.response.body", "body": evt, "more_body": True})
        ex.cut()


async def prepare(up: Upstreams, ex: Exchange) -> bytes | None:
    """After an attempt broke ``ex``'s tracked stream: the continuation body to send to another worker (counted by
    :func:`resumed` once a worker takes it), or None when the stream is done with (finished, refused: error event
    sent)."""
    s = ex.resume
    assert s is not None and s.broken is not None
    if ex.gone:
        return None
    if s.done:  # [DONE] was relayed: only the end of the body was lost
        await ex.send({"type": "http.response.body", "body": b"", "more_body": False})
        return None
    why = s.why_not()
    if why is None and s.finished and s.resumes < MAX_RESUMES:
        if not s.want_usage or s.usage_sent:  # the answer was complete: only [DONE] was lost
            s.done = True
            await ex.send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
            return None
        why = "finished"
    body: bytes | str = why if why is not None else continuation(s.body, s.chat, s.text, s.tokens,
                                                                   up.cfg.max_body_bytes)
    if isinstance(body, str):
        await end_stream(up, ex, body, s.broken)
        return None
    s.next_segment()
    return body


def resumed(up: Upstreams, ex: Exchange, broken: int, worker: int) -> None:
    """The continuation of ``ex``'s stream (its body in ``ex.body``), broken on worker ``broken``, was taken by
    ``worker`` (its response head arrived): logged, counted (``dplb_streams_resumed_total``) and traced. A
    continuation no worker takes — none ready, or the one picked unreachable — is not counted here but as refused
    (``no_worker``)."""
    s = ex.resume
    assert s is not None
    log.warning("resuming stream %s after %d tokens on worker %d (broken on worker %d)", ex.rid.decode(), s.tokens,
                worker, broken)
    up.metrics.resumed.inc()
    ex.trace.resumed(broken, s.tokens, len(ex.body))


__all__ = ["MAX_RESUMES", "REFUSAL_PHRASES", "ResumableAttempt", "ResumeStream", "continuation", "end_stream",
           "prepare", "refusal", "resumed", "track"]
