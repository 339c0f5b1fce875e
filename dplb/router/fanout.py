"""LoRA adapter administration through the router: ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
(vLLM's runtime LoRA API) sent to every routable worker, or to those named by ``?workers=0,2``.

Contract
- Off unless the router runs with ``--allow-runtime-lora`` (the app answers 404 ``route_disabled`` naming the
  flag); the workers themselves need ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` (vLLM) — the sim always answers.
- The body is sent unchanged to each selected worker at once (concurrently, ``timeout_s`` per phase); the answer
  lists every worker's result: ``{"object": "dplb.fanout", "results": [{"worker", "status", "body"}]}`` where
  ``body`` is the worker's answer as text (status 0 and the transport error when it could not be reached).
  Status: 200 when every worker answered 2xx, the common status when all answered the same non-2xx status, else
  207 (mixed results).
- :func:`lora_name`: the adapter a request body names (what a tenant's allow-list is checked against).
- After the fan-out, the touched workers' model lists are refreshed, so routing to a new adapter works as soon as
  the answer is back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgspec

from dplb.config import split_list
from dplb.errors import UpstreamError
from dplb.router.models import ServedModels
from dplb.router.upstream_pool import UpstreamPool, fetch

TIMEOUT_S = 120.0  # loading an adapter reads its weights from disk


class _LoraBody(msgspec.Struct):
    lora_name: Any = None


_lora_decode = msgspec.json.Decoder(_LoraBody).decode


def lora_name(body: bytes) -> Any:
    """The ``lora_name`` of a load/unload request body (any JSON value, as vLLM's field reads it: the last one when
    repeated), or None when the body is not a JSON object."""
    try:
        return _lora_decode(body).lora_name
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None


def parse_workers(text: str | None, num_workers: int) -> list[int] | None:
    """``"0,2"`` → ``[0, 2]``; None/empty → None (all routable). Raises ValueError for anything else (a stray
    comma included: :func:`dplb.config.split_list`)."""
    if not text:
        return None
    try:
        ids = sorted({int(t) for t in split_list(text, "workers")})
    except ValueError as e:
        raise ValueError(f"workers must be comma-separated worker ids in 0..{num_workers - 1}, got {text!r}") from e
    bad = [k for k in ids if not 0 <= k < num_workers]
    if bad or not ids:
        raise ValueError(f"workers must be worker ids in 0..{num_workers - 1}, got {text!r}")
    return ids


async def fan_out(pool: UpstreamPool, models: ServedModels, workers: list[int], path: str, body: bytes,
                  pid_of: Callable[[int], int]) -> tuple[int, bytes]:
    """Send ``body`` to ``path`` on each of ``workers``; (status, JSON report) as in the module docstring.
    ``pid_of(k)`` gives worker k's pid (for the model-list refresh). Never raises for a worker's failure."""

    async def one(k: int) -> dict[str, Any]:
        try:
            status, answer = await fetch(pool, k, path, TIMEOUT_S, body)
        except UpstreamError as e:
            return {"worker": k, "status": 0, "body": str(e)}
        return {"worker": k, "status": status, "body": answer.decode("utf-8", "replace")}

    results = await asyncio.gather(*(one(k) for k in workers))
    await asyncio.gather(*(models.refresh(pool, k, pid_of(k)) for k in workers))
    statuses = {int(r["status"]) for r in results}
    if all(200 <= s < 300 for s in statuses):
        status = 200
    elif len(statuses) == 1:
        status = statuses.pop() or 502
    else:
        status = 207
    return status, msgspec.json.encode({"object": "dplb.fanout", "results": results})


__all__ = ["fan_out", "lora_name", "parse_workers"]
