"""The lean request cycle of a request the router's direct handler may take (:mod:`dplb.runtime.protocol`).

Contract: :class:`LaneCycle` is uvicorn's ``RequestResponseCycle`` (a subclass) made by a positional constructor
with no ``asyncio.Event`` and no loggers; :meth:`LaneCycle.to_asgi` completes it into uvicorn's cycle in every
respect when the request goes to the ASGI app after all. Written against uvicorn 0.55's cycle: its initial state
is mirrored as class attributes (a uvicorn upgrade needs tests/test_serving_lane_fuzz.py and the relay tests rerun).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Final

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle


class _NoEvent:
    """The message event of a :class:`LaneCycle` before it goes to an ASGI task: no task waits on it."""

    __slots__ = ()

    def set(self) -> None:
        """Nothing waits: nothing to wake."""

    def clear(self) -> None:
        """Nothing was set."""


_NO_EVENT: Final = _NoEvent()  # (Final: mypyc takes a class default only from a literal or a Final name)


class LaneCycle(RequestResponseCycle):
    """uvicorn's ``RequestResponseCycle`` for a request a direct handler may take, made cheaply: the constructor sets
    the scope, transport, flow control, default headers, keep-alive, ``on_response`` callback and an empty body;
    the rest of uvicorn's initial state is class attributes (an instance attribute shadows each once written); no
    ``asyncio.Event`` until :meth:`to_asgi`. ``direct``: the :class:`dplb.runtime.direct.DirectResponse` writing
    its answer, if any."""

    # (Annotated as uvicorn's cycle types them: compiled, each is a typed slot that uvicorn's code writes too.)
    scope: Any
    transport: Any  # (uvicorn's transport, or the protocol's CorkedTransport)
    flow: Any
    default_headers: list[tuple[bytes, bytes]]
    keep_alive: bool
    on_response: Callable[..., None]
    body: bytearray
    disconnected: bool = False
    waiting_for_100_continue: bool = False
    more_body: bool = True
    response_started: bool = False
    response_complete: bool = False
    chunked_encoding: bool | None = None
    expected_content_length: int = 0
    access_log: bool = False
    direct: Any = None
    message_event: asyncio.Event = _NO_EVENT  # type: ignore[assignment]  # (to_asgi makes the event)

    def __init__(self, scope: Any, transport: Any, flow: Any, default_headers: list[tuple[bytes, bytes]],
                 keep_alive: bool, on_response: Callable[..., None]) -> None:  # (no super(): see the class)
        self.scope = scope
        self.transport = transport
        self.flow = flow
        self.default_headers = default_headers
        self.keep_alive = keep_alive
        self.on_response = on_response
        self.body = bytearray()

    def to_asgi(self, protocol: Any) -> None:
        """Complete the cycle as uvicorn's constructor would have made it, to be run as an ASGI task of
        ``protocol``: the message event (set: the body read so far is ready, or the disconnect) and the loggers."""
        event = asyncio.Event()
        event.set()
        self.message_event = event
        self.logger = protocol.logger
        self.access_logger = protocol.access_logger
        self.access_log = protocol.access_log


__all__ = ["LaneCycle"]
