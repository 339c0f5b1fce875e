"""The whole vLLM API through the router, against real routers and sim workers on real Unix sockets:
every proxied route, /v1/responses and its id → worker map, model/LoRA-aware routing, the union /v1/models,
LoRA fan-out, HEAD, CORS, compressed request bodies, SSE keep-alive comments."""

from __future__ import annotations

import gzip
import hashlib
import json
import time
import zlib
from collections import Counter
from collections.abc import Iterator

import httpx
import openai
import pytest
from cluster import Cluster, cluster, post, worker_get

from dplb.router.routes import PROXY_ROUTES

ORIGIN = "https://app.example.com"


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Worker 0 serves dplb-sim + sql-lora, worker 1 dplb-sim + chat-lora; LoRA admin and CORS on."""
    # A 500 ms state interval (stale after 1.5 s): this module tests the API surface, not heartbeat hysteresis, and
    # in a full -n 2 run on 2 cores both sim workers' heartbeats were once late past the default 0.6 s together.
    with cluster(str(tmp_path_factory.mktemp("lora")), 2,
                 worker_args={0: ["--sim-lora-adapters", "sql-lora"], 1: ["--sim-lora-adapters", "chat-lora=/a/c"]},
                 router_args=["--allow-runtime-lora", "--cors-allowed-origins", ORIGIN], state_interval_ms=500) as c:
        _wait_models(c, {"dplb-sim", "sql-lora", "chat-lora"})
        yield c


def _wait_models(c: Cluster, want: set[str]) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10:
        r = httpx.get(c.url + "/v1/models", timeout=5)
        if r.status_code == 200 and {m["id"] for m in r.json()["data"]} >= want:
            return
        time.sleep(0.1)
    raise AssertionError(f"models never became {want}: {r.text}")


def multipart(model: str) -> tuple[bytes, str]:
    b = "dplbBoundary7f"
    body = (f"--{b}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n{model}\r\n"
            f"--{b}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
            "Content-Type: audio/wav\r\n\r\n").encode() + bytes(range(256)) * 8 + f"\r\n--{b}--\r\n".encode()
    return body, f"multipart/form-data; boundary={b}"


# Bodies per proxied route; the routes the sim does not implement get the worker's own OpenAI-shaped 404 (the
# router's would have no X-SG-Worker-ID).
BODIES: dict[str, dict] = {  # type: ignore[type-arg]
    "/v1/chat/completions": {"model": "dplb-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/completions": {"model": "dplb-sim", "prompt": "once", "max_tokens": 2},
    "/v1/responses": {"model": "dplb-sim", "input": "hello", "max_output_tokens": 3},
    "/tokenize": {"model": "dplb-sim", "prompt": "a b c"}, "/detokenize": {"model": "dplb-sim", "tokens": [1, 2]},
    "/v1/embeddings": {"model": "dplb-sim", "input": "x"}, "/v2/embed": {"model": "dplb-sim", "texts": ["x"]},
    "/pooling": {"model": "dplb-sim", "input": "x"}, "/classify": {"model": "dplb-sim", "input": "x"},
    "/score": {"model": "dplb-sim", "text_1": "a", "text_2": "b"},
    "/v1/score": {"model": "dplb-sim", "text_1": "a", "text_2": "b"},
    "/rerank": {"model": "dplb-sim", "query": "q", "documents": ["a", "b"]},
    "/v1/rerank": {"model": "dplb-sim", "query": "q", "documents": ["a", "b"]},
    "/v2/rerank": {"model": "dplb-sim", "query": "q", "documents": ["a", "b"]},
    "/v1/messages": {"model": "dplb-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/messages/count_tokens": {"model": "dplb-sim", "messages": [{"role": "user", "content": "hi"}]},
}


def test_every_proxied_route_reaches_a_worker_byte_for_byte(lora: Cluster) -> None:
    for (method, path), route in sorted(PROXY_ROUTES.items()):
        if route.pinned:
            continue  # /v1/responses/{id}: test_responses_*
        if route.body == "multipart":
            body, ctype = multipart("dplb-sim")
        else:
            body, ctype = json.dumps(BODIES.get(path, {"model": "dplb-sim"}), indent=1).encode(), "application/json"
        r = httpx.request(method, lora.url + path, content=body, timeout=30,
                          headers={"content-type": ctype, "x-sim-debug": "body-sha256"})
        assert r.headers.get("x-sg-worker-id") in ("0", "1"), (path, r.status_code, r.text)
        if path in BODIES or route.body == "multipart":
            assert r.status_code == 200, (path, r.text)
        else:  # the routes the sim does not simulate say so, OpenAI-shaped (tests/test_sim_openai.py)
            assert r.status_code == 404 and "does not implement" in r.json()["error"]["message"], (path, r.text)
        assert r.headers["x-sim-body-sha256"] == hashlib.sha256(body).hexdigest(), path
    r = post(lora, "/v1/no/such/route", {})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found" and "x-sg-worker-id" not in r.headers


def test_responses_stream_and_id_map_pins_follow_ups(lora: Cluster) -> None:
    body = {"model": "dplb-sim", "input": "tell me", "max_output_tokens": 4, "stream": True}
    with httpx.stream("POST", lora.url + "/v1/responses", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        worker = r.headers["x-sg-worker-id"]
        raw = b"".join(r.iter_bytes())
    events = [json.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: ")]
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
    assert sum(e["type"] == "response.output_text.delta" for e in events) == 4
    rid = events[0]["response"]["id"]
    plain = post(lora, "/v1/responses", {"model": "dplb-sim", "input": "again", "max_output_tokens": 2}).json()
    for _ in range(10):  # two responses, each read back from the worker that made it (the other one 404s)
        g = httpx.get(lora.url + f"/v1/responses/{rid}", timeout=10)
        assert g.status_code == 200 and g.headers["x-sg-worker-id"] == worker and g.json()["id"] == rid
        assert g.json()["status"] == "completed"
        assert httpx.get(lora.url + f"/v1/responses/{plain['id']}", timeout=10).json()["id"] == plain["id"]
        f = post(lora, "/v1/responses", {"model": "dplb-sim", "input": "more", "previous_response_id": rid,
                                         "max_output_tokens": 1})
        assert f.status_code == 200 and f.headers["x-sg-worker-id"] == worker, f.text
    c = httpx.post(lora.url + f"/v1/responses/{rid}/cancel", timeout=10)
    assert c.status_code == 400 and c.headers["x-sg-worker-id"] == worker  # the owner's answer (others: 404)
    chosen = post(lora, "/v1/responses", {"model": "dplb-sim", "input": "x", "request_id": "resp_mine-1",
                                          "max_output_tokens": 1})
    assert httpx.get(lora.url + "/v1/responses/resp_mine-1").headers["x-sg-worker-id"] == \
        chosen.headers["x-sg-worker-id"]
    unknown = httpx.get(lora.url + "/v1/responses/resp_unknown", timeout=10)
    assert unknown.status_code == 404 and unknown.headers["x-sg-worker-id"] in ("0", "1")  # a worker's own 404


def test_openai_sdk_responses_create(lora: Cluster) -> None:
    client = openai.OpenAI(base_url=lora.url + "/v1", api_key="unused", max_retries=0)
    resp = client.responses.create(model="dplb-sim", input="Say hi", max_output_tokens=5)
    assert resp.status == "completed" and len(resp.output_text.split()) == 5 and resp.usage is not None
    assert client.responses.retrieve(resp.id).output_text == resp.output_text
    stream = client.responses.create(model="sql-lora", input=[{"role": "user", "content": "hi"}],
                                     max_output_tokens=3, stream=True)
    events = list(stream)
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text and len(text.split()) == 3  # type: ignore[union-attr]


def test_model_filtering_no_request_misrouted(lora: Cluster) -> None:
    import asyncio

    models = [("sql-lora", "chat-lora", "dplb-sim")[i % 3] for i in range(200)]

    async def burst() -> list[httpx.Response]:
        sem = asyncio.Semaphore(16)
        async with httpx.AsyncClient(timeout=30) as cl:
            async def one(i: int) -> httpx.Response:
                async with sem:
                    return await cl.post(lora.url + "/v1/completions",
                                         json={"model": models[i], "prompt": f"q {i}", "max_tokens": 1})
            return await asyncio.gather(*(one(i) for i in range(200)))

    seen: Counter[tuple[str, str, int]] = Counter(
        (m, r.headers.get("x-sg-worker-id", "-"), r.status_code) for m, r in zip(models, asyncio.run(burst()),
                                                                               strict=True))
    assert seen == {("sql-lora", "0", 200): 67, ("chat-lora", "1", 200): 67, ("dplb-sim", "0", 200): seen[
        ("dplb-sim", "0", 200)], ("dplb-sim", "1", 200): seen[("dplb-sim", "1", 200)]}, seen
    assert seen[("dplb-sim", "0", 200)] and seen[("dplb-sim", "1", 200)]  # the base model still spreads
    body, ctype = multipart("chat-lora")
    for _ in range(4):
        r = httpx.post(lora.url + "/v1/audio/transcriptions", content=body, headers={"content-type": ctype})
        assert r.status_code == 200 and r.headers["x-sg-worker-id"] == "1"  # model read from the form
    r = post(lora, "/v1/chat/completions", {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]})
    err = r.json()["error"]
    assert r.status_code == 404 and err["code"] == "model_not_found" and "x-sg-worker-id" not in r.headers
    assert "chat-lora" in err["message"] and "sql-lora" in err["message"] and "gpt-4o" in err["message"]


def test_models_is_the_union_of_the_workers(lora: Cluster) -> None:
    r = httpx.get(lora.url + "/v1/models")
    ids = [m["id"] for m in r.json()["data"]]
    assert sorted(ids) == ["chat-lora", "dplb-sim", "sql-lora"] and r.headers["x-sg-worker-id"] == "0,1"
    parents = {m["id"]: m["parent"] for m in r.json()["data"]}
    assert parents["chat-lora"] == "dplb-sim" and parents["dplb-sim"] is None


def test_lora_load_unload_fan_out(lora: Cluster) -> None:
    r = post(lora, "/v1/load_lora_adapter", {"lora_name": "new-lora", "lora_path": "/tmp/new"})
    assert r.status_code == 200, r.text
    res = r.json()["results"]
    assert [(x["worker"], x["status"]) for x in res] == [(0, 200), (1, 200)] and "added" in res[0]["body"]
    ks = {post(lora, "/v1/completions", {"model": "new-lora", "prompt": f"p{i}", "max_tokens": 1})
          .headers["x-sg-worker-id"] for i in range(8)}
    # Served at once by either: the fan-out refreshed the model table, so both workers are candidates of every
    # decision (which one wins at this light load is the latency term's call: the previous test's burst may have
    # left one worker with a fresh, slower figure).
    assert ks <= {"0", "1"} and ks
    decisions = httpx.get(lora.url + "/debug/decisions?limit=8", timeout=5).json()
    assert len(decisions) == 8 and all({c["worker"] for c in d["candidates"] if c["eligible"]} == {0, 1}
                                       for d in decisions), decisions
    again = post(lora, "/v1/load_lora_adapter?workers=1", {"lora_name": "new-lora", "lora_path": "/tmp/new"})
    assert again.status_code == 400 and [x["worker"] for x in again.json()["results"]] == [1]
    r = post(lora, "/v1/unload_lora_adapter?workers=0", {"lora_name": "new-lora"})
    assert r.status_code == 200 and [x["worker"] for x in r.json()["results"]] == [0]
    for i in range(6):
        k = post(lora, "/v1/completions", {"model": "new-lora", "prompt": f"x{i}", "max_tokens": 1})
        assert k.status_code == 200 and k.headers["x-sg-worker-id"] == "1"
    mixed = post(lora, "/v1/unload_lora_adapter", {"lora_name": "new-lora"})  # worker 0 no longer has it
    assert mixed.status_code == 207 and [x["status"] for x in mixed.json()["results"]] == [404, 200]
    gone = post(lora, "/v1/completions", {"model": "new-lora", "prompt": "x", "max_tokens": 1})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    bad = post(lora, "/v1/load_lora_adapter?workers=7", {"lora_name": "x", "lora_path": "/x"})
    assert bad.status_code == 400 and bad.json()["error"]["message"]


def test_head_answers_like_get_without_a_body(lora: Cluster) -> None:
    with httpx.Client(base_url=lora.url, timeout=10) as cl:
        for path in ("/health", "/ready", "/metrics", "/v1/models"):
            g, h = cl.get(path), cl.head(path)
            assert h.status_code == g.status_code == 200 and h.content == b"", path
            assert h.headers["content-type"] == g.headers["content-type"], path
        assert cl.head("/health").headers["content-length"] == cl.get("/health").headers["content-length"]


def test_cors_preflight_and_headers(lora: Cluster) -> None:
    pre = {"origin": ORIGIN, "access-control-request-method": "POST",
           "access-control-request-headers": "content-type,authorization"}
    with httpx.Client(base_url=lora.url, timeout=10) as cl:
        for path in ("/v1/chat/completions", "/v1/models", "/v1/responses/resp_x"):
            r = cl.options(path, headers=pre)
            assert r.status_code == 204 and r.headers["access-control-allow-origin"] == ORIGIN, (path, r.text)
            assert "POST" in r.headers["access-control-allow-methods"]
            assert "authorization" in r.headers["access-control-allow-headers"].lower()
            assert r.headers.get_list("vary") == ["Origin"], (path, r.headers)
        r = cl.options("/v1/chat/completions", headers={**pre, "origin": "https://evil.example"})
        assert r.status_code == 400 and r.headers.get_list("vary") == ["Origin"], r.headers
        r = cl.post("/v1/chat/completions", json=BODIES["/v1/chat/completions"], headers={"origin": ORIGIN})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        assert r.headers.get_list("vary") == ["Origin"], r.headers
        exposed = {h.strip() for h in r.headers["access-control-expose-headers"].split(",")}
        # a browser client reads the worker id, Retry-After and OpenAI's rate-limit headers (the SDKs back off on them)
        assert {"x-sg-worker-id", "x-request-id", "retry-after", "x-ratelimit-remaining-requests",
                "x-ratelimit-reset-tokens", "x-ratelimit-limit-concurrent"} <= exposed, exposed
        r = cl.get("/v1/models", headers={"origin": ORIGIN})
        assert r.headers["access-control-allow-origin"] == ORIGIN and r.headers.get_list("vary") == ["Origin"]
        for evil in (cl.post("/v1/chat/completions", json=BODIES["/v1/chat/completions"],
                             headers={"origin": "https://evil.example"}),
                     cl.get("/v1/models", headers={"origin": "https://evil.example"})):
            # refused, yet its answer depends on Origin: a shared cache must not hand it to an allowed origin
            assert evil.status_code == 200 and "access-control-allow-origin" not in evil.headers
            assert evil.headers.get_list("vary") == ["Origin"], evil.headers
        assert "vary" not in cl.get("/v1/models").headers  # no Origin: no CORS headers at all


def _worker_saw(c: Cluster, k: int, sha: str) -> dict:  # type: ignore[type-arg]
    return next(e for e in worker_get(c.sock(k), "/debug/requests").json() if e.get("body_sha256") == sha)  # type: ignore[no-any-return]


def test_compressed_bodies_are_decoded_with_a_bound(lora: Cluster) -> None:
    plain = json.dumps({**BODIES["/v1/chat/completions"], "pad": "z" * 5000}).encode()
    sha = hashlib.sha256(plain).hexdigest()
    for enc, data in (("gzip", gzip.compress(plain)), ("deflate", zlib.compress(plain)),
                      ("deflate", zlib.compress(plain, wbits=-15))):  # raw DEFLATE, as some clients send
        r = post(lora, "/v1/chat/completions", data, {"content-encoding": enc, "x-sim-debug": "body-sha256"})
        assert r.status_code == 200 and r.headers["x-sim-body-sha256"] == sha, (enc, r.text)
        seen = _worker_saw(lora, int(r.headers["x-sg-worker-id"]), sha)
        assert "content-encoding" not in seen["header_names"]
    bomb = gzip.compress(b"0" * (200 << 20), compresslevel=9)  # 200 MiB of zeros in ~200 KB
    t0 = time.monotonic()
    r = post(lora, "/v1/chat/completions", bomb, {"content-encoding": "gzip"})
    took = time.monotonic() - t0
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", r.text
    assert took < 5, took  # stops inflating at the 32 MiB limit
    r = post(lora, "/v1/chat/completions", plain, {"content-encoding": "br"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_content_encoding"
    r = post(lora, "/v1/chat/completions", gzip.compress(plain)[:-20], {"content-encoding": "gzip"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_content_encoding"


def test_sse_keepalive_comments_only_when_asked_and_between_events(tmp_path: str) -> None:
    long_prompt = " ".join(["word"] * 40)
    with cluster(str(tmp_path), 1, worker_args={0: ["--sim-prefill-s-per-token", "0.03"]},
                 router_args=["--sse-keepalive", "0.2"]) as c:
        with httpx.stream("POST", c.url + "/v1/completions", timeout=30, json={
                "model": "dplb-sim", "prompt": long_prompt, "max_tokens": 3, "stream": True}) as r:
            raw = b"".join(r.iter_bytes())
        blocks = raw.split(b"\n\n")
        assert blocks[-1] == b"" and blocks[-2] == b"data: [DONE]"
        comments = [b for b in blocks if b.startswith(b":")]
        assert len(comments) >= 3 and set(comments) == {b": keep-alive"}, raw  # ~1.2 s prefill / 0.2 s
        assert all(b.startswith(b"data: ") for b in blocks[:-1] if not b.startswith(b":"))
        # Off unless asked; and the LoRA admin routes are off without --allow-runtime-lora; no CORS without the flag.
        r = post(c, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/a"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "route_disabled"
        assert "--allow-runtime-lora" in r.json()["error"]["message"]
        r = httpx.options(c.url + "/v1/chat/completions", headers={"origin": ORIGIN,
                                                                   "access-control-request-method": "POST"})
        assert "access-control-allow-origin" not in r.headers


def test_no_keepalive_by_default(lora: Cluster) -> None:
    prompt = " ".join(["w"] * 4000)  # ~0.8 s of prefill at 0.0002 s/token
    with httpx.stream("POST", lora.url + "/v1/completions", timeout=30, json={
            "model": "dplb-sim", "prompt": prompt, "max_tokens": 2, "stream": True}) as r:
        raw = b"".join(r.iter_bytes())
    assert b"keep-alive" not in raw and raw.endswith(b"data: [DONE]\n\n")


# ---- the pieces, without processes -------------------------------------------------------------------------
def test_served_models_table_keeps_requests_off_workers_not_known_to_serve() -> None:
    from dplb.router.models import MAX_NAMES_PER_WORKER, ServedModels

    t = ServedModels(3)
    assert t.workers_not_serving("m") == frozenset() and not t.none_serves("m")  # nothing known: no filter
    t.update(0, 100, ["m", "a"])
    assert t.workers_not_serving("a") == {1, 2}  # worker 1 and 2 not known yet: kept off a name worker 0 has
    assert t.workers_not_serving("b") == {0}  # a name nobody known has: the unknown workers may answer for it
    t.update(1, 101, ["m", "b"])
    t.update(2, 102, [f"n{i}" for i in range(MAX_NAMES_PER_WORKER + 10)] + ["x" * 300])
    assert t.workers_not_serving("m") == {2} and t.workers_not_serving("b") == {0, 2}
    assert t.none_serves("zzz") and not t.none_serves("b") and "x" * 300 not in t.names()
    assert f"n{MAX_NAMES_PER_WORKER - 1}" in t.names() and f"n{MAX_NAMES_PER_WORKER}" not in t.names()
    assert not t.due(0, 100, 5.0, time.monotonic()) and t.due(0, 999, 5.0, time.monotonic())  # restart: ask again


def test_response_ids_are_bounded_and_codings_stack() -> None:
    from dplb.router.intake import Rejected, decode_body
    from dplb.router.routes import ResponseIds

    ids = ResponseIds(2)
    for i in range(3):
        ids.remember(f"r{i}", i)
    assert ids.worker_of("r0") is None and ids.worker_of("r2") == 2 and len(ids) == 2
    # A client-chosen request_id of any length would be kept capacity times over: ids past MAX_ID_CHARS are not.
    from dplb.router.ownership import OwnedResponseIds
    from dplb.router.routes import MAX_ID_CHARS

    for table in (ResponseIds(4), OwnedResponseIds(4)):
        table.remember("x" * (MAX_ID_CHARS + 1), 1)
        table.remember("y" * MAX_ID_CHARS, 0)
        assert len(table) == 1 and table.worker_of("y" * MAX_ID_CHARS) == 0
        assert table.worker_of("x" * (MAX_ID_CHARS + 1)) is None
    assert OwnedResponseIds(4).owner_of("x") is None
    assert decode_body(gzip.compress(zlib.compress(b"{}")), b"deflate, gzip", 10) == b"{}"
    with pytest.raises(Rejected) as e:
        decode_body(gzip.compress(b"x" * 11), b"gzip", 10)
    assert e.value.kind.code == "body_too_large"


def test_a_draining_worker_refuses_every_generating_route() -> None:
    """The worker's drain gate covers the new model routes (the router then retries elsewhere), not the tokenizer."""
    import asyncio

    from dplb.worker.engines.base import RequestStats, RequestStatsMiddleware

    async def engine(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def call(path: str) -> tuple[int, dict]:  # type: ignore[type-arg]
        sent: list[dict] = []  # type: ignore[type-arg]

        async def send(m: dict) -> None:  # type: ignore[type-arg]
            sent.append(m)

        async def receive() -> dict:  # type: ignore[type-arg]
            return {"type": "http.request", "body": b"{}", "more_body": False}

        mw = RequestStatsMiddleware(engine, RequestStats(), lambda: False)
        await mw({"type": "http", "path": path, "method": "POST", "headers": []}, receive, send)
        return sent[0]["status"], dict(sent[0]["headers"])

    for path in ("/v1/responses", "/v1/audio/transcriptions", "/v1/rerank", "/pooling", "/v1/messages"):
        status, headers = asyncio.run(call(path))
        assert status == 503 and headers[b"x-dplb-draining"] == b"1", path
    assert asyncio.run(call("/tokenize"))[0] == 200


def test_multipart_model_field_is_found_in_linear_time() -> None:
    from dplb.router.intake import multipart_model

    body, _ = multipart("sql-lora")
    assert multipart_model(body) == "sql-lora"
    assert multipart_model(body.replace(b'name="model"', b'name="model_x"')) is None
    hostile = b"Content-Disposition: x " + b'name="model" ' * 6000  # one 64 KiB line, no CRLF
    t0 = time.perf_counter()
    assert multipart_model(hostile) is None
    assert time.perf_counter() - t0 < 0.5
