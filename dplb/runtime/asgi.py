"""Raw-ASGI helpers shared by the router and the worker: one JSON responder, one body-receive loop, one wait for
the client's disconnect (the router's proxy, its local endpoints, the worker's middleware and the sim engine all
use these, so their framing cannot drift apart).

Contract
- :func:`send_json`: one complete response, ``Content-Type`` then ``Content-Length`` then the extra headers.
- :func:`receive_body`: the whole body, or None when the client disconnected first; raises
  :class:`dplb.errors.BodyTooLarge` as soon as the bytes received exceed ``limit`` (the rest is not read). A body in
  a single message (the common case) costs one ``receive()`` and no join.
- :func:`until_disconnect`: returns when ``receive()`` reports ``http.disconnect``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from dplb.errors import BodyTooLarge

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


async def send_json(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None,
                    content_type: bytes = b"application/json") -> None:
    """Send one complete response with ``status``, Content-Type and Content-Length, ``headers`` after them."""
    h = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *(headers or ())]
    await send({"type": "http.response.start", "status": status, "headers": h})
    await send({"type": "http.response.body", "body": body})


async def receive_body(receive: Receive, limit: int) -> bytes | None:
    """The whole request body from ASGI ``receive`` (at most ``limit`` bytes), or None when the client disconnected
    first. Raises :class:`~dplb.errors.BodyTooLarge` once more than ``limit`` bytes arrived."""
    msg = await receive()
    if msg["type"] == "http.disconnect":
        return None
    body = msg.get("body", b"")
    size = len(body)
    if size > limit:
        raise BodyTooLarge(limit)
    if not msg.get("more_body", False):
        return body
    parts = [body]
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        parts.append(chunk)
        if not msg.get("more_body", False):
            return b"".join(parts)


async def until_disconnect(receive: Receive) -> None:
    """Return when the client disconnects (after the body was read, ``receive()`` reports only that)."""
    while (await receive())["type"] != "http.disconnect":
        pass


__all__ = ["Message", "Receive", "Send", "receive_body", "send_json", "until_disconnect"]
