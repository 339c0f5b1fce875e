"""HAProxy agent-check port: each connection gets one line from the host load report, then is closed.

Contract (HAProxy 2.6 ``configuration.txt``, ``agent-check``: the agent answers one ASCII line of words "delimited
by spaces, tabs or commas"; ``NN%`` sets the weight relative to the configured one, ``ready``/``drain``/``maint``
the administrative state, ``up``/``down`` the operational state, "optionally followed by a description string
after a sharp ('#')"; anything left out is unchanged)
- ``up``: ``up ready NN%\\n`` with NN = the report's ``agent_weight`` (1..100; ``ready`` cancels a drain HAProxy
  may remember from an earlier process on this address).
- ``drain``: ``drain\\n`` — HAProxy sends no new requests (existing ones finish; persistence still applies).
- ``down``: ``down #<reason>\\n`` (reason: at most :data:`MAX_REASON` printable ASCII characters, ``#`` and line
  breaks removed) — e.g. no routable worker, state segment missing. The space before ``#`` is required: HAProxy's
  parser (``tcpcheck_agent_expect_reply`` in ``src/tcpcheck.c``) splits the line into words at spaces, tabs and
  commas and takes ``#`` as the start of the description only where a word begins, so ``down#reason`` is one
  unknown word ("agent reports an error : down#reason", the server's state unchanged) while ``down #reason`` marks
  the server DOWN "via agent : down (reason)". Only the agent's own ``up`` brings it back.
- Whatever HAProxy sends first (``agent-send``) is ignored; the answer never waits for it.
- :func:`bind_agent` binds the port before the router registers anywhere (the error naming the address and
  ``--agent-port`` when it cannot: :func:`dplb.errors.bind_error`; the router refuses to start rather than run
  without the agent its front balancer expects); :func:`start_agent` serves on that socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from typing import Any

from dplb.errors import bind_error

log = logging.getLogger("dplb.router.agent")
MAX_REASON = 64


def agent_line(report: Any) -> bytes:
    """The agent's answer for ``report`` (module docstring), newline-terminated ASCII."""
    if report.state == "drain":
        return b"drain\n"
    if report.state == "down":
        reason = "".join(c for c in str(report.reason) if 32 <= ord(c) < 127 and c != "#")[:MAX_REASON].strip()
        return f"down #{reason or 'down'}\n".encode()
    return f"up ready {int(report.agent_weight)}%\n".encode()


def bind_agent(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port``. Raises :class:`dplb.errors.ConfigError` when it cannot be bound
    (:func:`dplb.errors.bind_error`: a :class:`dplb.errors.PortInUseError` only when the port is taken)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(64)
    except OSError as e:
        sock.close()
        raise bind_error(host, port, e, "--agent-port", "the HAProxy agent-check") from e
    sock.setblocking(False)
    return sock


async def start_agent(sock: socket.socket, report: Callable[[], Any]) -> asyncio.Server:
    """Serve the agent protocol on the bound ``sock`` (:func:`bind_agent`); ``report()`` gives the latest
    host report."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            writer.write(agent_line(report()))
            await writer.drain()
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()

    server = await asyncio.start_server(answer, sock=sock)
    host, port = sock.getsockname()[:2]
    log.info("HAProxy agent-check listening on %s:%d", host, port)
    return server


__all__ = ["MAX_REASON", "agent_line", "bind_agent", "start_agent"]
