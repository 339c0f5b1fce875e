"""Log-probabilities of the sim engine's output tokens, in vLLM's OpenAI shapes (chat and completions, streamed
or not).

Contract
- Requests: chat ``logprobs: true`` (``top_logprobs`` 0..:data:`MAX_LOGPROBS`, which needs ``logprobs: true``);
  completions ``logprobs: K`` (0..:data:`MAX_LOGPROBS`). :func:`requested` validates them (400
  :class:`~dplb.worker.engines.sim.http.HTTPError` otherwise, vLLM's rules) and returns K, or None when off.
- Values are plausible, not meaningful: the sampled token's logprob is ≤ 0 (−Exp(4), mean −0.25) and the highest
  of its step; the alternatives are other vocabulary words with lower logprobs, in descending order. They are
  deterministic per sequence (their own PRNG, seeded like the text, so asking for logprobs never changes the text).
- Shapes: chat ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [K × {"token", "logprob",
  "bytes"}]}]}``; completions ``{"tokens", "token_logprobs", "text_offset", "top_logprobs": [{token: logprob}]}``
  with K + 1 entries per step (the sampled token and K others, as vLLM). A streamed chunk carries its own tokens.
"""

from __future__ import annotations

import random
import re
from typing import Any

from dplb.worker.engines.sim.http import HTTPError
from dplb.worker.engines.sim.scheduler import WORDS

_TOKEN = re.compile(r" ?[^ ]+")
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


def requested(data: dict[str, Any], chat: bool) -> int | None:
    """The number of alternatives per token asked for by ``data``, or None when logprobs are off. Raises HTTPError."""
    lp = data.get("logprobs")
    if chat:
        top = data.get("top_logprobs")
        if lp is not None and not isinstance(lp, bool):
            raise HTTPError(400, f"logprobs must be a boolean, got {lp!r}")
        if top is not None:
            if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_LOGPROBS:
                raise HTTPError(400, f"top_logprobs must be an integer between 0 and {MAX_LOGPROBS}, got {top!r}")
            if top > 0 and not lp:
                raise HTTPError(400, "when using `top_logprobs`, `logprobs` must be set to true.")
        return (top or 0) if lp else None
    if lp is None:
        return None
    if isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= MAX_LOGPROBS:
        raise HTTPError(400, f"logprobs must be an integer between 0 and {MAX_LOGPROBS}, got {lp!r}")
    return lp


class SequenceLogprobs:
    """Logprobs of one output sequence, token by token. ``seed``: the sequence's text seed; ``top``: K."""

    def __init__(self, seed: str, top: int, chat: bool) -> None:
        self.rng = random.Random(seed + ":logprobs")
        self.top, self.chat = top, chat
        self.offset = 0

    def step(self, token: str) -> tuple[float, list[tuple[str, float]]]:
        """(the logprob of ``token``, the step's alternatives best first: for completions the sampled token first)."""
        rng = self.rng
        lp = -rng.expovariate(4.0)
        space = " " if token.startswith(" ") else ""
        alts, cur = [], lp
        n = self.top if self.chat else self.top + 1
        if not self.chat and n:
            alts.append((token, lp))
        while len(alts) < n:
            cur -= rng.expovariate(1.0)
            word = space + rng.choice(WORDS)
            if word != token and all(word != a for a, _ in alts):
                alts.append((word, cur))
        if self.chat and n:
            alts = sorted([(token, lp), *alts], key=lambda a: -a[1])[:n]
        return lp, alts

    def chunk(self, tokens: list[str]) -> dict[str, Any]:
        """The ``logprobs`` object of a choice (or a streamed chunk) whose new tokens are ``tokens``."""
        steps = [(t, *self.step(t)) for t in tokens]
        if self.chat:
            return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                                 "top_logprobs": [{"token": a, "logprob": v, "bytes": list(a.encode())}
                                                  for a, v in alts]} for t, lp, alts in steps]}
        offsets = []
        for t in tokens:
            offsets.append(self.offset)
            self.offset += len(t)
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in steps], "text_offset": offsets,
                "top_logprobs": [dict(alts) for _, _, alts in steps]}


def tokens_of(text: str) -> list[str]:
    """The sim's output tokens of ``text`` as they are streamed: each word with its leading space (the first one
    without, when the text starts without one)."""
    return _TOKEN.findall(text)


__all__ = ["MAX_LOGPROBS", "SequenceLogprobs", "requested", "tokens_of"]
