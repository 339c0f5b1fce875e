"""Model request bodies of the sim engine: what a ``/v1/chat/completions`` or ``/v1/completions`` body asks for,
validated like vLLM (docs/DESIGN.md §8).

Contract
- :func:`parse_request` turns a body into a :class:`ParsedRequest` (token ids per prompt, ``max_tokens`` capped by
  ``max_model_len``, ``n``, streaming and usage options, logprobs, ``priority``) or raises
  :class:`~dplb.worker.engines.sim.http.HTTPError`: 400 for a bad field (vLLM's message where it has one; a
  ``model`` that is not a string too), 404 for a model that is neither the served one nor a loaded adapter.
- ``priority`` is vLLM's field (an integer, default 0, lower runs first); it is read whatever the scheduling
  policy, and only the ``priority`` policy of :mod:`dplb.worker.engines.sim.scheduler` uses it (vLLM 0.32 with
  ``--scheduling-policy fcfs`` accepts and ignores it too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dplb.worker.engines.sim import logprobs, text
from dplb.worker.engines.sim.http import HTTPError, check_model, decode_object
from dplb.worker.engines.sim.prompts import completion_prompts, tokenize
from dplb.worker.engines.sim.scheduler import SimConfig
from dplb.worker.engines.sim.text import render_prompt


@dataclass(slots=True)
class ParsedRequest:
    """A validated model request: token ids per prompt, capped ``max_tokens`` per prompt, ``n`` choices each."""

    prompts: list[list[int]]
    max_tokens: list[int]
    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    logprobs: int | None = None  # alternatives per token (dplb.worker.engines.sim.logprobs); None: off
    leads: list[bool] | None = None  # per prompt: its answer's first token has a leading space (sim.text)
    priority: int = 0  # vLLM's request priority (lower runs first under --scheduling-policy priority)


def parse_request(body: bytes, chat: bool, cfg: SimConfig, served: frozenset[str] = frozenset()) -> ParsedRequest:
    """Validate a model request body like vLLM; raises :class:`HTTPError` (400; 404: model not served)."""
    data = decode_object(body)
    model = data.get("model")
    if model != cfg.model:
        check_model(model, served)

    def int_field(name: str, value: Any, lo: int, hi: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise HTTPError(400, f"{name} must be an integer between {lo} and {hi}, got {value!r}")
        return value

    n = 1 if data.get("n") is None else int_field("n", data["n"], 1, 1 << 16)
    priority = 0 if data.get("priority") is None else int_field("priority", data["priority"], -(1 << 63),
                                                                  (1 << 63) - 1)
    name, req_max = "max_tokens", data.get("max_tokens")
    if chat and data.get("max_completion_tokens") is not None:
        name, req_max = "max_completion_tokens", data["max_completion_tokens"]
    if req_max is not None:
        req_max = int_field(name, req_max, 1, cfg.max_model_len)
    stream = data.get("stream") or False
    opts = data.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(opts, dict):
        raise HTTPError(400, "'stream' must be a boolean and 'stream_options' an object")
    try:
        if chat:
            rendered, lead = render_prompt(data)
            prompts, leads = [tokenize(rendered)], [lead]
        else:
            prompts, leads = completion_prompts(data.get("prompt")), text.leads(data.get("prompt"))
    except ValueError as e:
        raise HTTPError(400, str(e)) from None
    for ids in prompts:
        if len(ids) >= cfg.max_model_len:
            raise HTTPError(400, f"This model's maximum context length is {cfg.max_model_len} tokens. However, "
                                 f"your request has {len(ids)} input tokens. Please reduce the length of the input.")
    max_tokens = [min(req_max or cfg.default_max_tokens, cfg.max_model_len - len(ids)) for ids in prompts]
    return ParsedRequest(prompts, max_tokens, n, stream, bool(opts.get("include_usage")),
                         bool(opts.get("include_usage") and opts.get("continuous_usage_stats")),
                         logprobs.requested(data, chat), leads, priority)


__all__ = ["ParsedRequest", "parse_request"]
