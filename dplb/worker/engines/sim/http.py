"""The sim engine's HTTP plumbing, shared by its core endpoints (:mod:`dplb.worker.engines.sim.engine`) and the extra
ones (:mod:`dplb.worker.engines.sim.api`): its error type (vLLM's error shape, built by
:func:`dplb.errors.openai_error_body`), its bounded body reader (:func:`dplb.runtime.asgi.receive_body`), its
JSON-object decoder and the body's ``model`` check; responses go out through :func:`dplb.runtime.asgi.send_json`;
and the ``close_after_response_s`` fault (:class:`ShortKeepAlive`).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Container, MutableMapping
from typing import Any

import msgspec

from dplb.errors import BodyTooLarge, openai_error_body
from dplb.runtime.asgi import Receive, receive_body
from dplb.runtime.edge import DISCONNECT_EXT

MAX_BODY_BYTES = 64 << 20  # request bodies above this get 413
DEBUG_HEADER = b"x-sim-debug"  # request header: "body-sha256" asks for x-sim-body-sha256 in the response


class HTTPError(Exception):
    """An OpenAI-shaped error response: ``{"error": {"message", "type", "param": null, "code"}}`` (vLLM's shape)."""

    def __init__(self, status: int, message: str, type_: str = "BadRequestError", code: int | str | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type_
        self.code = status if code is None else code

    def body(self) -> bytes:
        """The response body: ``{"error": {"message", "type", "param": null, "code"}}``."""
        return openai_error_body(self.message, self.type, self.code)

    def as_dict(self) -> dict[str, Any]:
        """The error object as vLLM's ``ErrorResponse.model_dump()`` gives it (its stream error event is that,
        ``json.dumps``'d)."""
        return {"error": {"message": self.message, "type": self.type, "param": None, "code": self.code}}


def decode_object(body: bytes) -> dict[str, Any]:
    """``body`` as a JSON object. Raises :class:`HTTPError` 400 for invalid JSON or a non-object."""
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError as e:
        raise HTTPError(400, f"Invalid JSON body: {e}") from None
    if not isinstance(data, dict):
        raise HTTPError(400, "The request body must be a JSON object")
    return data


def check_model(model: Any, served: Container[str]) -> None:
    """vLLM's check of a body's ``model``: absent (None) or ``""`` passes (the served model answers: vLLM's
    ``check_model`` tests ``not model_name``); a non-string is 400 (vLLM's validation error, never a lookup); a name
    not in ``served`` is 404 ``NotFoundError``. Raises :class:`HTTPError`."""
    if model is None or model == "":
        return
    if not isinstance(model, str):
        raise HTTPError(400, f"'model' must be a string, got {model!r}")
    if model not in served:
        raise HTTPError(404, f"The model `{model}` does not exist.", "NotFoundError")


async def read_body(receive: Receive) -> bytes | None:
    """The whole request body; None if the client disconnected first. Raises HTTPError(413) above
    :data:`MAX_BODY_BYTES`."""
    try:
        return await receive_body(receive, MAX_BODY_BYTES)
    except BodyTooLarge:
        raise HTTPError(413, f"request body over {MAX_BODY_BYTES} bytes", "invalid_request_error") from None


__all__ = ["DEBUG_HEADER", "MAX_BODY_BYTES", "HTTPError", "check_model", "decode_object", "read_body"]



class ShortKeepAlive:
    """The ``close_after_response_s`` fault (:class:`dplb.worker.engines.sim.scheduler.SimConfig`): the connection
    of each model request another process (``SO_PEERCRED``: not the worker's own warm-up or probe) sent stops being
    read once its response is complete and is closed ``seconds`` later, reached through the request's disconnect
    hook (:class:`dplb.runtime.edge.DisconnectHook`); a request that arrived meanwhile is left unread, so the close
    resets it (ECONNRESET at the client). ``closed``: connections so closed. 0: off."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.closed = 0

    def after(self, scope: MutableMapping[str, Any]) -> None:
        """The response to the request of ``scope`` is complete: its connection stops being read, then closes."""
        if not self.seconds:
            return
        hook: Any = (scope.get("extensions") or {}).get(DISCONNECT_EXT)
        transport = getattr(getattr(hook, "conn", None), "transport", None)
        if transport is None or transport.is_closing() or hook.peer_pid in (0, os.getpid()):
            return
        transport.pause_reading()
        asyncio.get_running_loop().call_later(self.seconds, transport.close)
        self.closed += 1
