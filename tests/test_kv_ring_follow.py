"""A worker's KV ring follows a recreated state segment: after ``dplb segment create`` replaces the file, the sim
worker's ring in the NEW file says it follows the engine's events, records the routers' block size, confirms the
keys the engine still holds, and takes the next requests' keys; the old file's ring gets nothing more."""

from __future__ import annotations

import os
import struct

import httpx
from cluster import cluster, read, wait_for

from dplb.state.kv_rings import OP_STORED, split
from dplb.state.layout import KV_RING_ENTRIES, KV_RING_SIZE, kv_rings_offset
from dplb.state.shm import Segment


def _ring(seg: Segment, worker: int = 0) -> tuple[int, int, list[int]]:
    """(events_since_mono_ns, block_bytes, the keys of every OP_STORED entry in ring order) of ``worker``'s ring,
    read from the mapping with the byte layout of dplb.state.kv_rings."""
    mm = seg._mm
    off = kv_rings_offset(seg.num_workers) + worker * KV_RING_SIZE
    head, since = struct.unpack_from("<QQ", mm, off)
    (block_bytes,) = struct.unpack_from("<I", mm, off + 48)
    stored = []
    for i in range(max(0, head - KV_RING_ENTRIES), head):
        op, key = split(struct.unpack_from("<Q", mm, off + 64 + 8 * (i % KV_RING_ENTRIES))[0])
        if op == OP_STORED:
            stored.append(key)
    return since, block_bytes, stored


def _ask(url: str, prompt: str) -> None:
    r = httpx.post(url + "/v1/completions", json={"model": "dplb-sim", "prompt": prompt, "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text


def test_kv_ring_moves_into_a_recreated_segment(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with cluster(str(tmp_path), 1, state_interval_ms=100) as c:
        old = c.segment
        assert old is not None
        _ask(c.url, "alpha " * 200)  # 1.2 KB: several 128-byte router blocks
        since, block_bytes, held = wait_for(lambda: r if (r := _ring(old))[2] else None, 10, "keys in the old ring")
        assert since and block_bytes == 128, (since, block_bytes)
        os.unlink(c.shm_path)  # the runbook's recreate: the file goes, `dplb segment create` makes a new one
        new = Segment.create(c.shm_path, 1, state_interval_ms=100, model="dplb-sim")
        c.segment = new  # the cluster closes and removes this one
        wlog = os.path.join(c.run_dir, "worker-0.log")
        n_since, n_block_bytes, n_held = wait_for(lambda: r if (r := _ring(new))[0] else None, 10,
                                                  "the new ring following the engine's events")
        assert "KV ring moved to the new segment" in read(wlog)
        assert n_since == since and n_block_bytes == 128, (n_since, n_block_bytes)
        assert set(held) <= set(n_held), "the engine's held keys were not confirmed in the new ring"
        old_after = _ring(old)[2]
        _ask(c.url, "bravo " * 200)
        wait_for(lambda: len(_ring(new)[2]) > len(n_held), 10, "the next request's keys in the new ring")
        assert _ring(old)[2] == old_after, "the old file's ring still receives entries"
        old.close()
