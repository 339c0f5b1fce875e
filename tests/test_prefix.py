"""Chained block hashing and the bounded prefix index (dplb/policy/prefix.py)."""

from __future__ import annotations

import os
import tracemalloc
import zlib

import msgspec

from dplb.policy.prefix import ENTRY_BYTES, PrefixIndex, block_hashes

NOW = 10**12


def test_keys_are_a_chain_over_full_blocks() -> None:
    data = os.urandom(1000)
    keys = block_hashes(data, 128)
    assert len(keys) == 7  # 1000 // 128: the partial last block is not cached by vLLM either
    for i, k in enumerate(keys):
        assert k >> 32 == i and k & 0xFFFFFFFF == zlib.crc32(data[: (i + 1) * 128])  # covers every earlier byte
    assert block_hashes(data[:127], 128) == [] and block_hashes(data, 0) == []
    assert block_hashes(data, 128, max_blocks=3) == keys[:3]


def test_equal_prefixes_share_keys_and_a_change_breaks_the_chain() -> None:
    a = b"x" * 512 + b"tail one" * 40
    b = b"x" * 512 + b"tail two" * 40
    ka, kb = block_hashes(a, 128), block_hashes(b, 128)
    assert ka[:4] == kb[:4] and all(x != y for x, y in zip(ka[4:], kb[4:], strict=False))
    changed = b"y" + a[1:]  # one byte in block 0: every later key differs too
    assert not set(block_hashes(changed, 128)) & set(ka)


def test_a_conversations_next_turn_extends_the_raw_json_of_the_last() -> None:
    """Why raw bytes work: the messages JSON of turn k, minus its closing ``]``, starts turn k+1's."""
    turn1 = [{"role": "system", "content": "sys " * 100}, {"role": "user", "content": "q1 " * 50}]
    turn2 = [*turn1, {"role": "assistant", "content": "a1 " * 50}, {"role": "user", "content": "q2"}]
    raw1, raw2 = msgspec.json.encode(turn1), msgspec.json.encode(turn2)
    k1, k2 = block_hashes(raw1, 128), block_hashes(raw2, 128)
    assert k2[: len(k1)] == k1 or k2[: len(k1) - 1] == k1[:-1]  # all full blocks before the closing bracket
    assert block_hashes(msgspec.Raw(raw1), 128) == k1  # the router hashes msgspec.Raw without decoding


def test_match_is_per_worker_leading_blocks() -> None:
    idx = PrefixIndex(1000, 300.0, 4)
    keys = block_hashes(os.urandom(128 * 10), 128)
    idx.record(keys[:10], 0, NOW)
    idx.record(keys[:4], 2, NOW)
    assert idx.match(keys, NOW) == [10, 0, 4, 0]
    assert idx.match(keys[:2], NOW) == [2, 0, 2, 0]
    assert idx.match([], NOW) == [0, 0, 0, 0]
    other = block_hashes(os.urandom(128 * 3), 128)
    assert idx.match(other, NOW) == [0, 0, 0, 0]


def test_lru_capacity_and_ttl_bound_the_index() -> None:
    idx = PrefixIndex(100, 60.0, 2)
    for p in range(50):
        idx.record(block_hashes(f"prompt {p} ".encode() * 100, 128), p % 2, NOW + p)
    assert len(idx) == 100  # capacity holds
    newest = block_hashes(b"prompt 49 " * 100, 128)
    assert idx.match(newest, NOW + 50)[1] == len(newest)  # recent prompts survive, the oldest were evicted
    assert idx.match(block_hashes(b"prompt 0 " * 100, 128), NOW + 50) == [0, 0]
    later = NOW + 61 * 10**9
    assert idx.match(newest, later) == [0, 0]  # older than the TTL: absent
    idx.record(block_hashes(b"fresh " * 100, 128), 0, later)
    assert len(idx) <= len(block_hashes(b"fresh " * 100, 128)) + 1  # expired entries were evicted from the head


def test_forget_worker_drops_only_that_worker() -> None:
    idx = PrefixIndex(1000, 300.0, 3)
    keys = block_hashes(os.urandom(1280), 128)
    idx.record(keys, 0, NOW)
    idx.record(keys[:5], 1, NOW)
    assert idx.forget_worker(0) == 10
    assert idx.match(keys, NOW) == [0, 5, 0]
    assert len(idx) == 5  # entries nobody holds any more are gone


def test_entry_size_matches_the_stated_budget() -> None:
    """ENTRY_BYTES (the figure behind --prefix-index-blocks' memory budget and dplb_prefix_index_bytes) is within
    25 % of what 20,000 real entries take."""
    data = os.urandom(128 * 20_000)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    idx = PrefixIndex(1 << 20, 300.0, 8)
    for i in range(0, len(data), 128 * 20):  # 20 blocks per request, each request at its own time
        idx.record(block_hashes(data[i: i + 128 * 20], 128), i % 8, NOW + i)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    per = used / len(idx)
    assert 0.75 * ENTRY_BYTES <= per <= 1.25 * ENTRY_BYTES, per


def test_every_statement_of_the_entry_size_is_the_measured_one() -> None:
    """Regression: ``--prefix-index-blocks``' help said ~180 bytes a block and the README ~190. The help texts
    derive it from ENTRY_BYTES (measured above, 188); the README states it rounded the same way."""
    from pathlib import Path

    from dplb.cli import build_parser

    stated = f"~{round(ENTRY_BYTES, -1)} bytes a block"
    readme = " ".join((Path(__file__).resolve().parent.parent / "README.md").read_text().split())
    assert stated in readme
    helps = [a.help or "" for a in build_parser()._subparsers._group_actions[0].choices["router"]._actions
             if "--prefix-index-blocks" in a.option_strings]
    assert helps and stated in helps[0]
    assert "bytes a block" in readme and readme.count("bytes a block") == readme.count(stated)
