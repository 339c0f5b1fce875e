"""The sim engine's HTTP plumbing, shared by its core endpoints (:mod:`dplb.worker.engines.sim.engine`) and the extra
ones (:mod:`dplb.worker.engines.sim.api`): its error type (vLLM's error shape, built by
:func:`dplb.errors.openai_error_body`), its bounded body reader (:func:`dplb.runtime.asgi.receive_body`), its
JSON-object decoder and the body's ``model`` check; responses go out through :func:`dplb.runtime.asgi.send_json`;
and the ``drop_reused_every`` fault (:class:`ReusedDrops`), which closes a connection instead of answering.
"""

from __future__ import annotations

import os
import weakref
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


class ReusedDrops:
    """The ``drop_reused_every`` fault (:class:`dplb.worker.engines.sim.scheduler.SimConfig`): of the model requests
    that another process (``SO_PEERCRED``: not the worker's own warm-up or probe) sends on a server connection that
    carried one before, every ``every``-th is dropped: its connection is closed through the request's disconnect
    hook (:class:`dplb.runtime.edge.DisconnectHook`) before any response byte. 0: off."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.reused = 0  # such requests seen
        self.dropped = 0
        self._seen: weakref.WeakSet[Any] = weakref.WeakSet()  # the server connections that carried a request

    def drop(self, scope: MutableMapping[str, Any]) -> bool:
        """True when the request of ``scope`` was dropped (its connection closed; answer nothing)."""
        if not self.every:
            return False
        hook: Any = (scope.get("extensions") or {}).get(DISCONNECT_EXT)
        conn = getattr(hook, "conn", None)
        if conn is None or hook.peer_pid in (0, os.getpid()):
            return False
        if conn not in self._seen:
            self._seen.add(conn)
            return False
        self.reused += 1
        if self.reused % self.every:
            return False
        self.dropped += 1
        hook.cut()
        return True
