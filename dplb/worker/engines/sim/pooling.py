"""The sim engine's pooling, scoring and tokenizer answers, in vLLM's shapes: one result per input, as vLLM returns.

Contract
- Inputs (vLLM's): ``input`` of ``/v1/embeddings``, ``/pooling`` and ``/classify`` is a string, a list of token
  ids, or a list of either (one result per item, ``index`` in order); ``/v2/embed`` (Cohere's API) takes
  ``texts``; ``/score`` and ``/v1/score`` take ``text_1`` and ``text_2`` (a string or a list each: one text against
  each of the others, or pairwise when both are lists of one length); the rerank routes take ``query`` and
  ``documents`` (and ``top_n``). Anything else is a 400 :class:`~dplb.worker.engines.sim.http.HTTPError`.
- Embeddings: :data:`EMBED_DIM` floats of unit length, a deterministic function of the input's token ids (the
  same text always gives the same vector; different texts differ); ``encoding_format: "base64"`` (the OpenAI SDK's
  default) sends them as little-endian float32 bytes in base64, as vLLM does. Scores and relevance are the cosine
  of two embeddings mapped to 0..1; classification probabilities are a softmax of the first two embedding values.
- No scheduler time: pooling is answered at once.
"""

from __future__ import annotations

import base64
import hashlib
import math
import random
import struct
import time
import uuid
from typing import Any

import msgspec

from dplb.worker.engines.sim.http import HTTPError
from dplb.worker.engines.sim.prompts import tokenize
from dplb.worker.engines.sim.scheduler import WORDS

EMBED_DIM = 32  # small: the sim's vectors are for plumbing, not semantics
POOLING_PATHS = frozenset({"/v1/embeddings", "/v2/embed", "/pooling", "/classify", "/score", "/v1/score", "/rerank",
                           "/v1/rerank", "/v2/rerank"})


def embed(ids: list[int]) -> list[float]:
    """A unit-length :data:`EMBED_DIM`-vector determined by the token ids ``ids`` (Gaussian draws seeded by their
    SHA-256)."""
    seed = hashlib.sha256(msgspec.json.encode(ids)).digest()
    rng = random.Random(seed)
    v = [rng.gauss(0.0, 1.0) for _ in range(EMBED_DIM)]
    norm = math.sqrt(sum(x * x for x in v)) or 1.0
    return [x / norm for x in v]


def similarity(a: list[int], b: list[int]) -> float:
    """Cosine of the two inputs' embeddings mapped to 0..1 (identical inputs: 1.0)."""
    cos = sum(x * y for x, y in zip(embed(a), embed(b), strict=True))
    return max(0.0, min(1.0, (1.0 + cos) / 2.0))


def _ids(item: Any, field: str) -> list[int]:
    if isinstance(item, str):
        return tokenize(item)
    if isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                               for t in item):
        return list(item)
    raise HTTPError(400, f"'{field}' items must be strings or lists of token ids")


def inputs(value: Any, field: str) -> list[list[int]]:
    """Token ids of each input of ``value`` (a string, token ids, or a non-empty list of either). Raises HTTPError."""
    if isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(t, int) for t in value)):
        return [_ids(value, field)]
    if isinstance(value, list) and value:
        return [_ids(v, field) for v in value]
    raise HTTPError(400, f"'{field}' is required: a string, a list of token ids, or a non-empty list of either")


def _encode(vec: list[float], fmt: Any) -> list[float] | str:
    if fmt in (None, "float"):
        return vec
    if fmt == "base64":
        return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
    raise HTTPError(400, f"encoding_format must be 'float' or 'base64', got {fmt!r}")


def _usage(n: int) -> dict[str, int]:
    return {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}


def answer(path: str, data: dict[str, Any], model: str) -> dict[str, Any]:
    """The body of a pooling/scoring route ``path`` (one of :data:`POOLING_PATHS`) for request ``data``."""
    created = int(time.time())
    if path == "/v2/embed":
        texts = data.get("texts")
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise HTTPError(400, "'texts' is required: a non-empty list of strings")
        ids = [tokenize(t) for t in texts]
        return {"id": f"embd-{uuid.uuid4().hex}", "embeddings": {"float": [embed(i) for i in ids]}, "texts": texts,
                "response_type": "embeddings_by_type",
                "meta": {"api_version": {"version": "2"},
                         "billed_units": {"input_tokens": sum(len(i) for i in ids)}}}
    if path in ("/v1/embeddings", "/pooling", "/classify"):
        items = inputs(data.get("input"), "input")
        usage = _usage(sum(len(i) for i in items))
        head = {"object": "list", "created": created, "model": model, "usage": usage}
        if path == "/v1/embeddings":
            fmt = data.get("encoding_format")
            return {"id": f"embd-{uuid.uuid4().hex}", **head, "data": [
                {"index": k, "object": "embedding", "embedding": _encode(embed(i), fmt)} for k, i in enumerate(items)]}
        if path == "/pooling":
            return {"id": f"pool-{uuid.uuid4().hex}", **head, "data": [
                {"index": k, "object": "pooling", "data": embed(i)} for k, i in enumerate(items)]}
        out = []
        for k, i in enumerate(items):
            a, b = embed(i)[:2]
            p0 = 1.0 / (1.0 + math.exp(4.0 * (b - a)))
            out.append({"index": k, "label": "LABEL_0" if p0 >= 0.5 else "LABEL_1", "probs": [p0, 1.0 - p0],
                        "num_classes": 2})
        return {"id": f"classify-{uuid.uuid4().hex}", **head, "data": out}
    if path.endswith("rerank"):
        return _rerank(data, model)
    return _score(data, model, created)


def _score(data: dict[str, Any], model: str, created: int) -> dict[str, Any]:
    one, two = inputs(data.get("text_1"), "text_1"), inputs(data.get("text_2"), "text_2")
    if len(one) == 1:
        pairs = [(one[0], t) for t in two]
    elif len(one) == len(two):
        pairs = list(zip(one, two, strict=True))
    else:
        raise HTTPError(400, f"text_1 has {len(one)} items and text_2 {len(two)}: give one text_1, or as many as "
                             "text_2 (pairwise)")
    n = sum(len(a) + len(b) for a, b in pairs)
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": created, "model": model,
            "usage": _usage(n), "data": [{"index": k, "object": "score", "score": similarity(a, b)}
                                         for k, (a, b) in enumerate(pairs)]}


def _rerank(data: dict[str, Any], model: str) -> dict[str, Any]:
    query = data.get("query")
    docs = data.get("documents")
    if not isinstance(query, str):
        raise HTTPError(400, "'query' is required and must be a string")
    if not isinstance(docs, list) or not all(isinstance(d, str) for d in docs):
        raise HTTPError(400, "'documents' is required and must be a list of strings")
    top_n = data.get("top_n") or len(docs)
    if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1:
        raise HTTPError(400, f"top_n must be a positive integer, got {top_n!r}")
    q = tokenize(query)
    results = sorted(({"index": k, "document": {"text": d}, "relevance_score": similarity(q, tokenize(d))}
                      for k, d in enumerate(docs)), key=lambda r: -float(r["relevance_score"]))  # type: ignore[arg-type]
    n = len(q) * len(docs) + sum(len(tokenize(d)) for d in docs)
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "usage": {"total_tokens": n},
            "results": results[:top_n]}


def detokenize(tokens: Any) -> str:
    """The text of token ids (the sim's vocabulary, :data:`~dplb.worker.engines.sim.scheduler.WORDS`)."""
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise HTTPError(400, "'tokens' is required and must be a list of token ids")
    return " ".join(WORDS[t % len(WORDS)] for t in tokens)


__all__ = ["EMBED_DIM", "POOLING_PATHS", "answer", "detokenize", "embed", "inputs", "similarity"]
