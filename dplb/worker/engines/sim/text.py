"""The sim engine's output text: a deterministic function of the context, as greedy decoding is, so a request that
continues a partial answer produces exactly the tokens the original request would have produced next.

Contract
- Token k of an answer is drawn from :data:`~dplb.worker.engines.sim.scheduler.WORDS` by a CRC-32 of (``seed``,
  choice index) started from the CRC-32 of the context so far: the prompt's token ids followed by the k tokens
  generated before it (:func:`~dplb.worker.engines.sim.prompts.prompt_hash` of that list, extended one token at a
  time: ``crc32(b, crc32(a)) == crc32(a + b)``). So the next token depends on the whole context and nothing else:
  a prompt that already ends with the first D generated words (a completions prompt plus the text delivered, or a
  chat whose final assistant message holds them, rendered open by :func:`render_prompt`) yields token D + 1 next.
- Spacing: a token is its word with a leading space, except the first token of an answer that starts a new text
  (a chat answer, or a completions prompt that is empty, token ids, or ends with whitespace): it has none. So the
  answer's text joined onto the prompt's text tokenizes (whitespace split) to the prompt's ids plus the answer's.
- Chat template (:func:`render_prompt`): each message is a ``"role: content\\n"`` line
  (:func:`~dplb.worker.engines.sim.prompts.render_chat`); the generation prompt is empty. With
  ``continue_final_message: true`` (vLLM's flag; it needs ``add_generation_prompt: false``, else 400) the final
  message is rendered as its bare content, left open, and the answer continues it.
"""

from __future__ import annotations

import zlib
from array import array
from typing import Any

from dplb.worker.engines.sim.prompts import message_content, prompt_hash, render_chat
from dplb.worker.engines.sim.scheduler import WORDS

_PACKED = tuple(array("I", [zlib.crc32(w.encode())]).tobytes() for w in WORDS)  # each word's token id, as hashed


class TextGen:
    """The tokens of one answer (one choice) after a prompt of token ids ``ids``: :meth:`token` returns the next
    one's text. ``lead``: the first token has a leading space (module docstring)."""

    __slots__ = ("_h", "_salt", "_space")

    def __init__(self, seed: int, ids: list[int], index: int, lead: bool = False) -> None:
        self._h = prompt_hash(ids)
        self._salt = f"{seed}:{index}".encode()
        self._space = lead

    def token(self) -> str:
        """The next token's text (its word, with a leading space unless it starts the text)."""
        k = zlib.crc32(self._salt, self._h) % len(WORDS)
        self._h = zlib.crc32(_PACKED[k], self._h)
        text = " " + WORDS[k] if self._space else WORDS[k]
        self._space = True
        return text

    def text(self, n: int) -> str:
        """The next ``n`` tokens' text."""
        return "".join(self.token() for _ in range(n))


def render_prompt(data: dict[str, Any]) -> tuple[str, bool]:
    """(the chat prompt of request ``data``, whether the answer continues a final message's non-empty text that does
    not end with whitespace). Raises ValueError for bad messages or for ``continue_final_message`` together with
    ``add_generation_prompt`` (vLLM's rule)."""
    messages = data.get("messages")
    cont = data.get("continue_final_message") is True
    if not cont:
        return render_chat(messages), False
    if data.get("add_generation_prompt", True) is not False:
        raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    if not isinstance(messages, list) or not messages:
        return render_chat(messages), False  # raises
    head = render_chat(messages[:-1]) if len(messages) > 1 else ""
    content = message_content(len(messages) - 1, messages[-1])
    return head + content, bool(content) and not content[-1].isspace()


def leads(prompt: Any) -> list[bool]:
    """Per prompt of a completions ``prompt`` field: whether its answer's first token has a leading space (a string
    prompt with text that does not end with whitespace)."""
    many = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], str) else [prompt]
    return [isinstance(p, str) and bool(p) and not p[-1].isspace() for p in many]


__all__ = ["TextGen", "leads", "render_prompt"]
