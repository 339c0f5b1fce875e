"""The sim engine's HTTP plumbing, shared by its core endpoints (:mod:`dplb.worker.engines.sim.engine`) and the extra
ones (:mod:`dplb.worker.engines.sim.api`): one OpenAI-shaped error, one bounded body reader, one responder, one
JSON-object decoder — so the two cannot drift apart.
"""

from __future__ import annotations

from typing import Any

import msgspec

from dplb.worker.engines.base import Receive, Send

MAX_BODY_BYTES = 64 << 20  # request bodies above this get 413
DEBUG_HEADER = b"x-sim-debug"  # request header: "body-sha256" asks for x-sim-body-sha256 in the response
_json = msgspec.json.Encoder().encode


class HTTPError(Exception):
    """An OpenAI-shaped error response: ``{"error": {"message", "type", "param": null, "code"}}`` (vLLM's shape)."""

    def __init__(self, status: int, message: str, type_: str = "BadRequestError", code: int | str | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type_
        self.code = status if code is None else code

    def body(self) -> bytes:
        return _json({"error": {"message": self.message, "type": self.type, "param": None, "code": self.code}})


def decode_object(body: bytes) -> dict[str, Any]:
    """``body`` as a JSON object. Raises :class:`HTTPError` 400 for invalid JSON or a non-object."""
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError as e:
        raise HTTPError(400, f"Invalid JSON body: {e}") from None
    if not isinstance(data, dict):
        raise HTTPError(400, "The request body must be a JSON object")
    return data


async def read_body(receive: Receive) -> bytes | None:
    """The whole request body; None if the client disconnected first. Raises HTTPError(413) above
    :data:`MAX_BODY_BYTES`."""
    chunks, size = [], 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise HTTPError(413, f"request body over {MAX_BODY_BYTES} bytes", "invalid_request_error")
        chunks.append(chunk)
        if not msg.get("more_body", False):
            return b"".join(chunks)


async def respond(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None,
                  content_type: bytes = b"application/json") -> None:
    """Send one complete response with Content-Type and Content-Length, ``headers`` after them."""
    h = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *(headers or [])]
    await send({"type": "http.response.start", "status": status, "headers": h})
    await send({"type": "http.response.body", "body": body})
