"""The sim engine answers like vLLM, checked through the real OpenAI SDK against a real router + sim cluster:
batched pooling inputs (one result per input), logprobs, background responses and their cancel, the router's
``models.retrieve``, the proxied routes the sim does not simulate, and a client that leaves mid-upload."""

from __future__ import annotations

import base64
import math
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from dplb.router.routes import PROXY_PATHS
from dplb.worker.engines.sim.api import _GENERIC, NOT_SIMULATED
from dplb.worker.engines.sim.pooling import EMBED_DIM
from tests.cluster import Cluster, cluster

MODEL = "dplb-sim"


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with cluster(str(tmp_path_factory.mktemp("simoa")), 2) as c:
        yield c


@pytest.fixture(scope="module")
def client(two: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=two.url + "/v1", api_key="unused", max_retries=0)


def _unit(v: list[float]) -> bool:
    return len(v) == EMBED_DIM and abs(math.sqrt(sum(x * x for x in v)) - 1.0) < 1e-4


@pytest.mark.parametrize("fmt", [None, "float"])  # None: the SDK asks for base64 itself and decodes it
def test_embeddings_of_a_list_give_one_vector_per_input(client: openai.OpenAI, fmt: str | None) -> None:
    texts = ["the quick fox", "a lazy dog", "the quick fox", "ocean"]
    kw: dict[str, Any] = {"encoding_format": fmt} if fmt else {}
    r = client.embeddings.create(model=MODEL, input=texts, **kw)
    assert [d.index for d in r.data] == [0, 1, 2, 3]
    vecs = [d.embedding for d in r.data]
    assert all(_unit(v) for v in vecs)
    assert vecs[0] == pytest.approx(vecs[2]) and vecs[0] != pytest.approx(vecs[1])  # same text, same vector
    assert r.usage.prompt_tokens == 3 + 3 + 3 + 1
    one = client.embeddings.create(model=MODEL, input="ocean", **kw)
    assert len(one.data) == 1 and one.data[0].embedding == pytest.approx(vecs[3])
    raw = client.embeddings.create(model=MODEL, input="ocean", encoding_format="base64").data[0].embedding
    assert isinstance(raw, str)  # little-endian float32, as vLLM sends it
    assert list(struct.unpack(f"<{EMBED_DIM}f", base64.b64decode(raw))) == pytest.approx(vecs[3], abs=1e-6)
    ids = client.embeddings.create(model=MODEL, input=[[1, 2, 3], [4, 5]])
    assert len(ids.data) == 2


def _post(c: Cluster, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(c.url + path, json=body, timeout=30)


@pytest.mark.parametrize("model", [5, ["dplb-sim"], {"name": "dplb-sim"}, True], ids=["int", "list", "object", "bool"])
def test_a_model_that_is_not_a_string_is_a_400_on_every_model_route(two: Cluster, model: Any) -> None:
    """Regression: ``"model": 5`` got 404 "does not exist" (a list or an object, a 500 from an unhashable lookup);
    vLLM refuses a non-string model as a 400 validation error, before any lookup."""
    bodies = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
              "/v1/completions": {"prompt": "hi", "max_tokens": 2}, "/v1/embeddings": {"input": "hi"},
              "/v1/responses": {"input": "hi", "max_output_tokens": 2}, "/tokenize": {"prompt": "hi"}}
    for path, body in bodies.items():
        r = _post(two, path, {**body, "model": model})
        err = r.json()["error"]
        assert r.status_code == 400 and err["type"] == "BadRequestError", (path, r.text)
        assert err["message"] == f"'model' must be a string, got {model!r}", (path, err)
    r = _post(two, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "model": "no-such-model"})
    assert r.status_code == 404, r.text  # a name is still looked up (here the router knows every worker's list)


@pytest.mark.parametrize("prev", [5, ["resp_x"]], ids=["int", "list"])
def test_a_previous_response_id_that_is_not_a_string_is_a_400(two: Cluster, prev: Any) -> None:
    r = _post(two, "/v1/responses", {"model": MODEL, "input": "hi", "previous_response_id": prev})
    assert r.status_code == 400 and "'previous_response_id' must be a string" in r.json()["error"]["message"], r.text
    r = _post(two, "/v1/responses", {"model": MODEL, "input": "hi", "previous_response_id": "resp_nope"})
    assert r.status_code == 404, r.text


def test_classify_score_rerank_pooling_and_v2_embed_answer_every_input(two: Cluster) -> None:
    r = _post(two, "/classify", {"model": MODEL, "input": ["good", "bad"]}).json()
    assert [d["index"] for d in r["data"]] == [0, 1]
    assert all(abs(sum(d["probs"]) - 1) < 1e-9 and d["num_classes"] == 2 for d in r["data"])
    r = _post(two, "/score", {"model": MODEL, "text_1": "fox", "text_2": ["fox", "dog"]}).json()
    scores = [d["score"] for d in r["data"]]
    assert len(scores) == 2 and scores[0] == pytest.approx(1.0) and 0 <= scores[1] < 1
    r = _post(two, "/v1/score", {"model": MODEL, "text_1": ["a", "b"], "text_2": ["a", "c"]}).json()
    assert len(r["data"]) == 2 and r["data"][0]["score"] == pytest.approx(1.0)  # pairwise
    bad = _post(two, "/score", {"model": MODEL, "text_1": ["a", "b"], "text_2": ["a", "b", "c"]})
    assert bad.status_code == 400 and "error" in bad.json()
    r = _post(two, "/rerank", {"model": MODEL, "query": "fox", "documents": ["dog", "fox", "cat"], "top_n": 2}).json()
    rel = [x["relevance_score"] for x in r["results"]]
    assert len(rel) == 2 and rel == sorted(rel, reverse=True) and r["results"][0]["index"] == 1
    r = _post(two, "/pooling", {"model": MODEL, "input": ["x", "y", "z"]}).json()
    assert [d["index"] for d in r["data"]] == [0, 1, 2] and all(_unit(d["data"]) for d in r["data"])
    r = _post(two, "/v2/embed", {"model": MODEL, "texts": ["a", "b", "c"], "input_type": "search_document",
                                 "embedding_types": ["float"]}).json()
    vecs = r["embeddings"]["float"]
    assert len(vecs) == 3 and all(_unit(v) and any(v) for v in vecs) and r["texts"] == ["a", "b", "c"]


def test_every_proxied_route_is_simulated_or_says_it_is_not(two: Cluster) -> None:
    """Regression: several proxied routes got the sim's non-OpenAI ``404 {"detail":"Not Found"}``."""
    served = _GENERIC | {"/v1/chat/completions", "/v1/completions", "/v1/responses"}
    assert served | NOT_SIMULATED >= PROXY_PATHS, sorted(PROXY_PATHS - served - NOT_SIMULATED)
    for path in sorted(NOT_SIMULATED):
        r = _post(two, path, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 404, (path, r.status_code, r.text)  # a 4xx: not counted against the worker
        err = r.json()["error"]
        assert "does not implement" in err["message"] and path in err["message"] and err["type"]


def _check_chat_logprobs(content: list[Any], text: str, k: int) -> None:
    assert "".join(t.token for t in content) == text
    for t in content:
        assert t.logprob <= 0 and bytes(t.bytes) == t.token.encode()
        tops = [a.logprob for a in t.top_logprobs]
        assert len(tops) == k and tops == sorted(tops, reverse=True)
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob


def test_chat_logprobs_have_the_right_shape_streamed_or_not(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "tell me about logprobs"}]
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12)  # type: ignore[arg-type]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, logprobs=True,  # type: ignore[arg-type]
                                       top_logprobs=3)
    text = r.choices[0].message.content or ""
    assert text == plain.choices[0].message.content  # asking for logprobs does not change the text
    assert r.choices[0].logprobs is not None and r.choices[0].logprobs.content is not None
    assert len(r.choices[0].logprobs.content) == 12
    _check_chat_logprobs(r.choices[0].logprobs.content, text, 3)
    assert plain.choices[0].logprobs is None
    got: list[Any] = []
    streamed = ""
    for chunk in client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, logprobs=True,  # type: ignore[arg-type]
                                                top_logprobs=2, stream=True):
        for ch in chunk.choices:
            streamed += ch.delta.content or ""
            if ch.logprobs is not None and ch.logprobs.content:
                got += ch.logprobs.content
    assert streamed == text and len(got) == 12
    _check_chat_logprobs(got, text, 2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, top_logprobs=2)  # type: ignore[arg-type]


def test_completion_logprobs_have_the_right_shape_streamed_or_not(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="once upon a time", max_tokens=10, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.tokens) == 10
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(10)]
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(len(d) == 4 and d[t] == v for d, t, v in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs,
                                                            strict=True))
    tokens: list[str] = []
    for chunk in client.completions.create(model=MODEL, prompt="once upon a time", max_tokens=10, logprobs=1,
                                           stream=True):
        c = chunk.choices[0]
        assert c.logprobs is not None and c.logprobs.tokens is not None
        tokens += c.logprobs.tokens
    assert "".join(tokens) == r.choices[0].text
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, logprobs=21)


def test_background_response_can_be_cancelled_and_a_finished_one_cannot(client: openai.OpenAI) -> None:
    """Regression: cancelling a ``background: true`` response answered 400 "Cannot cancel a synchronous response"."""
    r = client.responses.create(model=MODEL, input="write a long story", background=True, max_output_tokens=2000)
    assert r.status in ("queued", "in_progress") and r.background
    c = client.responses.cancel(r.id)
    assert c.id == r.id and c.status == "cancelled"
    assert client.responses.retrieve(r.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError, match="Cannot cancel"):
        client.responses.cancel(r.id)
    done = client.responses.create(model=MODEL, input="short", background=True, max_output_tokens=5)
    t0 = time.monotonic()
    while (got := client.responses.retrieve(done.id)).status != "completed":
        assert got.status in ("queued", "in_progress") and time.monotonic() - t0 < 20, got.status
        time.sleep(0.05)
    assert got.output_text and got.usage is not None and got.usage.output_tokens == 5
    with pytest.raises(openai.BadRequestError, match="Cannot cancel"):
        client.responses.cancel(done.id)
    sync = client.responses.create(model=MODEL, input="sync", max_output_tokens=3)
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
        client.responses.cancel(sync.id)


def test_models_retrieve_answers_from_the_served_models(client: openai.OpenAI) -> None:
    """Regression: ``GET /v1/models/{id}`` got the router's 404 ``no route``."""
    m = client.models.retrieve(MODEL)
    assert m.id == MODEL and m.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such/model")
    body = e.value.body
    assert isinstance(body, dict) and body.get("code") == "model_not_found" and MODEL in str(body.get("message"))


def _raw_partial_upload(c: Cluster, sent: int, declared: int) -> None:
    s = socket.create_connection(("127.0.0.1", c.port), timeout=5)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {declared}\r\n\r\n".encode() + b'{"model": "' + b"x" * sent)
    time.sleep(0.2)
    s.close()


def test_a_client_gone_mid_upload_is_a_client_close_not_bad_json(two: Cluster) -> None:
    """Regression: a client that disconnected mid-upload was counted as ``invalid_json`` / HTTP 400."""
    labels = {"method": "POST", "route": "/v1/chat/completions"}  # the exposition order
    before_json = two.metric("dplb_requests_rejected_total", {"reason": "invalid_json"}) or 0
    before = two.metric("dplb_requests_rejected_total", {"reason": "client_closed_request"}) or 0
    for sent in (1000, 70_000):
        _raw_partial_upload(two, sent, 200_000)
    t0 = time.monotonic()
    while (two.metric("dplb_requests_rejected_total", {"reason": "client_closed_request"}) or 0) < before + 2:
        assert time.monotonic() - t0 < 10, two.tail()
        time.sleep(0.05)
    assert (two.metric("dplb_http_requests_total", {**labels, "status": "499"}) or 0) >= 2
    assert (two.metric("dplb_requests_rejected_total", {"reason": "invalid_json"}) or 0) == before_json
    assert httpx.get(two.url + "/ready", timeout=5).status_code == 200  # the router is fine
