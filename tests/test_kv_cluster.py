"""Engine truth end to end on a sim cluster: the sim publishes KV events, each worker translates them into the
router's keys, and the router's prefix index drops what the engine dropped (and keeps what it confirmed past the
speculative TTL). Timing: the speculative TTL is 2 s; the test waits 2.5 s where it must be over, and polls
(up to 10 s) for the workers to follow their engines; events need ~ms, and the test reads the index 2.5 s after
them."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.cluster import Cluster, cluster, post, wait_for

pytest.importorskip("zmq")

SIM = ["--sim-block-size", "16", "--sim-prefix-cache-blocks", "64", "--sim-decode-step-s", "0.002",
       "--sim-decode-step-s-per-seq", "0", "--sim-prefill-s-per-token", "0", "--sim-max-num-seqs", "4"]


def chat(text: str) -> dict:
    return {"model": "dplb-sim", "messages": [{"role": "user", "content": text}], "max_tokens": 2}


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def blocks(body: dict) -> int:
    """Router blocks of ``body``'s prompt (the raw ``messages`` JSON as this test sends it, 128-byte blocks)."""
    return len(json.dumps(body["messages"]).encode()) // 128


def depths(c: Cluster) -> dict[int, int]:
    """The last decision's matched prefix blocks per worker."""
    d = httpx.get(c.url + "/debug/decisions?limit=1", timeout=5).json()[0]
    return {cand["worker"]: cand["prefix_matched_blocks"] for cand in d["candidates"]}


def direct(c: Cluster, k: int, body: dict) -> None:
    """A request straight to worker ``k``'s socket: the router never sees it (its sent-bytes index cannot know)."""
    with httpx.Client(transport=httpx.HTTPTransport(uds=c.sock(k)), base_url="http://w", timeout=10) as cl:
        assert cl.post("/v1/chat/completions", content=json.dumps(body).encode(),
                       headers={"content-type": "application/json"}).status_code == 200


@pytest.mark.parametrize("truth", ["events", "sent"])
def test_evictions_reach_the_router_index(tmp_path, truth: str) -> None:
    a = chat(words("a", 800))  # 50 engine blocks of 16 tokens, ~35 router blocks of 128 bytes
    with cluster(str(tmp_path), 2, worker_args={0: SIM, 1: SIM},
                 router_args=["--scorer-param", f"prefix.truth={truth}"]) as c:
        wait_for(lambda: c.metric("dplb_prefix_engine_events", {"worker": "0"}) == 1.0, 10, "worker 0 event-fed")
        r = post(c, "/v1/chat/completions", a)
        w = int(r.headers["x-sg-worker-id"])
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        time.sleep(2.5)  # past the speculative TTL: only a confirmation keeps the blocks
        r2 = post(c, "/v1/chat/completions", a)
        held = depths(c)[w]
        assert held >= blocks(a) - 1 and int(r2.headers["x-sg-worker-id"]) == w  # the proportional map: ±1 block
        assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 784
        for i in range(3):  # behind the router's back, fill worker w's 64-block cache with other prompts
            direct(c, w, chat(words(f"z{i}x", 800)))
        time.sleep(2.5)  # r2's own speculation is over, and the events (~ms) are in the ring long since
        post(c, "/v1/chat/completions", chat("x"))  # a pick that records no block drains the rings
        post(c, "/v1/chat/completions", a)
        if truth == "events":
            assert depths(c)[w] < held // 2
            assert c.metric("dplb_prefix_compared_requests_total", {"worker": str(w)}) >= 2
        else:  # the sent-bytes index still believes it
            assert depths(c)[w] >= held
        assert c.metric("dplb_prefix_kv_ring_lost_total") == 0.0


def test_reset_prefix_cache_empties_the_router_view(tmp_path) -> None:
    a = chat(words("b", 800))
    with cluster(str(tmp_path), 2, worker_args={0: SIM, 1: SIM}) as c:
        wait_for(lambda: c.metric("dplb_prefix_engine_events", {"worker": "1"}) == 1.0, 10, "worker 1 event-fed")
        w = int(post(c, "/v1/chat/completions", a).headers["x-sg-worker-id"])
        time.sleep(2.5)
        post(c, "/v1/chat/completions", a)
        assert depths(c)[w] >= blocks(a) - 1
        with httpx.Client(transport=httpx.HTTPTransport(uds=c.sock(w)), base_url="http://w", timeout=10) as cl:
            assert cl.post("/reset_prefix_cache").status_code == 200
        time.sleep(2.5)  # the last request's speculation is over; the cleared event is in the ring long since
        post(c, "/v1/chat/completions", chat("y"))  # a pick that records no block drains the rings
        post(c, "/v1/chat/completions", a)
        assert depths(c)[w] == 0
