"""The worker's translation of its engine's KV events into the router's block keys (docs/DESIGN.md §5, §3.7).

Why here: the router keys prompts by their *bytes* (:func:`dplb.policy.prefix.block_hashes`, no tokenizer on the hot
path); the engine caches *token* blocks. Only the worker sees both — the bytes of every request it serves and, from
its engine, the request's token ids and the events of what the engine cached and evicted. So the worker keeps the
mapping and publishes, in the router's keys, what its engine holds (its KV ring, :mod:`dplb.state.kv_rings`).

Contract
- :meth:`KvTranslator.on_batch` (the subscriber's thread) indexes every BlockStored block by its content
  ``(parent hash, token ids)`` → engine hash; a BlockRemoved drops the block and publishes :data:`OP_REMOVED` for
  every router key whose deepest needed block it was; AllBlocksCleared (or a gap in the event sequence) publishes
  :data:`OP_CLEARED`. After a gap the content index is kept (the engine still holds nearly all of it).
- :meth:`KvTranslator.observe` (the serving loop, at a request's first response byte and again at its end) walks
  the request's token blocks through the content index (the chain of blocks the engine holds now), maps each router
  key i (bytes ``[0, (i+1)·block_bytes)``) to the token it ends at, in proportion (``⌈(i+1)·block_bytes·T/B⌉`` for
  T prompt tokens and B prompt bytes: the same prompt's bytes and tokens grow together; chat JSON overhead is spread
  evenly), registers the key under the deepest engine block it needs, and publishes :data:`OP_STORED` for keys not
  published within :data:`REPUBLISH_NS`. Keys whose blocks the engine does not (yet) hold are not confirmed.
- At a request's end it compares the router's prediction (request header :data:`PREDICTED_HEADER`: bytes the
  router believed cached on this worker; absent → not compared) with the engine's cached tokens: the prediction in
  tokens is ``min(pred_bytes·T/B, ⌊(T−1)/block_size⌋·block_size)`` (the most an engine can hit: the last prompt token
  is always recomputed), and the ring's counters add it, the cached tokens and ``|predicted − cached|``.
- Thread-safety: one lock around the maps and the ring (the ring has one writer). Cost: a dict lookup per token
  block of a request (a 2,000-token prompt: ~125 lookups, ~40 µs), on the worker, never on the router.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, Final

import msgspec

from dplb.policy.decision import PREFIX_PREDICTED_HEADER
from dplb.policy.prefix import MAX_PREFIX_BLOCKS, block_hashes
from dplb.state.kv_rings import OP_CLEARED, OP_REMOVED, OP_STORED
from dplb.state.layout import KV_RING_ENTRIES
from dplb.worker.engines.base import REQUEST_EXT, ASGIApp, OpenRequest, Receive, Scope, Send
from dplb.worker.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

#: Request header the router sets: prompt bytes its prefix index predicted this worker has cached.
PREDICTED_HEADER: Final = PREFIX_PREDICTED_HEADER
#: A confirmed key is published again after this long (a router's LRU may have dropped it meanwhile).
REPUBLISH_NS: Final = 10_000_000_000
_MAX_BODY: Final = 64 << 20  # bodies kept for translation; beyond, the request is not translated


class _Peek(msgspec.Struct):
    messages: msgspec.Raw = msgspec.Raw(b"")
    prompt: msgspec.Raw = msgspec.Raw(b"")
    input: msgspec.Raw = msgspec.Raw(b"")


_peek = msgspec.json.Decoder(_Peek).decode


def prompt_bytes(body: bytes) -> bytes | None:
    """The raw prompt bytes the router hashes (``messages``, else ``prompt``, else ``input``, as sent), or None."""
    try:
        p = _peek(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    raw = p.messages or p.prompt or p.input
    return bytes(raw) if raw else None


class KvTranslator:
    """Engine block hashes ↔ router keys for one worker, publishing into its KV ring ``ring``
    (:class:`dplb.state.kv_rings.KvRingWriter`); ``block_bytes``/``max_blocks``: the routers' prefix hashing."""

    def __init__(self, ring: Any, block_bytes: int, max_blocks: int = MAX_PREFIX_BLOCKS) -> None:
        self.ring = ring
        self.block_bytes = block_bytes
        self.max_blocks = max_blocks
        self.block_size = 0  # tokens per engine block, from the first BlockStored
        self._lock = threading.Lock()
        self._content: dict[tuple[Any, tuple[int, ...]], Any] = {}  # (parent hash, tokens) → engine hash
        self._of: dict[Any, tuple[Any, tuple[int, ...]]] = {}  # engine hash → its content key
        self._keys: dict[Any, dict[int, int]] = {}  # engine hash → {router key: last published ns}
        self.events_total = 0

    def __len__(self) -> int:
        return len(self._of)

    # ---- engine side (subscriber thread) ---------------------------------------------------------------------
    def on_batch(self, batch: EventBatch, gap: bool) -> None:
        """Apply one batch of engine events (``gap``: batches were lost before it)."""
        with self._lock:
            if gap:
                self._clear_router()
            for e in batch.events:
                self.events_total += 1
                if isinstance(e, BlockStored):
                    self._stored(e)
                elif isinstance(e, BlockRemoved):
                    self._removed(e.block_hashes)
                elif isinstance(e, AllBlocksCleared):
                    self._content.clear()
                    self._of.clear()
                    self._clear_router()

    def _stored(self, e: BlockStored) -> None:
        bs = e.block_size
        self.block_size = bs
        parent = e.parent_block_hash
        toks = e.token_ids
        for i, h in enumerate(e.block_hashes):
            key = (parent, tuple(toks[i * bs:(i + 1) * bs]))
            old = self._of.get(h)
            if old is not None and old != key:
                self._content.pop(old, None)
            self._content[key] = h
            self._of[h] = key
            parent = h

    def _removed(self, hashes: list[Any]) -> None:
        gone: list[int] = []
        for h in hashes:
            key = self._of.pop(h, None)
            if key is not None and self._content.get(key) == h:
                del self._content[key]
            keys = self._keys.pop(h, None)
            if keys:
                gone.extend(keys)
        if gone:
            self.ring.append(OP_REMOVED, gone)

    def _clear_router(self) -> None:
        self._keys.clear()
        self.ring.append(OP_CLEARED, [0])

    def move_to(self, ring: Any) -> int:
        """Publish into ``ring`` from now on (the worker's segment was replaced: ``ring`` is new and empty) and
        confirm there the router keys the engine still holds: the most recently published half ring's worth at
        most (KV_RING_ENTRIES / 2), so a reader that attached at the empty ring is not lapped by the burst.
        Returns how many keys were confirmed."""
        with self._lock:
            self.ring = ring
            held = sorted(((t, k) for keys in self._keys.values() for k, t in keys.items()), reverse=True)
            keys = [k for _, k in held[:KV_RING_ENTRIES // 2]]
            if keys:
                ring.append(OP_STORED, keys)
            return len(keys)

    # ---- request side (serving loop) -------------------------------------------------------------------------
    def observe(self, raw: bytes, ids: list[int], cached: int = -1, predicted_bytes: int = -1) -> int:
        """A request with prompt bytes ``raw`` and prompt token ids ``ids`` was admitted: confirm the router keys
        whose tokens the engine holds now. With ``cached`` ≥ 0 (its end) and ``predicted_bytes`` ≥ 0, count the
        comparison too. Returns how many keys were published."""
        bs = self.block_size
        if not raw or not ids or not bs:
            return 0
        keys = block_hashes(raw, self.block_bytes, self.max_blocks)
        n_bytes, n_tok = len(raw), len(ids)
        now = time.monotonic_ns()
        with self._lock:
            chain: list[Any] = []
            parent = None
            get = self._content.get
            for j in range(n_tok // bs):
                h = get((parent, tuple(ids[j * bs:(j + 1) * bs])))
                if h is None:
                    break
                chain.append(h)
                parent = h
            new: list[int] = []
            scale = self.block_bytes * n_tok / n_bytes
            for i, k in enumerate(keys):
                need = math.ceil(math.ceil((i + 1) * scale) / bs)  # engine blocks key i's bytes end in
                if need > len(chain):
                    break
                reg = self._keys.setdefault(chain[need - 1], {})
                if now - reg.get(k, -REPUBLISH_NS) >= REPUBLISH_NS:
                    reg[k] = now
                    new.append(k)
            if new:
                self.ring.append(OP_STORED, new)
            if cached >= 0 and predicted_bytes >= 0:
                cap = (n_tok - 1) // bs * bs
                pred = min(cap, round(predicted_bytes * n_tok / n_bytes))
                self.ring.compare(cached, pred)
        return len(new)


class KvTranslateMiddleware:
    """ASGI middleware in front of the engine's app: keeps each model request's body (up to 64 MiB, identity
    encoding only) and calls :meth:`KvTranslator.observe` at its first response body byte and at its end, with the
    token ids and cached tokens the engine left on the request's :class:`OpenRequest`."""

    def __init__(self, app: ASGIApp, translator: KvTranslator, paths: frozenset[str]) -> None:
        self.app = app
        self.t = translator
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        predicted = -1
        for k, v in scope.get("headers") or ():
            if k == b"content-encoding" and v.strip().lower() not in (b"", b"identity"):
                await self.app(scope, receive, send)
                return
            if k == PREDICTED_HEADER and v.isdigit():
                predicted = int(v)
        chunks: list[bytes] = []
        size = [0]

        async def kept_receive() -> Any:
            m = await receive()
            if m["type"] == "http.request" and size[0] <= _MAX_BODY:
                b = m.get("body", b"")
                size[0] += len(b)
                chunks.append(b)
            return m

        first = [True]
        raw: list[bytes | None] = []

        def req() -> OpenRequest | None:
            return (scope.get("extensions") or {}).get(REQUEST_EXT)

        def prompt() -> bytes | None:
            if not raw:
                raw.append(prompt_bytes(b"".join(chunks)) if size[0] <= _MAX_BODY else None)
            return raw[0]

        async def watched_send(m: Any) -> None:
            if first[0] and m["type"] == "http.response.body" and m.get("body"):
                first[0] = False
                r, p = req(), prompt()
                if r is not None and p is not None and r.prompt_token_ids:
                    self.t.observe(p, r.prompt_token_ids)
            await send(m)

        try:
            await self.app(scope, kept_receive, watched_send)
        finally:
            r, p = req(), prompt()
            if r is not None and p is not None and r.prompt_token_ids:
                self.t.observe(p, r.prompt_token_ids, r.cached_tokens, predicted if r.cached_tokens >= 0 else -1)
