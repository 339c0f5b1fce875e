"""Streams that survive their worker (``--resume-streams``, dplb/router/resume.py): the eligibility table, the
continuation body, the SSE stitcher, and the fault test with a real router, real sim workers and real SIGKILLs."""

from __future__ import annotations

import asyncio
import json
import random
import re
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
import pytest

from dplb.obs.metrics import RESUME_REFUSALS
from dplb.router.resume import REFUSAL_PHRASES, ResumeStream, _fields, continuation, refusal
from dplb.state.shm import Lifecycle
from dplb.worker.engines.sim.prompts import render_chat, tokenize
from dplb.worker.engines.sim.text import TextGen, leads
from tests.cluster import Cluster, cluster, post, wait_for, worker_get

SIM = ["--sim-decode-step-s", "0.04", "--sim-max-num-seqs", "64"]
NOT_RESUMED = "the stream was not resumed on another worker: "
CHAT, COMP = "/v1/chat/completions", "/v1/completions"


# ---- eligibility and the continuation body (pure) ------------------------------------------------------------------
@pytest.mark.parametrize(("chat", "body", "reason"), [
    (True, {"messages": []}, None),
    (True, {"n": 1, "logprobs": False, "response_format": {"type": "text"}, "tools": [{"x": 1}],
            "tool_choice": "none"}, None),
    (True, {"n": 2}, "n"),
    (False, {"prompt": "p", "best_of": 3}, "n"),
    (True, {"logprobs": True, "top_logprobs": 2}, "logprobs"),
    (False, {"prompt": "p", "logprobs": 0}, "logprobs"),
    (False, {"prompt": "p", "prompt_logprobs": 1}, "logprobs"),
    (True, {"response_format": {"type": "json_schema", "json_schema": {}}}, "structured_output"),
    (True, {"response_format": {"type": "json_object"}}, "structured_output"),
    (False, {"prompt": "p", "guided_regex": "a+"}, "structured_output"),
    (True, {"structured_outputs": {"choice": ["a"]}}, "structured_output"),
    (True, {"tools": [{"type": "function"}]}, "tools"),
    (False, {"prompt": "p", "echo": True}, "echo"),
    (False, {"prompt": ["a", "b"]}, "prompt_not_text"),
    (False, {"prompt": [1, 2, 3]}, "prompt_not_text"),
    (True, {"continue_final_message": True}, "continued_message"),
])
def test_refusal_table(chat: bool, body: dict[str, Any], reason: str | None) -> None:
    assert refusal(chat, _fields.decode(json.dumps(body).encode())) == reason


def test_every_refusal_label_has_a_phrase_a_client_can_read() -> None:
    """Regression: the error event ended ``not resumed on another worker: n`` (the metric label); each label now
    has a phrase, and no phrase is a bare label."""
    assert REFUSAL_PHRASES.keys() == set(RESUME_REFUSALS)
    assert REFUSAL_PHRASES["n"] == "n > 1 or best_of > 1"
    assert all(" " in p and p not in RESUME_REFUSALS for p in REFUSAL_PHRASES.values()), REFUSAL_PHRASES


def test_continuation_body_table() -> None:
    chat = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10,
                       "max_completion_tokens": 12, "min_tokens": 3, "stream": True, "extra": [1]}).encode()
    out = continuation(chat, True, "a b c", 3, 1 << 20)
    assert isinstance(out, bytes)
    obj = json.loads(out)
    assert obj["messages"][-1] == {"role": "assistant", "content": "a b c"} and len(obj["messages"]) == 2
    assert (obj["continue_final_message"], obj["add_generation_prompt"]) == (True, False)
    assert (obj["max_tokens"], obj["max_completion_tokens"], obj["min_tokens"], obj["extra"]) == (7, 9, 0, [1])
    comp = json.dumps({"prompt": "once", "max_tokens": 5, "stream": True}).encode()
    assert json.loads(continuation(comp, False, " upon a", 2, 1 << 20))["prompt"] == "once upon a"
    assert continuation(comp, False, " a b c d e", 5, 1 << 20) == "max_tokens"  # nothing left to generate
    grown = continuation(comp, False, " a", 1, 1 << 20)
    assert isinstance(grown, bytes) and continuation(comp, False, " a", 1, len(grown) - 1) == "body_too_large"
    assert continuation(comp, False, "", 0, 10) is comp  # nothing delivered: the body as it was


def _ev(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_stitcher_relays_whole_events_and_stitches_the_resumed_answer() -> None:
    s = ResumeStream(True, b"{}", None, True)
    first = [_ev({"id": "A", "created": 1, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
             _ev({"id": "A", "created": 1, "choices": [{"index": 0, "delta": {"content": "one"}}]}),
             _ev({"id": "A", "created": 1, "choices": [{"index": 0, "delta": {"content": " two"}}]})]
    raw = b"".join(first)
    cut = raw + b'data: {"id": "A", "choi'  # the worker dies mid-event
    assert s.feed(cut[:10]) == b"" and s.feed(cut[10:]) == raw  # whole events only; the partial one is held
    assert (s.text, s.tokens, s.id) == ("one two", 2, "A")
    s.broken = "killed"
    s.next_segment()
    resumed = [_ev({"id": "B", "created": 9, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
               _ev({"id": "B", "created": 9, "choices": [{"index": 0, "delta": {"content": " three"},
                                                          "finish_reason": "length"}]}),
               _ev({"id": "B", "created": 9, "choices": [],
                    "usage": {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8}}),
               b"data: [DONE]\n\n"]
    out = s.feed(b"".join(resumed)).split(b"\n\n")
    assert out[-1] == b"" and out[-2] == b"data: [DONE]" and len(out) == 4  # role chunk dropped
    a, u = msgspec.json.decode(out[0][6:]), msgspec.json.decode(out[1][6:])
    assert (a["id"], a["created"], a["choices"][0]["delta"]) == ("A", 1, {"content": " three"})
    assert u["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}  # 7 − 2 delivered
    assert s.text == "one two three" and s.done and s.feed(b"data: [DONE]\n\n") == b""  # one [DONE] only


def test_stitched_usage_reports_the_original_cached_tokens_never_more_than_the_prompt() -> None:
    """The continuation's prompt holds the delivered text, which its worker often has cached: the client's usage
    must show the original request's cached tokens (≤ its prompt_tokens), not the continuation's."""
    def stream(seen: dict | None) -> dict:
        s = ResumeStream(False, b"{}", None, True)
        events = [_ev({"id": "A", "created": 1, "choices": [{"index": 0, "text": t}]}) for t in "abc"]
        if seen is not None:  # continuous usage: the original's own figures are seen before the break
            events.append(_ev({"id": "A", "created": 1, "choices": [], "usage": seen}))
        s.feed(b"".join(events))
        s.broken = "killed"
        s.next_segment()
        out = s.feed(_ev({"id": "B", "created": 9, "choices": [],
                          "usage": {"prompt_tokens": 50, "completion_tokens": 2, "total_tokens": 52,
                                    "prompt_tokens_details": {"cached_tokens": 48}}}))
        return msgspec.json.decode(out.split(b"\n\n")[0][6:])["usage"]
    u = stream(None)
    assert (u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]) == (47, 47)  # 50 − 3 delivered
    u = stream({"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5,
                "prompt_tokens_details": {"cached_tokens": 0}})
    assert u == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7,
                 "prompt_tokens_details": {"cached_tokens": 0}}


def test_stitcher_treats_a_5xx_error_event_as_a_break_and_passes_a_4xx_one() -> None:
    s = ResumeStream(False, b"{}", None, False)
    e4 = _ev({"error": {"message": "bad", "code": 400}})
    assert s.feed(e4) == e4 and s.broken is None
    ok = _ev({"id": "c", "choices": [{"index": 0, "text": " x"}]})
    assert s.feed(ok + _ev({"error": {"message": "engine dead", "code": 500}}) + ok) == ok
    assert s.broken is not None and "engine dead" in s.broken and s.tokens == 1


# ---- the fault test ------------------------------------------------------------------------------------------------
@dataclass
class Stream:
    """One client stream as the client saw it."""

    path: str
    body: dict[str, Any]
    reason: str | None = None  # the refusal expected if it breaks (None: eligible)
    status: int = 0
    events: list[Any] = field(default_factory=list)
    done: int = 0
    error: str | None = None
    code: str | None = None
    after_done: bool = False
    cut: bool = False  # the response ended without its terminating chunk

    @property
    def text(self) -> str:
        key = "delta" if self.path == CHAT else None
        out = []
        for e in self.events:
            for c in e.get("choices") or ():
                piece = (c.get("delta") or {}).get("content") if key else c.get("text")
                out.append(piece or "")
        return "".join(out)


async def _run(client: httpx.AsyncClient, st: Stream) -> Stream:
    try:
        async with client.stream("POST", st.path, json=st.body, timeout=90) as r:
            st.status = r.status_code
            async for line in r.aiter_lines():
                _line(st, line)
    except httpx.RemoteProtocolError:  # the abnormal close after an error event
        st.cut = True
    return st


def _line(st: Stream, line: str) -> None:
    if not line.startswith("data: "):
        return
    if st.done:
        st.after_done = True
    data = line[6:]
    if data == "[DONE]":
        st.done += 1
        return
    obj = json.loads(data)
    if "error" in obj:
        st.error, st.code = obj["error"]["message"], obj["error"].get("code")
    else:
        st.events.append(obj)


def _expected(st: Stream) -> tuple[str, int]:
    """(the answer the sim gives this request, its prompt tokens) from the sim's own text function."""
    if st.path == CHAT:
        ids, lead = tokenize(render_chat(st.body["messages"])), False
    else:
        ids, lead = tokenize(st.body["prompt"]), leads(st.body["prompt"])[0]
    return TextGen(0, ids, 0, lead).text(st.body["max_tokens"]), len(ids)


_REFUSED = {
    "n": (CHAT, {"n": 2}), "logprobs": (CHAT, {"logprobs": True}),
    "structured_output": (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                           "schema": {}}}}),
    "tools": (CHAT, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
    "echo": (COMP, {"echo": True}),
}


def _body(path: str, rng: random.Random, tag: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    b: dict[str, Any] = {"model": "dplb-sim", "stream": True, "max_tokens": rng.randint(20, 40),
                         "stream_options": {"include_usage": True}, **(extra or {})}
    if path == CHAT:
        b["messages"] = [{"role": "user", "content": f"story {tag}"}]
    else:
        b["prompt"] = f"once upon {tag}"
    return b


def _ready(c: Cluster, k: int) -> bool:
    """Worker k's current process is alive and ready (fresh heartbeat)."""
    seg = c.segment
    assert seg is not None
    s = seg.read(k)
    p = c.workers[k]
    return s.lifecycle == Lifecycle.READY and not s.is_stale(seg.state_interval_ms) and p.poll() is None and \
        s.pid == p.pid


async def _storm(c: Cluster, kills: int, clients: int) -> tuple[list[Stream], float]:
    """``clients`` looping streams (2 per refused kind, the rest eligible chat/completions) while ``kills`` ready
    workers are SIGKILLed one at a time (at most 2 down) and restarted. Returns the streams and the storm's length."""
    rng = random.Random(7)
    stop = asyncio.Event()
    out: list[Stream] = []
    kinds = [k for k in _REFUSED for _ in range(2)]

    async def client(i: int, http: httpx.AsyncClient) -> None:
        j = 0
        while not stop.is_set():
            tag = f"{i}-{j}"
            if i < len(kinds):
                path, extra = _REFUSED[kinds[i]]
                st = Stream(path, _body(path, rng, tag, extra if path == CHAT else {**extra}), kinds[i])
            else:
                path = CHAT if i % 2 else COMP
                st = Stream(path, _body(path, rng, tag))
            out.append(await _run(http, st))
            j += 1

    async def killer() -> None:
        n = c.num_workers
        for i in range(kills):
            await asyncio.sleep(1.5)  # a stream (1–2 s here, more on a loaded box) meets few kills: MAX_RESUMES is 3
            while True:
                ready = [k for k in range(n) if _ready(c, k)]
                if ready and n - len(ready) < 2:
                    break
                await asyncio.sleep(0.1)
            k = ready[i % len(ready)]
            await asyncio.to_thread(c.kill_worker, k, signal.SIGKILL)
            c.start_worker(k, *SIM, wait=False)
        stop.set()

    t0 = time.monotonic()
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(base_url=c.url, limits=limits) as http:
        await asyncio.gather(killer(), *(client(i, http) for i in range(clients)))
    return out, time.monotonic() - t0


def test_20_sigkills_under_32_streams_every_eligible_stream_completes_seamlessly(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """20 worker SIGKILLs under 32 concurrent streams with --resume-streams: every eligible stream ends with one
    [DONE], its text is exactly the sim's answer (the delivered and resumed parts joined: no duplicated or lost
    token at the seam), ids and usage add up; every refused kind that broke ends with an error event naming why."""
    with cluster(str(tmp_path), 4, worker_args={k: SIM for k in range(4)}, router_args=["--resume-streams"]) as c:
        streams, took = asyncio.run(_storm(c, kills=20, clients=32))
        resumed = c.metric("dplb_streams_resumed_total") or 0
        lat_sum = c.metric("dplb_stream_resume_duration_seconds_sum") or 0
        lat_n = c.metric("dplb_stream_resume_duration_seconds_count") or 0
        refused = {r: c.metric("dplb_stream_resume_refused_total", {"reason": r}) or 0 for r in _REFUSED}
    eligible = [s for s in streams if s.reason is None]
    bad = []
    for st in eligible:
        want, prompt = _expected(st)
        ids = {e["id"] for e in st.events}
        # cached tokens depend on which workers served it: not compared, but never more than the prompt
        usage = [{k: v for k, v in e["usage"].items() if k != "prompt_tokens_details"} for e in st.events
                 if e.get("usage")]
        cached = [(e["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) for e in st.events
                  if e.get("usage")]
        n = st.body["max_tokens"]
        ok = (st.status == 200 and st.done == 1 and not st.after_done and st.error is None and st.text == want
              and len(ids) == 1 and all(c["index"] == 0 for e in st.events for c in e["choices"])
              and usage == [{"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}]
              and all(x <= prompt for x in cached))
        if not ok:
            bad.append((st.path, st.body, st.status, st.done, st.error, st.text, want, usage, cached))
    assert not bad, (len(bad), bad[:3], c.tail())
    broke = {r: [s for s in streams if s.reason == r and s.error is not None] for r in _REFUSED}
    for r, ss in broke.items():
        assert ss, f"no {r} stream was on a killed worker"
        assert all((s.error or "").endswith(NOT_RESUMED + REFUSAL_PHRASES[r]) and s.done == 0 for s in ss), \
            (r, [s.error for s in ss])
        assert refused[r] >= len(ss)
    # A refused stream whose worker died before its response head got the router's 502 (as without the flag).
    early = [s for s in streams if s.reason is not None and s.status != 200]
    assert all(s.status == 502 and not s.events for s in early), [(s.status, s.events[:1]) for s in early]
    clean = [s for s in streams if s.reason is not None and s.error is None and s.status == 200]
    assert all(s.done == 1 for s in clean), [(s.reason, s.done, s.cut) for s in clean if s.done != 1]
    assert resumed >= 20 and lat_n >= 20
    print(f"\nstorm {took:.1f} s: {len(eligible)} eligible streams all seamless, {int(resumed)} resumes, mean resume "
          f"latency {1000 * lat_sum / max(lat_n, 1):.0f} ms over {int(lat_n)}; refused by reason "
          f"{ {r: len(v) for r, v in broke.items()} }")


def test_without_the_flag_a_killed_worker_ends_the_stream_with_an_error_event(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Off by default: the stream of a SIGKILLed worker ends with the error event as before, no [DONE], nothing
    resumed."""
    with cluster(str(tmp_path), 2, worker_args={k: SIM for k in range(2)}) as c:
        async def main() -> Stream:
            st = Stream(CHAT, _body(CHAT, random.Random(1), "x", {"max_tokens": 200}))
            try:
                async with httpx.AsyncClient(base_url=c.url) as http, \
                        http.stream("POST", CHAT, json=st.body, timeout=30) as r:
                    worker = int(r.headers["x-sg-worker-id"])
                    async for line in r.aiter_lines():
                        _line(st, line)
                        if len(st.events) == 3 and c.workers[worker].poll() is None:
                            await asyncio.to_thread(c.kill_worker, worker)
            except httpx.RemoteProtocolError:
                st.cut = True
            return st

        st = asyncio.run(main())
        assert st.error is not None and "stopped mid-response" in st.error and NOT_RESUMED not in st.error
        assert st.done == 0 and st.cut and c.metric("dplb_streams_resumed_total") == 0


def test_a_stream_no_worker_can_take_is_refused_not_counted_as_resumed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Regression: with one worker, a SIGKILLed stream had no worker to continue on, yet it was logged as "resuming
    stream …" and counted in dplb_streams_resumed_total as well as in refused{no_worker}. Now it counts only as
    refused, and its error event says why."""
    with cluster(str(tmp_path), 1, worker_args={0: SIM}, router_args=["--resume-streams"]) as c:
        async def main() -> Stream:
            st = Stream(CHAT, _body(CHAT, random.Random(2), "x", {"max_tokens": 200}))
            try:
                async with httpx.AsyncClient(base_url=c.url) as http, \
                        http.stream("POST", CHAT, json=st.body, timeout=30) as r:
                    async for line in r.aiter_lines():
                        _line(st, line)
                        if len(st.events) == 3 and c.workers[0].poll() is None:
                            await asyncio.to_thread(c.kill_worker, 0)
            except httpx.RemoteProtocolError:
                st.cut = True
            return st

        st = asyncio.run(main())
        assert st.error is not None and st.error.endswith(NOT_RESUMED + "no other worker could take it") and st.done == 0, st.error
        assert c.metric("dplb_streams_resumed_total") == 0
        assert c.metric("dplb_stream_resume_refused_total", {"reason": "no_worker"}) == 1
        assert "resuming stream" not in c.router_log()


def test_a_stream_on_a_stalled_worker_is_resumed_on_another(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The stall check and --resume-streams together: worker 0's engine stalls for good after its first 2 answers
    (its process and collector live on); the router cuts its open streams after --stall-after and, the flag being
    on, resumes them on worker 1 instead of ending them with the worker_stalled error event. Every stream ends with
    one [DONE] and exactly the sim's answer."""
    stall = {0: [*SIM, "--sim-stall-after", "2", "--sim-stall-for-s", "0"], 1: SIM}
    with cluster(str(tmp_path), 2, worker_args=stall, router_args=["--resume-streams", "--stall-after", "1"]) as c:
        async def main() -> list[Stream]:
            rng = random.Random(7)
            streams = [Stream(CHAT if i % 2 else COMP, _body(CHAT if i % 2 else COMP, rng, f"s{i}",
                                                              {"max_tokens": 60})) for i in range(8)]
            streams += [Stream(CHAT, _body(CHAT, rng, f"r{i}", {"max_tokens": 60, "logprobs": True}), "logprobs")
                        for i in range(4)]
            async with httpx.AsyncClient(base_url=c.url) as http:
                return list(await asyncio.gather(*(_run(http, st) for st in streams)))

        streams = asyncio.run(main())
        resumed = c.metric("dplb_streams_resumed_total") or 0
        stalls = c.metric("dplb_worker_stalls_total", {"worker": "0"}) or 0
        log = c.router_log()
    # The log says where each stream went and where it broke (not the break's reason, reset by then: "(None)").
    assert re.search(r"resuming stream \S+ after \d+ tokens on worker 1 \(broken on worker 0\)", log), log[-2000:]
    assert "(None)" not in log
    for st in streams:
        if st.reason is not None and st.error is not None:  # refused and cut by the stall: says so
            assert st.code == "worker_stalled" and st.error.endswith(NOT_RESUMED + REFUSAL_PHRASES["logprobs"]) and st.done == 0, st.error
            continue
        want, _ = _expected(st)
        assert st.status == 200 and st.done == 1 and st.error is None and st.text == want, (st.path, st.error)
    assert stalls >= 1 and resumed >= 1, (stalls, resumed)


def test_with_tenants_a_resumed_stream_is_metered_and_keeps_the_events_the_client_asked_for(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """--tenants asks the engine for a usage event the client did not ask for and takes it out of the stream;
    --resume-streams relays whole events through its stitcher. Together: a stream broken by a SIGKILL and resumed
    still reaches the client without a usage-only event, with one [DONE] and the sim's exact answer, and the ledger
    counts the tokens of both parts."""
    from dplb.tenants import hash_key

    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[tenants.chat]\napi_key_sha256 = ["{hash_key("k")}"]\n')
    with cluster(str(tmp_path), 2, worker_args={k: SIM for k in range(2)},
                 router_args=["--resume-streams", "--tenants", str(tenants)]) as c:
        async def main() -> tuple[Stream, list[str]]:
            body = _body(CHAT, random.Random(3), "t", {"max_tokens": 40})
            del body["stream_options"]
            st, raw = Stream(CHAT, body), []
            async with httpx.AsyncClient(base_url=c.url) as http, \
                    http.stream("POST", CHAT, json=body, timeout=60, headers={"authorization": "Bearer k"}) as r:
                st.status, worker = r.status_code, int(r.headers["x-sg-worker-id"])
                async for line in r.aiter_lines():
                    raw.append(line)
                    _line(st, line)
                    if len(st.events) == 5 and c.workers[worker].poll() is None:
                        await asyncio.to_thread(c.kill_worker, worker)
            return st, raw

        st, raw = asyncio.run(main())
        resumed = c.metric("dplb_streams_resumed_total") or 0
        completion = wait_for(lambda: c.metric("dplb_tenant_tokens_total", {"kind": "completion", "tenant": "chat"}),
                              5, "the ledger's count (written when the request ends)")
        prompt = c.metric("dplb_tenant_tokens_total", {"kind": "prompt", "tenant": "chat"}) or 0
        cached = c.metric("dplb_tenant_tokens_total", {"kind": "cached", "tenant": "chat"}) or 0
    want, _ = _expected(st)
    assert resumed == 1 and st.status == 200 and st.done == 1 and st.error is None and st.text == want
    assert not [e for e in st.events if e.get("usage") or not e.get("choices")], raw[-4:]
    assert completion == 40
    assert prompt > 0 and cached <= prompt, (prompt, cached)  # the original request's, not the continuation's


def test_tokenize_body_renders_the_original_prompt_as_the_engine_does() -> None:
    """The /tokenize request that counts a resumed stream's original prompt (dplb/router/prompt_count.py): the
    prompt-rendering fields only, ``documents`` / ``reasoning_effort`` folded into the chat template's kwargs over
    the request's own (vLLM's chat completions do the same)."""
    from dplb.router.prompt_count import tokenize_body

    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0, "chat_template_kwargs": {"x": 1,
                                                                                                "enable_thinking": True},
            "reasoning_effort": "none", "documents": [{"t": "d"}], "add_generation_prompt": True, "tools": None}
    assert json.loads(tokenize_body(json.dumps(chat).encode(), True)) == {
        "model": "m", "messages": chat["messages"], "add_generation_prompt": True,
        "chat_template_kwargs": {"x": 1, "enable_thinking": True, "documents": [{"t": "d"}],
                                 "reasoning_effort": "none"}}
    plain = {"model": "m", "messages": [], "reasoning_effort": "low"}
    assert json.loads(tokenize_body(json.dumps(plain).encode(), True))["chat_template_kwargs"] == {
        "reasoning_effort": "low", "enable_thinking": True}
    comp = {"model": "m", "prompt": "once", "max_tokens": 3, "echo": False, "add_special_tokens": False}
    assert json.loads(tokenize_body(json.dumps(comp).encode(), False)) == {"model": "m", "prompt": "once",
                                                                           "add_special_tokens": False}


def test_the_sim_tokenizes_a_chat_as_its_chat_completions_count_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """vLLM's /tokenize chat form (``messages``) counts what chat completions would: the sim does too, so the
    router's count of a resumed stream's original prompt is exercised on the sim."""
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "tell me a story"}]
    with cluster(str(tmp_path), 1, worker_args={0: SIM}) as c:
        counted = post(c, "/tokenize", {"model": "dplb-sim", "messages": msgs})
        usage = post(c, CHAT, {"model": "dplb-sim", "messages": msgs, "max_tokens": 2}).json()["usage"]
        bad = post(c, "/tokenize", {"model": "dplb-sim", "messages": [{"content": "no role"}]})
    assert counted.status_code == 200 and counted.json()["count"] == usage["prompt_tokens"] == len(
        tokenize(render_chat(msgs))), counted.text
    assert bad.status_code == 400


def _kill_after(c: Cluster, st: Stream, events: int) -> Any:
    """Stream ``st`` through the router of ``c``; SIGKILL the serving worker after ``events`` data events. Returns
    (the stream as the client saw it, the worker killed)."""
    async def main() -> tuple[Stream, int]:
        worker = -1
        try:
            async with httpx.AsyncClient(base_url=c.url) as http, \
                    http.stream("POST", st.path, json=st.body, timeout=60) as r:
                st.status, worker = r.status_code, int(r.headers["x-sg-worker-id"])
                async for line in r.aiter_lines():
                    _line(st, line)
                    if len(st.events) == events and c.workers[worker].poll() is None:
                        await asyncio.to_thread(c.kill_worker, worker)
        except httpx.RemoteProtocolError:
            st.cut = True
        return st, worker

    return asyncio.run(main())


def test_a_resumed_stream_asks_the_continuations_worker_to_count_the_original_prompt(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The continuation's prompt holds the delivered text re-tokenized, so its own prompt_tokens minus the tokens
    delivered is not the original prompt on a real tokenizer (vLLM: 49 reported for 21). The router asks the
    worker that takes the continuation to count the original request's prompt (``POST /tokenize``) and reports
    that; the sim records the call. A stream whose client wants no usage is resumed without it."""
    with cluster(str(tmp_path), 3, worker_args={k: SIM for k in range(3)}, router_args=["--resume-streams"]) as c:
        st, first = _kill_after(c, Stream(CHAT, _body(CHAT, random.Random(5), "u", {"max_tokens": 60})), 6)
        quiet_body = _body(COMP, random.Random(6), "v", {"max_tokens": 60})
        del quiet_body["stream_options"]
        quiet, second = _kill_after(c, Stream(COMP, quiet_body), 6)
        live = [k for k in range(3) if k not in (first, second)]
        calls = [r for k in live for r in worker_get(c.sock(k), "/debug/requests").json() if r["path"] == "/tokenize"]
        resumed = c.metric("dplb_streams_resumed_total")
    want, prompt = _expected(st)
    assert st.done == 1 and st.error is None and st.text == want, (st.error, st.text)
    usage = [e["usage"] for e in st.events if e.get("usage")]
    assert [{k: u[k] for k in ("prompt_tokens", "completion_tokens")} for u in usage] == [
        {"prompt_tokens": prompt, "completion_tokens": 60}]
    assert quiet.done == 1 and quiet.error is None and quiet.text == _expected(quiet)[0]
    assert not [e for e in quiet.events if e.get("usage")]
    assert resumed == 2 and len(calls) == 1 and calls[0]["status"] == 200, (resumed, calls)


def test_a_broken_stream_that_cannot_be_resumed_is_logged_with_its_reason_not_0_tokens(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Regression: an n=2 stream (relayed untracked) whose worker died was logged "broke off stream … after 0
    tokens" although it had delivered events to both choices; the log now says it cannot be resumed and why."""
    with cluster(str(tmp_path), 2, worker_args={k: SIM for k in range(2)}, router_args=["--resume-streams"]) as c:
        st, _ = _kill_after(c, Stream(CHAT, _body(CHAT, random.Random(8), "n", {"max_tokens": 200, "n": 2}), "n"), 10)
        log = c.router_log()
    assert st.error is not None and st.error.endswith(NOT_RESUMED + "n > 1 or best_of > 1"), st.error
    assert re.search(r"broke off stream \S+, which cannot be resumed \(n > 1 or best_of > 1\)", log), log[-2000:]
    assert "after 0 tokens" not in log


def test_when_every_worker_died_the_stream_is_refused_not_logged_as_resumed_on_a_dead_one(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Regression: with both workers SIGKILLed one after the other, the second continuation was logged "resuming
    stream … on worker A (broken on worker B)" — A being the worker the stream had first broken on, dead — and
    counted as resumed, before the stream ended ``not resumed (no_worker)``. A resume is now logged and counted
    when a worker takes the continuation (its response head)."""
    with cluster(str(tmp_path), 2, worker_args={k: SIM for k in range(2)}, router_args=["--resume-streams"]) as c:
        async def main() -> tuple[Stream, list[int]]:
            st = Stream(CHAT, _body(CHAT, random.Random(9), "d", {"max_tokens": 300}))
            killed: list[int] = []
            try:
                async with httpx.AsyncClient(base_url=c.url) as http, \
                        http.stream("POST", CHAT, json=st.body, timeout=60) as r:
                    first = int(r.headers["x-sg-worker-id"])
                    async for line in r.aiter_lines():
                        _line(st, line)
                        if len(st.events) in (3, 8) and len(killed) < (1 if len(st.events) == 3 else 2):
                            k = first if not killed else 1 - first
                            await asyncio.to_thread(c.kill_worker, k)
                            killed.append(k)
            except httpx.RemoteProtocolError:
                st.cut = True
            return st, killed

        st, killed = asyncio.run(main())
        log = c.router_log()
        resumed = c.metric("dplb_streams_resumed_total")
        no_worker = c.metric("dplb_stream_resume_refused_total", {"reason": "no_worker"})
    assert killed == sorted(killed, key=lambda k: k != killed[0]) and len(killed) == 2, killed
    assert st.error is not None and st.error.endswith(NOT_RESUMED + "no other worker could take it") and st.done == 0, st.error
    lines = re.findall(r"resuming stream \S+ after \d+ tokens on worker (\d) \(broken on worker (\d)\)", log)
    assert lines == [(str(killed[1]), str(killed[0]))], lines
    assert (resumed, no_worker) == (1, 1)
