"""The original prompt's token count of a resumed stream, asked of the engine (``POST /tokenize``; docs/DESIGN.md §14).

Why: a resumed stream's continuation (:func:`dplb.router.resume.continuation`) carries the text already delivered
inside its prompt, so the worker that finishes it reports prompt_tokens = original prompt + that text as *its*
tokenizer splits it (plus, for chat, the template's continuation markers). The router has no tokenizer, and
"resumed prompt − tokens delivered" is exact only when the delivered text re-tokenizes into as many tokens as were
generated (the sim engine: one word, one token). On vLLM it does not (the tiny model: 145 generated tokens came back
as 173 prompt tokens, so the client was told 49 prompt tokens for a 21-token prompt).

Contract
- :func:`tokenize_body` is the ``/tokenize`` request that renders the original request's prompt as the engine does
  for it: chat — ``model``, ``messages``, ``add_generation_prompt``, ``add_special_tokens``, ``chat_template``,
  ``chat_template_kwargs`` (with the request's ``documents`` / ``reasoning_effort`` / the ``enable_thinking`` that
  implies, which vLLM's chat completions hand the chat template over the request's own kwargs), ``tools``,
  ``mm_processor_kwargs``, ``media_io_kwargs`` (vLLM's ``TokenizeChatRequest`` fields); completions — ``model``,
  ``prompt``, ``add_special_tokens`` (``TokenizeCompletionRequest``). Fields the original did not set are left out
  (the engine's defaults are the same for both requests).
- :func:`original_prompt_tokens` sends it to one worker (the one that takes the continuation: the same model and
  tokenizer) and returns vLLM's ``count`` (capped at a positive ``truncate_prompt_tokens``, as the engine truncates),
  or None when the worker cannot say (transport error, a non-200 answer, no ``count``); the caller then keeps its
  estimate. Each phase waits at most :data:`TIMEOUT_S`.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from dplb.errors import UpstreamError
from dplb.router.upstream_pool import UpstreamPool, fetch

log = logging.getLogger("dplb.router.resume")
TIMEOUT_S = 5.0  # per phase (connect, head, body) of the /tokenize call: tokenizing never waits for the engine
_CHAT_KEYS = ("model", "messages", "add_generation_prompt", "add_special_tokens", "chat_template",
              "chat_template_kwargs", "tools", "mm_processor_kwargs", "media_io_kwargs")
_COMPLETION_KEYS = ("model", "prompt", "add_special_tokens")
_TEMPLATE_ARGS = ("documents", "reasoning_effort")  # request fields vLLM passes to the chat template


class _Count(msgspec.Struct):
    count: int


_decode_count = msgspec.json.Decoder(_Count).decode


def tokenize_body(body: bytes, chat: bool) -> bytes:
    """The ``/tokenize`` request body that counts the prompt of request ``body`` (a chat or completions JSON
    object). Raises ``msgspec.DecodeError`` for a body that is not JSON."""
    obj: Any = msgspec.json.decode(body)
    out = {k: obj[k] for k in (_CHAT_KEYS if chat else _COMPLETION_KEYS) if obj.get(k) is not None}
    if chat:
        user = out.get("chat_template_kwargs")
        user = user if isinstance(user, dict) else {}
        extra = {k: obj[k] for k in _TEMPLATE_ARGS if obj.get(k) is not None}
        if "reasoning_effort" in extra and "enable_thinking" not in user:
            extra["enable_thinking"] = extra["reasoning_effort"] != "none"
        if extra:  # vLLM's ChatCompletionRequest.build_chat_params: these override the request's own kwargs
            out["chat_template_kwargs"] = {**user, **extra}
    return msgspec.json.encode(out)


async def original_prompt_tokens(pool: UpstreamPool, worker: int, body: bytes, chat: bool) -> int | None:
    """The prompt tokens of request ``body`` as ``worker``'s engine counts them, or None (module docstring)."""
    try:
        status, answer = await fetch(pool, worker, "/tokenize", TIMEOUT_S, tokenize_body(body, chat))
        if status != 200:
            raise UpstreamError(f"HTTP {status}: {answer[:200].decode('utf-8', 'replace')}")
        count = _decode_count(answer).count
        limit = msgspec.json.decode(body).get("truncate_prompt_tokens")
    except (UpstreamError, msgspec.DecodeError, msgspec.ValidationError, AttributeError) as e:
        log.warning("worker %d could not count the resumed stream's original prompt (%s): its usage estimates the "
                    "prompt as the continuation's prompt minus the tokens delivered", worker, e)
        return None
    if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
        count = min(count, limit)
    return count


__all__ = ["TIMEOUT_S", "original_prompt_tokens", "tokenize_body"]
