"""What a prompt is to the sim engine, and the prefix cache: whitespace tokens, the chat rendering, completion
prompts (text or token ids), chained block hashes and the LRU of cached blocks that
:class:`dplb.worker.engines.sim.scheduler.SimScheduler` consults when it admits a sequence.

Contract: everything here is pure (no event loop, no clock); token ids are the CRC-32 of each word, block *i*'s
hash (an unsigned 64-bit int) covers its tokens and block *i−1*'s hash (like vLLM's block hashing), and
:class:`PrefixCache` holds at most ``capacity`` block hashes, least recently used evicted first. Within one prompt
the chain is touched tail first, so its *last* blocks are evicted first and what stays cached of a chain is a prefix
of it (vLLM frees a request's blocks tail first into its free queue, ``FreeKVCacheBlockQueue``). A block is removed
only when its room is needed for a new one (vLLM evicts lazily, when a freed block is reallocated). With
``record_events`` the cache keeps the vLLM KV events of what it stored and removed
(:class:`dplb.worker.kv_events.BlockStored` / ``BlockRemoved``) until :meth:`PrefixCache.take_events`. The
scheduling policy (which sequence runs when) is the scheduler's alone.
"""

from __future__ import annotations

import zlib
from array import array
from collections import OrderedDict
from typing import Any

from dplb.worker.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

_U64 = (1 << 64) - 1


def tokenize(text: str) -> list[int]:
    """Token ids of ``text``: the CRC-32 of each whitespace-separated word; ``[0]`` for a blank text (≥ 1 token)."""
    ids = [zlib.crc32(w.encode()) for w in text.split()]
    return ids or [0]


def render_chat(messages: Any) -> str:
    """The chat prompt: one ``"role: content\\n"`` line per message (text parts joined). Raises ValueError."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' is required and must be a non-empty list of {role, content} objects")
    lines = []
    for i, msg in enumerate(messages):
        content = message_content(i, msg)  # validates msg first
        lines.append(f"{msg['role']}: {content}\n")
    return "".join(lines)


def message_content(i: int, msg: Any) -> str:
    """The text of chat message ``i`` (text parts joined by newlines; null is empty). Raises ValueError."""
    if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
        raise ValueError(f"messages[{i}] must be an object with a string 'role'")
    content = msg.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise ValueError(f"messages[{i}].content parts must be objects with a 'type'")
            if part["type"] == "text":
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"messages[{i}].content text parts need a string 'text'")
                texts.append(part["text"])
        return "\n".join(texts)
    if content is None:
        return ""
    if not isinstance(content, str):
        raise ValueError(f"messages[{i}].content must be a string, a list of parts or null")
    return content


def completion_prompts(prompt: Any) -> list[list[int]]:
    """Token ids of each prompt of a completions request (string, token ids, or a list of either). ValueError."""
    def ids(p: Any) -> list[int] | None:
        if isinstance(p, str):
            return tokenize(p)
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p):
            return list(p)
        return None

    one = ids(prompt)
    if one is not None:
        return [one]
    if isinstance(prompt, list) and prompt:
        many = [ids(p) for p in prompt]
        if all(m is not None for m in many):
            return [m for m in many if m is not None]
    raise ValueError("'prompt' is required: a string, a list of strings, a list of token ids or a list of "
                         "token id lists (non-empty)")


def prompt_hash(ids: list[int]) -> int:
    """A stable 32-bit hash of a token id list (seeds the output text)."""
    return zlib.crc32(array("I", [i & 0xFFFFFFFF for i in ids]).tobytes())


def block_hashes(ids: list[int], block_size: int) -> list[int]:
    """Chained hashes of the full ``block_size`` blocks of ``ids`` (a trailing partial block is not hashed); each an
    int in [0, 2**64) (Python's tuple-of-ints hash, which does not depend on ``PYTHONHASHSEED``)."""
    out: list[int] = []
    h = 0
    for start in range(0, len(ids) - block_size + 1, block_size):
        h = hash((h, tuple(ids[start:start + block_size]))) & _U64
        out.append(h)
    return out


class PrefixCache:
    """LRU set of block hashes with a capacity in blocks (0 = disabled); with ``record_events`` it keeps the KV
    events of its changes (see the module docstring)."""

    def __init__(self, capacity: int, record_events: bool = False) -> None:
        self.capacity = capacity
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.record_events = record_events
        self._events: list[KvEvent] = []

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, h: int) -> bool:
        return h in self._lru

    def match(self, hashes: list[int], max_blocks: int) -> int:
        """Number of leading ``hashes`` (at most ``max_blocks``) that are cached; hits become most recent, the
        first block most of all."""
        n = 0
        lru = self._lru
        for h in hashes[:max_blocks]:
            if h not in lru:
                break
            n += 1
        for h in reversed(hashes[:n]):
            lru.move_to_end(h)
        return n

    def insert(self, hashes: list[int], ids: list[int] | None = None, block_size: int = 0) -> None:
        """Add ``hashes`` (one prompt's chain) as most recently used, the first block most of all, evicting the
        least recently used beyond capacity. ``ids``/``block_size``: the prompt's tokens, for the BlockStored
        event of the blocks that are new."""
        if self.capacity <= 0:
            return
        lru = self._lru
        new_from = next((i for i, h in enumerate(hashes) if h not in lru), len(hashes))
        for h in reversed(hashes):
            lru[h] = None
            lru.move_to_end(h, last=True)
        removed: list[int] = []
        while len(lru) > self.capacity:
            removed.append(lru.popitem(last=False)[0])
        if not self.record_events:
            return
        if removed:
            self._events.append(BlockRemoved(removed))
        stored = [h for h in hashes[new_from:] if h in lru]
        if stored and ids is not None and block_size > 0:
            # one chain from the first new block: blocks after it that were cached already are stored again
            n = new_from + len(stored)
            self._events.append(BlockStored(hashes[new_from:n], hashes[new_from - 1] if new_from else None,
                                            ids[new_from * block_size:n * block_size], block_size))

    def clear(self) -> None:
        """Drop every cached block (``/reset_prefix_cache``)."""
        self._lru.clear()
        if self.record_events:
            self._events.append(AllBlocksCleared())

    def take_events(self) -> list[KvEvent]:
        """The events recorded since the last call, oldest first."""
        out, self._events = self._events, []
        return out
